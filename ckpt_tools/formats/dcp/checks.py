"""A DCP checkpoint checked, every problem listed (what `ckpt verify` reports, and what `ckpt gc` proves of a
slim before it swaps it in), per shared/docs/dcp-internals.md §8:
  1. `.metadata` unpickles (allow-list) and is well-formed: every finding of the metadata model
     (`formats.dcp.model.parse_metadata`: storage entries, chunk geometry, item sizes) listed;
  2. every storage item's file exists and `[offset, offset+length)` lies inside it; items do not
     overlap; gaps are warned about;
  3. every item is a torch.save zip whose records lie inside it and whose `data.pkl` dtype/shape
     agree with the metadata (and whose payload is exactly numel * itemsize bytes), decoded by
     `formats.dcp.item`;
  4. `--deep`: the CRC32 of every record equals the one stored in the zip (torch never checks it).
No full tensor is ever built: the metadata, each item's zip central directory and its tiny data.pkl.
"""

from __future__ import annotations

import io
import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ...core.dtypes import ITEMSIZE
from ...core.errors import CkptError, UnsafePickleError
from ...core.keys import classify, unknown_keys
from ...core.problems import VerifyReport
from ...core.progress import Progress
from ...core.progress import report as report_progress
from ...dist import map_units
from ...io.inputs import MAX_METADATA_BYTES, OpenFiles, as_input, read_input
from .item import (
    SMALL_ITEM_BYTES,
    ItemError,
    ItemLayout,
    TensorRecord,
    decode_tensor_pickle,
    parse_item,
    window,
)
from .layout import METADATA_NAME, PATCH_PREFIX, resolve_checkpoint_dir
from .metadata import load_metadata
from .model import PROBLEM, ParsedMetadata, parse_metadata

__all__ = ["CRC_BLOCK_BYTES", "verify_dcp"]

CRC_BLOCK_BYTES = 8 * 2**20


@dataclass
class _Item:
    key: str
    offsets: tuple[int, ...] | None  # None for a byte item
    file: str
    offset: int
    length: int
    sizes: tuple[int, ...] | None = None
    dtype: str | None = None

    @property
    def where(self) -> str:
        return "" if self.offsets is None else f"chunk at offsets {list(self.offsets)}: "


def verify_dcp(
    path: Path,
    report: VerifyReport,
    *,
    deep: bool,
    trust_pickle: bool = False,
    progress: Progress | None = None,
    group=None,
) -> None:
    ckpt_dir = resolve_checkpoint_dir(path)
    report.path = str(ckpt_dir)
    parsed = _parsed_metadata(ckpt_dir, report, trust_pickle)
    if parsed is None or not parsed.counts:  # the three tables are not dicts: nothing else can be checked
        return
    items = [
        _Item(
            key,
            None if ch is None else ch.offsets,
            loc.file,
            loc.offset,
            loc.length,
            None if ch is None else ch.sizes,
            dtype,
        )
        for key, ch, loc, dtype in parsed.located
    ]
    by_file: dict[str, list[_Item]] = {}
    for it in items:
        by_file.setdefault(it.file, []).append(it)
    readable, total_bytes, superseded = _check_files(ckpt_dir, by_file, report)
    records = _check_items(ckpt_dir, readable, report, deep=deep, progress=progress, group=group)
    report.checked.update(
        {
            **parsed.counts,
            "storage_items": len(items),
            "files": len(by_file),
            "file_bytes": total_bytes,
            "items_parsed": len(readable),
        }
    )
    if superseded:
        report.checked["superseded_bytes"] = superseded
    if deep:
        report.checked["records_crc_checked"] = records


