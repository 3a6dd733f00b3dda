"""Safetensors, read and written by us, one tensor (or one block of one tensor) in flight.

Reading: `read_header` parses and validates the header without trusting it (every range is checked
against the file before any tensor byte is read); `read_tensor` / `read_raw` read exactly one
tensor's byte range with `os.preadv`. Nothing is mmapped, so page cache pressure, not our RSS, is
what a 100 GB model costs.

Writing: `StreamingSafetensorsWriter` computes the whole header from the declared entries, then
takes each tensor's bytes whole (`write`) or in blocks (`write_chunk`, used by `copy_raw`).

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

import ctypes
import json
import math
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence, Union

import torch

from ..atomic import create_new
from ..errors import CkptError, FormatError, OutputExistsError, TruncatedFileError
from ..inputs import open_input

__all__ = [
    "DTYPES", "DTypeSpec", "TensorInfo", "SafetensorsHeader", "ByteCounter", "WriteEntry",
    "read_header", "parse_header", "read_tensor", "read_raw", "dtype_code", "torch_dtype", "build_header",
    "safetensors_save_order", "StreamingSafetensorsWriter", "copy_raw",
    "MAX_HEADER_BYTES", "COPY_BLOCK_BYTES",
]

# safetensors refuses headers above this (MAX_HEADER_SIZE in tensor.rs); so do we, before
# allocating anything for a length field that may be garbage.
MAX_HEADER_BYTES = 100_000_000
# Block size for verbatim copies: bounded memory however large one tensor is (a 2 GB embedding
# costs 64 MB of RAM), large enough that syscall overhead is noise.
COPY_BLOCK_BYTES = 64 * 2**20
_LEN_BYTES = 8
# Linux moves at most 0x7ffff000 bytes per read/write call; larger requests come back short.
_MAX_IO_BYTES = 0x7FFFF000


@dataclass(frozen=True)
class DTypeSpec:
    code: str                  # the safetensors spelling, e.g. "BF16"
    itemsize: int              # bytes per element
    rank: int                  # position in safetensors' Dtype enum (save_file sorts by it, descending)
    torch_dtype: torch.dtype


def _dtype_table() -> dict[str, DTypeSpec]:
    # (code, itemsize, torch attribute). Listed in the order of safetensors' Dtype enum: that order
    # is the `rank` save_file sorts by. Sub-byte codes (F4, F6_*) are absent: torch has no
    # per-element dtype for them, so we cannot read or check them.
    rows = [
        ("BOOL", 1, "bool"), ("U8", 1, "uint8"), ("I8", 1, "int8"),
        ("F8_E5M2", 1, "float8_e5m2"), ("F8_E4M3", 1, "float8_e4m3fn"), ("F8_E8M0", 1, "float8_e8m0fnu"),
        ("I16", 2, "int16"), ("U16", 2, "uint16"), ("F16", 2, "float16"), ("BF16", 2, "bfloat16"),
        ("I32", 4, "int32"), ("U32", 4, "uint32"), ("F32", 4, "float32"),
        ("C64", 8, "complex64"), ("F64", 8, "float64"), ("I64", 8, "int64"), ("U64", 8, "uint64"),
    ]
    table = {}
    for rank, (code, itemsize, attr) in enumerate(rows):
        dt = getattr(torch, attr, None)
        if dt is not None:  # older torch lacks some (uint16/32/64 < 2.3, float8_e8m0fnu < 2.7)
            table[code] = DTypeSpec(code, itemsize, rank, dt)
    return table


DTYPES: dict[str, DTypeSpec] = _dtype_table()
_CODE_BY_TORCH: dict[torch.dtype, str] = {s.torch_dtype: s.code for s in DTYPES.values()}


def dtype_code(dtype: torch.dtype | str) -> str:
    """The safetensors code ("BF16") for a torch dtype, or a code validated as known."""
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise FormatError(f"unknown safetensors dtype {dtype!r} (known: {', '.join(DTYPES)})")
        return dtype
    try:
        return _CODE_BY_TORCH[dtype]
    except KeyError:
        raise FormatError(f"torch dtype {dtype} has no safetensors code",
                          hint="convert the tensor to a supported dtype first") from None


def torch_dtype(code: str) -> torch.dtype:
    return DTYPES[dtype_code(code)].torch_dtype


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes lie. `begin` is an absolute offset in `path`."""
    name: str
    dtype: str                 # safetensors code, e.g. "BF16"
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
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype].torch_dtype


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    metadata: dict[str, str]           # `__metadata__`, {} when absent
    tensors: dict[str, TensorInfo]     # in file (data offset) order
    data_start: int                    # absolute offset of the data area = 8 + header_bytes
    file_bytes: int

    @property
    def header_bytes(self) -> int:
        return self.data_start - _LEN_BYTES

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


