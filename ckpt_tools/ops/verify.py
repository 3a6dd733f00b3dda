"""`ckpt verify`: integrity of a DCP checkpoint, an HF model dir or a PEFT adapter dir, before you
trust or ship it.

Every problem found becomes one `Problem(file, key, message)`; nothing here raises on a malformed
input (a problem we cannot even describe is reported as "cannot check: ..."). Warnings are facts
worth knowing that do not make the checkpoint unusable. No full tensor is ever built: DCP checks use
the metadata, each item's zip central directory (`dcp.zipitem`) and its tiny `data.pkl`; `--deep`
streams payloads in blocks through `zlib.crc32` (DCP) or a finiteness check (HF, PEFT).

DCP (`verify_dcp`), per shared/docs/dcp-internals.md §8:
  1. `.metadata` unpickles (allow-list) and is well-formed;
  2. every storage item's file exists and `[offset, offset+length)` lies inside it; items do not
     overlap; gaps are warned about;
  3. every tensor's chunks lie in bounds, do not overlap and cover it exactly (0-size chunks
     skipped); every chunk and byte item has a storage entry;
  4. every item is a torch.save zip whose records lie inside it and whose `data.pkl` dtype/shape
     agree with the metadata (and whose payload is exactly numel * itemsize bytes);
  5. `--deep`: the CRC32 of every record equals the one stored in the zip (torch never checks it).
"""
from __future__ import annotations

import io
import json
import math
import os
import re
import zlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..errors import CkptError, UsageError
from ..inputs import MAX_METADATA_BYTES, open_input, read_input, read_json

# Items up to this size are read with one pread and parsed in memory.
SMALL_ITEM_BYTES = 1 << 20
CRC_BLOCK_BYTES = 8 * 2**20
FINITE_BLOCK_BYTES = 16 * 2**20

Progress = Callable[[str, int, int], None]   # (phase, done, total) in bytes


@dataclass(frozen=True)
class Problem:
    file: str
    key: str | None
    message: str

    def render(self) -> str:
        where = self.file + (f", key {self.key!r}" if self.key else "")
        return f"{where}: {self.message}"


@dataclass
class VerifyReport:
    path: str
    format: str
    deep: bool
    problems: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)
    checked: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.problems

    def problem(self, file, key: str | None, message: str) -> None:
        self.problems.append(Problem(str(file), key, message))

    def warn(self, file, key: str | None, message: str) -> None:
        self.warnings.append(Problem(str(file), key, message))

    def to_json(self) -> dict:
        return {"path": self.path, "format": self.format, "deep": self.deep, "ok": self.ok,
                "problems": [asdict(p) for p in self.problems], "warnings": [asdict(w) for w in self.warnings],
                "checked": self.checked}


def detect_kind(path: Path) -> str:
    from ..weights_source import is_dcp_path

    p = Path(path)
    if not p.exists():
        raise UsageError("no such file or directory", path=p)
    if is_dcp_path(p):
        return "dcp"
    if p.is_dir() and (p / "adapter_config.json").is_file():
        return "peft"
    if p.is_dir() and ((p / "model.safetensors").is_file() or (p / "model.safetensors.index.json").is_file()):
        return "hf"
    raise UsageError("cannot tell what to verify: not a DCP checkpoint (.metadata), an HF model dir "
                     "(model.safetensors or model.safetensors.index.json) or a PEFT adapter dir "
                     "(adapter_config.json)", path=p)


def verify_path(path: str | Path, *, deep: bool = False, base: str | Path | None = None,
                trust_pickle: bool = False, progress: Progress | None = None) -> VerifyReport:
    p = Path(path)
    kind = detect_kind(p)
    if base is not None and kind != "peft":
        raise UsageError(f"--base applies to PEFT adapter dirs; {p} is a {kind} directory",
                         hint="use `ckpt diff-vs-base` to compare model weights with a base")
    report = VerifyReport(str(p), kind, deep)
    if kind == "dcp":
        verify_dcp(p, report, deep=deep, trust_pickle=trust_pickle, progress=progress)
    elif kind == "hf":
        verify_hf(p, report, deep=deep, progress=progress)
    else:
        verify_peft(p, report, deep=deep, base=base, trust_pickle=trust_pickle)
    return report


