"""The DCP metadata model: what a checkpoint holds, from `.metadata` alone (torch-free).

`parse_metadata(md)` turns the unpickled `Metadata` (stand-ins, `formats.dcp.metadata`) into one
`TensorEntry` (dtype by name, shape, chunks with their storage item) or `BytesEntry` per key, and
lists every `Finding` on the way: every rule the metadata must satisfy before a byte of data is
read or a destination allocated is checked here, once. `DcpCheckpoint.open` raises the first finding
that makes the checkpoint unreadable; `ckpt verify` lists them all (`formats.dcp.checks`).

The rules (shared/docs/dcp-internals.md §8): the three tables are dicts; every storage entry names a
plain file of the checkpoint dir with a non-negative range; every tensor has a known dtype and
non-negative dims, and its chunks lie inside it, do not overlap and cover it exactly (0-size chunks
skipped), each with a storage entry whose item holds at least its elements' bytes (a shorter item is
an expanded view or a crafted size: reading it would allocate by the metadata's claim); every byte
item has a storage entry.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

from ...core.dtypes import ITEMSIZE, ShapedBytes
from ...core.problems import PROBLEM, UNSUPPORTED, WARNING, Finding, first_fatal
from ...io.inputs import is_plain_file_name
from ...io.pickle_scan import gc_paused
from .metadata import Dims, DtypeName

__all__ = [
    "PROBLEM",
    "UNSUPPORTED",
    "WARNING",
    "BytesEntry",
    "Chunk",
    "Entry",
    "Finding",
    "ParsedMetadata",
    "StorageLoc",
    "TensorEntry",
    "parse_metadata",
]

CORRUPT_HINT = "the metadata is corrupt or crafted; run `ckpt verify`"


class Chunk(NamedTuple):
    """One chunk of a tensor and where its item lies. A NamedTuple, not a frozen dataclass: a 32B
    checkpoint has ~14k of them, built on every open (a frozen dataclass's __init__ costs 4x)."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # relative path inside the checkpoint dir
    offset: int  # item start in the file
    length: int  # item length in bytes

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class TensorEntry(ShapedBytes):
    key: str
    path: tuple  # planner_data path, e.g. ('app', 'model', 'model.layers.0.mlp.up_proj.weight')
    dtype: str  # torch dtype name, e.g. "float32"
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @property
    def stored_bytes(self) -> int:
        return sum(c.length for c in self.chunks)

    @property
    def is_tensor(self) -> bool:
        return True

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(c.file for c in self.chunks)


@dataclass(frozen=True)
class BytesEntry:
    key: str
    path: tuple
    file: str
    offset: int
    length: int

    @property
    def stored_bytes(self) -> int:
        return self.length

    @property
    def nbytes(self) -> int:
        return 0

    @property
    def is_tensor(self) -> bool:
        return False

    @property
    def files(self) -> tuple[str, ...]:
        return (self.file,)


Entry = TensorEntry | BytesEntry


class StorageLoc(NamedTuple):
    file: str
    offset: int
    length: int


@dataclass
class ParsedMetadata:
    entries: dict[str, Entry] = field(default_factory=dict)  # every readable key, sorted
    findings: list[Finding] = field(default_factory=list)
    storage: dict[tuple, StorageLoc] = field(default_factory=dict)  # (fqn, offsets | None) -> where
    used: set[tuple] = field(default_factory=set)  # storage keys some item references
    located: list[tuple[str, Chunk | None, StorageLoc, str | None]] = field(
        default_factory=list
    )  # items, dtype
    counts: dict[str, int] = field(default_factory=dict)

    def fatal(self) -> Finding | None:
        """The first finding that makes the checkpoint unreadable here (warnings are not)."""
        return first_fatal(self.findings)


def _ints(x) -> tuple[int, ...]:
    """Dims as a tuple of ints. A `Dims` (a torch.Size the unpickler built) is one already."""
    return x if type(x) is Dims else tuple(map(int, x))


# The most storage keys (fqn, offsets) of one hash. An int's hash is the file's choice (k * (2**61 - 1)
# hashes to 0), so a crafted `.metadata` can give 10^4 chunks one hash, and indexing them would cost
# 10^8 comparisons; genuine keys collide only by 64-bit chance.
MAX_SHARED_HASHES = 16


def _index_storage(storage: dict, out: ParsedMetadata) -> bool:
    """`out.storage` from `storage_data`; False (one finding) where its keys were made to collide."""
    if _hashes_collide(storage, out):
        return False
    plain: dict[str, bool] = {}  # a checkpoint has one data file per rank and ~10^4 items in them
    for idx, info in storage.items():
        try:
            fqn = idx.fqn
            off = None if idx.offset is None else _ints(idx.offset)
            rel, offset, length = info.relative_path, int(info.offset), int(info.length)
        except Exception as exc:  # a damaged entry of the allowed classes
            out.findings.append(
                Finding(
                    None,
                    None,
                    f"malformed storage entry {idx!r}: {type(exc).__name__}: {exc}",
                    hint=CORRUPT_HINT,
                )
            )
            continue
        if _storage_loc_ok(fqn, info, rel, offset, length, plain, out):
            out.storage[(fqn, off)] = StorageLoc(rel, offset, length)
    return True


def _hashes_collide(storage: dict, out: ParsedMetadata) -> bool:
    """True (one finding) where more than MAX_SHARED_HASHES storage keys share another one's hash."""
    keys = []
    for idx in storage:
        try:
            keys.append(hash((idx.fqn, None if idx.offset is None else _ints(idx.offset))))
        except Exception:  # a damaged entry: _index_storage names it
            pass
    if len(keys) - len(set(keys)) <= MAX_SHARED_HASHES:
        return False
    out.findings.append(
        Finding(
            None,
            None,
            f"{len(keys) - len(set(keys)):,} storage entries share the hash of "
            "another one's (fqn, offsets): a crafted metadata (indexing them "
            "would take quadratic time)",
            hint=CORRUPT_HINT,
        )
    )
    return True


def _storage_loc_ok(
    fqn, info, rel, offset: int, length: int, plain: dict[str, bool], out: ParsedMetadata
) -> bool:
    """Whether a storage entry can be read: a plain file name of the checkpoint dir (`plain` caches the
    answer per name) and a non-negative range; a finding where not, and a warning for transforms."""
    if type(rel) is str:
        ok = plain.get(rel)
        if ok is None:
            ok = plain[rel] = is_plain_file_name(rel)
    else:
        ok = is_plain_file_name(rel)
    if not ok:
        out.findings.append(
            Finding(
                None,
                fqn,
                f"storage item points at {rel!r}, which is not a file name inside the checkpoint directory",
                hint="the metadata is corrupt or crafted; refusing to read outside the checkpoint",
            )
        )
        return False
    if offset < 0 or length < 0:
        out.findings.append(
            Finding(
                rel, fqn, f"storage item has negative offset/length ({offset}, {length})", hint=CORRUPT_HINT
            )
        )
        return False
    transforms = getattr(info, "transform_descriptors", None)
    if transforms:
        out.findings.append(
            Finding(
                rel,
                fqn,
                f"item uses transforms {list(transforms)} (compression?), which we do not read",
                severity=UNSUPPORTED,
            )
        )
    return True


def _overlaps(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], ndim: int) -> Iterable[tuple]:
    """Pairs of non-empty chunks that overlap: a sweep along dim 0 (only chunks whose row ranges meet
    are compared)."""
    boxes = sorted(boxes)
    for i, (oa, sa) in enumerate(boxes):
        for ob, sb in boxes[i + 1 :]:
            if ndim and ob[0] >= oa[0] + sa[0]:
                break
            if all(b0 < a0 + a1 and a0 < b0 + b1 for a0, a1, b0, b1 in zip(oa, sa, ob, sb)):
                yield oa, ob


