"""One DCP storage item, decoded: the only place a `.distcp` item's bytes are interpreted.

DCP concatenates complete, uncompressed `torch.save` zip archives in each `.distcp` file. Every
record uses zip data descriptors, so local headers carry no sizes: `parse_item` reads the central
directory at the item's tail (Python's zipfile does that, through `window` over the file), then the
local header of `data/0` to find where the raw tensor bytes start. `data.pkl` of a tensor item is
decoded by a tiny allow-list unpickler that only records the `_rebuild_tensor_v2` arguments
(`decode_tensor_pickle`): no torch unpickling, no torch at all, on the fast path.

`decode_chunk` is what every reader of tensor bytes calls (the checkpoint reader, the DCP sources,
slim's hashing, verify): the item's layout and record, and whether its payload is exactly the chunk's
row-major bytes (`DecodedChunk.payload_is`), so a caller can pread them straight where they belong.
Anything else (`ItemError`) is for the caller to fall back on `load_byte_item`: `torch.load` with
its `weights_only` allow-list, after the checks that bound what it builds by the item's bytes.
"""

from __future__ import annotations

import io
import math
import pickle
import struct
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import BinaryIO

from ...core.crc import crc32
from ...core.dtypes import ITEMSIZE, STORAGE_CLASSES
from ...core.errors import ChecksumError, FormatError, UnsafePickleError
from ...io.safe_pickle import check_pickle_bounds

__all__ = [
    "CRC_HINT",
    "SMALL_ITEM_BYTES",
    "CentralEntry",
    "DataCrcReader",
    "DecodedChunk",
    "ItemError",
    "ItemLayout",
    "TensorRecord",
    "archive_pickle",
    "central_directory",
    "check_record_crcs",
    "crc_error",
    "decode_chunk",
    "decode_tensor_pickle",
    "is_row_block",
    "load_byte_item",
    "load_plain_item",
    "parse_item",
    "window",
]

CRC_HINT = (
    "the file's bytes changed after torch.save wrote them (disk, copy or transfer damage): re-copy the "
    "checkpoint from where it was written, or use another step; `ckpt verify --deep` lists every "
    "damaged item"
)


def crc_error(
    record: str, stored: int, got: int, *, path=None, key: str | None = None, where: str = ""
) -> ChecksumError:
    """The error for a record whose bytes fail its stored CRC-32."""
    return ChecksumError(
        f"{where}zip record {record} fails its CRC-32 check (stored {stored:#010x}, computed "
        f"{got:#010x}): its bytes are damaged; nothing was written from them",
        path=path,
        key=key,
        hint=CRC_HINT,
    )


# Items up to this size are read with one pread and parsed in memory (one syscall beats three
# scattered ones for the thousands of tiny LoRA/optimizer chunks); larger ones are parsed from their
# tail and the payload is read straight into its destination.
SMALL_ITEM_BYTES = 1 << 20


class ItemError(ValueError):
    """Not a torch.save item this decoder reads (a damaged zip, a data.pkl that is not one tensor)."""


@dataclass(frozen=True)
class TensorRecord:
    """What `data.pkl` of a single-tensor torch.save archive says."""

    dtype: str  # torch dtype name
    storage_numel: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def is_contiguous_whole(self) -> bool:
        numel = math.prod(self.size)
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

    prefix: str  # archive name, "archive" for DCP
    pkl_offset: int
    pkl_size: int
    data_offset: int | None  # payload of data/0, None for byte (non-tensor) items
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


def window(
    read: Callable[[int, int], bytes], base: int, length: int, buffer_bytes: int = io.DEFAULT_BUFFER_SIZE
) -> io.BufferedReader:
    """A seekable binary file over bytes [base, base + length) of a file read by `read(offset, n)`, read
    ahead `buffer_bytes` at a time (a many-record archive whose local headers are read one by one, at a URL:
    a small buffer, else each 30-byte header costs the default 8 KiB)."""
    return io.BufferedReader(_Window(read, base, length), buffer_size=buffer_bytes)


