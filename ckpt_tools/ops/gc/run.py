"""`ckpt gc`, executed: each planned step re-checked under its lock, slimmed beside itself, proven,
swapped."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ...core.errors import CkptError, DiskSpaceError, LockedError, UsageError
from ...core.progress import Progress, ProgressEvent
from ...core.units import human_bytes
from ...formats.dcp.reader import DcpCheckpoint
from ...formats.hf_dir.model_dir import HFModelDir
from ...formats.primerl.run_dir import dir_bytes
from ...formats.slim.partition import base_identity, partition
from ...formats.slim.writer import need_bytes, write_slim
from ...io.copy import copy_input_file
from ...io.files import fsync_path
from ...io.inputs import tracking
from ...io.lock import OutputLock
from ...io.owned import OUTPUT_MARKER
from ...io.staging import AtomicOutputDir, mount_point
from ...sources.hashing import base_crc_check, base_hash_check
from .layout import ASIDE, OWN_LOCKS, STAGED, STEP_LOCK, TRAINER, is_complete, is_slim, lock_holder
from .plan import DEFAULT_MIN_AGE_S, GcPlan, plan_gc, unknown_entries
from .swap import check_slim, recover_step, remove_tree, swap_in_slim

__all__ = ["GcReport", "GcResult", "StepResult", "gc", "run_gc", "write_verified_slim"]


@dataclass
class StepResult:
    step: int
    action: str
    result: str  # "slimmed" | "finished" | "restored" | "kept" | "skipped"
    reason: str
    bytes_before: int
    bytes_after: int
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    error: bool = False  # skipped because something failed (the reason says what)
    uploaded: dict | None = None  # with --slim-to: the slim's upload ({url, files, bytes, method})

    @property
    def freed_bytes(self) -> int:
        return self.bytes_before - self.bytes_after

    def to_json(self) -> dict:
        return dict(asdict(self), freed_bytes=self.freed_bytes)


def _step_bytes(step_dir: Path) -> int:
    try:
        return sum(
            dir_bytes(p) for p in (step_dir / TRAINER, step_dir / STAGED, step_dir / ASIDE) if p.is_dir()
        )
    except OSError:  # being deleted under us (prime-rl's keep_last)
        return 0


def _why(exc: BaseException, step_dir: Path) -> str:
    """One line for a step gc could not handle."""
    if isinstance(exc, CkptError):
        return exc.message
    if not os.path.isdir(step_dir):
        return f"{step_dir.name} was deleted while gc ran (prime-rl's keep_last?)"
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return (
            f"no space or no inodes left on {mount_point(step_dir)} ({exc.strerror}); free some and rerun gc"
        )
    if isinstance(exc, OSError) and exc.errno in (errno.EROFS, errno.EPERM, errno.EACCES):
        where = f" ({exc.filename})" if exc.filename else ""
        return (
            f"cannot change {step_dir.name}: {exc.strerror}{where}: a read-only filesystem, or an immutable "
            "or read-only directory (chattr -i / chmod u+w it to let gc slim it)"
        )
    if isinstance(exc, OSError) and exc.errno in (errno.EBUSY, errno.EXDEV):
        return f"cannot rename inside {step_dir.name}: {exc.strerror} (a mount point?)"
    return f"{type(exc).__name__}: {getattr(exc, 'strerror', None) or exc}"


def _clear_stale_locks(step_dir: Path) -> list[str]:
    """Remove gc's own lock files that nobody holds (left by a killed run): taking and releasing
    the lock replaces and unlinks it, so a live holder is never raced."""
    done = []
    for name in sorted(OWN_LOCKS):
        path = step_dir / name
        if not os.path.lexists(path) or lock_holder(path):
            continue
        lock = OutputLock(path, step_dir / TRAINER)
        try:
            lock.acquire()
        except (CkptError, OSError):
            continue
        lock.release()
        done.append(f"removed the stale lock {name} a killed run left")
    return done


def write_verified_slim(
    trainer: Path, out: Path, base: str, *, trust_pickle: bool = False, progress: Progress | None = None
) -> None:
    """The slim of `trainer` at the new path `out` (atomically), every dropped tensor proven equal to
    the base's upcast (`formats.slim.writer`: what `ckpt slim --base` writes)."""
    with DcpCheckpoint.open(trainer, trust_pickle=trust_pickle) as ckpt, HFModelDir.open_ref(base) as hf:
        layout = partition(ckpt)
        info = base_identity(hf, str(base))
        check = base_hash_check(hf, layout.dropped)
        with AtomicOutputDir(
            out, inputs=[ckpt.dir, hf.path], need_bytes=need_bytes(ckpt.dir, layout), marker=False
        ) as tmp:
            write_slim(
                ckpt,
                tmp,
                layout,
                base=info,
                base_hash=check,
                base_path=hf.path,
                progress=progress,
                base_crcs=base_crc_check(hf, layout.dropped),
            )
            if (ckpt.dir / OUTPUT_MARKER).is_file():  # a step ckpt-tools wrote: its marker travels verbatim
                copy_input_file(
                    ckpt.dir / OUTPUT_MARKER, tmp / OUTPUT_MARKER, root=ckpt.dir, what="output marker"
                )