def _coverage_message(covered: int, numel: int, shape: tuple, boxes) -> str:
    msg = f"chunks cover {covered} of {numel} elements"
    if shape and all(all(o == 0 for o in offs[1:]) and sz[1:] == shape[1:] for offs, sz in boxes):
        holes, pos = [], 0
        for offs, sz in sorted(boxes):
            if offs[0] > pos:
                holes.append(f"[{pos}, {offs[0]})")
            pos = max(pos, offs[0] + sz[0])
        if pos < shape[0]:
            holes.append(f"[{pos}, {shape[0]})")
        msg += f"; rows {', '.join(holes)} belong to no chunk"
    return msg + " (torch's loader would leave that region uninitialized, silently)"


def _dtype_name(value) -> str | None:
    """The dtype name of a metadata dtype, None if it is no dtype: the stand-ins carry `DtypeName`s (a
    plain str is not a dtype: torch's loader would not take one either); genuine torch metadata (an
    in-memory `Metadata` a caller built or unpickled itself) carries a `torch.dtype`, recognised by its
    type's name so that no torch import is needed."""
    if isinstance(value, DtypeName):
        return str(value)
    if type(value).__module__ == "torch" and type(value).__name__ == "dtype":
        return str(value).removeprefix("torch.")
    return None


def _bad(found: list[Finding], key: str, message: str, hint: str = CORRUPT_HINT) -> None:
    found.append(Finding(None, key, message, hint=hint))


