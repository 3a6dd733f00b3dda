"""`ckpt set-lr` and `ckpt set`: change byte items (lr, scheduler state, progress) by surgery.

prime-rl's resume restores the optimizer's and scheduler's state from the checkpoint and ignores
the config's lr, so changing the lr of a resumed run takes surgery. Cheap surgery (proven in
docs/dcp-internals.md §5): the output directory hard-links every data file of the source (reflink
or copy across filesystems; a linked file is never opened for writing), ONE small new data file
`__patch_<n>.distcp` holds the new values (a `torch.save` of each, exactly what DCP writes), and a
rewritten `.metadata` points the patched keys at it. O(KB) of data written whatever the size.
`--in-place` writes the patch file into the checkpoint itself, keeps the old `.metadata` as
`.metadata.bak-<timestamp>` and swaps the new one in with one atomic rename.

Which keys hold the lr (a table, never a substring match: `_get_lr_called_within_step` is a bool):
`param_groups.<i>.{lr, initial_lr}` and, for the scheduler and each of SequentialLR's
`_schedulers.<j>`, `{base_lrs, _last_lr, eta_min}`. torch's chainable schedulers compute the next
lr from the current one and from these absolute values, so scaling all of them by one factor
scales the whole remaining schedule (exactly, for a power-of-two factor). `--min-lr` retargets the
decay's end instead of scaling it (see `plan_set_lr`).
"""
from __future__ import annotations

import contextlib
import difflib
import errno
import io
import json
import logging
import math
import os
import re
import time
from bisect import bisect_right
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..atomic import copy_input_file, copy_input_tree, create_new, fsync_path, pid_alive
from ..dcp.reader import METADATA_NAME, BytesEntry, DcpCheckpoint, TensorEntry
from ..dcp.writer import METADATA_TMP_TAG
from ..inputs import check_input, open_input, scan_tree
from ..errors import CkptError, FormatError, UsageError
from ..keys import classify
from .inspect import scheduler_kind

log = logging.getLogger(__name__)

# (group, field) of every byte item that holds an absolute learning rate. Sub-schedulers of
# SequentialLR (`_schedulers.<j>.<field>`) are matched by the same scheduler fields.
LR_FIELDS: frozenset[tuple[str, str]] = frozenset({
    ("param_groups", "lr"), ("param_groups", "initial_lr"),
    ("scheduler", "base_lrs"), ("scheduler", "_last_lr"), ("scheduler", "eta_min"),
})
PATCH_PREFIX = "__patch_"
MAX_LR = 10.0   # an optimizer lr above this is a typo or a crafted value, not a schedule


def check_lr_value(v: Any, key: str) -> None:
    """Every learning-rate value written (a float or a list of them) is finite, >= 0 and <= MAX_LR."""
    vals = list(v) if isinstance(v, (list, tuple)) else [v]
    for x in vals:
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            continue
        if not (math.isfinite(x) and 0 <= x <= MAX_LR):
            raise UsageError(f"the new value {x!r} is not a learning rate (finite, in [0, {MAX_LR:g}])", key=key,
                             hint="check --lr / --scale / --min-lr, and the checkpoint's current lr values")


# progress counters (prime-rl's Progress) are counts: never negative
_COUNT_FIELDS = frozenset({"step", "total_tokens", "total_samples"})


# ======================================================================================== values
def _scale_value(v: Any, factor: float, key: str, exact: tuple[float, float] | None = None) -> Any:
    """Scale a float, or a list/tuple of floats, keeping its type. `exact=(old, new)`: a value
    equal to `old` becomes exactly `new` (so `--lr X` shows X, not X*(1+1e-16))."""
    if isinstance(v, bool) or v is None:
        raise FormatError(f"expected a learning rate, found {type(v).__name__} {v!r}", key=key)
    if isinstance(v, torch.Tensor):
        raise FormatError("the learning rate is stored as a tensor; set-lr patches Python floats only", key=key,
                          hint="this optimizer was built with a tensor lr; patch it with your own script")
    if isinstance(v, (list, tuple)):
        return type(v)(_scale_value(x, factor, key, exact) for x in v)
    if isinstance(v, int):
        if v == 0:
            return v
        return float(v) * factor
    if isinstance(v, float):
        if exact is not None and v == exact[0]:
            return exact[1]
        return v * factor
    raise FormatError(f"expected a learning rate, found {type(v).__name__} {v!r}", key=key)


