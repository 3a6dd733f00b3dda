"""A tensor storage item written as `torch.save` writes it, with its payload streamed: the bytes before
the payload (`TensorItemParts.head`), the payload block by block, then the bytes after it
(`TensorItemParts.tail(crc)`), so a rebuilt tensor never has to be in memory whole.

torch.save writes a zip archive through miniz with data descriptors (flag 0x0808): a record's local
header carries neither CRC nor sizes, the CRC-32 and sizes follow the data (`PK\\x07\\x08`), so a
streaming writer learns the CRC as the bytes go by, exactly like torch's own. The records of one tensor
are `archive/data.pkl` (protocol 2 pickle of `_rebuild_tensor_v2`), `.format_version`,
`.storage_alignment`, `byteorder`, `data/0` (the payload), `version`, `.data/serialization_id` (40
digits: a hash of the record names, then `c10::hash_combine` folded over every record's CRC-32), each
data start padded to 64 bytes by an `FB` extra field, then the central directory and the zip64 end
records.

That layout is torch's and may change with a torch release, so it is never trusted: `tensor_item_parts`
first writes a small tensor of the same dtype both ways (ours, `torch.save`) and returns None unless the
bytes are identical (checked once per dtype and process); the caller then writes with torch.save as
before. Archives that would need zip64 records (>= 4 GiB) are not streamed either.
"""

from __future__ import annotations

import io
import math
import pickle
import struct
from collections import OrderedDict
from dataclasses import dataclass

from ...core.crc import crc32
from ...core.dtypes import ITEMSIZE, STORAGE_CLASSES
from .item import ItemError, parse_item

__all__ = ["MAX_STREAMED_BYTES", "TensorItemParts", "tensor_item_parts"]

_ALIGN = 64
_PREFIX = "archive/"
_LIMIT = 0xFFFFFFFF - (1 << 20)  # below this, no zip64 record: miniz's 32-bit fields hold every size
MAX_STREAMED_BYTES = _LIMIT  # the largest payload `tensor_item_parts` streams
_STORAGE_CLASS = {dtype: cls for cls, dtype in STORAGE_CLASSES.items()}
_CHECKED: dict[str, tuple | None] = {}  # dtype -> (name hash digits, constant records) or None: not ours


def _fold(seed: int, value: int) -> int:
    """c10::hash_combine on a 64-bit size_t."""
    return (
        seed ^ (value + 0x9E3779B9 + ((seed << 6) & 0xFFFFFFFFFFFFFFFF) + (seed >> 2))
    ) & 0xFFFFFFFFFFFFFFFF


def _extra(cursor: int, name: bytes) -> bytes:
    start = cursor + 30 + len(name) + 4
    pad = (-start) % _ALIGN
    return b"FB" + struct.pack("<H", pad) + b"Z" * pad


def _local(cursor: int, name: bytes) -> bytes:
    extra = _extra(cursor, name)
    return (
        struct.pack("<4sHHHHHIIIHH", b"PK\x03\x04", 0, 0x0808, 0, 0, 0, 0, 0, 0, len(name), len(extra))
        + name
        + extra
    )


def _descriptor(crc: int, size: int) -> bytes:
    return struct.pack("<4sIII", b"PK\x07\x08", crc, size, size)


def _central(name: bytes, crc: int, size: int, offset: int) -> bytes:
    return (
        struct.pack(
            "<4sHHHHHHIIIHHHHHII",
            b"PK\x01\x02",
            0,
            0,
            0x0808,
            0,
            0,
            0,
            crc,
            size,
            size,
            len(name),
            0,
            0,
            0,
            0,
            0,
            offset,
        )
        + name
    )


def _data_pkl(dtype: str, shape: tuple[int, ...]) -> bytes:
    """torch.save's `data.pkl` of a contiguous CPU tensor of `dtype` and `shape` that owns its storage."""
    import torch  # lazy: the rest of this module is plain bytes
    import torch._utils

    rebuild = torch._utils._rebuild_tensor_v2  # what torch.save's data.pkl names (its GLOBAL opcode)

    numel = math.prod(shape)
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= s
    storage_cls = getattr(torch, _STORAGE_CLASS[dtype])

    class _Storage:
        pass

    store = _Storage()

    class _Tensor:
        def __reduce_ex__(self, protocol):
            return rebuild, (store, 0, tuple(shape), tuple(reversed(stride)), False, OrderedDict())

    class _Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", storage_cls, "0", "cpu", numel) if obj is store else None

    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(_Tensor())
    return buf.getvalue()