# ================================================================================================ DCP
@dataclass
class _Item:
    key: str
    offsets: tuple[int, ...] | None     # None for a byte item
    file: str
    offset: int
    length: int
    sizes: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None

    @property
    def where(self) -> str:
        return "" if self.offsets is None else f"chunk at offsets {list(self.offsets)}: "


def _ints(x) -> tuple[int, ...]:
    out = tuple(int(v) for v in x)
    return out


def _plain(name) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name \
        and "\0" not in name


def verify_dcp(path: Path, report: VerifyReport, *, deep: bool, trust_pickle: bool = False,
               progress: Progress | None = None) -> None:
    from ..dcp.reader import METADATA_NAME, resolve_checkpoint_dir
    from ..safe_pickle import load_metadata_pickle

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
        md = load_metadata_pickle(data, str(meta), trust=trust_pickle)
    except CkptError as exc:
        report.problem(meta, None, exc.message + (f" ({exc.hint})" if exc.hint else ""))
        return
    sdm = getattr(md, "state_dict_metadata", None)
    storage = getattr(md, "storage_data", None)
    planner = getattr(md, "planner_data", None) or {}
    if not isinstance(sdm, dict) or not isinstance(storage, dict) or not isinstance(planner, dict):
        report.problem(meta, None, "malformed metadata: state_dict_metadata / storage_data / planner_data "
                                   "are not dicts")
        return

    # ---- storage entries
    index: dict[tuple, object] = {}
    for idx, info in storage.items():
        try:
            fqn = idx.fqn
            off = None if idx.offset is None else _ints(idx.offset)
            rel, offset, length = info.relative_path, int(info.offset), int(info.length)
        except Exception as exc:  # a damaged entry of the allowed classes
            report.problem(meta, None, f"malformed storage entry {idx!r}: {type(exc).__name__}: {exc}")
            continue
        if not _plain(rel):
            report.problem(meta, fqn, f"storage item points at {rel!r}, not a file name inside the checkpoint dir")
            continue
        if offset < 0 or length < 0:
            report.problem(ckpt_dir / rel, fqn, f"storage item has negative offset/length ({offset}, {length})")
            continue
        if getattr(info, "transform_descriptors", None):
            report.warn(ckpt_dir / rel, fqn, f"item uses transforms {list(info.transform_descriptors)} "
                                             "(compression?); its payload was not checked")
        index[(fqn, off)] = (rel, offset, length)

    # ---- keys, chunks
    items: list[_Item] = []
    used: set[tuple] = set()
    n_tensors = n_bytes = 0
    for key in sorted(sdm, key=str):
        md_item = sdm[key]
        if not isinstance(key, str):
            report.problem(meta, repr(key), "key is not a string")
            continue
        if key not in planner:
            report.warn(meta, key, "no planner_data entry (DCP's key-filtered loads fail on such keys)")
        try:
            if hasattr(md_item, "chunks"):
                n_tensors += 1
                _check_tensor_key(key, md_item, index, used, items, report, meta, ckpt_dir)
            elif type(md_item).__name__ == "BytesStorageMetadata":
                n_bytes += 1
                loc = index.get((key, None))
                if loc is None:
                    report.problem(meta, key, "byte item has no storage entry")
                else:
                    used.add((key, None))
                    items.append(_Item(key, None, *loc))
            else:
                report.problem(meta, key, f"unknown item type {type(md_item).__name__}")
        except Exception as exc:
            report.problem(meta, key, f"cannot check: {type(exc).__name__}: {exc}")
    for (fqn, off) in sorted(set(index) - used, key=lambda t: (str(t[0]), t[1] or ())):
        report.warn(ckpt_dir / index[(fqn, off)][0], fqn,
                    f"storage item at offsets {list(off) if off is not None else None} is referenced by no "
                    "chunk in state_dict_metadata (orphaned: its data is never loaded)")

    # ---- files: existence, bounds, overlaps, gaps
    by_file: dict[str, list[_Item]] = {}
    for it in items:
        by_file.setdefault(it.file, []).append(it)
    readable: list[_Item] = []
    total_bytes = 0
    for rel in sorted(by_file):
        fitems = sorted(by_file[rel], key=lambda i: (i.offset, i.length, i.key))
        fpath = ckpt_dir / rel
        try:
            size = fpath.stat().st_size
        except FileNotFoundError:
            keys = sorted({i.key for i in fitems})
            report.problem(fpath, keys[0], f"data file is missing: {len(fitems)} storage item(s) of "
                                           f"{len(keys)} key(s) live in it (this is the first)")
            continue
        except OSError as exc:
            report.problem(fpath, fitems[0].key, f"cannot stat data file: {exc.strerror}")
            continue
        total_bytes += size
        past = [i for i in fitems if i.offset + i.length > size]
        if past:
            need = max(i.offset + i.length for i in fitems)
            first = past[0]
            report.problem(fpath, first.key,
                           f"file is truncated: it holds {size} bytes but the metadata needs {need}; "
                           f"{len(past)} item(s) lie past its end, the first {first.where}"
                           f"[{first.offset}, {first.offset + first.length})")
        prev_end, prev_key, gaps = 0, None, 0
        for it in fitems:
            if it.offset < prev_end:
                report.problem(fpath, it.key, f"{it.where}item [{it.offset}, {it.offset + it.length}) "
                                              f"overlaps the item of key {prev_key!r} (ends at {prev_end})")
            elif it.offset > prev_end:
                gaps += it.offset - prev_end
            if it.offset + it.length > prev_end:
                prev_end, prev_key = it.offset + it.length, it.key
        if gaps:
            report.warn(fpath, None, f"{gaps} bytes between items belong to no storage item")
        if size > prev_end and not past:
            report.warn(fpath, None, f"{size - prev_end} trailing bytes after the last item")
        readable += [i for i in fitems if i.offset + i.length <= size]

    # ---- items: zip structure, data.pkl vs metadata, CRC
    crc_total = sum(i.length for i in readable) if deep else 0
    state = {"done": 0, "records": 0}
    for rel in sorted({i.file for i in readable}):
        fpath = ckpt_dir / rel
        try:
            fd = open_input(fpath, root=ckpt_dir, what="data file")
        except CkptError as exc:
            report.problem(fpath, None, exc.message + (f" ({exc.hint})" if exc.hint else ""))
            continue
        try:
            for it in sorted((i for i in readable if i.file == rel), key=lambda i: i.offset):
                try:
                    _check_item(fd, fpath, it, report, deep, state)
                except Exception as exc:
                    report.problem(fpath, it.key, f"{it.where}cannot check item: {type(exc).__name__}: {exc}")
                if deep:
                    state["done"] += it.length
                    if progress is not None:
                        progress("crc32", state["done"], crc_total)
        finally:
            os.close(fd)
    report.checked.update({"keys": len(sdm), "tensors": n_tensors, "byte_items": n_bytes,
                           "storage_items": len(items), "files": len(by_file), "file_bytes": total_bytes,
                           "items_parsed": len(readable)})
    if deep:
        report.checked["records_crc_checked"] = state["records"]


