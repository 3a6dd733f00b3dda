"""Parse one DCP storage item: a complete, uncompressed `torch.save` zip archive.

DCP concatenates such archives in each `.distcp` file. Every record uses zip data descriptors, so
local headers carry no sizes: we read the central directory at the item's tail (Python's zipfile
does that, through a window over the file), then the local header of `data/0` to find where the
raw tensor bytes start. `data.pkl` is decoded by a tiny allow-list unpickler that only records the
`_rebuild_tensor_v2` arguments, so no torch unpickling happens on the fast path.
"""
from __future__ import annotations

import io
import os
import pickle
import struct
import zipfile
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..errors import FormatError, UnsafePickleError

# torch.save names storages by class; the class name carries the dtype.
STORAGE_DTYPES: dict[str, torch.dtype] = {
    "FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}


@dataclass(frozen=True)
class TensorRecord:
    """What `data.pkl` of a single-tensor torch.save archive says."""
    dtype: torch.dtype
    storage_numel: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def is_contiguous_whole(self) -> bool:
        numel = 1
        for s in self.size:
            numel *= s
        expected, acc = [], 1
        for s in reversed(self.size):
            expected.append(acc)
            acc *= s
        expected.reverse()
        dense = all(st == ex for st, ex, sz in zip(self.stride, expected, self.size) if sz > 1)
        return self.storage_offset == 0 and self.storage_numel == numel and dense


@dataclass(frozen=True)
class ItemLayout:
    """Where things are inside one item, relative to the item's first byte."""
    prefix: str                 # archive name, "archive" for DCP
    pkl_offset: int
    pkl_size: int
    data_offset: int | None     # payload of data/0, None for byte (non-tensor) items
    data_size: int | None
    data_crc: int | None
    records: tuple[tuple[str, int, int, int], ...]  # (name, payload offset, size, crc)


class _Window(io.RawIOBase):
    """A read-only seekable view of bytes [base, base+length) of a file, through `read(offset, n)`
    (absolute offsets; the caller's range-checked pread, which also counts bytes)."""

    def __init__(self, read, base: int, length: int):
        self._read, self._base, self._len, self._pos = read, base, length, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def tell(self):
        return self._pos

    def seek(self, pos, whence=0):
        origin = {0: 0, 1: self._pos, 2: self._len}[whence]
        self._pos = max(0, origin + pos)
        return self._pos

    def readinto(self, b):
        n = min(len(b), self._len - self._pos)
        if n <= 0:
            return 0
        data = self._read(self._base + self._pos, n)
        b[: len(data)] = data
        self._pos += len(data)
        return len(data)


def archive_pickle(raw: bytes) -> bytes:
    """The `data.pkl` of the torch.save archive `raw`, after checking what `torch.load` would
    otherwise trust: every record STORED (torch.save never compresses, and torch.load inflates a
    DEFLATE'd record without a limit: 3 MB became 3.4 GB) and inside the archive. ValueError if not."""
    try:
        zf = zipfile.ZipFile(io.BytesIO(raw))
        infos = zf.infolist()
    except Exception as exc:   # BadZipFile, NotImplementedError ("zip file version"), EOFError, ...
        raise ValueError(f"not a torch.save zip archive: {type(exc).__name__}: {exc}") from None
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED:
            raise ValueError(f"record {info.filename!r} is compressed (method {info.compress_type}); torch.save "
                             f"stores records uncompressed, and inflating it could take {info.file_size:,} bytes")
        if info.header_offset + info.file_size > len(raw):
            raise ValueError(f"record {info.filename!r} claims {info.file_size:,} bytes beyond the item's "
                             f"{len(raw):,}")
    pkl = [i for i in infos if i.filename.endswith("/data.pkl")]
    if len(pkl) != 1:
        raise ValueError("archive has no single */data.pkl record")
    try:
        return zf.read(pkl[0])
    except Exception as exc:
        raise ValueError(f"data.pkl does not read: {type(exc).__name__}: {exc}") from None


def _payload_offset(src, header_offset: int) -> int:
    src.seek(header_offset)
    hdr = src.read(30)
    if len(hdr) != 30 or hdr[:4] != b"PK\x03\x04":
        raise ValueError(f"bad local file header at {header_offset}")
    name_len, extra_len = struct.unpack("<HH", hdr[26:30])
    return header_offset + 30 + name_len + extra_len


def parse_item(src) -> ItemLayout:
    """`src` is a seekable binary file object positioned anywhere, spanning exactly one item."""
    try:
        zf = zipfile.ZipFile(src)
    except Exception as exc:  # BadZipFile, NotImplementedError ("zip file version"), EOFError, ...
        raise ValueError(f"not a torch.save zip archive: {type(exc).__name__}: {exc}") from None
    infos = zf.infolist()
    pkl = [i for i in infos if i.filename.endswith("/data.pkl")]
    if len(pkl) != 1:
        raise ValueError("archive has no single */data.pkl record")
    prefix = pkl[0].filename[: -len("/data.pkl")]
    item_len = src.seek(0, io.SEEK_END)
    records = []
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED:
            raise ValueError(f"record {info.filename} is compressed")
        off = _payload_offset(src, info.header_offset)
        if off + info.file_size > item_len:  # a damaged central directory: never read past the item
            raise ValueError(f"record {info.filename} [{off}, {off + info.file_size}) lies beyond the "
                             f"item's {item_len} bytes")
        records.append((info.filename, off, info.file_size, info.CRC))
    by_name = {r[0]: r for r in records}
    data = by_name.get(f"{prefix}/data/0")
    p = by_name[pkl[0].filename]
    return ItemLayout(prefix=prefix, pkl_offset=p[1], pkl_size=p[2],
                      data_offset=data[1] if data else None, data_size=data[2] if data else None,
                      data_crc=data[3] if data else None, records=tuple(records))


class _RecordingUnpickler(pickle.Unpickler):
    """Decodes a single-tensor data.pkl into a TensorRecord without building anything."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _record_tensor
        if module == "torch" and name in STORAGE_DTYPES:
            return ("storage-class", name)
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        raise UnsafePickleError(f"unexpected global {module}.{name} in a tensor item's data.pkl")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise UnsafePickleError(f"unexpected persistent id {pid!r} in a tensor item")
        _, cls, key, _location, numel = pid
        if not (isinstance(cls, tuple) and cls[0] == "storage-class"):
            raise UnsafePickleError(f"unexpected storage type {cls!r}")
        return ("storage", STORAGE_DTYPES[cls[1]], key, int(numel))


def _record_tensor(storage, storage_offset, size, stride, requires_grad=False, hooks=None, *rest):
    _, dtype, key, numel = storage
    if key != "0":
        raise ValueError(f"tensor item uses storage {key!r}, expected '0'")
    return TensorRecord(dtype=dtype, storage_numel=numel, storage_offset=int(storage_offset),
                        size=tuple(int(s) for s in size), stride=tuple(int(s) for s in stride))


def decode_tensor_pickle(pkl_bytes: bytes) -> TensorRecord:
    from ..safe_pickle import check_pickle_bounds

    check_pickle_bounds(pkl_bytes, "data.pkl", "a tensor item's data.pkl")
    try:
        rec = _RecordingUnpickler(io.BytesIO(pkl_bytes)).load()
    except UnsafePickleError:
        raise
    except Exception as exc:  # garbled data.pkl: UnpicklingError, EOFError, AttributeError, ...
        raise ValueError(f"data.pkl does not decode: {type(exc).__name__}: {exc}") from None
    if not isinstance(rec, TensorRecord):
        raise ValueError("data.pkl does not hold a single tensor")
    return rec
