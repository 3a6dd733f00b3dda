"""What `ckpt gc` will do to each step of a run's checkpoints dir, from listings and metadata only."""

from __future__ import annotations

import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ...core.errors import CkptError, UsageError
from ...formats.dcp.layout import METADATA_NAME, extra_entries
from ...formats.dcp.reader import DcpCheckpoint
from ...formats.primerl.config import load_run_config, locate_run_configs
from ...formats.primerl.run_dir import checkpoints_dir_of, dir_bytes, resolve_base, step_dirs
from ...formats.primerl.step_dir import step_extras
from ...formats.slim.partition import partition
from ...io.inputs import local_dir
from ...io.owned import OUTPUT_MARKER
from .layout import ASIDE, OWN_LOCKS, STAGED, STEP_LOCK, TRAINER, is_complete, is_slim, lock_holder

__all__ = ["DEFAULT_MIN_AGE_S", "GcPlan", "StepPlan", "plan_gc", "shared_files", "unknown_entries"]

log = logging.getLogger(__name__)

DEFAULT_MIN_AGE_S = 600
# Bytes of the slim manifest per dropped tensor (JSON: key, shape, chunk layout, sha256): measured
# ~350-600 on prime-rl checkpoints; 1 KiB keeps the free-disk check on the safe side.
_MANIFEST_BYTES_PER_TENSOR = 1024


@dataclass(frozen=True)
class StepPlan:
    step: int
    path: str  # step_N/trainer
    action: str  # "slim" | "finish" (free what a killed gc left) | "restore" | "keep" | "skip"
    reason: str
    bytes: int  # on disk now: trainer/ plus gc leftovers
    slim_bytes: int | None = None  # estimated size after (slim: of the slim; finish: of trainer/)
    then_slim: bool = False  # restore: the restored step is older than the newest N, slim it too

    @property
    def bytes_to_free(self) -> int:
        return max(0, self.bytes - self.slim_bytes) if self.slim_bytes is not None else 0


@dataclass(frozen=True)
class GcPlan:
    checkpoints: str
    keep_full: int
    base: dict | None  # {"name", "dir", "how"} or None when no base was found
    min_age_s: float
    steps: tuple[StepPlan, ...]
    free_bytes: int
    need_bytes: int  # free disk needed: the largest slim written
    # what the step dirs hold beside trainer/ (prime-rl's converters' weights/, weights-FP8/, the
    # orchestrator's state): kept as they are, never slimmed or deleted; counted (formats.primerl.step_dir)
    beside: tuple[dict, ...] = ()

    @property
    def units(self) -> list[StepPlan]:
        """The independent work units: the steps to change, each under its own lock."""
        return self.to_do

    @property
    def to_do(self) -> list[StepPlan]:
        return [s for s in self.steps if s.action in ("slim", "finish", "restore")]

    def to_json(self) -> dict:
        return {
            "checkpoints": self.checkpoints,
            "keep_full": self.keep_full,
            "base": self.base,
            "min_age_s": self.min_age_s,
            "free_bytes": self.free_bytes,
            "need_bytes": self.need_bytes,
            "bytes_to_free": sum(s.bytes_to_free for s in self.steps),
            "steps": [dict(asdict(s), bytes_to_free=s.bytes_to_free) for s in self.steps],
            "kept_beside": list(self.beside),
            "kept_beside_bytes": sum(b["bytes"] for b in self.beside),
        }


def _newest_mtime(d: Path) -> float:
    m = d.lstat().st_mtime
    for p in d.rglob("*"):
        try:
            m = max(m, p.lstat().st_mtime)
        except FileNotFoundError:
            pass
    return m


def _foreign_locks(step_dir: Path) -> list[str]:
    out = []
    for d in (step_dir, step_dir / TRAINER):
        if d.is_dir():
            out += [
                f"{d.name}/{p.name}"
                for p in d.iterdir()
                if p.name.endswith(".lock") and p.name not in OWN_LOCKS
            ]
    return out


def _leftovers(step_dir: Path) -> list[Path]:
    return [p for p in (step_dir / STAGED, step_dir / ASIDE) if os.path.lexists(p)]


def unknown_entries(ck: DcpCheckpoint) -> list[str]:
    """Entries of a checkpoint dir a slim of it would not carry: not `.metadata`, not a data file its
    metadata references, not an extra entry the slim copies (`dcp.layout.extra_entries`), not our own
    output marker (a regular `.ckpt-tools-output`: the step is an OUT of restart-prep, adapter-to-dcp,
    set-lr...; gc's slim carries it verbatim): hidden entries (`set-lr --in-place`'s `.metadata.bak-*`
    undo files, temp files), unreferenced `.distcp` files. gc deletes the full checkpoint after the swap,
    so it never slims a step holding any."""
    files = set(ck.data_files())
    marker = ck.dir / OUTPUT_MARKER
    ours = [OUTPUT_MARKER] if marker.is_file() and not marker.is_symlink() else []
    known = {METADATA_NAME, *ours, *files, *extra_entries(ck.dir, files)}
    return sorted(n for n in os.listdir(ck.dir) if n not in known)