# --------------------------------------------------------------------------------------------
# reading

Source = Union[int, str, os.PathLike, None]


def _require_little_endian() -> None:
    # safetensors data is little-endian; we view bytes as tensors without swapping.
    if sys.byteorder != "little":
        raise CkptError("big-endian hosts are not supported (safetensors data is little-endian)")


def _pread_into(fd: int, buf: memoryview, offset: int, *, path, key: str | None = None) -> None:
    """Fill `buf` from `fd` at `offset`, looping over short reads; EOF before full is truncation."""
    done = 0
    total = len(buf)
    while done < total:
        n = os.preadv(fd, [buf[done:done + _MAX_IO_BYTES]], offset + done)
        if n == 0:
            raise TruncatedFileError(
                f"file ended at byte {offset + done} while reading bytes [{offset}, {offset + total}); "
                "it shrank or was truncated after its header was read", path=path, key=key,
                hint="re-copy or re-download the file")
        done += n


class _Fd:
    """An fd for a read: the caller's (left open) or one we open from a path (closed after)."""

    def __init__(self, source: Source, default_path: Path):
        self.owned = not isinstance(source, int)
        if self.owned:
            self.path = Path(source) if source is not None else default_path
            # a shard belongs to its directory (an HF cache snapshot's to the repo's cache dir): a
            # symlink out of it, a FIFO, a device or a sparse file is refused before it is opened
            self.fd = open_input(self.path, root=self.path.parent, what="safetensors file")
        else:
            self.path = default_path
            self.fd = source

    def __enter__(self) -> int:
        return self.fd

    def __exit__(self, *exc) -> None:
        if self.owned:
            os.close(self.fd)


def _header_error(path, message, key=None, truncated=False):
    cls = TruncatedFileError if truncated else FormatError
    return cls(message, path=path, key=key,
               hint="the file is corrupt or not safetensors; re-download or re-export it")


