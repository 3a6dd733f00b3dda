"""Multi-rank execution on torch.distributed: the one place that knows whether this process runs
under torchrun, which part of a plan is its own, and how the ranks agree (barrier, sums, abort).

    torchrun --nproc-per-node N [--nnodes M --rdzv-backend c10d --rdzv-endpoint HOST:PORT] \\
        -m ckpt_tools <command> ...

Every rank opens the same inputs and builds the same deterministic plan; `core.parts.Part` says
which work units (output shards, items, files) are its own; rank 0 (the leader) creates the staging
directory beside OUT (`io.staging.SharedOutputDir`), every rank writes its own files into it, and
after a barrier the leader writes the index / `.metadata` and renames the directory into place.

Abort-all: a rank that fails raises as in one process (its one-line error, its exit code) and does
not reach the barrier, so the leader never commits. torchrun then stops the other ranks (SIGTERM,
which `io.signals` turns into `Terminated`: the staging directory is removed); a rank that is
waiting in a collective when a peer dies gets a gloo error instead, reported as `RankFailed`. Waits
poll (`_wait`), so SIGTERM is handled while a rank waits for the others. A rank killed by SIGKILL
can leave `.OUT.tmp-<pid>-*` behind (hidden, never OUT itself); the next run removes it.

The group uses gloo (CPU tensors, on CPU and GPU nodes alike: the ranks exchange a few integers, the
data moves through the filesystem). Multi-node needs OUT on a filesystem every node sees at the same
path (NFS, Lustre, a shared volume): the leader's staging directory is checked from every rank.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Literal, TypeVar, overload

from .core.errors import RankFailed, UsageError
from .core.parts import SOLO, Part, working_ranks
from .core.pool import one_intra_op_thread

__all__ = [
    "DEFAULT_MIN_BYTES_PER_RANK",
    "DEFAULT_RENDEZVOUS_S",
    "MIN_BYTES_PER_RANK_ENV",
    "RANKS_ENV",
    "RENDEZVOUS_ENV",
    "THREADS_PER_RANK",
    "TIMEOUT_ENV",
    "Group",
    "RankFailed",
    "SoloGroup",
    "TorchGroup",
    "check_env",
    "current",
    "env_part",
    "idle_rank",
    "launched_part",
    "local_workers",
    "map_units",
    "min_bytes_per_rank",
    "working",
    "working_per_node",
]

TIMEOUT_ENV = "CKPT_TOOLS_DIST_TIMEOUT_S"  # how long a rank waits for the others (default 6 h)
# How long a rank waits for all ranks to join at the start (the rendezvous): a process that finds
# WORLD_SIZE=2 exported without peers (every process of a SLURM or PyTorchJob pod inherits it) must not
# wait for torch's default (our 6 h collective timeout, in C++ where no signal is handled).
RENDEZVOUS_ENV = "CKPT_TOOLS_DIST_RENDEZVOUS_S"
DEFAULT_RENDEZVOUS_S = 300.0
_POLL_S = 0.02
# Read-only work is split over the ranks only when each gets at least this much (`core.parts.working_ranks`):
# below it, a rank's start-up and collectives cost more than its share of the reads saves, and N ranks were
# slower than one (the ranks past the number stay idle; the working ones take the node's cores).
MIN_BYTES_PER_RANK_ENV = "CKPT_TOOLS_MIN_BYTES_PER_RANK"
DEFAULT_MIN_BYTES_PER_RANK = 256 * 2**20
# How many ranks of a node work: `auto` (one per THREADS_PER_RANK cores, at least one) or `all`. Every command
# runs its units on threads over the cores it is given (up to THREADS_PER_RANK: `local_workers`), so on a
# 16-core node one process already uses the node, and each rank more only adds its start-up (a torch
# import, seconds with a CUDA build) and the rendezvous: with `auto` the other ranks end at once.
RANKS_ENV = "CKPT_TOOLS_RANKS"
THREADS_PER_RANK = 16


def launched_part(environ=os.environ) -> Part:
    """This process's rank and world size as the launcher set them (`Part(0, 1)` outside torchrun)."""
    try:
        world = int(environ.get("WORLD_SIZE", "1"))
        rank = int(environ.get("RANK", "0"))
        return Part(rank, world)
    except ValueError as exc:
        raise UsageError(
            f"RANK={environ.get('RANK')!r} WORLD_SIZE={environ.get('WORLD_SIZE')!r} do not name a "
            f"rank: {exc}",
            hint="launch with `torchrun --nproc-per-node N -m ckpt_tools ...`",
        ) from None


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _node_layout(environ) -> tuple[int, int, int] | None:
    """(nodes, this node's index, this rank's index on its node) when torchrun's LOCAL_WORLD_SIZE and
    LOCAL_RANK describe nodes of equal size with contiguous ranks (how torchrun numbers them); else None."""
    part = launched_part(environ)
    try:
        local = int(environ.get("LOCAL_WORLD_SIZE", "") or 0)
        local_rank = int(environ.get("LOCAL_RANK", "") or -1)
    except ValueError:
        return None
    if local < 1 or part.world % local or local_rank != part.rank % local:
        return None
    return part.world // local, part.rank // local, local_rank