def _estimate_slim_bytes(trainer: Path, trust_pickle: bool) -> tuple[int, list[str]]:
    with DcpCheckpoint.open(trainer, trust_pickle=trust_pickle) as ck:
        layout = partition(ck)
        meta = (trainer / METADATA_NAME).stat().st_size
        return layout.kept_bytes + meta + _MANIFEST_BYTES_PER_TENSOR * len(layout.dropped), unknown_entries(
            ck
        )


def _file_ids(trainer: Path) -> set[tuple[int, int]]:
    """(st_dev, st_ino) of every file a step's trainer/ reaches, links followed: two steps share a
    file when they reach one inode (a hard link, a `cp -s` / `ln -s` copy, a linked trainer/)."""
    ids: set[tuple[int, int]] = set()
    if not trainer.is_dir():
        return ids
    for root, dirs, names in os.walk(trainer, followlinks=False):
        for n in names + [d for d in dirs if os.path.islink(os.path.join(root, d))]:
            try:
                st = os.stat(os.path.join(root, n))
            except OSError:
                continue
            ids.add((st.st_dev, st.st_ino))
    return ids


def shared_files(steps: list[tuple[int, Path]]) -> dict[int, list[int]]:
    """step -> the other steps it shares a file with (see `_file_ids`)."""
    ids = {n: _file_ids(d / TRAINER) for n, d in steps}
    return {n: [m for m in ids if m != n and ids[n] & ids[m]] for n in ids}


def _named(names: list[str], most: int = 5) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def _classify(
    n: int,
    step_dir: Path,
    newest: set[int],
    now: float,
    min_age_s: float,
    trust_pickle: bool,
    shared: list[int],
) -> StepPlan:
    """What gc does with step `n`: the first rule that decides it, in the order below."""
    trainer = step_dir / TRAINER
    left = _leftovers(step_dir)
    size = sum(dir_bytes(p) for p in [trainer] + left if p.is_dir())
    return (
        _held_or_missing(n, step_dir, trainer, n in newest, size)
        or _by_state(n, step_dir, trainer, n in newest, bool(left), size)
        or _swap_blocked(n, trainer, shared, now, min_age_s, size)
        or _slim_or_skip(n, trainer, trust_pickle, size)
    )


def _held_or_missing(n: int, step_dir: Path, trainer: Path, newest: bool, size: int) -> StepPlan | None:
    """A step another ckpt command holds, a trainer/ that is a link, or none (put back from where a killed
    gc left it, else skipped)."""
    holder = lock_holder(step_dir / STEP_LOCK) or lock_holder(step_dir / f".{STAGED}.lock")
    if holder:
        return StepPlan(n, str(trainer), "skip", f"locked by another ckpt command (pid {holder})", size)
    if trainer.is_symlink():
        return StepPlan(
            n, str(trainer), "skip", "trainer is a symbolic link (gc swaps directories, never links)", size
        )
    if not trainer.is_dir():
        aside = step_dir / ASIDE
        if aside.is_dir() and is_complete(aside):
            return StepPlan(
                n,
                str(trainer),
                "restore",
                f"a gc was killed mid-swap: the full checkpoint is at {ASIDE}; it is put back",
                size,
                None,
                then_slim=not newest,
            )
        return StepPlan(n, str(trainer), "skip", "no trainer/ dir", size)
    return None


def _by_state(
    n: int, step_dir: Path, trainer: Path, newest: bool, leftovers: bool, size: int
) -> StepPlan | None:
    """What the checkpoint's state decides: a slim an interrupted gc left is finished; one being written,
    already slim, or one of the newest is left as it is."""
    if is_complete(trainer) and is_slim(trainer) and leftovers:
        return StepPlan(
            n, str(trainer), "finish", "slim; frees what an interrupted gc left", size, dir_bytes(trainer)
        )
    foreign = _foreign_locks(step_dir)
    if foreign:
        return StepPlan(n, str(trainer), "skip", f"lock file {foreign[0]} present (being written?)", size)
    if not is_complete(trainer):
        return StepPlan(
            n,
            str(trainer),
            "skip",
            f"in progress: no {METADATA_NAME} yet (a save being written, or one that died)",
            size,
        )
    if is_slim(trainer):
        return StepPlan(n, str(trainer), "skip", "already slim", size)
    if newest:
        return StepPlan(n, str(trainer), "keep", "one of the newest --keep-full", size)
    return None