def _parsed_metadata(ckpt_dir: Path, report: VerifyReport, trust_pickle: bool) -> ParsedMetadata | None:
    """The checkpoint's `.metadata` read, unpickled and parsed, each finding of the metadata model and each
    key no rule of the key model knows listed in `report`; None (one problem) where it cannot be read."""
    meta = ckpt_dir / METADATA_NAME
    try:
        data = read_input(meta, root=ckpt_dir, what="DCP .metadata", max_bytes=MAX_METADATA_BYTES)
    except CkptError as exc:
        report.problem(meta, None, exc.message + (f" ({exc.hint})" if exc.hint else ""))
        return None
    if not data:
        report.problem(meta, None, "empty .metadata (0 bytes): the save was interrupted")
        return None
    try:
        md = load_metadata(data, str(meta), trust=trust_pickle)
    except CkptError as exc:
        report.problem(meta, None, exc.message + (f" ({exc.hint})" if exc.hint else ""))
        return None
    parsed = parse_metadata(md)
    for f in parsed.findings:
        where = meta if f.file is None else ckpt_dir / f.file
        (report.problem if f.severity == PROBLEM else report.warn)(where, f.key, f.message)
    if not parsed.counts:
        return parsed
    unknown = unknown_keys([classify(k, e.path) for k, e in parsed.entries.items()])
    for key in unknown[:20]:  # a valid DCP item, but not a prime-rl key: the other commands refuse it
        report.warn(
            meta,
            key,
            "matches no rule of the prime-rl key model (a layout we do not know): every other "
            "ckpt command refuses this checkpoint",
        )
    return parsed


def _check_files(
    ckpt_dir: Path, by_file: dict[str, list[_Item]], report: VerifyReport
) -> tuple[list[_Item], int, int]:
    """Each data file exists and holds its items, which do not overlap; gaps and trailing bytes warned
    about. Returns (the items that lie inside their file, the files' bytes, the superseded gap bytes)."""
    readable: list[_Item] = []
    total_bytes = 0
    # bytes no item references are expected in the data files of a checkpoint our set-lr / set patched:
    # the values the patch file superseded (the data files are hard links of the original's)
    patched = any(rel.startswith(PATCH_PREFIX) for rel in by_file)
    superseded = 0
    for rel in sorted(by_file):
        fitems = sorted(by_file[rel], key=lambda i: (i.offset, i.length, i.key))
        fpath = ckpt_dir / rel
        size = _data_file_size(fpath, fitems, report)
        if size is None:
            continue
        total_bytes += size
        gaps, end = _check_extents(fpath, fitems, size, report)
        if gaps and patched and not rel.startswith(PATCH_PREFIX):
            superseded += gaps
        elif gaps:
            report.warn(fpath, None, f"{gaps} bytes between items belong to no storage item")
        if size > end:
            report.warn(fpath, None, f"{size - end} trailing bytes after the last item")
        readable += [i for i in fitems if i.offset + i.length <= size]
    return readable, total_bytes, superseded


def _data_file_size(fpath: Path, fitems: list[_Item], report: VerifyReport) -> int | None:
    """The data file's size; None (one problem) where it is missing or cannot be stat'ed."""
    try:
        return fpath.stat().st_size
    except FileNotFoundError:
        keys = sorted({i.key for i in fitems})
        report.problem(
            fpath,
            keys[0],
            f"data file is missing: {len(fitems)} storage item(s) of "
            f"{len(keys)} key(s) live in it (this is the first)",
        )
    except OSError as exc:
        report.problem(fpath, fitems[0].key, f"cannot stat data file: {exc.strerror}")
    return None


def _check_extents(fpath: Path, fitems: list[_Item], size: int, report: VerifyReport) -> tuple[int, int]:
    """A problem for a file too short for its items (`fitems`, in offset order) and for each item that
    overlaps the one before; returns (the bytes between items, the end of the last)."""
    past = [i for i in fitems if i.offset + i.length > size]
    if past:
        need = max(i.offset + i.length for i in fitems)
        first = past[0]
        report.problem(
            fpath,
            first.key,
            f"file is truncated: it holds {size} bytes but the metadata needs {need}; "
            f"{len(past)} item(s) lie past its end, the first {first.where}"
            f"[{first.offset}, {first.offset + first.length})",
        )
    prev_end, prev_key, gaps = 0, None, 0
    for it in fitems:
        if it.offset < prev_end:
            report.problem(
                fpath,
                it.key,
                f"{it.where}item [{it.offset}, {it.offset + it.length}) "
                f"overlaps the item of key {prev_key!r} (ends at {prev_end})",
            )
        elif it.offset > prev_end:
            gaps += it.offset - prev_end
        if it.offset + it.length > prev_end:
            prev_end, prev_key = it.offset + it.length, it.key
    return gaps, prev_end


