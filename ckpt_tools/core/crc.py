"""CRC-32 (the zip / zlib polynomial): the checksum torch.save stores for every record of an archive,
so of every DCP storage item. `crc32(data, value)` is ISA-L's (the optional `isal` package: about
5 GB/s on one core, measured on the 2-core test machine) where it is installed, else zlib's (about
0.9 GB/s there); both give the same value and release the GIL for large buffers. `crc32_combine`
joins the CRCs of two adjacent pieces without their bytes (zlib's own algorithm, which Python's zlib
does not expose), so pieces of one record read in any order, on any thread, are checked without a
second read. `PieceChecker` does that bookkeeping for the readers.
"""

from __future__ import annotations

import threading
import zlib

try:  # optional: `pip install ckpt-tools[fast]`
    from isal.isal_zlib import crc32 as _fast_crc32
except ImportError:  # pragma: no cover - depends on the environment
    _fast_crc32 = None

__all__ = ["CRC_IMPL", "PieceChecker", "crc32", "crc32_combine"]

CRC_IMPL = "isal" if _fast_crc32 is not None else "zlib"


def crc32(data, value: int = 0) -> int:
    """The CRC-32 of `data` (anything the buffer protocol takes), continuing from `value`."""
    if _fast_crc32 is not None:
        return _fast_crc32(data, value)
    return zlib.crc32(data, value)


_POLY = 0xEDB88320  # reflected


def _multmodp(a: int, b: int) -> int:
    """a * b modulo the CRC polynomial, in the reflected bit order zlib uses."""
    m, p = 1 << 31, 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                break
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return p


def _x2n_table() -> list[int]:
    p, table = 1 << 30, []  # x^1
    for _ in range(32):
        table.append(p)
        p = _multmodp(p, p)
    return table


_X2N = _x2n_table()


def _x8nmodp(n: int) -> int:
    """x^(8n) modulo the polynomial."""
    p, k = 1 << 31, 3  # x^0; start at x^(2^3) = x^8
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A + B from crc1 = crc32(A), crc2 = crc32(B) and len(B)."""
    return _multmodp(_x8nmodp(len2), crc1) ^ crc2


class PieceChecker:
    """Checks records read piece by piece against their stored CRC-32, without reading anything twice.

    `feed(record, size, crc, offset, data)`: `data` is bytes [offset, offset + len(data)) of the record
    `record` (any hashable id) of `size` bytes whose stored CRC is `crc`. Pieces may come in any order
    and from any thread; adjacent ones are joined (`crc32_combine`). When the pieces cover the record,
    its CRC is compared: `feed` returns False on a mismatch (the caller raises, naming the file), True
    otherwise. A record already checked is not checked again (a re-read); a piece overlapping one
    already held is ignored (that record is then left unchecked: `unchecked()` lists those)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict = {}  # record -> {start: (end, crc)}
        self._done: set = set()
        self.checked = 0  # records proven

    def feed(self, record, size: int, crc: int, offset: int, data) -> bool:
        if record in self._done:
            return True
        n = len(memoryview(data).cast("B")) if not isinstance(data, (bytes, bytearray)) else len(data)
        if n == 0 and size:
            return True
        c = crc32(data)  # outside the lock: the workers hash in parallel
        with self._lock:
            if record in self._done:
                return True
            pieces = self._open.setdefault(record, {})
            start, end = offset, offset + n
            if any(s < end and start < e for s, (e, _c) in pieces.items()):
                return True  # overlaps a piece held: not counted (see unchecked)
            left = next((s for s, (e, _c) in pieces.items() if e == start), None)
            if left is not None:
                _e, lc = pieces.pop(left)
                c, start = crc32_combine(lc, c, n), left
            right = pieces.pop(end, None)
            if right is not None:
                re, rc = right
                c, end = crc32_combine(c, rc, re - end), re
            if start == 0 and end >= size:
                del self._open[record]
                self._done.add(record)
                self.checked += 1
                return c == crc
            pieces[start] = (end, c)
            return True

    def unchecked(self) -> list:
        """Records read in part only (or with overlapping pieces): their CRC was not compared."""
        with self._lock:
            return sorted(self._open, key=repr)