def parse_value(text: str, old: Any, key: str) -> Any:
    """`ckpt set` values: the new value must have the old value's type. int stays int (no "3.5"),
    float stays float ("3" gives 3.0), bool is true/false, str is taken as is, a list or tuple is
    a JSON array of the same length with elements of the old elements' types. None is not settable."""
    def fail(why: str) -> CkptError:
        return UsageError(f"cannot set to {text!r}: {why}", key=key)

    if old is None:
        raise fail("the current value is None, so its type is unknown")
    if isinstance(old, bool):
        low = text.strip().lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        raise fail("expected a bool (true/false)")
    if isinstance(old, int):
        try:
            return int(text.strip(), 10)
        except ValueError:
            raise fail(f"expected an int like the current value {old!r}") from None
    if isinstance(old, float):
        try:
            v = float(text)
        except ValueError:
            raise fail(f"expected a float like the current value {old!r}") from None
        if not math.isfinite(v):
            raise fail("the value is not finite")
        return v
    if isinstance(old, str):
        return text
    if isinstance(old, (list, tuple)):
        try:
            items = json.loads(text)
        except ValueError:
            raise fail(f"expected a JSON array like {json.dumps(list(old))}") from None
        if not isinstance(items, list) or len(items) != len(old):
            raise fail(f"expected a JSON array of {len(old)} element(s) like {json.dumps(list(old))}")
        return type(old)(parse_value(json.dumps(x) if not isinstance(x, str) else x, o, key)
                         for x, o in zip(items, old))
    raise fail(f"values of type {type(old).__name__} cannot be set")


# ======================================================================================== patching
@dataclass(frozen=True)
class Change:
    key: str
    before: Any
    after: Any
    why: str = ""


@dataclass
class PatchResult:
    out: str
    in_place: bool
    patch_file: str
    changed_keys: int
    bytes_written: int            # patch file + new .metadata
    linked: dict                  # method -> number of data files (hardlink | reflink | copy)
    backup: str | None
    seconds: float
    warnings: list = field(default_factory=list)

    def to_json(self) -> dict:
        return dict(self.__dict__)


