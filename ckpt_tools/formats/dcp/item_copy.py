"""One storage item copied verbatim from a checkpoint into a `DcpWriter`, every zip record checked against
its stored CRC-32 first, and the CRC-32 of the whole item returned (what slim's manifest records of a kept
item and rehydrate compares). The item is read once: a small one whole (one pread), a large one in blocks
(memory: one block) whose bytes are then copied by `copy_file_range` from the page cache the check just
filled (`FileRange`); a remote checkpoint's large item is held whole (it is fetched once)."""

from __future__ import annotations

import struct

from ...core.crc import crc32
from ...core.errors import FormatError
from .item import CRC_HINT, SMALL_ITEM_BYTES, ItemError, crc_error, parse_item, window
from .model import BytesEntry
from .reader import DcpCheckpoint
from .writer import DcpWriter, FileRange, ItemSlot

__all__ = ["BLOCK_BYTES", "checked_item_crc", "copy_checked_item", "write_checked_item"]

BLOCK_BYTES = 16 << 20  # one read of a large item


def checked_item_crc(
    ckpt: DcpCheckpoint,
    rel: str,
    offset: int,
    length: int,
    key: str,
    block_bytes: int = BLOCK_BYTES,
    buf: memoryview | None = None,
) -> int:
    """The CRC-32 of the item's bytes, each of its zip records checked against its stored CRC-32 on the way
    (ChecksumError naming the file and key), read in blocks of `block_bytes` (or of the caller's `buf`). An
    item that is not a zip (DCP stores a BytesIO value raw) has only the whole CRC."""
    path = ckpt.dir / rel
    read = lambda off, n: ckpt.read_item_bytes(rel, off, n, key)  # noqa: E731
    try:
        records = parse_item(window(read, offset, length)).records
    except ItemError:
        records = ()
    except (ValueError, EOFError, struct.error, KeyError, IndexError) as exc:  # a zip that half-parses
        raise FormatError(
            f"storage item at byte {offset:,} is a damaged zip archive: {type(exc).__name__}: {exc}",
            path=path,
            key=key,
            hint=CRC_HINT,
        ) from None
    got = [0] * len(records)
    whole, pos = 0, 0
    buf = (
        memoryview(bytearray(min(block_bytes, max(1, length)))) if buf is None else memoryview(buf).cast("B")
    )
    while pos < length:
        n = min(len(buf), length - pos)
        view = buf[:n]
        ckpt.files.read_into(rel, offset + pos, view, key)
        whole = crc32(view, whole)
        for i, (_name, off, size, _crc) in enumerate(records):
            a, b = max(off, pos), min(off + size, pos + n)
            if a < b:
                got[i] = crc32(view[a - pos : b - pos], got[i])
        pos += n
    for (name, _off, _size, crc), have in zip(records, got):
        if have != crc and crc != 0:  # (0: torch.save's "not computed", see check_record_crcs)
            raise crc_error(name, crc, have, path=path, key=key)
    return whole


def copy_checked_item(
    ckpt: DcpCheckpoint,
    writer: DcpWriter,
    key: str,
    rel: str,
    offset: int,
    length: int,
    *,
    file_index: int,
    chunk=None,
) -> int:
    """Append the item at [offset, offset + length) of data file `rel` (of `key`; `chunk`: its tensor
    chunk, None for a byte item) to `writer` verbatim, checked; returns the CRC-32 of its bytes."""
    e = ckpt.entries[key]
    raw: bytes | FileRange
    if length <= SMALL_ITEM_BYTES or not ckpt.files.kernel_copy(rel):
        raw = ckpt.read_item_checked(rel, offset, length, key)
        crc = crc32(raw)
    else:
        crc = checked_item_crc(ckpt, rel, offset, length, key)
        raw = FileRange(ckpt.files.check_range(rel, offset, length, key), offset, length, ckpt.dir / rel, key)
    if isinstance(e, BytesEntry):
        writer.copy_bytes_item(key, e.path, raw, file_index=file_index)
    else:
        writer.copy_tensor_chunk(
            key, e.path, e.dtype, e.shape, chunk.offsets, chunk.sizes, raw, file_index=file_index
        )
    return crc


def write_checked_item(
    ckpt: DcpCheckpoint,
    slot: ItemSlot,
    key: str,
    rel: str,
    offset: int,
    length: int,
    *,
    buf: memoryview | None = None,
) -> int:
    """`copy_checked_item` into an item already registered (`DcpWriter.reserve_chunk` / `reserve_bytes`: any
    thread may run it): the item checked as it is read (a large one in blocks of the caller's `buf`, then
    copied by `copy_file_range`), written at its place; returns the CRC-32 of its bytes."""
    if length <= SMALL_ITEM_BYTES or not ckpt.files.kernel_copy(rel):
        raw = ckpt.read_item_checked(rel, offset, length, key)
        slot.write_at(0, raw)
        return crc32(raw)
    crc = checked_item_crc(ckpt, rel, offset, length, key, buf=buf)
    slot.copy_at(
        0, FileRange(ckpt.files.check_range(rel, offset, length, key), offset, length, ckpt.dir / rel, key)
    )
    return crc