def _check_tensor_key(key, md_item, index, used, items, report: VerifyReport, meta: Path, ckpt_dir: Path) -> None:
    size = _ints(md_item.size)
    dtype = md_item.properties.dtype
    if not isinstance(dtype, torch.dtype):
        report.problem(meta, key, f"dtype {dtype!r} is not a torch dtype")
        return
    numel = math.prod(size)
    boxes = []
    for ch in md_item.chunks:
        offs, sizes = _ints(ch.offsets), _ints(ch.sizes)
        if len(offs) != len(size) or len(sizes) != len(size):
            report.problem(meta, key, f"chunk offsets {list(offs)} / sizes {list(sizes)} do not match the "
                                      f"tensor's {len(size)} dims")
            continue
        if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(offs, sizes, size)):
            report.problem(meta, key, f"chunk at offsets {list(offs)} sizes {list(sizes)} lies outside the "
                                      f"tensor's size {list(size)}")
            continue
        loc = index.get((key, offs))
        if loc is None:
            report.problem(meta, key, f"chunk at offsets {list(offs)} has no storage entry")
        elif loc[2] < math.prod(sizes) * dtype.itemsize:   # the same rule as reader._check_chunk_bytes
            report.problem(meta, key, f"chunk at offsets {list(offs)} declares {list(sizes)} {dtype} "
                                      f"({math.prod(sizes) * dtype.itemsize:,} bytes) but its item holds "
                                      f"{loc[2]:,} bytes: an expanded (stride-0) or crafted item")
            used.add((key, offs))
        else:
            used.add((key, offs))
            items.append(_Item(key, offs, *loc, sizes=sizes, dtype=dtype))
        if math.prod(sizes):
            boxes.append((offs, sizes))
    # overlaps: sort by dim-0 start; only chunks whose dim-0 ranges meet can overlap
    boxes.sort()
    overlap = False
    for i, (oa, sa) in enumerate(boxes):
        for ob, sb in boxes[i + 1:]:
            if size and ob[0] >= oa[0] + sa[0]:
                break
            if all(b0 < a0 + a1 and a0 < b0 + b1 for a0, a1, b0, b1 in zip(oa, sa, ob, sb)):
                report.problem(meta, key, f"chunks at offsets {list(oa)} and {list(ob)} overlap")
                overlap = True
    covered = sum(math.prod(s) for _, s in boxes)
    if not overlap and covered != numel:
        msg = f"chunks cover {covered} of {numel} elements"
        if size and all(all(o == 0 for o in offs[1:]) and sz[1:] == size[1:] for offs, sz in boxes):
            holes, pos = [], 0
            for offs, sz in boxes:
                if offs[0] > pos:
                    holes.append(f"[{pos}, {offs[0]})")
                pos = max(pos, offs[0] + sz[0])
            if pos < size[0]:
                holes.append(f"[{pos}, {size[0]})")
            msg += f"; rows {', '.join(holes)} belong to no chunk"
        report.problem(meta, key, msg + " (torch's loader would leave that region uninitialized, silently)")