def archive_pickle(raw: bytes, *, path=None, key: str | None = None) -> bytes:
    """The `data.pkl` of the torch.save archive `raw`, after checking what `torch.load` would
    otherwise trust: every record STORED (torch.save never compresses, and torch.load inflates a
    DEFLATE'd record without a limit: 3 MB became 3.4 GB), inside the archive, and equal to its
    CRC-32 (ChecksumError). ItemError if not."""
    try:
        zf = zipfile.ZipFile(io.BytesIO(raw))
        infos = zf.infolist()
    except Exception as exc:  # BadZipFile, NotImplementedError ("zip file version"), EOFError, ...
        raise ItemError(f"not a torch.save zip archive: {type(exc).__name__}: {exc}") from None
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED:
            raise ItemError(
                f"record {info.filename!r} is compressed (method {info.compress_type}); torch.save "
                f"stores records uncompressed, and inflating it could take {info.file_size:,} bytes"
            )
        if info.header_offset + info.file_size > len(raw):
            raise ItemError(
                f"record {info.filename!r} claims {info.file_size:,} bytes beyond the item's {len(raw):,}"
            )
    pkl = [i for i in infos if i.filename.endswith("/data.pkl")]
    if len(pkl) != 1:
        raise ItemError("archive has no single */data.pkl record")
    try:  # every record's CRC-32 (torch.load checks none of them); the bytes are in memory
        check_record_crcs(raw, path=path, key=key)
    except ChecksumError:
        raise
    except Exception as exc:
        raise ItemError(f"archive records do not read: {type(exc).__name__}: {exc}") from None
    try:
        return zf.read(pkl[0])
    except Exception as exc:
        raise ItemError(f"data.pkl does not read: {type(exc).__name__}: {exc}") from None


def _payload_offset(src, header_offset: int) -> int:
    src.seek(header_offset)
    hdr = src.read(30)
    if len(hdr) != 30 or hdr[:4] != b"PK\x03\x04":
        raise ItemError(f"bad local file header at {header_offset}")
    name_len, extra_len = struct.unpack("<HH", hdr[26:30])
    return header_offset + 30 + name_len + extra_len


def parse_item(src) -> ItemLayout:
    """`src` is a seekable binary file object positioned anywhere, spanning exactly one item."""
    try:
        zf = zipfile.ZipFile(src)
    except Exception as exc:  # BadZipFile, NotImplementedError ("zip file version"), EOFError, ...
        raise ItemError(f"not a torch.save zip archive: {type(exc).__name__}: {exc}") from None
    infos = zf.infolist()
    pkl = [i for i in infos if i.filename.endswith("/data.pkl")]
    if len(pkl) != 1:
        raise ItemError("archive has no single */data.pkl record")
    prefix = pkl[0].filename[: -len("/data.pkl")]
    item_len = src.seek(0, io.SEEK_END)
    records = []
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED:
            raise ItemError(f"record {info.filename} is compressed")
        off = _payload_offset(src, info.header_offset)
        if off + info.file_size > item_len:  # a damaged central directory: never read past the item
            raise ItemError(
                f"record {info.filename} [{off}, {off + info.file_size}) lies beyond the "
                f"item's {item_len} bytes"
            )
        records.append((info.filename, off, info.file_size, info.CRC))
    by_name = {r[0]: r for r in records}
    data = by_name.get(f"{prefix}/data/0")
    p = by_name[pkl[0].filename]
    return ItemLayout(
        prefix=prefix,
        pkl_offset=p[1],
        pkl_size=p[2],
        data_offset=data[1] if data else None,
        data_size=data[2] if data else None,
        data_crc=data[3] if data else None,
        records=tuple(records),
    )


