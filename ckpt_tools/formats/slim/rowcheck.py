"""A rebuilt tensor checked against its slim manifest identification as its rows stream by, whatever row
chunks it is written in: the sha256 of the whole tensor (when recorded) and the CRC-32 of each original
chunk (`segments`: rows [start, start + rows) and the CRC its item stored). Memory: none (hash states)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

from ...core.crc import crc32

__all__ = ["RowCheck", "Segment", "segments_of"]


@dataclass(frozen=True)
class Segment:
    start: int  # first row
    rows: int
    crc: int  # the CRC-32 the original chunk's item stored for its payload


def segments_of(chunks, crcs) -> tuple[Segment, ...] | None:
    """The original chunks (`ChunkLayout`s, row blocks) with their CRC-32s as segments sorted by row; empty
    chunks left out. None without CRCs."""
    if crcs is None:
        return None
    segs = [Segment(c.offsets[0], c.sizes[0], crc) for c, crc in zip(chunks, crcs) if c.sizes and c.sizes[0]]
    return tuple(sorted(segs, key=lambda s: s.start))


@dataclass
class RowCheck:
    """Feed a tensor's rows in increasing row order (`feed(row, data)`, `data` = whole rows of `row_bytes`);
    gaps are allowed (a rank that reads only its own rows): a segment or the sha256 that was not fed whole
    is left unchecked. `mismatch()` is the first failing check, as text, or None."""

    row_bytes: int
    rows: int
    sha256: str | None
    segments: tuple[Segment, ...] | None
    _h: Any = None  # a hashlib sha256 (its class has no public name)
    _next: int = 0  # the row the sha256 expects next (-1: a gap, not checkable)
    _seg: dict = field(default_factory=dict)  # segment index -> (next row, crc so far); -1 row: a gap
    checked: int = 0  # checks made (segments whole, the sha256)
    failed: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.sha256 is not None:
            self._h = hashlib.sha256()

    def feed(self, row: int, data, *, segments: bool = True) -> None:
        """`segments=False`: the sha256 only (the caller reports the segment's CRC itself, `segment_crc`)."""
        view = memoryview(data).cast("B")
        n = len(view) // max(1, self.row_bytes) if self.row_bytes else 0
        if self._h is not None:
            if row == self._next:
                self._h.update(view)
                self._next = row + n
            else:
                self._next = -1
        for i, s in enumerate(self.segments if segments and self.segments else ()):
            a, b = max(row, s.start), min(row + n, s.start + s.rows)
            if a >= b:
                continue
            at, crc = self._seg.get(i, (s.start, 0))
            if at != a:
                self._seg[i] = (-1, 0)
                continue
            crc = crc32(view[(a - row) * self.row_bytes : (b - row) * self.row_bytes], crc)
            self._seg[i] = (b, crc)
            if b == s.start + s.rows:
                self._compare(s, crc)

    def segment_of(self, start: int, rows: int) -> int | None:
        """The index of the segment of exactly rows [start, start + rows), if any."""
        return next(
            (i for i, s in enumerate(self.segments or ()) if (s.start, s.rows) == (start, rows)), None
        )

    def segment_crc(self, index: int, crc: int) -> None:
        """The CRC-32 of segment `index`'s rows, computed by the caller (a writer that has it anyway)."""
        assert self.segments is not None  # `index` is one of segment_of's
        self._seg[index] = (-1, 0)
        self._compare(self.segments[index], crc)

    def _compare(self, s: Segment, crc: int) -> None:
        self.checked += 1
        if crc != s.crc:
            self.failed.append(
                f"rows {s.start}..{s.start + s.rows} have CRC-32 {crc:#010x}, the slim "
                f"manifest recorded {s.crc:#010x}"
            )

    def sha256_done(self) -> str | None:
        """The sha256 of what was fed, when every row was fed in order; else None."""
        if self._h is None or self._next != self.rows:
            return None
        return self._h.hexdigest()

    def complete(self) -> bool:
        """Every recorded check was made (every row fed in order)."""
        sha_ok = self.sha256 is None or self._next == self.rows
        return sha_ok and self.checked == len(self.segments or ())
