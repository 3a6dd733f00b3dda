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
from dataclasses import dataclass
from pathlib import Path

from ...core.dtypes import ITEMSIZE
from ...core.errors import CkptError, UnsafePickleError
from ...core.keys import classify, unknown_keys
from ...core.problems import VerifyReport
from ...core.progress import Progress
from ...core.progress import report as report_progress
from ...dist import map_units
from ...io.inputs import MAX_METADATA_BYTES, OpenFiles, read_input
from .item import SMALL_ITEM_BYTES, ItemError, decode_tensor_pickle, parse_item, window
from .layout import METADATA_NAME, PATCH_PREFIX, resolve_checkpoint_dir
from .metadata import load_metadata
from .model import PROBLEM, parse_metadata

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
    meta = ckpt_dir / METADATA_NAME
    try:
        data = read_input(meta, root=ckpt_dir, what="DCP .metadata", max_bytes=MAX_METADATA_BYTES)
    except CkptError as exc:
        report.problem(meta, None, exc.message + (f" ({exc.hint})" if exc.hint else ""))
        return
    if not data:
        report.problem(meta, None, "empty .metadata (0 bytes): the save was interrupted")
        return
    try:
        md = load_metadata(data, str(meta), trust=trust_pickle)
    except CkptError as exc:
        report.problem(meta, None, exc.message + (f" ({exc.hint})" if exc.hint else ""))
        return
    parsed = parse_metadata(md)
    for f in parsed.findings:
        where = meta if f.file is None else ckpt_dir / f.file
        (report.problem if f.severity == PROBLEM else report.warn)(where, f.key, f.message)
    if not parsed.counts:  # the three tables are not dicts: nothing else can be checked
        return
    unknown = unknown_keys([classify(k, e.path) for k, e in parsed.entries.items()])
    for key in unknown[:20]:  # a valid DCP item, but not a prime-rl key: the other commands refuse it
        report.warn(
            meta,
            key,
            "matches no rule of the prime-rl key model (a layout we do not know): every other "
            "ckpt command refuses this checkpoint",
        )
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

    # ---- files: existence, bounds, overlaps, gaps
    by_file: dict[str, list[_Item]] = {}
    for it in items:
        by_file.setdefault(it.file, []).append(it)
    readable: list[_Item] = []
    total_bytes = 0
    # bytes no item references are expected in the data files of a checkpoint our set-lr / set patched:
    # the values the patch file superseded (the data files are hard links of the original's)
    patched = any(rel.startswith(PATCH_PREFIX) for rel in by_file)
    superseded = 0
    for rel in sorted(by_file):
        fitems = sorted(by_file[rel], key=lambda i: (i.offset, i.length, i.key))
        fpath = ckpt_dir / rel
        try:
            size = fpath.stat().st_size
        except FileNotFoundError:
            keys = sorted({i.key for i in fitems})
            report.problem(
                fpath,
                keys[0],
                f"data file is missing: {len(fitems)} storage item(s) of "
                f"{len(keys)} key(s) live in it (this is the first)",
            )
            continue
        except OSError as exc:
            report.problem(fpath, fitems[0].key, f"cannot stat data file: {exc.strerror}")
            continue
        total_bytes += size
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
        if gaps and patched and not rel.startswith(PATCH_PREFIX):
            superseded += gaps
        elif gaps:
            report.warn(fpath, None, f"{gaps} bytes between items belong to no storage item")
        if size > prev_end and not past:
            report.warn(fpath, None, f"{size - prev_end} trailing bytes after the last item")
        readable += [i for i in fitems if i.offset + i.length <= size]

    # ---- items: zip structure, data.pkl vs metadata, CRC
    crc_total = sum(i.length for i in readable) if deep else 0
    state = {"done": 0, "records": 0}
    files = OpenFiles(ckpt_dir, what="data file")
    try:
        units = []
        unopened: dict[int, list] = {}  # files that do not open, reported before the units that follow them
        for rel in sorted({i.file for i in readable}):
            try:
                files.fd(rel)
            except CkptError as exc:
                unopened.setdefault(len(units), []).append(
                    [ckpt_dir / rel, None, exc.message + (f" ({exc.hint})" if exc.hint else "")]
                )
                continue
            units += sorted((i for i in readable if i.file == rel), key=lambda i: i.offset)

        def check(k: int) -> dict:
            # items are independent: checked on torchrun's ranks and this rank's threads (preadv and zlib
            # release the GIL), each into its own collector; reported below in file and offset order
            it, found = units[k], _Collected()
            fpath = ckpt_dir / it.file
            try:
                _check_item(
                    lambda off, n, _rel=it.file, _key=it.key: files.read(_rel, off, n, _key),
                    fpath,
                    it,
                    found,
                    deep,
                    found.state,
                )
            except Exception as exc:
                found.problem(fpath, it.key, f"{it.where}cannot check item: {type(exc).__name__}: {exc}")
            return {"problems": found.problems, "records": found.state["records"]}

        def done(k: int, _result) -> None:
            if deep:
                state["done"] += units[k].length
                report_progress(progress, "crc32", state["done"], crc_total)

        # without --deep an item is a few hundred bytes of headers: parsing them is GIL-bound Python, and a
        # pool only adds a future per item (14,300 of them in a 32B LoRA checkpoint: 2-5x slower)
        results = map_units(check, [i.length for i in units], group, done=done, threads=None if deep else 1)
    finally:
        files.close()
    results = results if results is not None else [None] * len(units)  # (a follower rank: the leader reports)
    for k in range(len(units) + 1):
        for problem in unopened.get(k, ()):
            report.problem(*problem)
        if k < len(units) and results[k] is not None:
            for path_, key, message in results[k]["problems"]:
                report.problem(Path(path_), key, message)
            state["records"] += results[k]["records"]
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
        report.checked["records_crc_checked"] = state["records"]


