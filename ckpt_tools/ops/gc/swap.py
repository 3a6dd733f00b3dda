"""`ckpt gc`'s proof and swap: a slim is checked against its original before the exchange, the two
directories are swapped atomically, the full one set aside and deleted; `recover_step` finishes or
undoes what a killed run left (see `ops.gc` for why every step is full or slim at every instant)."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

from ...core.errors import FormatError
from ...core.problems import VerifyReport
from ...formats.dcp.checks import verify_dcp
from ...formats.dcp.model import TensorEntry
from ...formats.dcp.reader import DcpCheckpoint
from ...formats.slim.manifest import read_manifest
from ...io import files
from ...io.files import exchange_paths, fsync_path
from ...io.signals import signals_deferred
from ...io.staging import clean_stale_temps
from .layout import ASIDE, STAGED, TRAINER, is_complete, is_slim

__all__ = [
    "check_slim",
    "recover_step",
    "remove_file",
    "remove_tree",
    "set_aside",
    "swap_in_slim",
    "verify_slim_against",
]

log = logging.getLogger(__name__)


def _item_sha(ck: DcpCheckpoint, file: str, offset: int, length: int, key: str) -> str:
    return hashlib.sha256(ck.read_item_bytes(file, offset, length, key)).hexdigest()


def verify_slim_against(full_dir: Path, slim_dir: Path, *, trust_pickle: bool = False) -> int:
    """Prove a slim checkpoint holds the original's every kept item byte for byte and lists exactly its
    other tensors as dropped (layout included), with the base verified at slim time. Returns the
    number of items compared; raises FormatError naming the first difference."""
    m = read_manifest(slim_dir)
    if not (m.base or {}).get("verified"):
        raise FormatError(
            "the slim manifest does not record a verified base",
            path=m.path,
            hint="gc only frees a checkpoint whose base was checked; rerun with --base",
        )
    n = 0
    with (
        DcpCheckpoint.open(full_dir, trust_pickle=trust_pickle) as full,
        DcpCheckpoint.open(slim_dir, trust_pickle=trust_pickle) as sl,
    ):
        dropped = {d.key: d for d in m.dropped}
        if set(sl.entries) & set(dropped) or set(sl.entries) | set(dropped) != set(full.entries):
            raise FormatError(
                "the slim's kept and dropped keys do not partition the original's keys",
                path=slim_dir,
                hint="the slim is damaged: delete it and rerun gc",
            )
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
                    if _item_sha(sl, c.file, c.offset, c.length, key) != _item_sha(
                        full, t.file, t.offset, t.length, key
                    ):
                        raise FormatError(
                            f"chunk {list(c.offsets)} differs from the original's bytes",
                            path=slim_dir,
                            key=key,
                            hint="the slim is damaged: delete it and rerun gc",
                        )
                    n += 1
            else:
                if _item_sha(sl, e.file, e.offset, e.length, key) != _item_sha(
                    full, o.file, o.offset, o.length, key
                ):
                    raise FormatError("item differs from the original's bytes", path=slim_dir, key=key)
                n += 1
        for key, d in dropped.items():
            o = full.entries[key]
            if (
                not isinstance(o, TensorEntry)
                or tuple(o.shape) != tuple(d.shape)
                or sorted((c.offsets, c.sizes) for c in o.chunks)
                != sorted((c.offsets, c.sizes) for c in d.chunks)
            ):
                raise FormatError(
                    "dropped tensor's recorded layout differs from the original's", path=m.path, key=key
                )
    return n


def check_slim(full_dir: Path, slim_dir: Path, *, trust_pickle: bool = False) -> None:
    """Everything gc proves before the swap: `ckpt verify`'s structural checks of the slim (metadata,
    every item's zip records, dtypes and shapes), then `verify_slim_against` the original."""
    report = VerifyReport(str(slim_dir), "dcp", False)
    verify_dcp(slim_dir, report, deep=False, trust_pickle=trust_pickle)
    if not report.ok:
        raise FormatError(
            f"the new slim fails `ckpt verify`: {report.problems[0].render()}",
            path=slim_dir,
            hint="nothing was swapped; the full checkpoint is untouched. Report this",
        )
    verify_slim_against(full_dir, slim_dir, trust_pickle=trust_pickle)


def remove_file(p: Path) -> None:
    """Delete one file of the set-aside full checkpoint (its own function: a kill point in tests)."""
    files.remove_file(p)


def remove_tree(d: Path) -> None:
    """Delete a directory file by file, deepest first (never following links)."""
    if not os.path.lexists(d):
        return
    if d.is_symlink() or not d.is_dir():
        remove_file(d)
        return
    for root, dirs, names in os.walk(d, topdown=False):
        for name in names:
            remove_file(Path(root) / name)
        for name in dirs:
            p = Path(root) / name
            if p.is_symlink():
                files.remove_file(p)
            else:
                files.remove_empty_dir(p)
    files.remove_empty_dir(d)


def set_aside(step_dir: Path) -> None:
    """After the exchange `.trainer.gc-slim` holds the full checkpoint: rename it for what it is."""
    files.rename_entry(step_dir / STAGED, step_dir / ASIDE)
    fsync_path(step_dir)


def swap_in_slim(step_dir: Path) -> None:
    """Make the verified slim `step_N/trainer` in one atomic step (see the module docstring)."""
    staged, trainer = step_dir / STAGED, step_dir / TRAINER
    try:
        exchange_paths(staged, trainer)
    except OSError as exc:
        log.warning("atomic exchange unavailable (%s): swapping with two renames", exc)
        with signals_deferred():
            files.rename_entry(trainer, step_dir / ASIDE)
            try:
                files.rename_entry(staged, trainer)
            except BaseException:
                files.rename_entry(step_dir / ASIDE, trainer)  # put the full one back: never neither
                raise
            fsync_path(step_dir)
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
            files.rename_entry(aside, trainer)  # killed between the two fallback renames: put the full back
            fsync_path(step_dir)
            done.append(f"restored {TRAINER} from {ASIDE}")
        elif staged.is_dir() and is_complete(staged) and is_slim(staged):
            files.rename_entry(staged, trainer)
            fsync_path(step_dir)
            done.append(f"restored {TRAINER} from {STAGED}")
    if is_complete(trainer) and is_slim(trainer):
        for p in (staged, aside):  # the full copy or its remains: trainer is the verified slim
            if os.path.lexists(p):
                remove_tree(p)
                done.append(f"removed {p.name}")
        fsync_path(step_dir)
    elif os.path.lexists(aside):
        remove_tree(aside)  # trainer is full: an aside can only be a leftover copy
        done.append(f"removed {ASIDE}")
    return done