def working_per_node(environ=os.environ, cores: int | None = None) -> int | None:
    """How many ranks of each node work (RANKS_ENV): `auto`, one per THREADS_PER_RANK cores (at least one),
    since one process already runs its work on threads over the node's cores, and a rank more on the same
    cores only adds its start-up; `all`, every rank. None: every rank works (`all`, or a launch whose node
    layout is unknown: no LOCAL_WORLD_SIZE)."""
    mode = environ.get(RANKS_ENV, "auto") or "auto"
    if mode not in ("auto", "all"):
        raise UsageError(
            f"{RANKS_ENV}={mode!r} is not `auto` or `all`",
            hint=f"unset {RANKS_ENV} (auto: one working rank per {THREADS_PER_RANK} cores of a node)",
        )
    layout = _node_layout(environ)
    if mode == "all" or layout is None:
        return None
    local = launched_part(environ).world // layout[0]
    return max(1, min(local, (cores or _cores()) // THREADS_PER_RANK))


def env_part(environ=os.environ) -> Part:
    """This process's share among the ranks that work (`Part(0, 1)` outside torchrun): its index and their
    number, from the launch (`launched_part`) and `working_per_node`. An idle rank (`idle_rank`) has none."""
    part = launched_part(environ)
    per_node = working_per_node(environ) if part.world > 1 else None
    layout = None if per_node is None else _node_layout(environ)
    if per_node is None or layout is None:  # (a layout is known where per_node is)
        return part
    nodes, node, local_rank = layout
    if local_rank >= per_node:
        raise UsageError(
            f"rank {part.rank} takes no part in this run (it idles: {per_node} working rank(s) per node)",
            hint=f"ask `dist.idle_rank()` first; {RANKS_ENV}=all makes every rank work",
        )
    return Part(node * per_node + local_rank, nodes * per_node)


def idle_rank(environ=os.environ) -> bool:
    """Whether this process is a rank that takes no part in the run (`working_per_node`): the CLI ends it
    at once, with exit 0 and no output, before it imports or opens anything."""
    part = launched_part(environ)
    if part.world == 1:
        return False
    per_node = working_per_node(environ)
    layout = None if per_node is None else _node_layout(environ)
    return per_node is not None and layout is not None and layout[2] >= per_node


def _seconds(environ, name: str, default: float) -> float:
    raw = environ.get(name)
    try:
        v = float(raw) if raw not in (None, "") else default
    except ValueError:
        v = -1.0
    if not v > 0:
        raise UsageError(
            f"{name}={raw!r} is not a number of seconds > 0", hint=f"unset {name} for the default"
        )
    return v


def check_env(environ=os.environ) -> tuple[str, int]:
    """(MASTER_ADDR, MASTER_PORT) for a group of 2+ ranks, checked before anything waits on them: a
    UsageError naming the variable when WORLD_SIZE is set without them (torch would raise a ValueError
    deep inside its rendezvous)."""
    part = launched_part(environ)
    addr, port = environ.get("MASTER_ADDR"), environ.get("MASTER_PORT")
    fix = (
        "launch with `torchrun --nproc-per-node N -m ckpt_tools ...` (it sets them), or unset WORLD_SIZE and "
        "RANK to run in one process"
    )
    for name, v in (("MASTER_ADDR", addr), ("MASTER_PORT", port)):
        if not v:
            raise UsageError(
                f"WORLD_SIZE={part.world} (rank {part.rank}) is set but {name} is not: the ranks have "
                "no address to meet at",
                hint=fix,
            )
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"MASTER_PORT={port!r} is not a TCP port (1-65535)", hint=fix)
    if not 0 <= part.rank < part.world:
        raise UsageError(f"RANK={part.rank} is outside WORLD_SIZE={part.world}", hint=fix)
    _seconds(environ, RENDEZVOUS_ENV, DEFAULT_RENDEZVOUS_S)
    _seconds(environ, TIMEOUT_ENV, 6 * 3600)
    return addr, int(port)


class Group:
    """How ranks agree. `part` is this rank's share; the collectives are no-ops for one process."""

    part: Part = SOLO

    @property
    def leader(self) -> bool:
        return self.part.leader

    def barrier(self, what: str) -> None:
        """Wait until every rank got here (`what` names the point, for the error if one never does)."""

    def sum(self, values: Sequence[int], what: str) -> list[int]:
        """Element-wise sum of `values` over the ranks."""
        return [int(v) for v in values]

    def broadcast(self, value, what: str):
        """The leader's JSON-able `value`, on every rank."""
        return value

    def gather(self, value, what: str) -> list | None:
        """Every rank's JSON-able `value`, in rank order, on the leader (None on the others)."""
        return [value]


class SoloGroup(Group):
    """One process: every unit is its own, nothing to wait for."""


class TorchGroup(Group):
    """A gloo process group of torchrun's ranks (initialized once, on first use)."""

    def __init__(self, part: Part):
        # torch.distributed is imported here, not at module top: the CLI asks `launched_part()` on
        # every command, and torch-free commands (inspect, verify of metadata) must stay torch-free.
        import torch
        import torch.distributed as tdist

        self.part = part
        self._torch, self._dist = torch, tdist
        timeout_s = _seconds(os.environ, TIMEOUT_ENV, 6 * 3600)
        self._timeout_s = timeout_s
        if not tdist.is_initialized():
            store = self._rendezvous()
            tdist.init_process_group(
                "gloo",
                store=store,
                rank=part.rank,
                world_size=part.world,
                timeout=datetime.timedelta(seconds=timeout_s),
            )

    def _rendezvous(self):
        """The ranks' TCPStore, with every rank arrived, as torch's env:// rendezvous makes it (rank 0
        hosts it, or torchrun's agent does), but waited for here in Python: each blocking call into C++
        lasts at most a second, so SIGTERM and Ctrl-C are handled while a rank waits, and a rank whose
        peers never come gives up after RENDEZVOUS_ENV seconds with one line."""
        from torch.distributed import TCPStore

        addr, port = check_env()
        part, env = self.part, os.environ
        limit = _seconds(env, RENDEZVOUS_ENV, DEFAULT_RENDEZVOUS_S)
        deadline = time.monotonic() + limit
        where = f"MASTER_ADDR={addr} MASTER_PORT={port}"
        agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = None
        if part.rank == 0 and not agent:
            try:
                store = TCPStore(
                    addr,
                    port,
                    part.world,
                    is_master=True,
                    wait_for_workers=False,
                    multi_tenant=True,
                    timeout=datetime.timedelta(seconds=limit),
                )
            except (RuntimeError, OSError, ValueError) as exc:  # DistNetworkError is a RuntimeError
                busy = "in use" in str(exc).lower() or "errno: 98" in str(exc).lower()
                raise UsageError(
                    (
                        f"MASTER_PORT={port} is already in use on this host: rank 0 cannot listen on it"
                        if busy
                        else f"rank 0 cannot listen on {where}: {str(exc).splitlines()[0][:200]}"
                    ),
                    hint="pick a free port (torchrun --master-port P) or stop what holds it",
                ) from None
        while store is None:
            try:
                store = TCPStore(
                    addr, port, part.world, is_master=False, timeout=datetime.timedelta(seconds=1)
                )
            except (RuntimeError, OSError, ValueError):
                if time.monotonic() > deadline:
                    raise RankFailed(
                        f"rank {part.rank}: no rank 0 answered at {where} within {limit:.0f} s; "
                        "nothing was written",
                        hint=f"start every rank (torchrun), check the address, or raise {RENDEZVOUS_ENV}",
                    ) from None
                time.sleep(0.2)
        run_id, restart = env.get("TORCHELASTIC_RUN_ID", ""), env.get("TORCHELASTIC_RESTART_COUNT", "0")
        key = f"ckpt_tools/arrived/{run_id}/{restart}"
        store.add(key, 1)
        while (n := store.add(key, 0)) < part.world:
            if time.monotonic() > deadline:
                raise RankFailed(
                    f"rank {part.rank}: only {n} of WORLD_SIZE={part.world} ranks joined at {where} "
                    f"within {limit:.0f} s; nothing was written",
                    hint="WORLD_SIZE and RANK exported without their peers (a SLURM or PyTorchJob "
                    "environment)? Launch with torchrun, or unset WORLD_SIZE to run in one "
                    f"process; {RENDEZVOUS_ENV} sets this wait",
                )
            time.sleep(0.05)
        store.set_timeout(datetime.timedelta(seconds=self._timeout_s))
        return store

    def _wait(self, work, what: str) -> None:
        # Poll rather than block in C++: a blocked main thread would not run the SIGTERM handler, and
        # torchrun's SIGTERM (a peer failed) must remove this rank's staging directory.
        deadline = time.monotonic() + self._timeout_s
        try:
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise RankFailed(
                        f"rank {self.part.rank}: the other ranks did not reach {what} within "
                        f"{self._timeout_s:.0f} s; nothing was committed",
                        hint=f"look at the other ranks' errors; raise {TIMEOUT_ENV} for slow disks",
                    )
                time.sleep(_POLL_S)
            work.wait()
        except RuntimeError as exc:  # gloo: a peer closed its connection (it failed or was killed)
            raise RankFailed(
                f"rank {self.part.rank}: another rank failed or stopped before {what} "
                f"({str(exc).splitlines()[0][:200]}); nothing was committed",
                hint="look at the other ranks' errors above, fix, and rerun",
            ) from None

    def barrier(self, what: str) -> None:
        self.sum([0], what)

    def sum(self, values: Sequence[int], what: str) -> list[int]:
        t = self._torch.tensor([int(v) for v in values] or [0], dtype=self._torch.int64)
        self._wait(self._dist.all_reduce(t, async_op=True), what)
        return [int(v) for v in t.tolist()][: len(values)]

    def gather(self, value, what: str) -> list | None:
        torch = self._torch
        data = json.dumps(value).encode()
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.part.world)]
        self._wait(
            self._dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), async_op=True), what
        )
        most = max(int(n.item()) for n in sizes)
        mine = torch.zeros(most, dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
        got = [torch.empty(most, dtype=torch.uint8) for _ in range(self.part.world)]
        self._wait(self._dist.all_gather(got, mine, async_op=True), what)
        if not self.leader:
            return None
        return [json.loads(g[: int(n.item())].numpy().tobytes().decode()) for g, n in zip(got, sizes)]

    def broadcast(self, value, what: str):
        # JSON, not pickle: nothing a rank receives is unpickled
        torch = self._torch
        data = json.dumps(value).encode() if self.leader else b""
        n = torch.tensor([len(data)], dtype=torch.int64)
        self._wait(self._dist.broadcast(n, 0, async_op=True), what)
        buf = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if self.leader
            else torch.empty(int(n.item()), dtype=torch.uint8)
        )
        if int(n.item()):
            self._wait(self._dist.broadcast(buf, 0, async_op=True), what)
        return json.loads(buf.numpy().tobytes().decode()) if int(n.item()) else None