def _upload_slim(staged: Path, slim_to: str, step_dir: Path, res) -> None:
    """The verified slim of one step committed at `slim_to/step_N/trainer` (io.upload: one commit), before
    anything local is deleted; a failure removes the staged slim and leaves the step full."""
    from ...io.upload import upload_tree  # lazy: only a URL imports the remote packages

    url = f"{slim_to.rstrip('/')}/{step_dir.name}/{TRAINER}"
    try:
        res.uploaded = upload_tree(staged, url).to_json()
    except BaseException as exc:
        with contextlib.suppress(OSError):
            remove_tree(staged)
        if isinstance(exc, CkptError):
            raise CkptError(f"{exc.message}; the step stays full", path=exc.path, hint=exc.hint) from None
        raise


def _slim_one(
    step_dir: Path,
    base: str,
    trust_pickle: bool,
    progress: Progress | None,
    slim_to: str | None = None,
    res=None,
) -> list[str]:
    trainer, staged = step_dir / TRAINER, step_dir / STAGED
    notes = []
    with DcpCheckpoint.open(trainer, trust_pickle=trust_pickle) as ck:
        unknown = unknown_entries(ck)
    if unknown:  # added since the plan: a slim would not carry them, and the full copy is deleted
        raise UsageError(
            f"holds entries a slim would not carry: {', '.join(unknown[:5])}; left alone",
            path=trainer,
            hint="move them out of trainer/ to let gc slim this step",
        )
    if staged.is_dir():
        try:
            with tracking():  # a stale one is deleted and written anew: its reads make it no input
                check_slim(trainer, staged, trust_pickle=trust_pickle)
            notes.append(f"reused the verified {STAGED} of an interrupted run")
        except CkptError as exc:
            notes.append(f"discarded {STAGED} of an interrupted run ({exc.message})")
            remove_tree(staged)
    if not staged.is_dir():
        write_verified_slim(trainer, staged, base, trust_pickle=trust_pickle, progress=progress)
        try:
            check_slim(trainer, staged, trust_pickle=trust_pickle)
        except CkptError:
            remove_tree(staged)
            raise
    if slim_to is not None:
        _upload_slim(staged, slim_to, step_dir, res)
    try:
        swap_in_slim(step_dir)
    except OSError:
        if is_complete(trainer) and not is_slim(trainer):
            with contextlib.suppress(OSError):
                remove_tree(staged)  # nothing swapped: the full checkpoint stays, the slim goes
        raise
    remove_tree(step_dir / ASIDE)
    fsync_path(step_dir)
    return notes


def run_gc(
    plan: GcPlan, *, trust_pickle: bool = False, progress: Progress | None = None, slim_to: str | None = None
) -> list[StepResult]:
    """Execute a plan (with `slim_to`, a URL: each slim is uploaded to `slim_to/step_N/trainer` and
    committed before the step's full copy is deleted; a failed upload leaves the step full). Every step is
    re-checked under its lock before anything is written. `progress`
    gets each slim's events (phase `step_N copy` / `step_N hash`) and, as each step is done, one
    `ProgressEvent("gc", i, n, unit="steps", name="step_N", finished=StepResult)`."""
    todo = plan.to_do
    slims = [s for s in todo if s.action == "slim" or s.then_slim]
    if slims:
        if plan.base is None or plan.base.get("dir") is None:
            why = (plan.base or {}).get(
                "problem"
            ) or "no --base, and the run's config names no model found here"
            raise UsageError(
                f"no base model to prove the slims against: {why}",
                path=plan.checkpoints,
                hint="gc deletes a full checkpoint only after checking that the base rebuilds it; "
                "pass --base with the bf16 HF model the run trained on",
            )
        free = shutil.disk_usage(plan.checkpoints).free
        if free < plan.need_bytes:
            raise DiskSpaceError(
                f"need {human_bytes(plan.need_bytes)} free for the largest slim, {human_bytes(free)} free",
                path=plan.checkpoints,
                hint="free some space first (gc writes each slim before it frees the full checkpoint)",
            )
    results = []
    for i, sp in enumerate(plan.steps):
        step_dir = Path(sp.path).parent
        before = _step_bytes(step_dir)
        res = StepResult(
            sp.step,
            sp.action,
            {"keep": "kept", "skip": "skipped"}.get(sp.action, ""),
            sp.reason,
            before,
            before,
        )
        if sp.action in ("slim", "finish", "restore"):
            t0 = time.perf_counter()
            try:
                _run_step(sp, step_dir, res, plan, trust_pickle, progress, slim_to)
            except (CkptError, OSError) as exc:  # this step is left as it is (full or slim); the others go on
                trainer = step_dir / TRAINER
                slim_now = is_complete(trainer) and is_slim(trainer)
                if slim_now and sp.action == "slim":
                    res.result = "slimmed"
                    res.notes.append(f"the full copy was not all freed ({_why(exc, step_dir)}); rerun gc")
                else:
                    res.result, res.reason, res.error = "skipped", _why(exc, step_dir), True
            res.seconds = round(time.perf_counter() - t0, 3)
            res.bytes_after = _step_bytes(step_dir)
        elif not sp.reason.startswith("locked by") and step_dir.is_dir():
            res.notes += _clear_stale_locks(step_dir)
        results.append(res)
        if progress is not None:
            progress(
                ProgressEvent(
                    "gc", i + 1, len(plan.steps), unit="steps", name=f"step_{sp.step}", finished=res
                )
            )
    return results


