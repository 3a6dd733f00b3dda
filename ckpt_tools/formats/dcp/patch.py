"""DCP byte-item surgery: a checkpoint equal to another except for some byte items (lr, scheduler state,
progress), in O(KB) written whatever its size.

Proven in docs/dcp-internals.md §5: the output directory hard-links every data file of the source
(reflink or copy across filesystems; a linked file is never opened for writing), ONE small new data
file `__patch_<n>.distcp` holds the new values (a `torch.save` of each, exactly what DCP writes), and
a rewritten `.metadata` points the patched keys at it. In place (`in_place=True`), the patch file is
written into the checkpoint itself, the old `.metadata` kept as `.metadata.bak-<timestamp>` and the
new one swapped in with one atomic rename; `clean_in_place_leftovers` finishes what a killed in-place
run left.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...core.crc import crc32
from ...core.errors import UsageError
from ...io.copy import copy_input_tree, link_or_copy, link_writes_bytes
from ...io.files import atomic_write_bytes, fsync_path, link_entry, remove_file, write_new_file
from ...io.inputs import MAX_METADATA_BYTES, lexists, local_dir, read_input, scan_tree
from ...io.lock import OutputLock, lock_path_for, pid_alive
from ...io.signals import signals_deferred
from ...io.staging import AtomicOutputDir, note_committed
from ..slim.manifest import SLIM_MANIFEST, is_slim, kept_item_id, read_manifest, with_patch
from .layout import METADATA_NAME, METADATA_TMP_TAG, PATCH_PREFIX, extra_entries
from .metadata import load_metadata
from .model import BytesEntry, TensorEntry
from .reader import DcpCheckpoint
from .writer import DcpWriter

__all__ = ["PATCH_PREFIX", "PatchResult", "clean_in_place_leftovers", "patch_checkpoint"]

log = logging.getLogger(__name__)


@dataclass
class PatchResult:
    out: str
    in_place: bool
    patch_file: str
    changed_keys: int
    bytes_written: int  # patch file + new .metadata
    linked: dict  # method -> number of data files (hardlink | reflink | copy | fetch | remote)
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
    while lexists(ckpt_dir / f"{PATCH_PREFIX}{n}.distcp"):  # lexists: a dangling link is taken too
        n += 1
    return f"{PATCH_PREFIX}{n}.distcp"


def _register_all(writer, ckpt: DcpCheckpoint, encoded: dict[str, bytes], patch_rel: str) -> None:
    for key, e in ckpt.entries.items():
        if key in encoded:
            writer.copy_bytes_item(key, e.path, encoded[key], rel=patch_rel)
        elif isinstance(e, TensorEntry):
            for c in e.chunks:
                writer.register_existing_chunk(
                    key, e.path, e.dtype, e.shape, c.offsets, c.sizes, c.file, c.offset, c.length
                )
        else:
            writer.register_existing_bytes(key, e.path, e.file, e.offset, e.length)


def _slim_manifest(ckpt: DcpCheckpoint) -> dict | None:
    """A slim checkpoint's manifest, read and checked before anything is written (None: not a slim). A
    slim stays a slim: its manifest gains the new items' CRC-32s (`slim.manifest.with_patch`), which
    rehydrate proves them against; one it cannot read is refused here, nothing changed."""
    return read_manifest(ckpt.dir).raw if is_slim(ckpt.dir) else None


def _manifest_bytes(raw: dict, patch_rel: str, encoded: dict[str, bytes], files: set[str]) -> bytes:
    crcs = {kept_item_id(k, None): crc32(b) for k, b in encoded.items()}
    return (json.dumps(with_patch(raw, patch_rel, crcs, files), indent=1, allow_nan=False) + "\n").encode()


def _check_patchable(ckpt: DcpCheckpoint, new_values: dict[str, Any]) -> None:
    if not new_values:
        raise UsageError("nothing to change")
    for key in new_values:
        e = ckpt.entries.get(key)
        if not isinstance(e, BytesEntry):
            raise UsageError(
                "is not a byte item of this checkpoint" if e is None else "is a tensor, not a byte item",
                key=key,
                path=ckpt.dir,
            )


def patch_checkpoint(
    ckpt: DcpCheckpoint,
    out: Path | None,
    new_values: dict[str, Any],
    *,
    in_place: bool = False,
    overwrite: bool = False,
) -> PatchResult:
    """Write a checkpoint equal to `ckpt` except that each byte item in `new_values` holds its new
    value. `out=None` with `in_place=True` patches `ckpt` itself (backup of `.metadata` kept)."""
    _check_patchable(ckpt, new_values)
    t0 = time.perf_counter()
    if in_place:  # a URL is refused (io.inputs.local_dir)
        local_dir(
            ckpt.dir,
            "--in-place patches a local checkpoint",
            hint="write OUT instead: a URL in one S3 store copies the data files server-side (O(KB) sent)",
        )
    if not in_place and out is None:
        raise UsageError("give an output directory, or --in-place")
    encoded = {k: _encode(v) for k, v in new_values.items()}
    manifest = _slim_manifest(ckpt)
    if in_place:
        return _patch_in_place(ckpt, encoded, manifest, t0)
    assert out is not None
    return _patch_to(ckpt, Path(out), encoded, manifest, overwrite, t0)


def _patch_to(
    ckpt: DcpCheckpoint,
    out: Path,
    encoded: dict[str, bytes],
    manifest: dict | None,
    overwrite: bool,
    t0: float,
) -> PatchResult:
    """`patch_checkpoint` into a new OUT: the data files linked, the patch file and `.metadata` written."""
    patch_rel = _patch_file_name(ckpt.dir)
    keep = {f for k, e in ckpt.entries.items() if k not in encoded for f in e.files}
    extras = extra_entries(ckpt.dir, keep, exclude={SLIM_MANIFEST} if manifest is not None else ())
    new_manifest = None if manifest is None else _manifest_bytes(manifest, patch_rel, encoded, keep)
    # Free space for what is really written: the patch and metadata, the copied extra entries (a slim's
    # manifest), and, when the data files cannot be linked (another filesystem; a remote checkpoint to a
    # local OUT), every data file too.
    need = (1 << 20) + len(new_manifest or b"")
    need += sum(size for n in extras for _p, size in scan_tree(ckpt.dir / n, root=ckpt.dir))
    parent = Path(out).expanduser().resolve().parent
    if link_writes_bytes(ckpt.dir, parent if parent.is_dir() else parent.parent):
        need += sum(ckpt.file_size(rel) for rel in keep)
    counts: dict[str, int] = {}
    with AtomicOutputDir(out, inputs=[ckpt.dir], need_bytes=need, overwrite=overwrite) as tmp:
        for rel in sorted(keep):
            m = link_or_copy(ckpt.dir / rel, tmp / rel, root=ckpt.dir)
            counts[m] = counts.get(m, 0) + 1
        for name in extras:
            copy_input_tree(ckpt.dir / name, tmp / name, root=ckpt.dir, what="checkpoint entry")
        if new_manifest is not None:
            write_new_file(tmp / SLIM_MANIFEST, new_manifest)
        writer = DcpWriter(tmp)
        try:
            _register_all(writer, ckpt, encoded, patch_rel)
            writer.finish()
        except BaseException:
            writer.abort()
            raise
        written = (tmp / patch_rel).stat().st_size + (tmp / METADATA_NAME).stat().st_size
    warnings = []
    if counts.get("fetch"):
        warnings.append(
            f"{counts['fetch']} data file(s) were fetched from the URL: a local OUT holds the whole "
            "checkpoint (an OUT in the same S3 store is copied server-side, nothing fetched)"
        )
    elif counts.get("copy"):
        warnings.append(
            f"{counts['copy']} data file(s) were copied, not linked (output on another filesystem?)"
        )
    return PatchResult(
        out=str(out),
        in_place=False,
        patch_file=patch_rel,
        changed_keys=len(encoded),
        bytes_written=written,
        linked=counts,
        backup=None,
        seconds=round(time.perf_counter() - t0, 4),
        warnings=warnings,
    )


def _patch_in_place(
    ckpt: DcpCheckpoint, encoded: dict[str, bytes], manifest: dict | None, t0: float
) -> PatchResult:
    d = ckpt.dir
    lock = OutputLock(lock_path_for(d), d)  # the same lock an AtomicOutputDir(ckpt) would take
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
        _register_all(writer, ckpt, encoded, patch_rel)
        # the old metadata survives the swap under this name (the entry itself, never a link's target)
        link_entry(d / METADATA_NAME, backup)
        if manifest is not None:  # before the swap: the manifest fits the old .metadata and the new one
            atomic_write_bytes(
                d / SLIM_MANIFEST, _manifest_bytes(manifest, patch_rel, encoded, set(os.listdir(d)))
            )
        with signals_deferred():  # a Ctrl-C during the swap lands after it, the swap known as done
            writer.finish()  # fsync patch, write .metadata.tmp-*, fsync, rename over .metadata
            swapped = True
            note_committed(d)
        fsync_path(d)
    except BaseException:
        writer.abort()
        # the new .metadata may be in place although finish failed after its rename: then the patch it
        # points at stays (judged by the entry itself: `.metadata` is no longer the backup's inode)
        if not swapped and not _swapped_in(d / METADATA_NAME, backup):
            for p in (d / patch_rel, backup):
                remove_file(p)
        raise
    finally:
        lock.release()
    written = (d / patch_rel).stat().st_size + (d / METADATA_NAME).stat().st_size
    return PatchResult(
        out=str(d),
        in_place=True,
        patch_file=patch_rel,
        changed_keys=len(encoded),
        bytes_written=written,
        linked={},
        backup=str(backup),
        seconds=round(time.perf_counter() - t0, 4),
        warnings=[f"removed {n}, left by a killed in-place run" for n in removed],
    )


def _swapped_in(meta: Path, backup: Path) -> bool:
    """Whether a new `.metadata` replaced the one linked as `backup` (False when it cannot tell)."""
    try:
        return os.path.lexists(backup) and os.lstat(meta).st_ino != os.lstat(backup).st_ino
    except OSError:
        return False


# a new `.metadata`, or a slim's new manifest (`atomic_write_bytes`' `.<name>.tmp-`), never renamed in
_TMP_LEFTOVER = re.compile(
    rf"^(?:{re.escape(METADATA_NAME)}|\.{re.escape(SLIM_MANIFEST)}){re.escape(METADATA_TMP_TAG)}(\d+)-[0-9a-f]+$"
)
_PATCH_FILE = re.compile(rf"^{re.escape(PATCH_PREFIX)}\d+\.distcp$")


def _referenced_files(meta_path: Path, root: Path) -> set[str] | None:
    """Data files a `.metadata` (or a backup of one) points at; None when it cannot be read."""
    try:
        md = load_metadata(
            read_input(meta_path, root=root, what="metadata", max_bytes=MAX_METADATA_BYTES), str(meta_path)
        )
        storage = getattr(md, "storage_data", None)
        if not isinstance(storage, dict):
            return None
        return {str(info.relative_path) for info in storage.values()}
    except Exception:
        return None


def clean_in_place_leftovers(d: Path) -> list[str]:
    """What killed `--in-place` runs left in checkpoint `d`, removed. Called with `d`'s lock held,
    so no in-place run is alive (a live one holds the lock); temp names carry the pid and only dead
    pids' are touched. Removed: `.metadata.tmp-<pid>-*` (a new metadata never renamed in) and a slim's
    `.ckpt-slim-manifest.json.tmp-<pid>-*`;
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
            remove_file(d / n)
            removed.append(n)
    backups = [n for n in names if n.startswith(METADATA_NAME + ".bak-")]
    for n in backups:
        with contextlib.suppress(FileNotFoundError):
            if os.lstat(d / n).st_ino == meta_ino:
                remove_file(d / n)
                removed.append(n)
    patches = [n for n in names if _PATCH_FILE.match(n)]
    if patches:
        used: set[str] = set()
        for m_path in [meta] + [d / n for n in backups if n not in removed]:
            refs = _referenced_files(m_path, d)
            if refs is None:
                return removed  # a metadata we cannot read: keep every patch file
            used |= refs
        for n in patches:
            if n not in used:
                remove_file(d / n)
                removed.append(n)
    for n in removed:
        log.warning("removed %s from %s: left by a killed --in-place run", n, d)
    return removed