def _tensor(key: str, path: tuple, item, out: ParsedMetadata) -> TensorEntry | None:
    found = out.findings
    n0 = len(found)
    raw_dtype = getattr(item.properties, "dtype", None)
    dtype = _dtype_name(raw_dtype)
    if dtype is None or dtype not in ITEMSIZE:
        _bad(found, key, f"dtype {raw_dtype!r} is not a torch dtype")
        return None
    shape = _ints(item.size)
    if shape and min(shape) < 0:
        _bad(found, key, f"tensor shape {list(shape)} has a negative dimension")
        return None
    chunks, boxes, covered = _locate_chunks(key, item.chunks, dtype, shape, out)
    overlap = False
    if len(boxes) > 1:
        for oa, ob in _overlaps(boxes, len(shape)):
            _bad(found, key, f"chunks at offsets {list(oa)} and {list(ob)} overlap")
            overlap = True
    if not overlap and covered != math.prod(shape):
        _bad(found, key, _coverage_message(covered, math.prod(shape), shape, boxes))
    if len(found) > n0:
        return None
    return TensorEntry(key, path, dtype, shape, tuple(chunks))


def _locate_chunks(
    key: str, item_chunks, dtype: str, shape: tuple[int, ...], out: ParsedMetadata
) -> tuple[list[Chunk], list[tuple[tuple[int, ...], tuple[int, ...]]], int]:
    """Each chunk of a tensor checked (dims, inside the tensor, a storage entry that holds its bytes) and
    located: (its chunks, the (offsets, sizes) of the non-empty ones, the elements they cover). A
    finding for each chunk that fails; the located ones are recorded in `out.used` and `out.located`."""
    found, storage, used, located = out.findings, out.storage, out.used, out.located
    ndim, itemsize = len(shape), ITEMSIZE[dtype]
    chunks: list[Chunk] = []
    boxes = []
    covered = 0
    for ch in item_chunks:
        offs, sizes = _ints(ch.offsets), _ints(ch.sizes)
        if len(offs) != ndim or len(sizes) != ndim:
            _bad(
                found,
                key,
                f"chunk offsets {list(offs)} / sizes {list(sizes)} do not match the tensor's {len(shape)} "
                f"dims",
            )
            continue
        # (map over operator's functions: the same test as a generator over zip, in C, per chunk)
        if ndim and (
            min(sizes) < 0
            or (
                0 not in sizes
                and (min(offs) < 0 or any(map(operator.gt, map(operator.add, offs, sizes), shape)))
            )
        ):
            _bad(
                found,
                key,
                f"chunk at offsets {list(offs)} sizes {list(sizes)} lies outside the tensor's size "
                f"{list(shape)}",
            )
            continue
        where = (key, offs)
        loc = storage.get(where)
        numel = math.prod(sizes)
        if loc is None:
            _bad(found, key, f"chunk at offsets {list(offs)} has no storage entry")
        else:
            used.add(where)
            need = numel * itemsize
            chunk = Chunk(offs, sizes, loc.file, loc.offset, loc.length)
            chunks.append(chunk)
            if loc.length < need:
                _bad(
                    found,
                    key,
                    f"chunk at offsets {list(offs)} declares {list(sizes)} torch.{dtype} ({need:,} bytes) "
                    f"but its "
                    f"item holds {loc.length:,} bytes: an expanded (stride-0) or crafted item",
                    hint="the metadata is corrupt or crafted; refusing to allocate by its claim",
                )
            else:
                located.append((key, chunk, loc, dtype))
        if numel:
            boxes.append((offs, sizes))
            covered += numel
    return chunks, boxes, covered


