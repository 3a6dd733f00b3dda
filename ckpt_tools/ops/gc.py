"""`ckpt gc`: keep every checkpoint of a run, the newest N whole and every older one slim, in place.

For each older `step_N/trainer` (oldest first): slim it next to itself into `step_N/.trainer.gc-slim`
(`ops.slim.slim`, with the base model checked: every dropped tensor must equal the base's upcast, so
`ckpt rehydrate` can rebuild it), verify the slim against the original (every kept storage item's
bytes by sha256, the key sets, the dropped tensors' layout), swap the two directories atomically
(`atomic.exchange_paths`, renameat2 RENAME_EXCHANGE), move the full one aside to `.trainer.gc-old`
and delete it. The step lock `step_N/.trainer.lock` (the one `AtomicOutputDir` and in-place editors
of `step_N/trainer` take) is held throughout.

Why a kill at any moment leaves every step full or slim: until the exchange, `trainer` is the
untouched original; the exchange is one syscall; after it `trainer` is a complete, verified slim.
What a killed run leaves (`.trainer.gc-slim`, `.trainer.gc-old`, `..trainer.gc-slim.tmp-*`) is
hidden, named for what it is, and finished or removed by the next run (`recover_step`). Where the
filesystem cannot exchange (some network filesystems), the swap is two renames with signals held;
a SIGKILL between them leaves `trainer` absent and the full copy at `.trainer.gc-old` until the next
gc (or `ckpt gc --dry-run`) puts it back.

Left alone: the newest N complete checkpoints, anything without `.metadata` (being written, or a
save that died), anything modified within `min_age_s`, anything whose step lock is held or that
holds a lock file we do not know, and checkpoints already slim. Refuses to start when free disk is
below the largest slim it would write.
"""
from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..atomic import OutputLock, clean_stale_temps, exchange_paths, fsync_path
from ..dcp.reader import METADATA_NAME, DcpCheckpoint, TensorEntry
from ..errors import CkptError, DiskSpaceError, FormatError, LockedError, UsageError
from ..primerl.config import load_run_config, locate_run_configs
from ..primerl.run_dir import checkpoints_dir_of, dir_bytes, resolve_base, step_dirs
from ..units import human_bytes
from .inspect import SLIM_MANIFEST
from .slim import plan_slim, read_manifest, slim
from .verify import verify_path

log = logging.getLogger(__name__)

TRAINER = "trainer"
STAGED = ".trainer.gc-slim"       # the slim being written and verified
ASIDE = ".trainer.gc-old"         # the full checkpoint after the swap, being deleted
STEP_LOCK = ".trainer.lock"       # AtomicOutputDir(step_N/trainer)'s lock name
OWN_LOCKS = {STEP_LOCK, f".{STAGED}.lock"}
DEFAULT_MIN_AGE_S = 600
# Bytes of the slim manifest per dropped tensor (JSON: key, shape, chunk layout, sha256): measured
# ~350-600 on prime-rl checkpoints; 1 KiB keeps the free-disk check on the safe side.
_MANIFEST_BYTES_PER_TENSOR = 1024

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class StepPlan:
    step: int
    path: str                      # step_N/trainer
    action: str                    # "slim" | "finish" (free what a killed gc left) | "restore" | "keep" | "skip"
    reason: str
    bytes: int                     # on disk now: trainer/ plus gc leftovers
    slim_bytes: int | None = None  # estimated size after (slim: of the slim; finish: of trainer/)
    then_slim: bool = False        # restore: the restored step is older than the newest N, slim it too

    @property
    def bytes_to_free(self) -> int:
        return max(0, self.bytes - self.slim_bytes) if self.slim_bytes is not None else 0


@dataclass(frozen=True)
class GcPlan:
    checkpoints: str
    keep_full: int
    base: dict | None              # {"name", "dir", "how"} or None when no base was found
    min_age_s: float
    steps: tuple[StepPlan, ...]
    free_bytes: int
    need_bytes: int                # free disk needed: the largest slim written

    @property
    def to_do(self) -> list[StepPlan]:
        return [s for s in self.steps if s.action in ("slim", "finish", "restore")]

    def to_json(self) -> dict:
        return {"checkpoints": self.checkpoints, "keep_full": self.keep_full, "base": self.base,
                "min_age_s": self.min_age_s, "free_bytes": self.free_bytes, "need_bytes": self.need_bytes,
                "bytes_to_free": sum(s.bytes_to_free for s in self.steps),
                "steps": [dict(asdict(s), bytes_to_free=s.bytes_to_free) for s in self.steps]}