def _check_items(
    ckpt_dir: Path, readable: list[_Item], report: VerifyReport, *, deep: bool, progress, group
) -> int:
    """Each item checked (`_check_item`) on torchrun's ranks and this rank's threads, its problems
    reported in file and offset order; returns the records CRC'd."""
    crc_total = sum(i.length for i in readable) if deep else 0
    crc_done = 0
    files = OpenFiles(ckpt_dir, what="data file")
    try:
        units, unopened = _open_units(ckpt_dir, files, readable)

        def check(k: int) -> dict:
            # items are independent: checked on torchrun's ranks and this rank's threads (preadv and zlib
            # release the GIL), each into its own collector; reported below in file and offset order
            it, found = units[k], _Collected()
            fpath = ckpt_dir / it.file
            try:
                _check_item(lambda off, n: files.read(it.file, off, n, it.key), fpath, it, found, deep)
            except Exception as exc:
                found.problem(fpath, it.key, f"{it.where}cannot check item: {type(exc).__name__}: {exc}")
            return {"problems": found.problems, "records": found.records}

        def done(k: int, _result) -> None:
            nonlocal crc_done
            if deep:
                crc_done += units[k].length
                report_progress(progress, "crc32", crc_done, crc_total)

        # without --deep an item is a few hundred bytes of headers: parsing them is GIL-bound Python, and a
        # pool only adds a future per item (14,300 of them in a 32B LoRA checkpoint: 2-5x slower)
        results = map_units(check, [i.length for i in units], group, done=done, threads=None if deep else 1)
    finally:
        files.close()
    return _report_checked(report, len(units), unopened, results)


def _open_units(
    ckpt_dir: Path, files: OpenFiles, readable: list[_Item]
) -> tuple[list[_Item], dict[int, list[list]]]:
    """The items to check, by file and offset, and the problems of the files that do not open, keyed by
    the number of units before them (so that they are reported in file order)."""
    units: list[_Item] = []
    unopened: dict[int, list[list]] = {}
    for rel in sorted({i.file for i in readable}):
        try:
            files.fd(rel)
        except CkptError as exc:
            unopened.setdefault(len(units), []).append(
                [ckpt_dir / rel, None, exc.message + (f" ({exc.hint})" if exc.hint else "")]
            )
            continue
        units += sorted((i for i in readable if i.file == rel), key=lambda i: i.offset)
    return units, unopened


def _report_checked(
    report: VerifyReport, n_units: int, unopened: dict[int, list[list]], results: list | None
) -> int:
    """The units' problems and the unopened files' into `report`, in file order; returns the records
    CRC'd. `results` is None on a follower rank: the leader reports."""
    results = results if results is not None else [None] * n_units
    records = 0
    for k in range(n_units + 1):
        for problem in unopened.get(k, ()):
            report.problem(*problem)
        if k < n_units and results[k] is not None:
            for path_, key, message in results[k]["problems"]:
                report.problem(as_input(path_), key, message)
            records += results[k]["records"]
    return records


class _Collected:
    """One item's problems (as JSON-able [file, key, message]) and CRC'd record count."""

    def __init__(self) -> None:
        self.problems: list[list] = []
        self.records = 0

    def problem(self, file, key, message: str) -> None:
        self.problems.append([str(file), key, message])


def _check_item(
    read: Callable[[int, int], bytes], fpath: Path, it: _Item, found: _Collected, deep: bool
) -> None:
    """The item's zip records lie inside it, its data.pkl agrees with the metadata (dtype, shape, payload
    bytes, no expanded view) and, `deep`, every record's CRC32 is the one the zip stores."""
    opened = _open_item(read, fpath, it, found)
    if opened is None:
        return
    layout, record_bytes = opened
    byteorder = next((r for r in layout.records if r[0].endswith("/byteorder")), None)
    if byteorder is not None and byteorder[2] <= 16:
        order = record_bytes(byteorder[1], byteorder[2])
        if order != b"little":
            found.problem(
                fpath,
                it.key,
                f"{it.where}byteorder record says {order!r}; only little-endian "
                "items are read correctly here",
            )
    if it.offsets is not None:
        _check_tensor_record(fpath, it, layout, record_bytes, found)
    if deep:
        _check_crcs(fpath, it, layout, record_bytes, found)