def parse_metadata(md) -> ParsedMetadata:
    """Every entry of `md` and every finding (see the module docstring). Never raises on a malformed
    Metadata of the allowed classes: what cannot be read is a finding. Runs with the cyclic GC paused
    (`gc_paused`): a 32B checkpoint's entries and chunks are ~10^5 acyclic objects, and each collection
    they trigger would walk the ~10^6 objects of the metadata they are made from."""
    with gc_paused():
        return _parse(md)


def _parse(md) -> ParsedMetadata:
    out = ParsedMetadata()
    sdm = getattr(md, "state_dict_metadata", None)
    storage = getattr(md, "storage_data", None)
    planner = getattr(md, "planner_data", None) or {}
    if not isinstance(sdm, dict) or not isinstance(storage, dict) or not isinstance(planner, dict):
        out.findings.append(
            Finding(
                None,
                None,
                "malformed metadata: state_dict_metadata / storage_data / planner_data are not dicts",
                hint=CORRUPT_HINT,
            )
        )
        return out
    if not _index_storage(storage, out):
        return out
    counts = {"keys": len(sdm), "tensors": 0, "byte_items": 0}
    keys = list(sdm)
    if all(type(k) is str for k in keys):
        keys.sort()
    else:
        keys.sort(key=str)
    for key in keys:
        entry = _entry(key, sdm[key], planner, out, counts)
        if entry is not None:
            out.entries[key] = entry
    for fqn, off in sorted(set(out.storage) - out.used, key=lambda t: (str(t[0]), t[1] or ())):
        out.findings.append(
            Finding(
                out.storage[(fqn, off)].file,
                fqn,
                f"storage item at offsets {list(off) if off is not None else None} is referenced "
                "by no chunk in state_dict_metadata (orphaned: its data is never loaded)",
                severity=WARNING,
            )
        )
    out.counts = counts
    return out


def _entry(key, item, planner: dict, out: ParsedMetadata, counts: dict[str, int]) -> Entry | None:
    """The entry of one key of state_dict_metadata, None where it cannot be read (a finding says why);
    `counts` counts its kind."""
    if not isinstance(key, str):
        out.findings.append(Finding(None, repr(key), "key is not a string", hint=CORRUPT_HINT))
        return None
    if key not in planner:
        out.findings.append(
            Finding(
                None,
                key,
                "no planner_data entry (DCP's key-filtered loads fail on such keys)",
                severity=WARNING,
            )
        )
    path = tuple(planner.get(key) or ())
    try:
        if hasattr(item, "chunks"):
            counts["tensors"] += 1
            return _tensor(key, path, item, out)
        if type(item).__name__ == "BytesStorageMetadata":
            counts["byte_items"] += 1
            loc = out.storage.get((key, None))
            if loc is None:
                out.findings.append(Finding(None, key, "byte item has no storage entry", hint=CORRUPT_HINT))
                return None
            out.used.add((key, None))
            out.located.append((key, None, loc, None))
            return BytesEntry(key, path, loc.file, loc.offset, loc.length)
        out.findings.append(Finding(None, key, f"unknown item type {type(item).__name__}", hint=CORRUPT_HINT))
    except Exception as exc:  # a damaged item of the allowed classes
        out.findings.append(
            Finding(None, key, f"cannot check: {type(exc).__name__}: {exc}", hint=CORRUPT_HINT)
        )
    return None