class _Collected:
    """One item's problems (as JSON-able [file, key, message]) and CRC'd record count."""

    def __init__(self) -> None:
        self.problems: list[list] = []
        self.state = {"records": 0}

    def problem(self, file, key, message: str) -> None:
        self.problems.append([str(file), key, message])


def _check_item(read, fpath: Path, it: _Item, report: VerifyReport, deep: bool, state: dict) -> None:
    """The item's zip records lie inside it, its data.pkl agrees with the metadata (dtype, shape, payload
    bytes, no expanded view) and, `deep`, every record's CRC32 is the one the zip stores."""
    if it.length <= SMALL_ITEM_BYTES:
        buf = read(it.offset, it.length)
        src = io.BytesIO(buf)
    else:
        buf = None
        src = window(read, it.offset, it.length)
    try:
        layout = parse_item(src)
    except ItemError as exc:
        report.problem(
            fpath,
            it.key,
            f"{it.where}item [{it.offset}, {it.offset + it.length}) is not a valid torch.save archive: {exc}",
        )
        return
    for name, off, size, _crc in layout.records:
        if off < 0 or off + size > it.length:
            report.problem(
                fpath,
                it.key,
                f"{it.where}zip record {name} [{off}, {off + size}) lies outside "
                f"the item ({it.length} bytes)",
            )
            return

    def record_bytes(off: int, size: int) -> bytes:
        if buf is not None:
            return buf[off : off + size]
        return read(it.offset + off, size)

    byteorder = next((r for r in layout.records if r[0].endswith("/byteorder")), None)
    if byteorder is not None and byteorder[2] <= 16:
        order = record_bytes(byteorder[1], byteorder[2])
        if order != b"little":
            report.problem(
                fpath,
                it.key,
                f"{it.where}byteorder record says {order!r}; only little-endian "
                "items are read correctly here",
            )
    if it.offsets is not None:
        try:
            rec = decode_tensor_pickle(record_bytes(layout.pkl_offset, layout.pkl_size))
        except UnsafePickleError as exc:
            report.problem(fpath, it.key, f"{it.where}data.pkl: {exc.message}")
            rec = None
        except Exception as exc:
            report.problem(
                fpath, it.key, f"{it.where}data.pkl does not describe one tensor: {type(exc).__name__}: {exc}"
            )
            rec = None
        if layout.data_offset is None:
            report.problem(fpath, it.key, f"{it.where}item holds no tensor payload (no data/0 record)")
        else:
            if rec is not None:
                bad = []
                if rec.dtype != it.dtype:
                    bad.append(f"dtype torch.{rec.dtype} (metadata: torch.{it.dtype})")
                if rec.size != it.sizes:
                    bad.append(f"shape {list(rec.size)} (metadata: {list(it.sizes)})")
                need = rec.storage_numel * ITEMSIZE[rec.dtype]
                if layout.data_size != need:
                    bad.append(f"payload {layout.data_size} bytes (its storage needs {need})")
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
                if bad:
                    report.problem(
                        fpath, it.key, f"{it.where}data.pkl disagrees with the metadata: " + ", ".join(bad)
                    )
    if deep:
        for name, off, size, crc in layout.records:
            got = 0
            for pos in range(0, size, CRC_BLOCK_BYTES):
                got = zlib.crc32(record_bytes(off + pos, min(CRC_BLOCK_BYTES, size - pos)), got)
            state["records"] += 1
            if got != crc:
                report.problem(
                    fpath,
                    it.key,
                    f"{it.where}CRC32 mismatch in zip record {name}: stored "
                    f"{crc:#010x}, computed {got:#010x}; its bytes changed after they "
                    "were written (torch.load does not check this and would load the "
                    "damaged values silently)",
                )