def _read_exact(fd: int, offset: int, n: int) -> bytes:
    parts, done = [], 0
    while done < n:
        b = os.pread(fd, min(n - done, 0x7FFFF000), offset + done)
        if not b:
            raise EOFError(f"file ended at byte {offset + done}")
        parts.append(b)
        done += len(b)
    return b"".join(parts)


def _check_item(fd: int, fpath: Path, it: _Item, report: VerifyReport, deep: bool, state: dict) -> None:
    from ..dcp.zipitem import _Window, decode_tensor_pickle, parse_item
    from ..errors import UnsafePickleError

    if it.length <= SMALL_ITEM_BYTES:
        buf = _read_exact(fd, it.offset, it.length)
        src = io.BytesIO(buf)
    else:
        buf = None
        src = io.BufferedReader(_Window(lambda off, n: os.pread(fd, n, off), it.offset, it.length))
    try:
        layout = parse_item(src)
    except ValueError as exc:
        report.problem(fpath, it.key, f"{it.where}item [{it.offset}, {it.offset + it.length}) is not a valid "
                                      f"torch.save archive: {exc}")
        return
    for name, off, size, _crc in layout.records:
        if off < 0 or off + size > it.length:
            report.problem(fpath, it.key, f"{it.where}zip record {name} [{off}, {off + size}) lies outside "
                                          f"the item ({it.length} bytes)")
            return

    def record_bytes(off: int, size: int) -> bytes:
        if buf is not None:
            return buf[off:off + size]
        return _read_exact(fd, it.offset + off, size)

    byteorder = next((r for r in layout.records if r[0].endswith("/byteorder")), None)
    if byteorder is not None and byteorder[2] <= 16:
        order = record_bytes(byteorder[1], byteorder[2])
        if order != b"little":
            report.problem(fpath, it.key, f"{it.where}byteorder record says {order!r}; only little-endian "
                                          "items are read correctly here")
    if it.offsets is not None:
        try:
            rec = decode_tensor_pickle(record_bytes(layout.pkl_offset, layout.pkl_size))
        except UnsafePickleError as exc:
            report.problem(fpath, it.key, f"{it.where}data.pkl: {exc.message}")
            rec = None
        except Exception as exc:
            report.problem(fpath, it.key, f"{it.where}data.pkl does not describe one tensor: "
                                          f"{type(exc).__name__}: {exc}")
            rec = None
        if layout.data_offset is None:
            report.problem(fpath, it.key, f"{it.where}item holds no tensor payload (no data/0 record)")
        else:
            if rec is not None:
                bad = []
                if rec.dtype != it.dtype:
                    bad.append(f"dtype {rec.dtype} (metadata: {it.dtype})")
                if rec.size != it.sizes:
                    bad.append(f"shape {list(rec.size)} (metadata: {list(it.sizes)})")
                need = rec.storage_numel * rec.dtype.itemsize
                if layout.data_size != need:
                    bad.append(f"payload {layout.data_size} bytes (its storage needs {need})")
                extent = rec.storage_offset + sum((s - 1) * st for s, st in zip(rec.size, rec.stride)) + 1 \
                    if all(rec.size) else 0
                if extent > rec.storage_numel:
                    bad.append(f"view reaches element {extent} of a {rec.storage_numel}-element storage")
                numel = math.prod(rec.size)
                if numel > rec.storage_numel or any(st == 0 and n > 1 for st, n in zip(rec.stride, rec.size)):
                    bad.append(f"an expanded (stride-0) view: {numel} elements from {rec.storage_numel} stored "
                               f"(strides {list(rec.stride)}); a loader materializes all of them")
                if bad:
                    report.problem(fpath, it.key, f"{it.where}data.pkl disagrees with the metadata: "
                                                  + ", ".join(bad))
    if deep:
        for name, off, size, crc in layout.records:
            got = 0
            for pos in range(0, size, CRC_BLOCK_BYTES):
                got = zlib.crc32(record_bytes(off + pos, min(CRC_BLOCK_BYTES, size - pos)), got)
            state["records"] += 1
            if got != crc:
                report.problem(fpath, it.key, f"{it.where}CRC32 mismatch in zip record {name}: stored "
                                              f"{crc:#010x}, computed {got:#010x}; its bytes changed after they "
                                              "were written (torch.load does not check this and would load the "
                                              "damaged values silently)")


