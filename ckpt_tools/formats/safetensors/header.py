"""Safetensors headers: the layout of a file, validated before a byte of tensor data is read.

Here, the header: `read_header` parses and validates it without trusting it (every range is checked
against the file before any tensor byte is read). `formats.safetensors.read` reads tensors by range,
`formats.safetensors.writer` writes files whose whole layout is fixed up front.

File layout (what `safetensors` 0.8 itself writes and checks, see its `tensor.rs`):
  8-byte little-endian u64 N | N bytes of JSON header, space-padded to a multiple of 8 | data.
  The JSON is compact (no spaces); `__metadata__` (if any) comes first, then the tensors in data
  order, each `{"dtype":..,"shape":[..],"data_offsets":[begin,end]}` with offsets relative to the
  start of the data area. The data area is covered contiguously, without gaps or trailing bytes.
`save_file` orders tensors by dtype (the rank of its `Dtype` enum, descending) then by name;
`safetensors_save_order` reproduces that, and with at most one metadata entry our bytes are then
identical to `save_file`'s. (With 2+ metadata entries `save_file` is itself not deterministic:
it serializes a Rust HashMap. We sort metadata keys.)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from ...core.dtypes import SAFETENSORS, torch_dtype
from ...core.errors import CkptError, FormatError, TruncatedFileError
from ...io.inputs import MAX_TABLE_VALUES, as_input, close_input, is_url, open_input, reader_size
from ...io.pread import RangeReader, pread_into

__all__ = [
    "LEN_BYTES",
    "MAX_HEADER_BYTES",
    "ByteCounter",
    "OpenedFile",
    "SafetensorsHeader",
    "Source",
    "TensorInfo",
    "is_int",
    "parse_header",
    "read_header",
    "require_little_endian",
]

# safetensors refuses headers above this (MAX_HEADER_SIZE in tensor.rs); so do we, before
# allocating anything for a length field that may be garbage.
MAX_HEADER_BYTES = 100_000_000
LEN_BYTES = 8


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes lie. `begin` is an absolute offset in `path`."""

    name: str
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int
    nbytes: int
    path: Path

    @property
    def end(self) -> int:
        return self.begin + self.nbytes

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.shape[0] if self.shape and self.shape[0] else 0

    def rows(self, start: int, count: int) -> TensorInfo:
        """The TensorInfo of rows [start, start + count) (one contiguous range of the row-major data)."""
        return dataclasses.replace(
            self,
            shape=(count,) + tuple(self.shape[1:]),
            begin=self.begin + start * self.row_bytes,
            nbytes=count * self.row_bytes,
        )

    @property
    def dtype_name(self) -> str:
        """The torch dtype name ("bfloat16") of the safetensors code."""
        return SAFETENSORS[self.dtype].name

    @property
    def torch_dtype(self):
        return torch_dtype(self.dtype_name)


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    metadata: dict[str, str]  # `__metadata__`, {} when absent
    tensors: dict[str, TensorInfo]  # in file (data offset) order
    data_start: int  # absolute offset of the data area = 8 + header_bytes
    file_bytes: int

    @property
    def header_bytes(self) -> int:
        return self.data_start - LEN_BYTES

    @property
    def data_bytes(self) -> int:
        return self.file_bytes - self.data_start


class ByteCounter:
    """Counts tensor bytes actually read from disk (tests use it to prove what was not read)."""

    def __init__(self) -> None:
        self.bytes_read = 0
        self.reads = 0

    def add(self, nbytes: int) -> None:
        self.bytes_read += nbytes
        self.reads += 1

    def __repr__(self) -> str:
        return f"ByteCounter(bytes_read={self.bytes_read}, reads={self.reads})"


Source = int | RangeReader | str | os.PathLike | None


def require_little_endian() -> None:
    # safetensors data is little-endian; we view bytes as tensors without swapping.
    if sys.byteorder != "little":
        raise CkptError("big-endian hosts are not supported (safetensors data is little-endian)")


class OpenedFile:
    """An fd for a read: the caller's (left open) or one we open from a path (closed after)."""

    def __init__(self, source: Source, default_path: Path):
        # a path (or URL) is opened here; a reader (an fd, a remote object) is the caller's
        self.owned = isinstance(source, (str, os.PathLike)) or source is None or is_url(source)
        self.fd: int | RangeReader
        if not self.owned:
            self.path = default_path
            self.fd = cast("int | RangeReader", source)
        else:
            self.path = as_input(source) if source is not None else default_path
            # a shard belongs to its directory (an HF cache snapshot's to the repo's cache dir): a
            # symlink out of it, a FIFO, a device or a sparse file is refused before it is opened
            self.fd = open_input(self.path, root=self.path.parent, what="safetensors file")

    def __enter__(self) -> int | RangeReader:
        return self.fd

    def __exit__(self, *exc) -> None:
        if self.owned:
            close_input(self.fd)


def _header_error(path, message, key=None, truncated=False):
    cls = TruncatedFileError if truncated else FormatError
    return cls(
        message,
        path=path,
        key=key,
        hint="the file is corrupt or not safetensors; re-download or re-export it",
    )