# ------------------------------------------------------------------------------------------ state of a step
def is_complete(d: Path) -> bool:
    return (d / METADATA_NAME).is_file()


def is_slim(d: Path) -> bool:
    return (d / SLIM_MANIFEST).is_file()


def lock_holder(lock: Path) -> str | None:
    """The pid text of a live holder of an flock lock file, None when nobody holds it (read-only
    probe: creates nothing)."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
        except OSError:
            return None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


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
            out += [f"{d.name}/{p.name}" for p in d.iterdir() if p.name.endswith(".lock") and p.name not in OWN_LOCKS]
    return out


def _leftovers(step_dir: Path) -> list[Path]:
    return [p for p in (step_dir / STAGED, step_dir / ASIDE) if os.path.lexists(p)]


def _estimate_slim_bytes(trainer: Path, trust_pickle: bool) -> int:
    with DcpCheckpoint.open(trainer, trust_pickle=trust_pickle) as ck:
        plan = plan_slim(ck, trainer.parent / STAGED)
        meta = (trainer / METADATA_NAME).stat().st_size
        return plan.kept_bytes + meta + _MANIFEST_BYTES_PER_TENSOR * len(plan.dropped)


def _classify(n: int, step_dir: Path, newest: set[int], now: float, min_age_s: float,
              trust_pickle: bool) -> StepPlan:
    trainer = step_dir / TRAINER
    left = _leftovers(step_dir)
    size = sum(dir_bytes(p) for p in [trainer] + left if p.is_dir())
    holder = lock_holder(step_dir / STEP_LOCK) or lock_holder(step_dir / f".{STAGED}.lock")
    if holder:
        return StepPlan(n, str(trainer), "skip", f"locked by another ckpt command (pid {holder})", size)
    if trainer.is_symlink():
        return StepPlan(n, str(trainer), "skip", "trainer is a symbolic link (gc swaps directories, never links)",
                        size)
    if not trainer.is_dir():
        aside = step_dir / ASIDE
        if aside.is_dir() and is_complete(aside):
            return StepPlan(n, str(trainer), "restore", "a gc was killed mid-swap: the full checkpoint is at "
                            f"{ASIDE}; it is put back", size, None, then_slim=n not in newest)
        return StepPlan(n, str(trainer), "skip", "no trainer/ dir", size)
    if is_complete(trainer) and is_slim(trainer) and left:
        return StepPlan(n, str(trainer), "finish", "slim; frees what an interrupted gc left", size, dir_bytes(trainer))
    foreign = _foreign_locks(step_dir)
    if foreign:
        return StepPlan(n, str(trainer), "skip", f"lock file {foreign[0]} present (being written?)", size)
    if not is_complete(trainer):
        return StepPlan(n, str(trainer), "skip", f"in progress: no {METADATA_NAME} yet (a save being written, "
                        "or one that died)", size)
    if is_slim(trainer):
        return StepPlan(n, str(trainer), "skip", "already slim", size)
    if n in newest:
        return StepPlan(n, str(trainer), "keep", "one of the newest --keep-full", size)
    age = now - _newest_mtime(trainer)
    if age < min_age_s:
        return StepPlan(n, str(trainer), "skip", f"in progress: modified {age:.0f} s ago (< --min-age "
                        f"{min_age_s:g} s)", size)
    try:
        est = _estimate_slim_bytes(trainer, trust_pickle)
    except CkptError as exc:
        return StepPlan(n, str(trainer), "skip", f"cannot slim: {exc.message}", size)
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


def plan_gc(checkpoints_dir: str | Path, *, keep_full: int, base: str | Path | None = None,
            min_age_s: float = DEFAULT_MIN_AGE_S, trust_pickle: bool = False, now: float | None = None) -> GcPlan:
    """What gc will do to each step, from directory listings and checkpoint metadata only."""
    if keep_full < 1:
        raise UsageError(f"--keep-full must be >= 1, got {keep_full}",
                         hint="keep at least the newest checkpoint whole, to resume from")
    ck = checkpoints_dir_of(checkpoints_dir)
    now = time.time() if now is None else now
    steps = step_dirs(ck)
    complete = [n for n, d in steps if is_complete(d / TRAINER)
                or (not (d / TRAINER).is_dir() and is_complete(d / ASIDE))]   # restorable after a kill
    newest = set(sorted(complete)[-keep_full:])
    plans = tuple(_classify(n, d, newest, now, min_age_s, trust_pickle) for n, d in steps)
    b = _base_for(ck, base) if any(p.action == "slim" or p.then_slim for p in plans) or base is not None else None
    need = max((p.slim_bytes or p.bytes for p in plans if p.action == "slim" or p.then_slim), default=0)
    return GcPlan(str(ck), keep_full, b, min_age_s, plans, shutil.disk_usage(ck).free,
                  int(need * 1.02) + (1 << 20) if need else 0)


# ------------------------------------------------------------------------------------------ verify
def _item_sha(ck: DcpCheckpoint, file: str, offset: int, length: int, key: str) -> str:
    return hashlib.sha256(ck.read_item_bytes(file, offset, length, key)).hexdigest()


def verify_slim_against(full_dir: Path, slim_dir: Path, *, trust_pickle: bool = False) -> int:
    """Prove a slim checkpoint holds the original's every kept item byte for byte and lists exactly its
    other tensors as dropped (layout included), with the base verified at slim time. Returns the
    number of items compared; raises FormatError naming the first difference."""
    m = read_manifest(slim_dir)
    if not (m.base or {}).get("verified"):
        raise FormatError("the slim manifest does not record a verified base", path=m.path,
                          hint="gc only frees a checkpoint whose base was checked; rerun with --base")
    n = 0
    with DcpCheckpoint.open(full_dir, trust_pickle=trust_pickle) as full, \
            DcpCheckpoint.open(slim_dir, trust_pickle=trust_pickle) as sl:
        dropped = {d.key: d for d in m.dropped}
        if set(sl.entries) & set(dropped) or set(sl.entries) | set(dropped) != set(full.entries):
            raise FormatError("the slim's kept and dropped keys do not partition the original's keys",
                              path=slim_dir, hint="the slim is damaged: delete it and rerun gc")
        for key, e in sl.entries.items():
            o = full.entries[key]
            if type(e) is not type(o) or tuple(e.path) != tuple(o.path):
                raise FormatError("entry differs from the original's", path=slim_dir, key=key)
            if isinstance(e, TensorEntry):
                if e.dtype != o.dtype or tuple(e.shape) != tuple(o.shape):
                    raise FormatError("dtype/shape differ from the original's", path=slim_dir, key=key)
                mine = {(c.offsets, c.sizes): c for c in e.chunks}
                theirs = {(c.offsets, c.sizes): c for c in o.chunks}
                if set(mine) != set(theirs):
                    raise FormatError("chunk layout differs from the original's", path=slim_dir, key=key)
                for k, c in mine.items():
                    t = theirs[k]
                    if _item_sha(sl, c.file, c.offset, c.length, key) != _item_sha(full, t.file, t.offset, t.length, key):
                        raise FormatError(f"chunk {list(c.offsets)} differs from the original's bytes", path=slim_dir,
                                          key=key, hint="the slim is damaged: delete it and rerun gc")
                    n += 1
            else:
                if _item_sha(sl, e.file, e.offset, e.length, key) != _item_sha(full, o.file, o.offset, o.length, key):
                    raise FormatError("item differs from the original's bytes", path=slim_dir, key=key)
                n += 1
        for key, d in dropped.items():
            o = full.entries[key]
            if not isinstance(o, TensorEntry) or tuple(o.shape) != tuple(d.shape) or \
                    sorted((c.offsets, c.sizes) for c in o.chunks) != sorted((c.offsets, c.sizes) for c in d.chunks):
                raise FormatError("dropped tensor's recorded layout differs from the original's", path=m.path, key=key)
    return n


def check_slim(full_dir: Path, slim_dir: Path, *, trust_pickle: bool = False) -> None:
    """Everything gc proves before the swap: `ckpt verify`'s structural checks of the slim (metadata,
    every item's zip records, dtypes and shapes), then `verify_slim_against` the original."""
    report = verify_path(slim_dir, trust_pickle=trust_pickle)
    if not report.ok:
        raise FormatError(f"the new slim fails `ckpt verify`: {report.problems[0].render()}", path=slim_dir,
                          hint="nothing was swapped; the full checkpoint is untouched. Report this")
    verify_slim_against(full_dir, slim_dir, trust_pickle=trust_pickle)