def _reject_duplicate_keys(pairs):
    out = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def read_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Parse and validate a safetensors header; reads only the header bytes.

    Raises FormatError (TruncatedFileError when the file is shorter than the header promises)
    naming the file and, where one is at fault, the tensor key."""
    path = Path(path)
    with _Fd(path, path) as fd:
        file_bytes = os.fstat(fd).st_size
        if file_bytes < _LEN_BYTES:
            raise _header_error(path, f"file is {file_bytes} bytes, too short for the 8-byte header length",
                                truncated=True)
        prefix = bytearray(_LEN_BYTES)
        _pread_into(fd, memoryview(prefix), 0, path=path)
        (n,) = struct.unpack("<Q", prefix)
        if n > MAX_HEADER_BYTES:
            raise _header_error(path, f"header length field says {n} bytes, above the {MAX_HEADER_BYTES}-byte limit")
        if n > file_bytes - _LEN_BYTES:
            raise _header_error(path, f"header length field says {n} bytes but the file holds only "
                                      f"{file_bytes - _LEN_BYTES} after it", truncated=True)
        raw = bytearray(n)
        _pread_into(fd, memoryview(raw), _LEN_BYTES, path=path)
    return parse_header(bytes(raw), path=path, file_bytes=file_bytes)


def parse_header(raw: bytes, *, path: Path, file_bytes: int) -> SafetensorsHeader:
    """Validate header JSON `raw` (the N bytes after the length field) of a file of `file_bytes`."""
    data_start = _LEN_BYTES + len(raw)
    data_bytes = file_bytes - data_start
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _header_error(path, f"header is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if not text.lstrip().startswith("{"):
        raise _header_error(path, "header is not a JSON object")
    try:
        obj = json.loads(text, object_pairs_hook=_reject_duplicate_keys)
    except (ValueError, RecursionError) as e:  # RecursionError: absurdly nested JSON
        raise _header_error(path, f"header is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise _header_error(path, "header is not a JSON object")

    metadata = obj.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _header_error(path, "__metadata__ must map strings to strings", key="__metadata__")

    parsed = []  # (begin, end, json position, name, code, shape)
    for pos, (name, spec) in enumerate(obj.items()):
        if not isinstance(spec, dict):
            raise _header_error(path, "tensor entry is not a JSON object", key=name)
        for field in ("dtype", "shape", "data_offsets"):
            if field not in spec:
                raise _header_error(path, f"tensor entry has no {field!r}", key=name)
        code, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
        if not isinstance(code, str) or code not in DTYPES:
            raise _header_error(path, f"unknown dtype {code!r} (known: {', '.join(DTYPES)})", key=name)
        if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
            raise _header_error(path, f"shape {shape!r} is not a list of non-negative integers", key=name)
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise _header_error(path, f"data_offsets {offsets!r} is not [begin, end] with 0 <= begin <= end",
                                key=name)
        need = math.prod(shape) * DTYPES[code].itemsize
        if offsets[1] - offsets[0] != need:
            raise _header_error(path, f"data_offsets {offsets} span {offsets[1] - offsets[0]} bytes but "
                                      f"shape {shape} of {code} needs {need}", key=name)
        parsed.append((offsets[0], offsets[1], pos, name, code, tuple(shape)))

    # File order; ties (only possible between empty tensors and their neighbour) keep JSON order.
    parsed.sort(key=lambda t: (t[0], t[1], t[2]))
    promised = max((t[1] for t in parsed), default=0)
    if promised > data_bytes:
        first_past = next(t for t in parsed if t[1] > data_bytes)
        raise _header_error(path, f"header promises {promised} bytes of tensor data, file holds {data_bytes} "
                                  f"(tensor ends at data byte {first_past[1]}); the shard is truncated",
                            key=first_past[3], truncated=True)
    expected = 0
    prev = None
    for begin, end, _, name, _, _ in parsed:
        if begin < expected:
            raise _header_error(path, f"data_offsets [{begin}, {end}] overlap tensor {prev!r} "
                                      f"(which ends at {expected})", key=name)
        if begin > expected:
            after = f" after tensor {prev!r}" if prev is not None else " at the start of the data area"
            raise _header_error(path, f"gap: data bytes [{expected}, {begin}){after} belong to no tensor "
                                      "(safetensors rejects such files)", key=name)
        expected = end
        prev = name
    if expected != data_bytes:
        raise _header_error(path, f"{data_bytes - expected} trailing bytes after the last tensor "
                                  "(safetensors rejects such files)")

    tensors = {name: TensorInfo(name=name, dtype=code, shape=shape, begin=data_start + begin,
                                nbytes=end - begin, path=path)
               for begin, end, _, name, code, shape in parsed}
    return SafetensorsHeader(path=path, metadata=dict(metadata), tensors=tensors,
                             data_start=data_start, file_bytes=file_bytes)


def read_raw(info: TensorInfo, source: Source = None, *, counter: ByteCounter | None = None) -> bytearray:
    """Exactly the bytes of `info` (a fresh buffer). `source`: an open fd (left open), a path, or
    None for `info.path`."""
    buf = bytearray(info.nbytes)
    if info.nbytes:
        with _Fd(source, info.path) as fd:
            _pread_into(fd, memoryview(buf), info.begin, path=info.path, key=info.name)
    if counter is not None:
        counter.add(info.nbytes)
    return buf


def read_tensor(info: TensorInfo, source: Source = None, *, counter: ByteCounter | None = None) -> torch.Tensor:
    """A new CPU tensor (owning its memory) holding `info`'s bytes; nothing is cached."""
    _require_little_endian()
    dtype = info.torch_dtype
    if info.nbytes == 0:
        # torch.frombuffer rejects empty buffers
        if counter is not None:
            counter.add(0)
        return torch.empty(info.shape, dtype=dtype)
    buf = read_raw(info, source, counter=counter)
    return torch.frombuffer(buf, dtype=dtype).reshape(info.shape)