def _swap_blocked(
    n: int, trainer: Path, shared: list[int], now: float, min_age_s: float, size: int
) -> StepPlan | None:
    """What keeps gc from swapping the slim in: a mount point, files shared with another step, a
    checkpoint modified within --min-age."""
    if os.path.ismount(trainer):
        return StepPlan(
            n,
            str(trainer),
            "skip",
            "trainer is a mount point (gc swaps directories by rename, which cannot move a mount)",
            size,
        )
    if shared:
        return StepPlan(
            n,
            str(trainer),
            "skip",
            "shares files with "
            + ", ".join(f"step_{m}" for m in shared)
            + " (symlinks or hard links between them): slimming it would break that step; gc slims "
            "only a step whose files are its own",
            size,
        )
    age = now - _newest_mtime(trainer)
    if age < min_age_s:
        return StepPlan(
            n,
            str(trainer),
            "skip",
            f"in progress: modified {age:.0f} s ago (< --min-age {min_age_s:g} s)",
            size,
        )
    return None


def _slim_or_skip(n: int, trainer: Path, trust_pickle: bool, size: int) -> StepPlan:
    """Slimmed, with its estimated size, unless its metadata does not read or it holds entries a slim
    would not carry (gc deletes the full checkpoint)."""
    try:
        est, unknown = _estimate_slim_bytes(trainer, trust_pickle)
    except CkptError as exc:
        return StepPlan(n, str(trainer), "skip", f"cannot slim: {exc.message}", size)
    except OSError as exc:
        return StepPlan(n, str(trainer), "skip", f"cannot read it: {exc.strerror or exc}", size)
    if unknown:
        return StepPlan(
            n,
            str(trainer),
            "skip",
            f"holds entries a slim would not carry: {_named(unknown)} "
            "(hidden entries, unreferenced .distcp files, set-lr's .metadata.bak-* undo files); gc "
            "deletes the full checkpoint, so it leaves this step alone: move them out of trainer/ "
            "to let gc slim it",
            size,
        )
    return StepPlan(n, str(trainer), "slim", "older than the newest --keep-full", size, est)


def _base_for(checkpoints: Path, base) -> dict | None:
    cfg = None
    if base is None:
        try:
            found = locate_run_configs(checkpoints)
            cfg = load_run_config(found) if found is not None else None
        except CkptError as exc:
            log.info("run config not read: %s", exc)
    b = resolve_base(base, cfg)
    if b is None:
        return None
    return {"name": b.name, "dir": str(b.dir) if b.dir else None, "how": b.how, "problem": b.problem}


def plan_gc(
    checkpoints_dir: str | Path,
    *,
    keep_full: int,
    base: str | Path | None = None,
    min_age_s: float = DEFAULT_MIN_AGE_S,
    trust_pickle: bool = False,
    now: float | None = None,
) -> GcPlan:
    """What gc will do to each step, from directory listings and checkpoint metadata only."""
    if keep_full < 1:
        raise UsageError(
            f"--keep-full must be >= 1, got {keep_full}",
            hint="keep at least the newest checkpoint whole, to resume from",
        )
    local_dir(
        checkpoints_dir,
        "gc slims a run's checkpoints in place, on this machine's disk",
        hint="run gc where the checkpoints are written; `gc --slim-to URL` uploads each slim to a store",
    )
    ck = checkpoints_dir_of(checkpoints_dir)
    now = time.time() if now is None else now
    steps = step_dirs(ck)
    # --keep-full counts FULL checkpoints: a slim newest step is no resume point and keeps no full one
    full = [
        n
        for n, d in steps
        if (is_complete(d / TRAINER) and not is_slim(d / TRAINER))
        or (not (d / TRAINER).is_dir() and is_complete(d / ASIDE))
    ]  # restorable after a kill
    newest = set(sorted(full)[-keep_full:])
    shared = shared_files(steps)
    plans = tuple(_classify(n, d, newest, now, min_age_s, trust_pickle, shared[n]) for n, d in steps)
    b = (
        _base_for(ck, base)
        if any(p.action == "slim" or p.then_slim for p in plans) or base is not None
        else None
    )
    need = max((p.slim_bytes or p.bytes for p in plans if p.action == "slim" or p.then_slim), default=0)
    return GcPlan(
        str(ck),
        keep_full,
        b,
        min_age_s,
        plans,
        shutil.disk_usage(ck).free,
        int(need * 1.02) + (1 << 20) if need else 0,
        tuple(
            {"step": n, "name": e.name, "kind": e.kind, "bytes": e.bytes}
            for n, d in steps
            for e in step_extras(d)
        ),
    )