@dataclass(frozen=True)
class TensorItemParts:
    """The bytes of one tensor item around its payload of `payload_bytes` (whose CRC-32 the tail needs)."""

    head: bytes
    payload_bytes: int
    data_offset: int  # where data/0's local header starts
    pre: tuple  # (name, crc, size, offset) of the records before data/0
    name_hash: str  # the serialization id's first 20 digits (the record names')
    version: bytes  # the `version` record

    def tail(self, crc: int) -> bytes:
        """Everything after the payload, given the payload's CRC-32: its data descriptor, the records after
        it, the central directory and the end records."""
        out = bytearray(_descriptor(crc, self.payload_bytes))
        cursor = len(self.head) + self.payload_bytes + len(out)
        data_name = (_PREFIX + "data/0").encode()
        records = list(self.pre) + [(data_name, crc, self.payload_bytes, self.data_offset)]
        combined = 0
        for _n, c, _s, _o in records:
            combined = _fold(combined, c)
        vname = (_PREFIX + "version").encode()
        vcrc = crc32(self.version)
        at = cursor
        out += _local(cursor, vname) + self.version + _descriptor(vcrc, len(self.version))
        records.append((vname, vcrc, len(self.version), at))
        combined = _fold(combined, vcrc)
        sid = f"{self.name_hash}{combined:020d}".encode()
        sname = (_PREFIX + ".data/serialization_id").encode()
        at = len(self.head) + self.payload_bytes + len(out)
        out += _local(at, sname) + sid + _descriptor(crc32(sid), len(sid))
        records.append((sname, crc32(sid), len(sid), at))
        cd_off = len(self.head) + self.payload_bytes + len(out)
        cd = b"".join(_central(n, c, s, o) for n, c, s, o in records)
        out += cd
        z64 = cd_off + len(cd)
        out += struct.pack(
            "<4sQHHIIQQQQ",
            b"PK\x06\x06",
            44,
            0x031E,
            0x002D,
            0,
            0,
            len(records),
            len(records),
            len(cd),
            cd_off,
        )
        out += struct.pack("<4sIQI", b"PK\x06\x07", 0, z64, 1)
        out += struct.pack("<4sHHHHIIH", b"PK\x05\x06", 0, 0, len(records), len(records), len(cd), cd_off, 0)
        return bytes(out)

    @property
    def size(self) -> int:
        """The whole item's bytes (its tail's length does not depend on the CRC)."""
        return len(self.head) + self.payload_bytes + len(self.tail(0))


def _build(dtype: str, shape: tuple[int, ...], name_hash: str, consts: tuple) -> TensorItemParts:
    fmt, align, order, version = consts
    head = bytearray()
    pre = []
    for rel, data in (
        ("data.pkl", _data_pkl(dtype, shape)),
        (".format_version", fmt),
        (".storage_alignment", align),
        ("byteorder", order),
    ):
        name = (_PREFIX + rel).encode()
        at = len(head)
        c = crc32(data)
        head += _local(at, name) + data + _descriptor(c, len(data))
        pre.append((name, c, len(data), at))
    data_offset = len(head)
    head += _local(data_offset, (_PREFIX + "data/0").encode())
    return TensorItemParts(
        bytes(head), math.prod(shape) * ITEMSIZE[dtype], data_offset, tuple(pre), name_hash, version
    )


def _learn(dtype: str) -> tuple | None:
    """What this torch's torch.save writes around a tensor of `dtype`, proven by writing one both ways."""
    import torch

    from ...core.dtypes import torch_dtype

    t = torch.arange(6, dtype=torch.float64).reshape(2, 3).to(torch_dtype(dtype))
    buf = io.BytesIO()
    torch.save(t, buf)
    want = buf.getvalue()
    try:
        records = {
            name: want[off : off + size] for name, off, size, _crc in parse_item(io.BytesIO(want)).records
        }
        sid = records[_PREFIX + ".data/serialization_id"].decode()
        consts = tuple(
            records[_PREFIX + n] for n in (".format_version", ".storage_alignment", "byteorder", "version")
        )
    except (ItemError, KeyError, UnicodeDecodeError):  # another archive layout: not ours to stream
        return None
    if len(sid) != 40:
        return None
    learned = (sid[:20], consts)
    parts = _build(dtype, (2, 3), *learned)
    payload = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    got = parts.head + payload + parts.tail(crc32(payload))
    return learned if got == want else None


def tensor_item_parts(dtype: str, shape: tuple[int, ...]) -> TensorItemParts | None:
    """The bytes around the payload of a contiguous `dtype` tensor of `shape`, as this torch's torch.save
    writes them; None where ours would differ (checked on a small tensor once per dtype) or the archive
    would need zip64 records, or the tensor is empty."""
    nbytes = math.prod(shape) * ITEMSIZE[dtype] if dtype in ITEMSIZE else 0
    if dtype not in _STORAGE_CLASS or not 0 < nbytes <= _LIMIT:  # (an empty tensor is archived otherwise)
        return None
    if dtype not in _CHECKED:
        _CHECKED[dtype] = _learn(dtype)
    learned = _CHECKED[dtype]
    return None if learned is None else _build(dtype, tuple(shape), *learned)