def _open_item(
    read: Callable[[int, int], bytes], fpath: Path, it: _Item, found: _Collected
) -> tuple[ItemLayout, Callable[[int, int], bytes]] | None:
    """The item's zip layout and a reader of its records' bytes (a small item read whole, once); None
    (one problem) where it is no torch.save archive or a record lies outside it."""
    buf: bytes | None
    src: BinaryIO
    if it.length <= SMALL_ITEM_BYTES:
        buf = read(it.offset, it.length)
        src = io.BytesIO(buf)
    else:
        buf = None
        src = window(read, it.offset, it.length)
    try:
        layout = parse_item(src)
    except ItemError as exc:
        found.problem(
            fpath,
            it.key,
            f"{it.where}item [{it.offset}, {it.offset + it.length}) is not a valid torch.save archive: {exc}",
        )
        return None
    for name, off, size, _crc in layout.records:
        if off < 0 or off + size > it.length:
            found.problem(
                fpath,
                it.key,
                f"{it.where}zip record {name} [{off}, {off + size}) lies outside "
                f"the item ({it.length} bytes)",
            )
            return None

    def record_bytes(off: int, size: int) -> bytes:
        if buf is not None:
            return buf[off : off + size]
        return read(it.offset + off, size)

    return layout, record_bytes


def _check_tensor_record(
    fpath: Path, it: _Item, layout: ItemLayout, record_bytes: Callable[[int, int], bytes], found: _Collected
) -> None:
    """A tensor item's data.pkl describes one tensor that agrees with the metadata, and it has a payload."""
    rec: TensorRecord | None
    try:
        rec = decode_tensor_pickle(record_bytes(layout.pkl_offset, layout.pkl_size))
    except UnsafePickleError as exc:
        found.problem(fpath, it.key, f"{it.where}data.pkl: {exc.message}")
        rec = None
    except Exception as exc:
        found.problem(
            fpath, it.key, f"{it.where}data.pkl does not describe one tensor: {type(exc).__name__}: {exc}"
        )
        rec = None
    if layout.data_offset is None:
        found.problem(fpath, it.key, f"{it.where}item holds no tensor payload (no data/0 record)")
    elif rec is not None:
        bad = _disagreements(rec, it, layout.data_size)
        if bad:
            found.problem(fpath, it.key, f"{it.where}data.pkl disagrees with the metadata: " + ", ".join(bad))


def _disagreements(rec: TensorRecord, it: _Item, data_size: int | None) -> list[str]:
    """Where a tensor item's data.pkl record disagrees with its metadata (dtype, shape) or its payload
    (`data_size` bytes), or is a view no loader reads as stored (past its storage, or expanded)."""
    assert it.sizes is not None  # a tensor item's
    bad = []
    if rec.dtype != it.dtype:
        bad.append(f"dtype torch.{rec.dtype} (metadata: torch.{it.dtype})")
    if rec.size != it.sizes:
        bad.append(f"shape {list(rec.size)} (metadata: {list(it.sizes)})")
    need = rec.storage_numel * ITEMSIZE[rec.dtype]
    if data_size != need:
        bad.append(f"payload {data_size} bytes (its storage needs {need})")
    extent = (
        rec.storage_offset + sum((s - 1) * st for s, st in zip(rec.size, rec.stride)) + 1
        if all(rec.size)
        else 0
    )
    if extent > rec.storage_numel:
        bad.append(f"view reaches element {extent} of a {rec.storage_numel}-element storage")
    numel = math.prod(rec.size)
    if numel > rec.storage_numel or any(st == 0 and n > 1 for st, n in zip(rec.stride, rec.size)):
        bad.append(
            f"an expanded (stride-0) view: {numel} elements from {rec.storage_numel} stored "
            f"(strides {list(rec.stride)}); a loader materializes all of them"
        )
    return bad


def _check_crcs(
    fpath: Path, it: _Item, layout: ItemLayout, record_bytes: Callable[[int, int], bytes], found: _Collected
) -> None:
    """Every zip record's CRC32, computed in CRC_BLOCK_BYTES blocks, is the one the zip stores."""
    for name, off, size, crc in layout.records:
        got = 0
        for pos in range(0, size, CRC_BLOCK_BYTES):
            got = zlib.crc32(record_bytes(off + pos, min(CRC_BLOCK_BYTES, size - pos)), got)
        found.records += 1
        if got != crc:
            found.problem(
                fpath,
                it.key,
                f"{it.where}CRC32 mismatch in zip record {name}: stored "
                f"{crc:#010x}, computed {got:#010x}; its bytes changed after they "
                "were written (torch.load does not check this and would load the "
                "damaged values silently)",
            )