_CURRENT: Group | None = None
T = TypeVar("T")


def local_workers(cap: int = THREADS_PER_RANK, environ=os.environ, n_working: int | None = None) -> int:
    """Threads for a read-bound job on this rank: this process's cores shared by the ranks of its node
    that work (`working_per_node`; every rank of torchrun's LOCAL_WORLD_SIZE when all do), at most `cap`
    (each holds one read block). `n_working`: only ranks 0 .. n_working - 1 of the working ones take units
    of this job (`working`); a node's working ranks are numbered contiguously, so this node's are those
    below that number."""
    cores = _cores()
    per_node = working_per_node(environ, cores) if launched_part(environ).world > 1 else None
    local = per_node or max(1, int(environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    if n_working is not None and local > 1:
        if per_node is None:
            first_here = int(environ.get("RANK", "0") or 0) - int(environ.get("LOCAL_RANK", "0") or 0)
        else:
            rank = env_part(environ).rank
            first_here = rank - rank % per_node
        local = max(1, min(local, n_working - first_here))
    per_rank = max(1, cores // local)
    return max(1, min(cap, per_rank))


def min_bytes_per_rank(environ=os.environ) -> int:
    """The work a rank must get before read-only work is split (MIN_BYTES_PER_RANK_ENV; 0: always split)."""
    raw = environ.get(MIN_BYTES_PER_RANK_ENV, "")
    if raw == "":
        return DEFAULT_MIN_BYTES_PER_RANK
    try:
        v = int(raw)
    except ValueError:
        v = -1
    if v < 0:
        raise UsageError(
            f"{MIN_BYTES_PER_RANK_ENV}={raw!r} is not a number of bytes >= 0",
            hint=f"unset {MIN_BYTES_PER_RANK_ENV} for the default ({DEFAULT_MIN_BYTES_PER_RANK})",
        )
    return v


def working(weights: Sequence[int], group: Group | None = None, environ=os.environ) -> int:
    """How many ranks of `group` take units of a read-only job weighing `weights` (`core.parts.working_ranks`
    with `min_bytes_per_rank`); 1 outside torchrun."""
    group = group or SoloGroup()
    return (
        working_ranks(weights, group.part.world, min_bytes_per_rank(environ)) if group.part.world > 1 else 1
    )


@overload
def map_units(
    fn: Callable[[int], T],
    weights: Sequence[int],
    group: Group | None = None,
    *,
    threads: int | None = None,
    done: Callable[[int, T], None] | None = None,
    everywhere: Literal[True],
) -> list[T]: ...
@overload
def map_units(
    fn: Callable[[int], T],
    weights: Sequence[int],
    group: Group | None = None,
    *,
    threads: int | None = None,
    done: Callable[[int, T], None] | None = None,
    everywhere: bool = False,
) -> list[T] | None: ...
def map_units(
    fn: Callable[[int], T],
    weights: Sequence[int],
    group: Group | None = None,
    *,
    threads: int | None = None,
    done: Callable[[int, T], None] | None = None,
    everywhere: bool = False,
) -> list[T] | None:
    """`fn(i)` for every independent unit i (weights: its bytes), split over the group's working ranks
    (`working`: the first ones, one per `min_bytes_per_rank` of work; then `Part.mine`) and this rank's
    threads; `done(i, result)` runs in this thread as results arrive in
    order (progress). Returns every unit's result in unit order on the leader (on every rank with
    `everywhere`), None on the others (results cross ranks as JSON). Read-only work: nothing to
    commit, so no staging."""
    group = group or SoloGroup()
    # below `min_bytes_per_rank` a rank costs more than it saves: only the first `n` ranks take units
    n = working(weights, group)
    part = group.part
    mine = Part(part.rank, n).mine(weights) if part.rank < n else ()
    threads = threads or local_workers(n_working=n)
    results: dict[int, T] = {}

    def ordered() -> Iterator[tuple[int, T]]:
        if threads <= 1 or len(mine) <= 1:
            for i in mine:
                yield i, fn(i)
            return
        # the ordered map of a pool reads ahead `threads` units; preadv, zlib and torch release the GIL
        pool = ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="ckpt-units", initializer=one_intra_op_thread
        )
        try:
            yield from zip(mine, pool.map(fn, mine))
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    for i, r in ordered():
        results[i] = r
        if done is not None:
            done(i, r)
    if group.part.world == 1:
        return [results[i] for i in range(len(weights))]
    gathered = group.gather([[i, results[i]] for i in mine], "the results of every unit")
    ordered_all = None
    if gathered is not None:
        every = {i: r for part in gathered for i, r in part}
        ordered_all = [every[i] for i in range(len(weights))]
    if everywhere:
        ordered_all = group.broadcast(ordered_all, "the results of every unit")
    return ordered_all


def current() -> Group:
    """This process's group: a `TorchGroup` under torchrun with 2+ ranks (created once), else solo.
    Commands ask for it once their inputs are open and planned, before any work: the ranks then check
    that they read the same inputs (`same_inputs`)."""
    global _CURRENT
    if _CURRENT is None:
        part = env_part()
        group = TorchGroup(part) if part.world > 1 else SoloGroup()
        if part.world > 1:
            same_inputs(group)
        _CURRENT = group
    return _CURRENT


def same_inputs(group: Group) -> None:
    """Refuse, on every rank, to start when the ranks did not open the same inputs: the same files (a
    hub id resolves from each node's own HF cache: two snapshots of one repo id gave a merge of two
    bases, exit 0), of the same sizes, with the same first and last bytes (`io.inputs.input_identity`)."""
    from .io.inputs import input_identity

    mine = input_identity()
    every = group.gather(mine, "the identity of every input")
    why = None
    if every is not None:
        ref = {e[0]: e[1:] for e in every[0]}
        for rank, other in enumerate(every[1:], 1):
            theirs = {e[0]: e[1:] for e in other}
            if theirs == ref:
                continue
            only0 = sorted(set(ref) - set(theirs))
            only_r = sorted(set(theirs) - set(ref))
            changed = sorted(k for k in set(ref) & set(theirs) if ref[k] != theirs[k])
            what = (
                f"{changed[0]} differs (size/digest {ref[changed[0]]} on rank 0, {theirs[changed[0]]} on "
                f"rank "
                f"{rank})"
                if changed
                else f"rank 0 reads {only0[0] if only0 else 'nothing more'}, rank {rank} reads "
                f"{only_r[0] if only_r else 'nothing more'}"
            )
            why = (
                f"rank {rank} does not read the same inputs as rank 0: {what}; {len(only0) + len(only_r)} "
                f"file(s) seen by one rank only, {len(changed)} differing"
            )
            break
    why = group.broadcast(why, "the verdict on the inputs")
    if why:
        raise UsageError(
            why + "; nothing was written",
            hint="give every rank the same files (a local directory on a shared filesystem, or the "
            "same revision in every node's HF cache: org/name@<commit>)",
        )