# ------------------------------------------------------------------------------------------ swap
def remove_file(p: Path) -> None:
    """Delete one file of the set-aside full checkpoint (its own function: a kill point in tests)."""
    p.unlink(missing_ok=True)


def remove_tree(d: Path) -> None:
    """Delete a directory file by file, deepest first (never following links)."""
    if not os.path.lexists(d):
        return
    if d.is_symlink() or not d.is_dir():
        remove_file(d)
        return
    for root, dirs, files in os.walk(d, topdown=False):
        for name in files:
            remove_file(Path(root) / name)
        for name in dirs:
            p = Path(root) / name
            if p.is_symlink():
                p.unlink()
            else:
                p.rmdir()
    d.rmdir()


def set_aside(step_dir: Path) -> None:
    """After the exchange `.trainer.gc-slim` holds the full checkpoint: rename it for what it is."""
    os.rename(step_dir / STAGED, step_dir / ASIDE)
    fsync_path(step_dir)


def swap_in_slim(step_dir: Path) -> None:
    """Make the verified slim `step_N/trainer` in one atomic step (see the module docstring)."""
    staged, trainer = step_dir / STAGED, step_dir / TRAINER
    try:
        exchange_paths(staged, trainer)
    except OSError as exc:
        log.warning("atomic exchange unavailable (%s): swapping with two renames", exc)
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            os.rename(trainer, step_dir / ASIDE)
            os.rename(staged, trainer)
            fsync_path(step_dir)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        return
    set_aside(step_dir)


