"""A rebuilt tensor cut into blocks of whole rows (pure: plain facts in, a frozen layout out; no I/O, no
torch).

Every output chunk item of a rebuilt tensor is written streamed (`formats.dcp.stream_item`): its payload is
the row-major bytes of its box of the tensor. A block is rows [start, start + rows) of the whole tensor (all
of its other dims), read from the base and cast once; each output chunk whose rows it crosses gets one
contiguous piece of its payload from it (rows of a chunk are contiguous in its payload, whatever its other
dims: for dim-0 row blocks, FSDP's layout, the piece is the block itself; for any other box, e.g. a column
split, the block's columns of that chunk gathered). Blocks are cut at every chunk's and every original
chunk's (`Segment`: a manifest CRC-32) row boundary, so each block lies inside each, and the CRC-32 of a
chunk or a segment is its blocks' joined in order (`core.crc.crc32_combine`). Blocks are independent:
any thread may make any of them, in any order."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

__all__ = [
    "Block",
    "OutChunk",
    "Piece",
    "TensorLayout",
    "row_blocks_in_order",
    "rows_per_block",
    "tensor_layout",
]


@dataclass(frozen=True)
class OutChunk:
    """One output chunk item: its box (offsets, sizes) and data file index, its payload's bytes per row."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file_index: int
    row_bytes: int

    @property
    def start(self) -> int:
        return self.offsets[0]

    @property
    def rows(self) -> int:
        return self.sizes[0]

    @property
    def payload_bytes(self) -> int:
        return self.rows * self.row_bytes

    @property
    def empty(self) -> bool:
        return self.payload_bytes == 0


@dataclass(frozen=True)
class Piece:
    """Bytes [at, at + nbytes) of output chunk `chunk`'s payload, made from one block."""

    chunk: int
    at: int
    nbytes: int


@dataclass(frozen=True)
class Block:
    index: int  # in the tensor's blocks, which are in row order
    start: int  # first row
    rows: int
    pieces: tuple[Piece, ...]  # of every non-empty output chunk whose rows these are
    segments: tuple[int, ...]  # the segments (original chunks) these rows lie in


@dataclass(frozen=True)
class TensorLayout:
    rows: int
    row_bytes: int  # bytes of one row of the whole tensor, in the output dtype
    chunks: tuple[OutChunk, ...]  # in write order
    row_blocks: bool  # dim-0 row blocks: a block's bytes are its one piece's
    blocks: tuple[Block, ...]

    def chunk_blocks(self, chunk: int) -> tuple[int, ...]:
        """The blocks that make output chunk `chunk`, in order."""
        return tuple(b.index for b in self.blocks if any(p.chunk == chunk for p in b.pieces))

    def segment_blocks(self, segment: int) -> tuple[int, ...]:
        return tuple(b.index for b in self.blocks if segment in b.segments)


def rows_per_block(row_bytes: int, block_bytes: int) -> int:
    """Whole rows in a block of at most `block_bytes` (at least one: a row larger than that is a block)."""
    return max(1, block_bytes // max(1, row_bytes))


def row_blocks_in_order(shape: tuple[int, ...], chunks):
    """`chunks` ((offsets, sizes, file index)) sorted by row, as the writer writes them, when they are dim-0
    row blocks tiling the tensor in order (empty chunks anywhere, an empty one before a full one at its row);
    else None (any other box layout: written in the given order)."""
    if not shape:
        return None
    chunks = sorted(chunks, key=lambda c: (c[0][0], c[1][0] != 0))
    expect = 0
    for offsets, sizes, _fi in chunks:
        if any(o != 0 for o in offsets[1:]) or tuple(sizes[1:]) != tuple(shape[1:]):
            return None
        if sizes[0] == 0:
            continue
        if offsets[0] != expect:
            return None
        expect += sizes[0]
    return chunks if expect == shape[0] else None


def tensor_layout(
    shape: tuple[int, ...], itemsize: int, chunks, segments, block_bytes: int
) -> TensorLayout | None:
    """The blocks of a tensor of `shape` (elements of `itemsize` bytes) written as `chunks` ((offsets, sizes,
    file index), in the order the sequential writer writes them; row blocks are sorted by row, empty ones
    where they fall), checked against `segments` (`Segment`s: start, rows; or None), each block at most
    `block_bytes` of the output (one row at least). None for a scalar or an empty tensor (nothing to
    stream)."""
    if not shape or shape[0] == 0 or math.prod(shape) == 0:
        return None
    rows = shape[0]
    row_bytes = math.prod(shape[1:]) * itemsize
    in_order = row_blocks_in_order(shape, chunks)
    row_blocks = in_order is not None
    chunks = in_order if row_blocks else chunks
    out = tuple(OutChunk(tuple(o), tuple(s), fi, math.prod(s[1:]) * itemsize) for o, s, fi in chunks)
    segs = tuple(segments or ())
    cuts = {0, rows}
    for c in out:
        if not c.empty:
            cuts.update((c.start, c.start + c.rows))
    for g in segs:
        cuts.update((g.start, g.start + g.rows))
    step = rows_per_block(row_bytes, block_bytes)
    blocks: list[Block] = []
    edges = sorted(x for x in cuts if 0 <= x <= rows)
    for lo, hi in itertools.pairwise(edges):
        for start in range(lo, hi, step):
            n = min(step, hi - start)
            pieces = tuple(
                Piece(i, (start - c.start) * c.row_bytes, n * c.row_bytes)
                for i, c in enumerate(out)
                if not c.empty and c.start <= start and start + n <= c.start + c.rows
            )
            inside = tuple(
                j for j, g in enumerate(segs) if g.start <= start and start + n <= g.start + g.rows
            )
            blocks.append(Block(len(blocks), start, n, pieces, inside))
    return TensorLayout(rows, row_bytes, out, row_blocks, tuple(blocks))