# --------------------------------------------------------------------------------------------
# writing


@dataclass(frozen=True)
class WriteEntry:
    """One declared tensor of a file being written; `begin` is relative to the data area."""
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    nbytes: int


EntrySpec = tuple  # (name, dtype code or torch.dtype, shape)


def safetensors_save_order(entries: Iterable[EntrySpec]) -> list[EntrySpec]:
    """`entries` in the order `safetensors.torch.save_file` lays tensors out: dtype rank descending
    (wider dtypes first), then name. Python's str order equals Rust's byte order for UTF-8."""
    return sorted(entries, key=lambda e: (-DTYPES[dtype_code(e[1])].rank, e[0]))


def _layout(entries: Sequence[EntrySpec]) -> list[WriteEntry]:
    out: list[WriteEntry] = []
    seen: set[str] = set()
    offset = 0
    for e in entries:
        if len(e) != 3:
            raise ValueError(f"entry {e!r} is not (name, dtype, shape)")
        name, dtype, shape = e
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor name {name!r} is not a non-empty string")
        if name == "__metadata__":
            raise ValueError("'__metadata__' is reserved by safetensors and cannot name a tensor")
        if name in seen:
            raise ValueError(f"tensor {name!r} is declared twice")
        seen.add(name)
        shape = tuple(shape)
        if not all(_is_int(d) and d >= 0 for d in shape):
            raise ValueError(f"tensor {name!r}: shape {shape!r} is not non-negative integers")
        code = dtype_code(dtype)
        nbytes = math.prod(shape) * DTYPES[code].itemsize
        out.append(WriteEntry(name, code, shape, offset, nbytes))
        offset += nbytes
    return out