def recover_step(step_dir: Path) -> list[str]:
    """Finish or undo what a killed gc left in a step dir; the caller holds the step lock. Returns
    what was done."""
    done = []
    trainer, staged, aside = step_dir / TRAINER, step_dir / STAGED, step_dir / ASIDE
    for p in clean_stale_temps(staged):
        done.append(f"removed {p.name}")
    if not trainer.is_dir():
        if aside.is_dir() and is_complete(aside):
            os.rename(aside, trainer)          # killed between the two fallback renames: put the full back
            fsync_path(step_dir)
            done.append(f"restored {TRAINER} from {ASIDE}")
        elif staged.is_dir() and is_complete(staged) and is_slim(staged):
            os.rename(staged, trainer)
            fsync_path(step_dir)
            done.append(f"restored {TRAINER} from {STAGED}")
    if is_complete(trainer) and is_slim(trainer):
        for p in (staged, aside):               # the full copy or its remains: trainer is the verified slim
            if os.path.lexists(p):
                remove_tree(p)
                done.append(f"removed {p.name}")
        fsync_path(step_dir)
    elif os.path.lexists(aside):
        remove_tree(aside)                      # trainer is full: an aside can only be a leftover copy
        done.append(f"removed {ASIDE}")
    return done


# ------------------------------------------------------------------------------------------ run
@dataclass
class StepResult:
    step: int
    action: str
    result: str                    # "slimmed" | "finished" | "restored" | "kept" | "skipped"
    reason: str
    bytes_before: int
    bytes_after: int
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def freed_bytes(self) -> int:
        return self.bytes_before - self.bytes_after

    def to_json(self) -> dict:
        return dict(asdict(self), freed_bytes=self.freed_bytes)


def _step_bytes(step_dir: Path) -> int:
    return sum(dir_bytes(p) for p in (step_dir / TRAINER, step_dir / STAGED, step_dir / ASIDE) if p.is_dir())