# ================================================================================================ HF
# Expected shapes of common decoder weights (Llama / Qwen / Mistral naming) from config.json. A dim
# the config does not state makes the rule not apply.
_SHAPE_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"model\.embed_tokens\.weight", ("vocab_size", "hidden_size")),
    (r"lm_head\.weight", ("vocab_size", "hidden_size")),
    (r"model\.norm\.weight", ("hidden_size",)),
    (r"model\.layers\.\d+\.(input|post_attention)_layernorm\.weight", ("hidden_size",)),
    (r"model\.layers\.\d+\.self_attn\.q_proj\.weight", ("q_dim", "hidden_size")),
    (r"model\.layers\.\d+\.self_attn\.[kv]_proj\.weight", ("kv_dim", "hidden_size")),
    (r"model\.layers\.\d+\.self_attn\.o_proj\.weight", ("hidden_size", "q_dim")),
    (r"model\.layers\.\d+\.self_attn\.[qk]_norm\.weight", ("head_dim",)),
    (r"model\.layers\.\d+\.mlp\.(gate|up)_proj\.weight", ("intermediate_size", "hidden_size")),
    (r"model\.layers\.\d+\.mlp\.down_proj\.weight", ("hidden_size", "intermediate_size")),
)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_CONFIG_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64",
                  "fp32": "F32", "fp16": "F16", "bf16": "BF16"}