def build_header(entries: Sequence[EntrySpec], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length + padded JSON header for `entries` laid out in the given order."""
    return _header_bytes(_layout(entries), metadata)


def _header_bytes(layout: Sequence[WriteEntry], metadata: dict[str, str] | None) -> bytes:
    def dumps(x) -> str:
        # serde_json's compact form: same separators, no ASCII escaping, same control escapes.
        return json.dumps(x, separators=(",", ":"), ensure_ascii=False)

    parts = []
    if metadata is not None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError("safetensors metadata must map strings to strings")
        parts.append('"__metadata__":' + dumps(dict(sorted(metadata.items()))))
    for e in layout:
        parts.append(f'{dumps(e.name)}:{{"dtype":"{e.dtype}","shape":{dumps(list(e.shape))},'
                     f'"data_offsets":[{e.begin},{e.begin + e.nbytes}]}}')
    body = ("{" + ",".join(parts) + "}").encode("utf-8")
    body += b" " * (-len(body) % 8)  # safetensors pads with spaces so the data area is 8-aligned
    return struct.pack("<Q", len(body)) + body


def _tensor_bytes(t: torch.Tensor) -> tuple[memoryview, torch.Tensor]:
    """A zero-copy byte view of contiguous CPU tensor `t` (returned with the tensor that owns it)."""
    if t.device.type != "cpu":
        t = t.cpu()
    n = t.numel() * t.element_size()
    raw = (ctypes.c_ubyte * n).from_address(t.data_ptr())
    return memoryview(raw).cast("B"), t


class StreamingSafetensorsWriter:
    """Writes one safetensors file whose layout is fixed up front by `entries` (kept in the given
    order: callers decide it, e.g. with `safetensors_save_order`).

    `write(name, tensor_or_bytes)` supplies a whole tensor, `write_chunk(name, buf)` the next
    block of one. With `strict_order` (default) tensors must come in declared order; otherwise
    any order is accepted (each block goes to its precomputed offset) but each tensor's blocks
    are still sequential. `close()` checks every byte was written, fsyncs and closes; leaving a
    `with` block by exception (or `abort()`) deletes the partial file.

    The file is created exclusively: an existing file is never overwritten."""

    def __init__(self, path: str | os.PathLike, entries: Sequence[EntrySpec],
                 metadata: dict[str, str] | None = None, *, strict_order: bool = True, fsync: bool = True):
        _require_little_endian()
        self.path = Path(path)
        self.entries: tuple[WriteEntry, ...] = tuple(_layout(entries))
        self._by_name = {e.name: i for i, e in enumerate(self.entries)}
        self._header = _header_bytes(self.entries, metadata)
        self.data_start = len(self._header)
        self.file_bytes = self.data_start + sum(e.nbytes for e in self.entries)
        self.strict_order = strict_order
        self._fsync = fsync
        self._written = [0] * len(self.entries)   # bytes written per entry
        self._complete = [False] * len(self.entries)
        self._next = 0                            # strict order: first entry not complete
        self._closed = False
        try:
            self._fd = create_new(self.path)
        except FileExistsError:
            raise OutputExistsError("refusing to overwrite an existing file", path=self.path,
                            hint="write into a fresh directory") from None
        try:
            self._pwrite(memoryview(self._header), 0)
        except BaseException:
            self.abort()
            raise

    # -- internals
    def _error(self, message: str, key: str | None = None, hint: str | None = None) -> FormatError:
        return FormatError(message, path=self.path, key=key, hint=hint)

    def _pwrite(self, buf: memoryview, offset: int) -> None:
        done = 0
        while done < len(buf):
            done += os.pwrite(self._fd, buf[done:done + _MAX_IO_BYTES], offset + done)

    def _entry_for_write(self, name: str) -> int:
        if self._closed:
            raise self._error("write after close", key=name)
        i = self._by_name.get(name)
        if i is None:
            raise self._error("tensor was not declared when the file was opened", key=name)
        if self._complete[i]:
            raise self._error("tensor was already written completely", key=name)
        if self.strict_order and i != self._next:
            expected = self.entries[self._next].name if self._next < len(self.entries) else None
            raise self._error(f"written out of order: expected {expected!r} next", key=name)
        return i

    def _advance(self, i: int) -> None:
        self._complete[i] = self._written[i] == self.entries[i].nbytes
        while self._next < len(self.entries) and self._complete[self._next]:
            self._next += 1

    # -- public
    def write_chunk(self, name: str, buf) -> None:
        """Append the next block of tensor `name` (any bytes-like object)."""
        i = self._entry_for_write(name)
        e = self.entries[i]
        mv = memoryview(buf).cast("B")
        if self._written[i] + len(mv) > e.nbytes:
            raise self._error(f"{self._written[i] + len(mv)} bytes supplied, declared size is {e.nbytes}", key=name)
        self._pwrite(mv, self.data_start + e.begin + self._written[i])
        self._written[i] += len(mv)
        self._advance(i)

    def write(self, name: str, data) -> None:
        """Write tensor `name` whole: a torch.Tensor (dtype and shape must match the declaration;
        contiguous) or bytes-like of exactly the declared size."""
        i = self._entry_for_write(name)
        e = self.entries[i]
        if self._written[i]:
            raise self._error("tensor was partly written with write_chunk; finish it with write_chunk", key=name)
        if isinstance(data, torch.Tensor):
            code = _CODE_BY_TORCH.get(data.dtype)
            if code != e.dtype:
                raise self._error(f"declared {e.dtype}, got a tensor of {data.dtype}", key=name)
            if tuple(data.shape) != e.shape:
                raise self._error(f"declared shape {list(e.shape)}, got {list(data.shape)}", key=name)
            if data.layout != torch.strided or not data.is_contiguous():
                raise self._error("tensor is not contiguous", key=name,
                                  hint="call `.contiguous()` on it before writing")
            if e.nbytes == 0:
                self._advance(i)
                return
            mv, _keepalive = _tensor_bytes(data)  # _keepalive owns mv's memory until we return
        else:
            mv = memoryview(data).cast("B")
            if len(mv) != e.nbytes:
                raise self._error(f"{len(mv)} bytes supplied, declared size is {e.nbytes}", key=name)
            if e.nbytes == 0:
                self._advance(i)
                return
        self.write_chunk(name, mv)

    @property
    def missing(self) -> list[str]:
        """Declared tensors not (completely) written yet."""
        return [e.name for e, done in zip(self.entries, self._complete) if not done]

    def close(self) -> None:
        """Verify every declared byte was written, fsync, close. Idempotent."""
        if self._closed:
            return
        missing = self.missing
        if missing:
            shown = ", ".join(repr(m) for m in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            self.abort()
            raise self._error(f"{len(missing)} of {len(self.entries)} declared tensors were not written: {shown}; "
                              "the partial file was deleted")
        try:
            size = os.fstat(self._fd).st_size
            if size != self.file_bytes:
                raise self._error(f"file is {size} bytes after writing, expected {self.file_bytes}")
            if self._fsync:
                os.fsync(self._fd)
        except BaseException:
            self.abort()
            raise
        os.close(self._fd)
        self._closed = True

    def abort(self) -> None:
        """Close and delete the partial file (no-op after a successful close)."""
        if self._closed:
            return
        self._closed = True
        try:
            os.close(self._fd)
        finally:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "StreamingSafetensorsWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def copy_raw(src: TensorInfo, source: Source, writer: StreamingSafetensorsWriter, *, name: str | None = None,
             block_bytes: int = COPY_BLOCK_BYTES, counter: ByteCounter | None = None) -> None:
    """Copy tensor `src` verbatim (no decode) into `writer` as `name` (default: the same name),
    in blocks of at most `block_bytes`. The declared dtype and shape must match the source's."""
    dst = name if name is not None else src.name
    i = writer._by_name.get(dst)
    if i is None:
        raise FormatError("tensor was not declared when the file was opened", path=writer.path, key=dst)
    e = writer.entries[i]
    if (e.dtype, e.shape) != (src.dtype, src.shape):
        raise FormatError(f"declared {e.dtype}{list(e.shape)} but the source {src.path} holds "
                          f"{src.dtype}{list(src.shape)}", path=writer.path, key=dst)
    if block_bytes <= 0:
        raise ValueError("block_bytes must be positive")
    if src.nbytes == 0:
        writer.write(dst, b"")
        return
    buf = bytearray(min(block_bytes, src.nbytes))
    mv = memoryview(buf)
    with _Fd(source, src.path) as fd:
        done = 0
        while done < src.nbytes:
            n = min(len(buf), src.nbytes - done)
            _pread_into(fd, mv[:n], src.begin + done, path=src.path, key=src.name)
            if counter is not None:
                counter.add(n)
            writer.write_chunk(dst, mv[:n])
            done += n