def _slim_one(step_dir: Path, base: str, trust_pickle: bool, progress: Progress | None) -> list[str]:
    trainer, staged = step_dir / TRAINER, step_dir / STAGED
    notes = []
    if staged.is_dir():
        try:
            check_slim(trainer, staged, trust_pickle=trust_pickle)
            notes.append(f"reused the verified {STAGED} of an interrupted run")
        except CkptError as exc:
            notes.append(f"discarded {STAGED} of an interrupted run ({exc.message})")
            remove_tree(staged)
    if not staged.is_dir():
        slim(trainer, staged, base=base, trust_pickle=trust_pickle, progress=progress)
        try:
            check_slim(trainer, staged, trust_pickle=trust_pickle)
        except CkptError:
            remove_tree(staged)
            raise
    swap_in_slim(step_dir)
    remove_tree(step_dir / ASIDE)
    fsync_path(step_dir)
    return notes


def run_gc(plan: GcPlan, *, trust_pickle: bool = False, progress: Progress | None = None,
           on_step: Callable[[StepResult], None] | None = None) -> list[StepResult]:
    """Execute a plan. Every step is re-checked under its lock before anything is written."""
    todo = plan.to_do
    slims = [s for s in todo if s.action == "slim" or s.then_slim]
    if slims:
        if plan.base is None or plan.base.get("dir") is None:
            why = (plan.base or {}).get("problem") or "no --base, and the run's config names no model found here"
            raise UsageError(f"no base model to prove the slims against: {why}", path=plan.checkpoints,
                             hint="gc deletes a full checkpoint only after checking that the base rebuilds it; "
                                  "pass --base with the bf16 HF model the run trained on")
        free = shutil.disk_usage(plan.checkpoints).free
        if free < plan.need_bytes:
            raise DiskSpaceError(f"need {human_bytes(plan.need_bytes)} free for the largest slim, "
                                 f"{human_bytes(free)} free", path=plan.checkpoints,
                                 hint="free some space first (gc writes each slim before it frees the full "
                                      "checkpoint)")
    results = []
    for i, sp in enumerate(plan.steps):
        step_dir = Path(sp.path).parent
        before = _step_bytes(step_dir)
        res = StepResult(sp.step, sp.action, {"keep": "kept", "skip": "skipped"}.get(sp.action, ""), sp.reason,
                         before, before)
        if sp.action in ("slim", "finish", "restore"):
            t0 = time.perf_counter()
            lock = OutputLock(step_dir / STEP_LOCK, step_dir / TRAINER)
            try:
                lock.acquire()
            except LockedError as exc:
                res.result, res.reason = "skipped", exc.message
            else:
                try:
                    res.notes += recover_step(step_dir)
                    trainer = step_dir / TRAINER
                    if (sp.action == "slim" or sp.then_slim) and is_complete(trainer) and not is_slim(trainer):
                        step_progress = (lambda ph, d, t, _s=sp.step: progress(f"step_{_s} {ph}", d, t)) \
                            if progress else None
                        res.notes += _slim_one(step_dir, plan.base["dir"], trust_pickle, step_progress)
                        res.result = "slimmed"
                    elif sp.action == "slim":
                        res.result, res.reason = "skipped", "changed since the plan (not a full checkpoint now)"
                    else:
                        res.result = {"finish": "finished", "restore": "restored"}[sp.action]
                finally:
                    lock.release()
            res.seconds = round(time.perf_counter() - t0, 3)
            res.bytes_after = _step_bytes(step_dir)
        results.append(res)
        if on_step is not None:
            on_step(res)
    return results


def gc(checkpoints_dir: str | Path, *, keep_full: int, base: str | Path | None = None, dry_run: bool = False,
       min_age_s: float = DEFAULT_MIN_AGE_S, trust_pickle: bool = False, progress: Progress | None = None,
       on_step: Callable[[StepResult], None] | None = None) -> dict:
    """Library entry point: plan, and unless `dry_run` execute. Returns a JSON-able report."""
    plan = plan_gc(checkpoints_dir, keep_full=keep_full, base=base, min_age_s=min_age_s, trust_pickle=trust_pickle)
    report = {"plan": plan.to_json(), "dry_run": dry_run}
    if dry_run:
        return report
    before = dir_bytes(Path(plan.checkpoints))
    results = run_gc(plan, trust_pickle=trust_pickle, progress=progress, on_step=on_step)
    after = dir_bytes(Path(plan.checkpoints))
    report["result"] = {"steps": [r.to_json() for r in results], "bytes_before": before, "bytes_after": after,
                        "freed_bytes": before - after,
                        "slimmed": [r.step for r in results if r.result == "slimmed"]}
    return report