def check_record_crcs(raw, layout: ItemLayout | None = None, *, path=None, key: str | None = None) -> int:
    """Every record of the item `raw` (read whole: its bytes are in memory) against its stored CRC-32;
    a ChecksumError naming the first that fails. A stored CRC of 0 is torch.save's "not computed"
    (`torch.serialization.set_crc32_options(False)`) unless the record is empty: not checked. Returns
    the records checked."""
    if layout is None:
        layout = parse_item(io.BytesIO(raw))
    mv = memoryview(raw)
    n = 0
    for name, off, size, crc in layout.records:
        got = crc32(mv[off : off + size])
        if got != crc and crc != 0:
            raise crc_error(name, crc, got, path=path, key=key)
        n += 1
    return n


class _RecordingUnpickler(pickle.Unpickler):
    """Decodes a single-tensor data.pkl into a TensorRecord without building anything."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _record_tensor
        if module == "torch" and name in STORAGE_CLASSES:
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
        return ("storage", STORAGE_CLASSES[cls[1]], key, int(numel))


def _record_tensor(storage, storage_offset, size, stride, requires_grad=False, hooks=None, *rest):
    _, dtype, key, numel = storage
    if key != "0":
        raise ItemError(f"tensor item uses storage {key!r}, expected '0'")
    return TensorRecord(
        dtype=dtype,
        storage_numel=numel,
        storage_offset=int(storage_offset),
        size=tuple(int(s) for s in size),
        stride=tuple(int(s) for s in stride),
    )


def decode_tensor_pickle(pkl_bytes: bytes) -> TensorRecord:
    check_pickle_bounds(pkl_bytes, "data.pkl", "a tensor item's data.pkl")
    try:
        rec = _RecordingUnpickler(io.BytesIO(pkl_bytes)).load()
    except UnsafePickleError:
        raise
    except Exception as exc:  # garbled data.pkl: UnpicklingError, EOFError, AttributeError, ...
        raise ItemError(f"data.pkl does not decode: {type(exc).__name__}: {exc}") from None
    if not isinstance(rec, TensorRecord):
        raise ItemError("data.pkl does not hold a single tensor")
    return rec


def is_row_block(offsets: tuple[int, ...], sizes: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """A chunk of whole rows (FSDP2's Shard(0)): its bytes are one contiguous range of the tensor's."""
    return len(sizes) == 0 or (all(o == 0 for o in offsets[1:]) and tuple(sizes[1:]) == tuple(shape[1:]))


@dataclass(frozen=True)
class DecodedChunk:
    layout: ItemLayout
    record: TensorRecord
    raw: bytes | None  # the whole item when it was read whole (small items), else None

    @property
    def payload_offset(self) -> int | None:
        return self.layout.data_offset

    @property
    def payload_size(self) -> int | None:
        return self.layout.data_size

    def payload_is(self, dtype: str, sizes: tuple[int, ...]) -> bool:
        """True when the payload is exactly a contiguous `sizes` tensor of `dtype`, row-major: its bytes
        can be read straight into place."""
        rec = self.record
        return (
            self.layout.data_offset is not None
            and rec.dtype == dtype
            and rec.size == tuple(sizes)
            and rec.is_contiguous_whole
            and self.layout.data_size == math.prod(sizes) * ITEMSIZE[dtype]
        )

    def payload(self) -> memoryview:
        """The payload bytes of a small item (read whole)."""
        start, size = self.layout.data_offset, self.layout.data_size
        assert self.raw is not None and start is not None and size is not None
        return memoryview(self.raw)[start : start + size]


def decode_chunk(
    read: Callable[[int, int], bytes], offset: int, length: int, *, small_bytes: int | None = None
) -> DecodedChunk:
    """Decode the tensor item at [offset, offset + length) of a file read by `read(offset, n)`: read
    whole when it is small (one syscall), else parsed from its tail. A small item's records are all
    checked against their CRC-32 here (its bytes are in memory); a large one's data.pkl is, and its
    payload's CRC (`layout.data_crc`) is for the reader to check as it reads the payload. Raises
    ItemError (a layout this decoder does not read: fall back on `load_byte_item`), UnsafePickleError
    (its data.pkl is not a plain tensor record) or ChecksumError (damaged): never fall back on those."""
    small = length <= (SMALL_ITEM_BYTES if small_bytes is None else small_bytes)
    src: BinaryIO
    try:
        if small:
            raw = read(offset, length)
            src = io.BytesIO(raw)
        else:
            raw = None
            src = window(read, offset, length)
        layout = parse_item(src)
        if layout.data_offset is None:
            raise ItemError("item holds no tensor data")
        if raw is not None:  # in memory already: every record checked now
            check_record_crcs(raw, layout)
        src.seek(layout.pkl_offset)
        pkl = src.read(layout.pkl_size)
        if raw is None:  # data.pkl's own CRC; the payload's is the reader's, as it reads it
            for name, _off, _size, crc in layout.records:
                if name.endswith("/data.pkl") and crc and crc32(pkl) != crc:
                    raise crc_error(name, crc, crc32(pkl))
        record = decode_tensor_pickle(pkl)
    except (ItemError, UnsafePickleError, ChecksumError):
        raise
    except (ValueError, KeyError, EOFError, IndexError, TypeError, struct.error) as exc:
        raise ItemError(f"{type(exc).__name__}: {exc}") from None
    return DecodedChunk(layout, record, raw)


def _check_own_bytes(obj, path, key: str) -> None:
    """Every tensor torch.load built holds its elements in its own storage: an expanded (stride-0)
    view of a few bytes would be materialized at its full size by the first `.to()` or copy."""
    import torch  # lazy, as in load_byte_item

    todo = [obj]
    while todo:
        o = todo.pop()
        if isinstance(o, torch.Tensor):
            need = o.numel() * o.element_size()
            if need and (
                o.untyped_storage().nbytes() < need
                or any(st == 0 and n > 1 for st, n in zip(o.stride(), o.shape))
            ):
                raise FormatError(
                    f"tensor of shape {list(o.shape)} is an expanded view of "
                    f"{o.untyped_storage().nbytes():,} stored bytes (strides {list(o.stride())}); "
                    f"refusing to materialize {need:,} bytes from it",
                    path=path,
                    key=key,
                    hint="a checkpoint stores every element; this item is crafted or corrupt",
                )
        elif isinstance(o, dict):
            todo.extend(o.values())
        elif isinstance(o, (list, tuple)):
            todo.extend(o)


class _PlainValueUnpickler(pickle.Unpickler):
    """A byte item that holds plain values only (an lr, a step, a list of floats, a dict of them): no
    global but OrderedDict, no persistent id (that is tensor storage). Anything else is an ItemError,
    for `load_byte_item` to decide."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("collections", "OrderedDict"):
            return OrderedDict
        raise ItemError(f"not a plain value: references {module}.{name}")

    def persistent_load(self, pid):
        raise ItemError("not a plain value: holds tensor storage")


def load_plain_item(raw: bytes, *, path, key: str):
    """A byte item of plain Python values (int, float, bool, str, None, lists, tuples, dicts), decoded
    without torch: `inspect` and `verify` read step, lr and scheduler fields this way and never import
    torch (2-3 s). The archive and pickle checks are `load_byte_item`'s; the values are the ones
    `torch.load(weights_only=True)` returns for them. ItemError for anything else (a tensor, a global):
    the caller falls back on `load_byte_item`."""
    pkl = archive_pickle(raw, path=path, key=key)
    try:
        check_pickle_bounds(pkl, str(path), "the item's data.pkl")
    except UnsafePickleError:
        raise ItemError("data.pkl is past the pickle bounds") from None
    try:
        return _PlainValueUnpickler(io.BytesIO(pkl)).load()
    except ItemError:
        raise
    except Exception as exc:  # a damaged pickle: load_byte_item names it
        raise ItemError(f"data.pkl does not unpickle: {type(exc).__name__}") from None


def load_byte_item(raw: bytes, *, trust: bool, path, key: str):
    """torch.load of one storage item; weights_only (an allow-list) unless the user trusts the file.
    Before torch.load: the archive's records must be stored (not compressed) and inside it, and its
    data.pkl must pass the pickle bounds (`safe_pickle.check_pickle_bounds`); after: no tensor may
    be an expanded view (`_check_own_bytes`). So what it builds is bounded by the item's bytes."""
    # lazy: everything above (layouts, records, row blocks) is torch-free, so commands that only parse
    # items need no torch; building an object from a pickle does
    import torch

    try:
        pkl = archive_pickle(raw, path=path, key=key)
    except ItemError as exc:
        raise FormatError(
            f"cannot decode item: {exc}",
            path=path,
            key=key,
            hint="the file is corrupt or crafted; run `ckpt verify`",
        ) from None
    try:
        check_pickle_bounds(pkl, str(path), "the item's data.pkl")
    except UnsafePickleError as exc:
        raise UnsafePickleError(exc.message, path=path, key=key, hint=exc.hint) from None
    try:
        obj = torch.load(io.BytesIO(raw), weights_only=not trust, map_location="cpu")
        _check_own_bytes(obj, path, key)
        return obj
    except FormatError:
        raise
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()
        reason = next(
            (ln for ln in first if "GLOBAL" in ln or "Unsupported" in ln), first[0] if first else ""
        )
        raise UnsafePickleError(
            f"refusing to unpickle item: {reason.strip()[:300]}",
            path=path,
            key=key,
            hint="torch.load(weights_only=True) rejected it; pass --trust-remote-pickle "
            "only if you trust where this checkpoint came from",
        ) from None
    except Exception as exc:
        raise FormatError(
            f"cannot decode item: {type(exc).__name__}: {str(exc)[:300]}",
            path=path,
            key=key,
            hint="the file is corrupt; run `ckpt verify`",
        ) from None


# ---- the zip central directory of one item, read from its end (tens of bytes per record)
_CD_SIG, _EOCD_SIG, _Z64_LOC_SIG = b"PK\x01\x02", b"PK\x05\x06", b"PK\x06\x07"
_U32_MAX = 0xFFFFFFFF


@dataclass(frozen=True)
class CentralEntry:
    """One central directory entry: its record's name, where the entry lies (`at`, from the item's first
    byte), the stored CRC-32 and sizes, and where the record's local header is (`header_offset`; -1 where a
    zip64 entry does not say)."""

    name: bytes
    at: int
    method: int
    crc: int
    csize: int
    usize: int
    header_offset: int


def _zip64_header_offset(extra: bytes, usize: int, csize: int) -> int | None:
    """The local header offset a zip64 extra field holds (its fields come in order, each only where the
    fixed one is 0xFFFFFFFF: uncompressed size, compressed size, header offset)."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, pos)
        if tag == 1:
            skip = 8 * ((usize == _U32_MAX) + (csize == _U32_MAX))
            if n >= skip + 8:
                return struct.unpack_from("<Q", extra, pos + 4 + skip)[0]
            return None
        pos += 4 + n
    return None


def _central_entries(cd: bytes, cd_off: int):
    pos = 0
    while pos + 46 <= len(cd) and cd[pos : pos + 4] == _CD_SIG:
        (method,) = struct.unpack_from("<H", cd, pos + 10)
        crc, csize, usize = struct.unpack_from("<III", cd, pos + 16)
        nlen, xlen, clen = struct.unpack_from("<HHH", cd, pos + 28)
        (hdr,) = struct.unpack_from("<I", cd, pos + 42)
        name = bytes(cd[pos + 46 : pos + 46 + nlen])
        if hdr == _U32_MAX:
            extra = bytes(cd[pos + 46 + nlen : pos + 46 + nlen + xlen])
            found = _zip64_header_offset(extra, usize, csize)
            hdr = -1 if found is None else found  # unknown: a caller that needs it refuses
        yield CentralEntry(name, cd_off + pos, method, crc, csize, usize, hdr)
        pos += 46 + nlen + xlen + clen


def central_directory(read: Callable[[int, int], bytes], length: int) -> list[CentralEntry]:
    """Every entry of the central directory of the zip spanning bytes [0, length) of what `read(offset,
    n)` reads (offsets from the zip's first byte): its end record, the zip64 locator where it has one, then
    the directory itself. ItemError for anything but a zip without a comment whose directory lies inside."""
    n = min(length, 22 + 20 + 56)
    tail = read(length - n, n)
    at = n - 22
    if at < 0 or tail[at : at + 4] != _EOCD_SIG:
        raise ItemError("no zip end record at the item's end (a comment, or not a zip)")
    cd_size, cd_off = struct.unpack_from("<II", tail, at + 12)
    if _U32_MAX in (cd_size, cd_off):  # zip64: the locator names the zip64 end record
        if at < 20 or tail[at - 20 : at - 16] != _Z64_LOC_SIG:
            raise ItemError("zip64 end record locator missing")
        (z64,) = struct.unpack_from("<Q", tail, at - 12)
        if z64 + 56 > length:
            raise ItemError("zip64 end record lies beyond the item")
        rec = read(z64, 56)
        cd_size, cd_off = struct.unpack_from("<QQ", rec, 40)
    if cd_off + cd_size > length:
        raise ItemError("central directory lies beyond the item")
    return list(_central_entries(read(cd_off, cd_size), cd_off))


class DataCrcReader:
    """The CRC-32 that a tensor item's zip stores for its `data/0` record, read from the item's central
    directory (tens of bytes), never from its payload: how a slim of a remote checkpoint identifies the
    tensors it drops without fetching them. The first item is parsed from its end (EOCD, zip64 locator,
    the whole central directory); the `data/0` entry's distance from the item's end is then learned, and
    every later item costs one read of that one entry, checked (signature, name, sizes, stored) before
    it is trusted, else parsed from its end again. ItemError for anything but a stored `data/0` of the
    expected size."""

    def __init__(self) -> None:
        self._back: int | None = None
        self._name: bytes | None = None

    @staticmethod
    def _entry(buf: bytes, pos: int):
        if buf[pos : pos + 4] != _CD_SIG or len(buf) < pos + 46:
            return None
        (method,) = struct.unpack_from("<H", buf, pos + 10)
        crc, csize, usize = struct.unpack_from("<III", buf, pos + 16)
        nlen, xlen, clen = struct.unpack_from("<HHH", buf, pos + 28)
        return method, crc, csize, usize, bytes(buf[pos + 46 : pos + 46 + nlen]), 46 + nlen + xlen + clen

    def crc(self, read: Callable[[int, int], bytes], offset: int, length: int, payload_bytes: int) -> int:
        back, name = self._back, self._name
        if back is not None and name is not None and back <= length:
            e = self._entry(read(offset + length - back, 46 + len(name)), 0)
            if (
                e is not None
                and e[4] == name
                and e[0] == 0
                and e[2] == e[3] == payload_bytes
                and e[5] == 46 + len(name)
            ):
                return e[1]
        return self._from_end(read, offset, length, payload_bytes)

    def _from_end(self, read, offset: int, length: int, payload_bytes: int) -> int:
        for e in central_directory(lambda off, n: read(offset + off, n), length):
            if e.name.endswith(b"/data/0"):
                if e.method != 0 or e.csize != e.usize or e.usize != payload_bytes:
                    raise ItemError(
                        f"data record is not {payload_bytes} stored bytes (method {e.method}, size {e.usize})"
                    )
                self._back, self._name = length - e.at, e.name
                return e.crc
        raise ItemError("no data/0 record in the central directory")