def _config_dims(cfg: dict) -> dict[str, int]:
    c = cfg if "hidden_size" in cfg else (cfg.get("text_config") or {})

    def num(name):
        v = c.get(name)
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    dims = {k: num(k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")}
    heads, kv = num("num_attention_heads"), num("num_key_value_heads") or num("num_attention_heads")
    head_dim = num("head_dim") or (dims["hidden_size"] // heads if heads and dims["hidden_size"]
                                   and dims["hidden_size"] % heads == 0 else None)
    dims["head_dim"] = head_dim
    dims["q_dim"] = heads * head_dim if heads and head_dim else None
    dims["kv_dim"] = kv * head_dim if kv and head_dim else None
    return {k: v for k, v in dims.items() if v is not None}


def _load_json(path: Path, report: VerifyReport):
    try:
        return read_json(path, root=path.parent, what=path.name)
    except CkptError as exc:
        report.problem(path, None, exc.message)
    return None


def verify_hf(path: Path, report: VerifyReport, *, deep: bool, progress: Progress | None = None) -> None:
    from ..formats.safetensors_io import read_header

    single, index_path = path / "model.safetensors", path / "model.safetensors.index.json"
    config = None
    if (path / "config.json").is_file():
        config = _load_json(path / "config.json", report)
        if config is not None and not isinstance(config, dict):
            report.problem(path / "config.json", None, "is not a JSON object")
            config = None
    else:
        report.warn(path / "config.json", None, "no config.json: transformers cannot load this directory")
    if single.is_file() and index_path.is_file():
        report.problem(path, None, "has both model.safetensors and model.safetensors.index.json; loaders "
                                   "disagree on which wins (delete the stale one)")
    headers = {}
    weight_map = None
    if index_path.is_file() and not single.is_file():
        index = _load_json(index_path, report)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if index is not None and (not isinstance(weight_map, dict) or not weight_map):
            report.problem(index_path, None, "has no non-empty 'weight_map' object")
            weight_map = None
        files: dict[str, list[str]] = {}
        for k, f in (weight_map or {}).items():
            if not _plain(f):
                report.problem(index_path, k, f"weight_map points at {f!r}, not a file inside the model dir")
                continue
            files.setdefault(f, []).append(k)
        for f in sorted(files):
            if not (path / f).is_file():
                keys = sorted(files[f])
                report.problem(path / f, keys[0], f"shard listed in {index_path.name} is missing "
                                                  f"({len(keys)} tensor(s) map to it; this is the first)")
                continue
            headers[f] = _header(path / f, report, read_header)
        listed = set(files)
        for extra in sorted(n.name for n in path.glob("*.safetensors")):
            if extra not in listed:
                report.warn(path / extra, None, f"not referenced by {index_path.name}; loaders ignore it")
        meta = index.get("metadata") if isinstance(index, dict) else None
        total = meta.get("total_size") if isinstance(meta, dict) else None
        if isinstance(total, int) and all(h is not None for h in headers.values()) and len(headers) == len(files):
            have = sum(t.nbytes for h in headers.values() for t in h.tensors.values())
            if have != total:
                report.warn(index_path, None, f"metadata.total_size is {total} but the shards hold {have} "
                                              "bytes of tensor data")
    elif single.is_file():
        headers[single.name] = _header(single, report, read_header)
    # index <-> headers, duplicates
    owner: dict[str, str] = {}
    for f, h in sorted(headers.items()):
        if h is None:
            continue
        for k in h.tensors:
            if k in owner:
                report.problem(path / f, k, f"tensor also stored in {owner[k]}")
            owner.setdefault(k, f)
            if weight_map is not None:
                mapped = weight_map.get(k)
                if mapped is None:
                    report.problem(path / f, k, f"tensor is not listed in {index_path.name}: loaders will not find it")
                elif mapped != f:
                    report.problem(path / f, k, f"tensor is in {f} but {index_path.name} maps it to {mapped}")
    if weight_map is not None:
        for k, f in sorted(weight_map.items()):
            h = headers.get(f)
            if h is not None and k not in h.tensors and k not in owner:
                report.problem(path / f, k, f"{index_path.name} maps the tensor to {f}, which does not hold it")
    tensors = {k: headers[f].tensors[k] for k, f in owner.items()}
    if config is not None:
        _check_config(path / "config.json", config, tensors, report)
    if deep:
        _deep_finite(tensors, report, progress)
    report.checked.update({"files": len(headers), "tensors": len(tensors),
                           "tensor_bytes": sum(t.nbytes for t in tensors.values())})


def _header(p: Path, report: VerifyReport, read_header):
    try:
        return read_header(p)
    except CkptError as exc:
        report.problem(exc.path or p, exc.key, exc.message)
    except OSError as exc:
        report.problem(p, None, f"cannot read: {exc.strerror}")
    return None


def _check_config(cfg_path: Path, config: dict, tensors: dict, report: VerifyReport) -> None:
    dims = _config_dims(config)
    layers = dims.get("num_hidden_layers")
    for name in sorted(tensors):
        t = tensors[name]
        m = _LAYER.match(name)
        if m and layers is not None and int(m.group(1)) >= layers:
            report.problem(t.path, name, f"layer {m.group(1)} but config.json says num_hidden_layers={layers}")
        for pattern, want in _SHAPE_RULES:
            if re.fullmatch(pattern, name):
                if all(w in dims for w in want):
                    expected = tuple(dims[w] for w in want)
                    if tuple(t.shape) != expected:
                        report.problem(t.path, name, f"shape {list(t.shape)} but config.json implies "
                                                     f"{list(expected)} ({' x '.join(want)})")
                break
    cfg_dtype = config.get("dtype") or config.get("torch_dtype")
    code = _CONFIG_DTYPES.get(cfg_dtype) if isinstance(cfg_dtype, str) else None
    floats = sorted({t.dtype for t in tensors.values() if t.dtype.startswith(("F", "BF"))})
    if code and floats and code not in floats:
        report.warn(cfg_path, None, f"config.json says dtype {cfg_dtype} but the weights are {'/'.join(floats)}; "
                                    "a loader using dtype='auto' converts them")


# IEEE layouts: a value is inf/nan iff all exponent bits are set (one integer pass, no float decode).
_EXP_MASKS = {torch.float16: (torch.int16, 0x7C00), torch.bfloat16: (torch.int16, 0x7F80),
              torch.float32: (torch.int32, 0x7F800000), torch.float64: (torch.int64, 0x7FF0000000000000)}


def count_nonfinite(t: torch.Tensor) -> int:
    spec = _EXP_MASKS.get(t.dtype)
    if spec is not None:
        int_dtype, mask = spec
        return int(torch.count_nonzero((t.view(int_dtype) & mask) == mask))
    return int(t.numel() - torch.count_nonzero(torch.isfinite(t.float() if t.element_size() == 1 else t)))


def _deep_finite(tensors: dict, report: VerifyReport, progress: Progress | None) -> None:
    from ..formats.safetensors_io import torch_dtype

    total = sum(t.nbytes for t in tensors.values())
    done = 0
    fds: dict[Path, int] = {}
    try:
        for name in sorted(tensors, key=lambda n: (str(tensors[n].path), tensors[n].begin)):
            t = tensors[name]
            try:
                fd = fds.get(t.path)
                if fd is None:
                    fd = fds[t.path] = open_input(t.path, root=t.path.parent, what="safetensors shard")
                dt = torch_dtype(t.dtype)
                item = dt.itemsize
                block = max(item, FINITE_BLOCK_BYTES // item * item)
                bad = 0
                for pos in range(0, t.nbytes, block):
                    raw = bytearray(_read_exact(fd, t.begin + pos, min(block, t.nbytes - pos)))
                    if dt.is_floating_point and raw:
                        bad += count_nonfinite(torch.frombuffer(raw, dtype=dt))
                if bad:
                    report.problem(t.path, name, f"{bad} non-finite value(s) (inf/nan)")
            except Exception as exc:
                report.problem(t.path, name, f"cannot read tensor bytes: {type(exc).__name__}: {exc}")
            done += t.nbytes
            if progress is not None:
                progress("read", done, total)
    finally:
        for fd in fds.values():
            os.close(fd)


# ================================================================================================ PEFT
def verify_peft(path: Path, report: VerifyReport, *, deep: bool, base=None, trust_pickle: bool = False) -> None:
    from ..peft_adapter import ADAPTER_CONFIG, PEFT_PREFIX, matches_target_modules, open_peft_adapter, parse_peft_config

    cfg_path = path / ADAPTER_CONFIG
    try:
        cfg = parse_peft_config(cfg_path)
    except CkptError as exc:
        report.problem(exc.path or cfg_path, exc.key, exc.message)
        return
    try:
        adapter = open_peft_adapter(path, strict=False)
    except CkptError as exc:
        report.problem(exc.path or path, exc.key, exc.message + (f" ({exc.hint})" if exc.hint else ""))
        return
    except Exception as exc:
        report.problem(path, None, f"cannot open the adapter weights: {type(exc).__name__}: {exc}")
        return
    wpath = adapter.weights_path
    for k in adapter.unrecognized:
        hint = ""
        if not k.startswith(PEFT_PREFIX) or re.search(r"\.lora_[AB]\.\d+\.weight$", k):
            hint = " (prime-rl's export key bug: `ckpt fix-adapter` renames it)"
        report.problem(wpath, k, "key maps to no LoRA module: PEFT expects "
                                 f"{PEFT_PREFIX}<module>.lora_A.weight / lora_B.weight and would silently "
                                 f"ignore it{hint}")
    for msg in adapter.problems:
        module = msg.split(":", 1)[0]
        report.problem(wpath, module, msg.split(": ", 1)[-1])
    if not adapter.modules and not adapter.full_tensors:
        report.problem(wpath, None, "holds no LoRA weights PEFT would load: applying it changes nothing")
    targets = cfg.target_modules
    matched_targets = set()
    for module in sorted(adapter.modules):
        ok = matches_target_modules(module, targets)
        if ok is False:
            report.problem(wpath, adapter.modules[module].a_key,
                           f"module {module} is not matched by target_modules {targets!r}: PEFT would not "
                           "create it and would silently ignore these weights")
        if isinstance(targets, list):
            matched_targets.update(t for t in targets if module == t or module.endswith("." + t))
    if isinstance(targets, list) and adapter.modules:
        for t in sorted(set(targets) - matched_targets):
            report.warn(cfg_path, None, f"target_modules entry {t!r} matches no module in the weights")
    if deep:
        for key in sorted(adapter._shapes):
            try:
                t = adapter.read(key)
            except Exception as exc:
                report.problem(wpath, key, f"cannot read: {type(exc).__name__}: {exc}")
                continue
            if t.is_floating_point() and count_nonfinite(t.reshape(-1)):
                report.problem(wpath, key, f"{count_nonfinite(t.reshape(-1))} non-finite value(s) (inf/nan)")
    if base is not None:
        _check_against_base(adapter, cfg, base, report, trust_pickle)
    report.checked.update({"modules": len(adapter.modules), "modules_to_save": len(adapter.full_tensors),
                           "keys": len(adapter._shapes)})


def _check_against_base(adapter, cfg, base, report: VerifyReport, trust_pickle: bool) -> None:
    from ..weights_source import open_weights

    try:
        src = open_weights(base, trust_pickle=trust_pickle)
    except CkptError as exc:
        report.problem(exc.path or base, exc.key, f"cannot open --base: {exc.message}")
        return
    wpath = adapter.weights_path
    try:
        for module, m in sorted(adapter.modules.items()):
            name = f"{module}.weight"
            if name not in src:
                report.problem(wpath, m.a_key, f"target module {module} does not exist in the base "
                                               f"({src.label} has no {name})")
                continue
            shape = src.info(name).shape
            a, b = adapter._shapes[m.a_key], adapter._shapes[m.b_key]
            if len(shape) != 2:
                report.problem(wpath, m.a_key, f"base {name} is {list(shape)}, not a 2-D linear weight")
                continue
            out_f, in_f = (shape[1], shape[0]) if cfg.fan_in_fan_out else shape
            if a[1] != in_f or b[0] != out_f:
                report.problem(wpath, m.a_key, f"shapes do not fit the base: A {list(a)}, B {list(b)} but base "
                                               f"{name} is {list(shape)} (expects A [r, {in_f}], B [{out_f}, r])")
        for name, key in sorted(adapter.full_tensors.items()):
            if name not in src:
                report.problem(wpath, key, f"modules_to_save tensor {name} does not exist in the base")
            elif tuple(src.info(name).shape) != tuple(adapter._shapes[key]):
                report.problem(wpath, key, f"shape {list(adapter._shapes[key])} but the base's {name} is "
                                           f"{list(src.info(name).shape)}")
        report.checked["base"] = src.describe()
    finally:
        src.close()