def _run_step(
    sp,
    step_dir: Path,
    res: StepResult,
    plan: GcPlan,
    trust_pickle: bool,
    progress,
    slim_to: str | None = None,
) -> None:
    """One planned step, under its lock, re-checked first."""
    lock = OutputLock(step_dir / STEP_LOCK, step_dir / TRAINER)
    try:
        lock.acquire()
    except LockedError as exc:
        res.result, res.reason = "skipped", exc.message
        return
    try:
        res.notes += recover_step(step_dir)
        trainer = step_dir / TRAINER
        if (sp.action == "slim" or sp.then_slim) and is_complete(trainer) and not is_slim(trainer):
            step_progress = (
                (lambda ev, _s=sp.step: progress(ProgressEvent(f"step_{_s} {ev.phase}", ev.done, ev.total)))
                if progress
                else None
            )
            base_dir = plan.base["dir"] if plan.base is not None else None
            assert base_dir is not None  # run_gc refuses slims without their base, before any step
            res.notes += _slim_one(step_dir, base_dir, trust_pickle, step_progress, slim_to, res)
            res.result = "slimmed"
        elif sp.action == "slim":
            res.result, res.reason = "skipped", "changed since the plan (not a full checkpoint now)"
        else:
            res.result = {"finish": "finished", "restore": "restored"}[sp.action]
    finally:
        lock.release()


@dataclass(frozen=True)
class GcResult:
    """What a gc run did: each step's outcome and the checkpoints dir's bytes before and after."""

    steps: tuple[StepResult, ...]
    bytes_before: int
    bytes_after: int

    @property
    def slimmed(self) -> list[int]:
        return [r.step for r in self.steps if r.result == "slimmed"]

    @property
    def failed(self) -> list[int]:
        """The steps skipped because something failed (the command then exits 1)."""
        return [r.step for r in self.steps if r.error]

    def to_json(self) -> dict:
        return {
            "steps": [r.to_json() for r in self.steps],
            "bytes_before": self.bytes_before,
            "bytes_after": self.bytes_after,
            "freed_bytes": self.bytes_before - self.bytes_after,
            "slimmed": self.slimmed,
            "failed": self.failed,
        }


@dataclass(frozen=True)
class GcReport:
    """`ckpt gc`'s report: the plan (with `slim_to`), and the result unless a dry run."""

    plan: GcPlan
    slim_to: str | None = None
    result: GcResult | None = None  # None: a dry run

    def to_json(self) -> dict:
        rep: dict = {"plan": dict(self.plan.to_json(), slim_to=self.slim_to), "dry_run": self.result is None}
        if self.result is not None:
            rep["result"] = self.result.to_json()
        return rep


def gc(
    checkpoints_dir: str | Path,
    *,
    keep_full: int,
    base: str | Path | None = None,
    dry_run: bool = False,
    min_age_s: float = DEFAULT_MIN_AGE_S,
    trust_pickle: bool = False,
    progress: Progress | None = None,
    slim_to: str | None = None,
) -> GcReport:
    """Library entry point: plan, and unless `dry_run` execute. `slim_to`: a URL (s3://, hf://, gs://) each
    slim is also uploaded to, as `slim_to/step_N/trainer`."""
    if slim_to is not None:
        from ...io.upload import check_writable

        check_writable(slim_to)
    plan = plan_gc(
        checkpoints_dir, keep_full=keep_full, base=base, min_age_s=min_age_s, trust_pickle=trust_pickle
    )
    if dry_run:
        return GcReport(plan, slim_to)
    before = dir_bytes(Path(plan.checkpoints))
    results = run_gc(plan, trust_pickle=trust_pickle, progress=progress, slim_to=slim_to)
    after = dir_bytes(Path(plan.checkpoints))
    return GcReport(plan, slim_to, GcResult(tuple(results), before, after))