def _reject_duplicate_keys(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Parse and validate a safetensors header; reads only the header bytes.

    Raises FormatError (TruncatedFileError when the file is shorter than the header promises)
    naming the file and, where one is at fault, the tensor key."""
    path = as_input(path)
    with OpenedFile(path, path) as fd:
        file_bytes = reader_size(fd)
        if file_bytes < LEN_BYTES:
            raise _header_error(
                path, f"file is {file_bytes} bytes, too short for the 8-byte header length", truncated=True
            )
        prefix = bytearray(LEN_BYTES)
        pread_into(fd, prefix, 0, path=path)
        (n,) = struct.unpack("<Q", prefix)
        if n > MAX_HEADER_BYTES:
            raise _header_error(
                path, f"header length field says {n} bytes, above the {MAX_HEADER_BYTES}-byte limit"
            )
        if n > file_bytes - LEN_BYTES:
            raise _header_error(
                path,
                f"header length field says {n} bytes but the file holds only "
                f"{file_bytes - LEN_BYTES} after it",
                truncated=True,
            )
        raw = bytearray(n)
        pread_into(fd, raw, LEN_BYTES, path=path)
    return parse_header(bytes(raw), path=path, file_bytes=file_bytes)


def parse_header(raw: bytes, *, path: Path, file_bytes: int) -> SafetensorsHeader:
    """Validate header JSON `raw` (the N bytes after the length field) of a file of `file_bytes`."""
    data_start = LEN_BYTES + len(raw)
    data_bytes = file_bytes - data_start
    obj = _header_object(raw, path)
    metadata = obj.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _header_error(path, "__metadata__ must map strings to strings", key="__metadata__")
    parsed = _tensor_spans(obj, path)
    # File order; ties (only possible between empty tensors and their neighbour) keep JSON order.
    parsed.sort(key=lambda t: (t[0], t[1], t[2]))
    _check_data_area(parsed, data_bytes, path)
    tensors = {
        name: TensorInfo(
            name=name, dtype=code, shape=shape, begin=data_start + begin, nbytes=end - begin, path=path
        )
        for begin, end, _, name, code, shape in parsed
    }
    return SafetensorsHeader(
        path=path, metadata=dict(metadata), tensors=tensors, data_start=data_start, file_bytes=file_bytes
    )


def _header_object(raw: bytes, path: Path) -> dict:
    """The header's JSON object: UTF-8, its values bounded before it is parsed, no duplicate key."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _header_error(path, f"header is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if not text.lstrip().startswith("{"):
        raise _header_error(path, "header is not a JSON object")
    n_values = text.count("{") + text.count("[") + text.count(",")
    if n_values > MAX_TABLE_VALUES:  # parsing costs ~140 bytes of RSS per value: bounded before it
        raise _header_error(
            path,
            f"header could hold {n_values:,} JSON values, far more than a header of tensors "
            f"(the limit is {MAX_TABLE_VALUES:,})",
        )
    try:
        obj = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
    except (ValueError, RecursionError) as e:  # RecursionError: absurdly nested JSON
        raise _header_error(path, f"header is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise _header_error(path, "header is not a JSON object")
    return obj


def _tensor_spans(obj: dict, path: Path) -> list[tuple[int, int, int, str, str, tuple[int, ...]]]:
    """(begin, end, JSON position, name, dtype code, shape) of each tensor entry, in JSON order, each
    entry checked: a known dtype, a shape of non-negative ints, data_offsets that span its bytes."""
    parsed = []
    for pos, (name, spec) in enumerate(obj.items()):
        if not isinstance(spec, dict):
            raise _header_error(path, "tensor entry is not a JSON object", key=name)
        for field in ("dtype", "shape", "data_offsets"):
            if field not in spec:
                raise _header_error(path, f"tensor entry has no {field!r}", key=name)
        code, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
        if not isinstance(code, str) or code not in SAFETENSORS:
            raise _header_error(path, f"unknown dtype {code!r} (known: {', '.join(SAFETENSORS)})", key=name)
        if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
            raise _header_error(path, f"shape {shape!r} is not a list of non-negative integers", key=name)
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(is_int(o) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise _header_error(
                path, f"data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end", key=name
            )
        need = math.prod(shape) * SAFETENSORS[code].itemsize
        if offsets[1] - offsets[0] != need:
            raise _header_error(
                path,
                f"data_offsets {offsets} span {offsets[1] - offsets[0]} bytes but "
                f"shape {shape} of {code} needs {need}",
                key=name,
            )
        parsed.append((offsets[0], offsets[1], pos, name, code, tuple(shape)))
    return parsed


def _check_data_area(
    parsed: list[tuple[int, int, int, str, str, tuple[int, ...]]], data_bytes: int, path: Path
) -> None:
    """The tensors (in file order) cover the data area of `data_bytes` exactly: none past its end, no
    overlap, no gap, no trailing bytes (safetensors' own rules)."""
    promised = max((t[1] for t in parsed), default=0)
    if promised > data_bytes:
        first_past = next(t for t in parsed if t[1] > data_bytes)
        raise _header_error(
            path,
            f"header promises {promised} bytes of tensor data, file holds {data_bytes} "
            f"(tensor ends at data byte {first_past[1]}); the shard is truncated",
            key=first_past[3],
            truncated=True,
        )
    expected = 0
    prev = None
    for begin, end, _, name, _, _ in parsed:
        if begin < expected:
            raise _header_error(
                path,
                f"data_offsets [{begin}, {end}] overlap tensor {prev!r} (which ends at {expected})",
                key=name,
            )
        if begin > expected:
            after = f" after tensor {prev!r}" if prev is not None else " at the start of the data area"
            raise _header_error(
                path,
                f"gap: data bytes [{expected}, {begin}){after} belong to no tensor "
                "(safetensors rejects such files)",
                key=name,
            )
        expected = end
        prev = name
    if expected != data_bytes:
        raise _header_error(
            path,
            f"{data_bytes - expected} trailing bytes after the last tensor (safetensors rejects such files)",
        )