def _encode(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _patch_file_name(ckpt_dir: Path) -> str:
    n = 0
    while os.path.lexists(ckpt_dir / f"{PATCH_PREFIX}{n}.distcp"):   # lexists: a dangling link is taken too
        n += 1
    return f"{PATCH_PREFIX}{n}.distcp"


_FICLONE = 0x40049409   # linux/fs.h: _IOW(0x94, 9, int)


def link_or_copy(src: Path, dst: Path, *, root: Path) -> str:
    """Hard link the data file `src` (of the checkpoint `root`, checked as an input: no symlink out
    of it, no FIFO) at the new path `dst`; across filesystems (or where links are refused) a
    reflink, else a copy. Returns the method used. Never opens `src` for writing; `dst` is new."""
    real, _st = check_input(src, root=root, what="data file")
    try:
        os.link(real, dst, follow_symlinks=False)   # the checked file itself, never a link's target
        return "hardlink"
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    try:
        import fcntl
        fs = open_input(src, root=root, what="data file")
        try:
            fd = create_new(dst)
            try:
                fcntl.ioctl(fd, _FICLONE, fs)
            finally:
                os.close(fd)
        finally:
            os.close(fs)
        return "reflink"
    except (OSError, ImportError):
        with contextlib.suppress(FileNotFoundError):
            dst.unlink()
    copy_input_file(src, dst, root=root, what="data file")
    return "copy"


def _extra_entries(ckpt_dir: Path, data_files: set[str]) -> list[str]:
    """Everything in the checkpoint dir besides `.metadata` (and its backups/temps) and .distcp
    files: the slim manifest, prime-rl's `dataloader/`, user files. They travel along, COPIED (a
    hard link would make an append to the copy change the original); each is checked as an input
    first (no FIFO, device, socket or symlink out of the checkpoint)."""
    names = [n for n in sorted(os.listdir(ckpt_dir))
             if n != METADATA_NAME and not n.startswith(METADATA_NAME + ".") and not n.endswith(".distcp")
             and not n.startswith(".")]
    for n in names:
        scan_tree(ckpt_dir / n, root=ckpt_dir, what="checkpoint entry")
    return names


def _same_filesystem(a: Path, b: Path) -> bool:
    try:
        return os.stat(a).st_dev == os.stat(b).st_dev
    except OSError:
        return False


def _register_all(writer, ckpt: DcpCheckpoint, new_values: dict[str, Any], patch_rel: str) -> None:
    for key, e in ckpt.entries.items():
        if key in new_values:
            writer.copy_bytes_item(key, e.path, _encode(new_values[key]), rel=patch_rel)
        elif isinstance(e, TensorEntry):
            for c in e.chunks:
                writer.register_existing_chunk(key, e.path, e.dtype, e.shape, c.offsets, c.sizes, c.file, c.offset,
                                               c.length)
        else:
            writer.register_existing_bytes(key, e.path, e.file, e.offset, e.length)


def _check_patchable(ckpt: DcpCheckpoint, new_values: dict[str, Any]) -> None:
    if not new_values:
        raise UsageError("nothing to change")
    for key in new_values:
        e = ckpt.entries.get(key)
        if not isinstance(e, BytesEntry):
            raise UsageError("is not a byte item of this checkpoint" if e is None else "is a tensor, not a byte item",
                             key=key, path=ckpt.dir)


def patch_checkpoint(ckpt: DcpCheckpoint, out: Path | None, new_values: dict[str, Any], *,
                     in_place: bool = False, overwrite: bool = False) -> PatchResult:
    """Write a checkpoint equal to `ckpt` except that each byte item in `new_values` holds its new
    value. `out=None` with `in_place=True` patches `ckpt` itself (backup of `.metadata` kept)."""
    _check_patchable(ckpt, new_values)
    t0 = time.perf_counter()
    if in_place:
        return _patch_in_place(ckpt, new_values, t0)
    from ..atomic import AtomicOutputDir
    from ..dcp.writer import DcpWriter

    if out is None:
        raise UsageError("give an output directory, or --in-place")
    patch_rel = _patch_file_name(ckpt.dir)
    keep = {f for k, e in ckpt.entries.items() if k not in new_values
            for f in ([c.file for c in e.chunks] if isinstance(e, TensorEntry) else [e.file])}
    extras = _extra_entries(ckpt.dir, keep)
    # Free space for what is really written: the patch and metadata, the copied extra entries,
    # and, when OUT is on another filesystem (no hard links), every data file too.
    need = (1 << 20) + sum(size for n in extras for _p, size in scan_tree(ckpt.dir / n, root=ckpt.dir))
    parent = Path(out).expanduser().resolve().parent
    if not _same_filesystem(ckpt.dir, parent if parent.is_dir() else parent.parent):
        need += sum(ckpt.file_size(rel) for rel in keep)
    counts: dict[str, int] = {}
    with AtomicOutputDir(out, inputs=[ckpt.dir], need_bytes=need, overwrite=overwrite) as tmp:
        for rel in sorted(keep):
            m = link_or_copy(ckpt.dir / rel, tmp / rel, root=ckpt.dir)
            counts[m] = counts.get(m, 0) + 1
        for name in extras:
            copy_input_tree(ckpt.dir / name, tmp / name, root=ckpt.dir, what="checkpoint entry")
        writer = DcpWriter(tmp)
        try:
            _register_all(writer, ckpt, new_values, patch_rel)
            writer.finish()
        except BaseException:
            writer.abort()
            raise
        written = (tmp / patch_rel).stat().st_size + (tmp / METADATA_NAME).stat().st_size
    warnings = []
    if counts.get("copy"):
        warnings.append(f"{counts['copy']} data file(s) were copied, not linked (output on another filesystem?)")
    return PatchResult(out=str(out), in_place=False, patch_file=patch_rel, changed_keys=len(new_values),
                       bytes_written=written, linked=counts, backup=None,
                       seconds=round(time.perf_counter() - t0, 4), warnings=warnings)


def _patch_in_place(ckpt: DcpCheckpoint, new_values: dict[str, Any], t0: float) -> PatchResult:
    from ..atomic import _Lock   # the same lock an AtomicOutputDir(ckpt) would take
    from ..dcp.writer import DcpWriter

    d = ckpt.dir
    lock = _Lock(d.parent / f".{d.name}.lock", d)
    lock.acquire()
    try:
        removed = clean_in_place_leftovers(d)
    except BaseException:
        lock.release()
        raise
    patch_rel = _patch_file_name(d)
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    backup = d / f"{METADATA_NAME}.bak-{stamp}"
    n = 1
    while os.path.lexists(backup):
        backup = d / f"{METADATA_NAME}.bak-{stamp}-{n}"
        n += 1
    writer = DcpWriter(d)
    swapped = False
    try:
        _register_all(writer, ckpt, new_values, patch_rel)
        # the old metadata survives the swap under this name (the entry itself, never a link's target)
        os.link(d / METADATA_NAME, backup, follow_symlinks=False)
        writer.finish()                      # fsync patch, write .metadata.tmp-*, fsync, rename over .metadata
        swapped = True
        fsync_path(d)
    except BaseException:
        writer.abort()
        if not swapped:
            for p in (d / patch_rel, backup):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
        raise
    finally:
        lock.release()
    written = (d / patch_rel).stat().st_size + (d / METADATA_NAME).stat().st_size
    return PatchResult(out=str(d), in_place=True, patch_file=patch_rel, changed_keys=len(new_values),
                       bytes_written=written, linked={}, backup=str(backup),
                       seconds=round(time.perf_counter() - t0, 4),
                       warnings=[f"removed {n}, left by a killed in-place run" for n in removed])


_TMP_LEFTOVER = re.compile(rf"^{re.escape(METADATA_NAME)}{re.escape(METADATA_TMP_TAG)}(\d+)-[0-9a-f]+$")
_PATCH_FILE = re.compile(rf"^{re.escape(PATCH_PREFIX)}\d+\.distcp$")


def _referenced_files(meta_path: Path, root: Path) -> set[str] | None:
    """Data files a `.metadata` (or a backup of one) points at; None when it cannot be read."""
    from ..inputs import MAX_METADATA_BYTES, read_input
    from ..safe_pickle import load_metadata_pickle

    try:
        md = load_metadata_pickle(read_input(meta_path, root=root, what="metadata", max_bytes=MAX_METADATA_BYTES),
                                  str(meta_path))
        return {str(info.relative_path) for info in md.storage_data.values()}
    except Exception:
        return None


def clean_in_place_leftovers(d: Path) -> list[str]:
    """What killed `--in-place` runs left in checkpoint `d`, removed. Called with `d`'s lock held,
    so no in-place run is alive (a live one holds the lock); temp names carry the pid and only dead
    pids' are touched. Removed: `.metadata.tmp-<pid>-*` (a new metadata never renamed in);
    `.metadata.bak-*` that is still `.metadata` itself (same inode: linked, then the run died before
    the swap); `__patch_<n>.distcp` that neither `.metadata` nor any backup references. Anything
    that cannot be read for certain is kept."""
    removed: list[str] = []
    meta = d / METADATA_NAME
    try:
        meta_ino = os.lstat(meta).st_ino
    except FileNotFoundError:
        return removed
    names = sorted(os.listdir(d))
    for n in names:
        m = _TMP_LEFTOVER.match(n)
        if m and not pid_alive(int(m.group(1))):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(d / n)
            removed.append(n)
    backups = [n for n in names if n.startswith(METADATA_NAME + ".bak-")]
    for n in backups:
        with contextlib.suppress(FileNotFoundError):
            if os.lstat(d / n).st_ino == meta_ino:
                os.unlink(d / n)
                removed.append(n)
    patches = [n for n in names if _PATCH_FILE.match(n)]
    if patches:
        used: set[str] = set()
        for m_path in [meta] + [d / n for n in backups if n not in removed]:
            refs = _referenced_files(m_path, d)
            if refs is None:
                return removed      # a metadata we cannot read: keep every patch file
            used |= refs
        for n in patches:
            if n not in used:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(d / n)
                removed.append(n)
    for n in removed:
        log.warning("removed %s from %s: left by a killed --in-place run", n, d)
    return removed


# ======================================================================================== scheduler model
@dataclass(frozen=True)
class SchedState:
    """The scheduler and param-group byte items, read (they are tiny)."""
    groups: dict            # group index -> {field: value}
    top: dict               # scheduler field -> value
    subs: dict              # j -> {field: value}
    keys: dict              # ("pg", i, field) | ("top", None, field) | ("sub", j, field) -> flat key

    @property
    def kind(self) -> str:
        return scheduler_kind(set(self.top))

    def sub_kind(self, j: int) -> str:
        return scheduler_kind(set(self.subs[j]))


def read_sched_state(ckpt: DcpCheckpoint) -> SchedState:
    groups, top, subs, keys = {}, {}, {}, {}
    for key, e in ckpt.entries.items():
        info = classify(key, e.path)
        if info.group == "param_groups" and info.field != "params":
            if not isinstance(e, BytesEntry):
                raise FormatError("param_groups field stored as a tensor; set-lr patches byte items only", key=key)
            groups.setdefault(info.group_index, {})[info.field] = ckpt.read_object(key)
            keys[("pg", info.group_index, info.field)] = key
        elif info.group == "scheduler" and isinstance(e, BytesEntry):
            if info.sub_scheduler is None:
                top[info.field] = ckpt.read_object(key)
                keys[("top", None, info.field)] = key
            else:
                subs.setdefault(info.sub_scheduler, {})[info.field] = ckpt.read_object(key)
                keys[("sub", info.sub_scheduler, info.field)] = key
    if not groups:
        raise FormatError("has no optimizer param_groups", path=ckpt.dir,
                          hint="set-lr needs a training checkpoint with optimizer state")
    return SchedState(groups, top, subs, keys)


def _uniform(values, what: str) -> float:
    vals = list(values)
    if any(v != vals[0] for v in vals):
        raise UsageError(f"{what} differs between param groups ({vals}); --min-lr needs a single value",
                         hint="use --scale or --lr without --min-lr")
    return vals[0]


def _decays(st: SchedState) -> list[tuple[str, int | None, dict, str, int]]:
    """(kind, j, fields, status, k) of every decaying scheduler: CosineAnnealingLR, or LinearLR
    with end_factor < start_factor. status: active | pending | finished; k = its last_epoch."""
    out = []
    if st.kind == "SequentialLR":
        idx = bisect_right(list(st.top.get("_milestones") or []), int(st.top.get("last_epoch", 0)))
        items = [(j, st.subs[j], "finished" if j < idx else "active" if j == idx else "pending") for j in sorted(st.subs)]
    else:
        items = [(None, st.top, "active")]
    for j, f, status in items:
        kind = scheduler_kind(set(f))
        is_decay = kind == "CosineAnnealingLR" or (
            kind == "LinearLR" and float(f.get("end_factor", 1.0)) < float(f.get("start_factor", 1.0)))
        if is_decay:
            k = int(f.get("last_epoch", 0))
            if kind == "LinearLR" and status == "active" and k >= int(f["total_iters"]):
                status = "finished"
            out.append((kind, j, f, status, k))
    return out


@dataclass(frozen=True)
class SetLrPlan:
    source: str
    factor: float
    lr_before: float
    lr_after: float
    min_lr: float | None
    scheduler: str
    changes: tuple[Change, ...]
    preview: dict | None
    warnings: tuple[str, ...]

    def to_json(self) -> dict:
        return {"source": self.source, "factor": self.factor, "lr_before": self.lr_before, "lr_after": self.lr_after,
                "min_lr": self.min_lr, "scheduler": self.scheduler,
                "changes": [{"key": c.key, "before": c.before, "after": c.after, "why": c.why} for c in self.changes],
                "preview": self.preview, "warnings": list(self.warnings)}


def plan_set_lr(ckpt: DcpCheckpoint, *, lr: float | None = None, scale: float | None = None,
                min_lr: float | None = None, preview: bool = True) -> SetLrPlan:
    """Compute every byte item to patch. Exactly one of `lr` (the current lr becomes `lr`; factor =
    lr / current lr of param group 0) or `scale` (factor). `preview` replays the remaining
    schedule before and after with torch's schedulers (building a torch optimizer imports
    torch._dynamo: seconds, so the real run skips it).

    `min_lr` retargets the end of the decay instead of scaling it: CosineAnnealingLR's `eta_min`
    is set to it; a LinearLR decay that has not started gets `end_factor = min_lr / base_lr`
    (its new base lr); one in progress at step k of T gets the end factor that makes torch's
    chainable LinearLR go linearly from the current lr to `min_lr` at T:
    `e = min_lr * s * (T - k) / (lr * T - min_lr * k)`."""
    if (lr is None) == (scale is None):
        raise UsageError("give exactly one of --lr or --scale")
    st = read_sched_state(ckpt)
    g0 = st.groups[min(st.groups)]
    current = g0.get("lr")
    if not isinstance(current, float):
        raise FormatError(f"param group lr is {type(current).__name__} {current!r}, expected a float",
                          key=st.keys.get(("pg", min(st.groups), "lr")))
    if not math.isfinite(current) or current < 0:
        raise FormatError(f"the checkpoint's lr is {current!r}: not a finite number >= 0, so no new lr can be "
                          "derived from it", path=ckpt.dir, key=st.keys.get(("pg", min(st.groups), "lr")),
                          hint="the checkpoint is damaged or crafted; `ckpt set` can write a finite lr")
    if lr is not None:
        if not (math.isfinite(lr) and 0 < lr <= MAX_LR):
            raise UsageError(f"--lr must be a finite number in (0, {MAX_LR:g}], got {lr}")
        if current <= 0:
            raise UsageError(f"the current lr is {current}, so --lr cannot be turned into a factor",
                             hint="use --scale")
        factor = lr / current
        exact = (current, lr)
    else:
        if not (math.isfinite(scale) and scale > 0):
            raise UsageError(f"--scale must be a positive finite number, got {scale}")
        factor, exact = scale, None
    if min_lr is not None and not (math.isfinite(min_lr) and min_lr >= 0):
        raise UsageError(f"--min-lr must be a finite number >= 0, got {min_lr}")

    new: dict[str, Any] = {}
    why: dict[str, str] = {}
    for (where, idx, fld), key in sorted(st.keys.items(), key=lambda kv: kv[1]):
        group = "param_groups" if where == "pg" else "scheduler"
        if (group, fld) in LR_FIELDS:
            old = (st.groups[idx] if where == "pg" else st.top if where == "top" else st.subs[idx])[fld]
            new[key] = _scale_value(old, factor, key, exact)
            why[key] = f"x{factor:g}"
    warnings = []
    if min_lr is not None:
        _apply_min_lr(st, new, why, min_lr, factor, exact)
    if len(st.groups) > 1 and lr is not None:
        warnings.append(f"{len(st.groups)} param groups: all scaled by the factor of group 0 ({factor:g})")
    if st.kind in ("unknown",):
        warnings.append("unrecognised scheduler: only lr fields known by name were patched")
    for key, v in new.items():
        check_lr_value(v, key)
    changes = tuple(Change(k, _old(st, k), v, why[k]) for k, v in sorted(new.items()) if _old(st, k) != v)
    patched = _apply_to_state(st, new)
    shown = None
    if preview:
        try:
            shown = {"before": preview_schedule(st), "after": preview_schedule(patched)}
        except Exception as exc:   # a scheduler we cannot rebuild only costs the preview
            warnings.append(f"no schedule preview: {type(exc).__name__}: {exc}")
    return SetLrPlan(source=str(ckpt.dir), factor=factor, lr_before=current,
                     lr_after=new[st.keys[("pg", min(st.groups), "lr")]], min_lr=min_lr, scheduler=_describe(st),
                     changes=changes, preview=shown, warnings=tuple(warnings))


def _old(st: SchedState, key: str):
    for (where, idx, fld), k in st.keys.items():
        if k == key:
            return (st.groups[idx] if where == "pg" else st.top if where == "top" else st.subs[idx])[fld]
    raise KeyError(key)


def _describe(st: SchedState) -> str:
    if st.kind == "SequentialLR":
        return "SequentialLR(" + ", ".join(st.sub_kind(j) for j in sorted(st.subs)) + ")"
    return st.kind


def _apply_min_lr(st: SchedState, new: dict, why: dict, y: float, factor: float, exact) -> None:
    decays = _decays(st)
    todo = [d for d in decays if d[3] != "finished"]
    if not todo:
        raise UsageError(f"--min-lr: the scheduler ({_describe(st)}) has no decay phase left to retarget",
                         hint="drop --min-lr; the lr stays where the schedule ends")
    lr_key = st.keys[("pg", min(st.groups), "lr")]
    cur_new = _uniform([_scale_value(g["lr"], factor, lr_key, exact) for g in st.groups.values()], "lr")
    for kind, j, f, status, k in todo:
        where = ("top", None) if j is None else ("sub", j)
        if kind == "CosineAnnealingLR":
            key = st.keys[where + ("eta_min",)]
            new[key] = float(y)
            why[key] = "--min-lr"
            continue
        key = st.keys[where + ("end_factor",)]
        s, T = float(f["start_factor"]), int(f["total_iters"])
        if status == "pending":
            base_new = _uniform(new[st.keys[where + ("base_lrs",)]], "base_lrs")
            e = y / base_new
        else:   # active at step k < T, chainable from the current lr
            if y > cur_new:
                raise UsageError(f"--min-lr {y:g} is above the current lr {cur_new:g} of a decay in progress",
                                 key=key)
            e = y * s * (T - k) / (cur_new * T - y * k)
        new[key] = e
        why[key] = "--min-lr"


def _apply_to_state(st: SchedState, new: dict) -> SchedState:
    groups = {i: dict(g) for i, g in st.groups.items()}
    top = dict(st.top)
    subs = {j: dict(s) for j, s in st.subs.items()}
    for (where, idx, fld), key in st.keys.items():
        if key in new:
            (groups[idx] if where == "pg" else top if where == "top" else subs[idx])[fld] = new[key]
    return SchedState(groups, top, subs, st.keys)


# ---------------------------------------------------------------------------------------- preview
_PREVIEW_STEPS_MAX = 100_000


def _build_scheduler(opt, kind: str, f: dict):
    from torch.optim import lr_scheduler as L
    if kind == "LinearLR":
        return L.LinearLR(opt, start_factor=f["start_factor"], end_factor=f["end_factor"], total_iters=f["total_iters"])
    if kind == "CosineAnnealingLR":
        return L.CosineAnnealingLR(opt, T_max=f["T_max"], eta_min=f["eta_min"])
    if kind == "ConstantLR":
        return L.ConstantLR(opt, factor=f["factor"], total_iters=f["total_iters"])
    raise ValueError(f"cannot rebuild a {kind}")


def _sched_end(kind: str, f: dict) -> int:
    return int(f.get("total_iters", f.get("T_max", 0)))


def preview_schedule(st: SchedState, steps: int | None = None) -> dict:
    """Replay the remaining schedule with torch's own schedulers loaded from this state (exactly
    what a resumed run does, minus the model): the lr now, at the peak, and at the end."""
    import warnings

    n_groups = len(st.groups)
    params = [torch.nn.Parameter(torch.zeros(1)) for _ in range(n_groups)]
    opt = torch.optim.SGD([{"params": [p], "lr": st.groups[i]["lr"], "initial_lr": st.groups[i].get("initial_lr",
                           st.groups[i]["lr"])} for i, p in zip(sorted(st.groups), params)], lr=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if st.kind == "SequentialLR":
            subs = [_build_scheduler(opt, st.sub_kind(j), st.subs[j]) for j in sorted(st.subs)]
            sched = torch.optim.lr_scheduler.SequentialLR(opt, subs, milestones=list(st.top["_milestones"]))
            state = dict(st.top)
            state["_schedulers"] = [dict(st.subs[j]) for j in sorted(st.subs)]
            last = max(st.subs)
            end = int(st.top["_milestones"][-1]) + _sched_end(st.sub_kind(last), st.subs[last])
        else:
            sched = _build_scheduler(opt, st.kind, st.top)
            state = dict(st.top)
            end = _sched_end(st.kind, st.top)
        sched.load_state_dict(state)
        for i, g in zip(sorted(st.groups), opt.param_groups):
            g["lr"] = st.groups[i]["lr"]
            g["initial_lr"] = st.groups[i].get("initial_lr", g["lr"])
        now_epoch = int(st.top.get("last_epoch", 0))
        n = steps if steps is not None else max(1, min(_PREVIEW_STEPS_MAX, end - now_epoch + 1))
        trace = []
        for _ in range(n):   # no opt.step(): the lr does not depend on it (and its first call is slow)
            sched.step()
            trace.append(float(opt.param_groups[0]["lr"]))
    return {"now": float(st.groups[min(st.groups)]["lr"]), "steps": n, "peak": max(trace), "end": trace[-1],
            "trace_head": trace[:8]}


# ======================================================================================== entry points
def set_lr(ckpt_path, out, *, lr: float | None = None, scale: float | None = None, min_lr: float | None = None,
           in_place: bool = False, dry_run: bool = False, overwrite: bool = False, trust_pickle: bool = False) -> dict:
    """Library entry point of `ckpt set-lr`. Returns {"plan": ..., "result": ...} (JSON-able)."""
    if in_place and out is not None:
        raise UsageError("give either OUT or --in-place, not both")
    if not in_place and out is None and not dry_run:
        raise UsageError("give an output directory OUT, or --in-place")
    ckpt = DcpCheckpoint.open(ckpt_path, trust_pickle=trust_pickle)
    try:
        plan = plan_set_lr(ckpt, lr=lr, scale=scale, min_lr=min_lr, preview=dry_run)
        report = {"plan": plan.to_json(), "dry_run": dry_run}
        if not dry_run:
            values = {c.key: c.after for c in plan.changes}
            report["result"] = patch_checkpoint(ckpt, None if in_place else Path(out), values, in_place=in_place,
                                                overwrite=overwrite).to_json()
        return report
    finally:
        ckpt.close()


def resolve_key(ckpt: DcpCheckpoint, name: str) -> str:
    """A flat key, or one without the leading `app.` (`progress.step`)."""
    for cand in (name, f"app.{name}"):
        if cand in ckpt.entries:
            return cand
    close = difflib.get_close_matches(name, [k.removeprefix("app.") for k in ckpt.entries
                                             if isinstance(ckpt.entries[k], BytesEntry)], n=3)
    raise UsageError("no such byte item in the checkpoint", key=name, path=ckpt.dir,
                     hint=(f"did you mean {', '.join(close)}?" if close else "`ckpt inspect --keys` lists them"))


def plan_set_values(ckpt: DcpCheckpoint, assignments: list[str]) -> tuple[tuple[Change, ...], list[str]]:
    changes, warnings, seen = [], [], set()
    for a in assignments:
        if "=" not in a:
            raise UsageError(f"{a!r} is not KEY=VALUE", hint="e.g. ckpt set CKPT OUT progress.step=100")
        name, text = a.split("=", 1)
        key = resolve_key(ckpt, name.strip())
        if key in seen:
            raise UsageError("assigned twice", key=key)
        seen.add(key)
        e = ckpt.entries[key]
        if not isinstance(e, BytesEntry):
            raise UsageError("is a tensor; `ckpt set` changes byte items (scalars, lists) only", key=key)
        old = ckpt.read_object(key)
        new = parse_value(text, old, key)
        info = classify(key, e.path)
        if info.group == "progress" and info.field in _COUNT_FIELDS and isinstance(new, int) and new < 0:
            raise UsageError(f"cannot set to {new}: {info.field} counts steps/tokens/samples and must be >= 0", key=key)
        if (info.group, info.field) in LR_FIELDS:
            check_lr_value(new, key)
        if (info.group, info.field) in LR_FIELDS:
            warnings.append(f"{key}: changing one lr field alone desynchronises the schedule; "
                            "`ckpt set-lr` patches all of them consistently")
        if info.field == "params":
            warnings.append(f"{key}: param_groups params must name the optimizer's parameters in order")
        changes.append(Change(key, old, new, "set"))
    return tuple(changes), warnings


def set_values(ckpt_path, out, assignments: list[str], *, in_place: bool = False, dry_run: bool = False,
               overwrite: bool = False, trust_pickle: bool = False) -> dict:
    """Library entry point of `ckpt set`."""
    if in_place and out is not None:
        raise UsageError("give either OUT or --in-place, not both")
    ckpt = DcpCheckpoint.open(ckpt_path, trust_pickle=trust_pickle)
    try:
        changes, warnings = plan_set_values(ckpt, assignments)
        report = {"plan": {"source": str(ckpt.dir), "warnings": warnings,
                           "changes": [{"key": c.key, "before": c.before, "after": c.after} for c in changes]},
                  "dry_run": dry_run}
        if not dry_run:
            if not in_place and out is None:
                raise UsageError("give an output directory OUT, or --in-place")
            report["result"] = patch_checkpoint(ckpt, None if in_place else Path(out),
                                                {c.key: c.after for c in changes}, in_place=in_place,
                                                overwrite=overwrite).to_json()
        return report
    finally:
        ckpt.close()
