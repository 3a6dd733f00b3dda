"""rehydrate's blocks (ops/rehydrate/blocks.py), on plain facts: every output chunk's payload is made exactly
once, in order, from blocks of whole rows no larger than asked; every block lies inside each chunk and each
original chunk (segment) it touches, so their CRC-32s join from the blocks'; the write order is the
sequential writer's."""
from __future__ import annotations

import math
import zlib

import pytest
import torch

from ckpt_tools.core.crc import crc32_combine
from ckpt_tools.formats.slim.rowcheck import Segment
from ckpt_tools.ops.rehydrate.blocks import row_blocks_in_order, rows_per_block, tensor_layout


def _covers(layout) -> None:
    """Each chunk's pieces tile its payload in block order; each block is at most its step of rows."""
    for i, c in enumerate(layout.chunks):
        pieces = [(b.index, p) for b in layout.blocks for p in b.pieces if p.chunk == i]
        at = 0
        for _b, p in pieces:
            assert p.at == at, (i, pieces)
            at += p.nbytes
        assert at == c.payload_bytes, (i, at, c.payload_bytes)
    rows = [b.start for b in layout.blocks]
    assert rows == sorted(rows) and layout.blocks[0].start == 0
    assert sum(b.rows for b in layout.blocks) == layout.rows


def test_fsdp_row_blocks_are_cut_at_every_chunk_and_block_size_and_each_block_is_one_piece():
    shape, item = (10, 4), 4                                   # 16 bytes a row
    chunks = [((3, 0), (3, 4), 1), ((0, 0), (3, 4), 0), ((6, 0), (4, 4), 2)]
    lay = tensor_layout(shape, item, chunks, None, block_bytes=32)   # 2 rows a block
    assert lay.row_blocks
    assert [c.start for c in lay.chunks] == [0, 3, 6]          # written by row, as the sequential writer does
    assert [(b.start, b.rows) for b in lay.blocks] == [(0, 2), (2, 1), (3, 2), (5, 1), (6, 2), (8, 2)]
    assert all(len(b.pieces) == 1 and b.pieces[0].nbytes == b.rows * 16 for b in lay.blocks)
    _covers(lay)


def test_blocks_are_also_cut_where_an_original_chunk_ends_so_its_crc_joins_from_whole_blocks():
    """--world-size 2 over a 3-rank original: the original chunks straddle the new ones."""
    shape, item = (9, 2), 4
    chunks = [((0, 0), (5, 2), 0), ((5, 0), (4, 2), 1)]
    segs = (Segment(0, 3, 0), Segment(3, 3, 0), Segment(6, 3, 0))
    lay = tensor_layout(shape, item, chunks, segs, block_bytes=1 << 20)
    assert [(b.start, b.rows) for b in lay.blocks] == [(0, 3), (3, 2), (5, 1), (6, 3)]
    assert [b.segments for b in lay.blocks] == [(0,), (1,), (1,), (2,)]
    assert lay.segment_blocks(1) == (1, 2) and lay.chunk_blocks(0) == (0, 1)
    _covers(lay)


def test_the_crc32_of_a_chunk_and_of_an_original_chunk_join_from_their_blocks():
    t = torch.randn(9, 5)
    raw = t.numpy().tobytes()
    lay = tensor_layout((9, 5), 4, [((0, 0), (4, 5), 0), ((4, 0), (5, 5), 1)], (Segment(0, 6, 0), Segment(6, 3, 0)),
                        block_bytes=40)
    crc = {b.index: zlib.crc32(raw[b.start * 20:(b.start + b.rows) * 20]) for b in lay.blocks}

    def joined(blocks):
        out = None
        for i in blocks:
            b = lay.blocks[i]
            out = crc[i] if out is None else crc32_combine(out, crc[i], b.rows * 20)
        return out
    assert joined(lay.chunk_blocks(1)) == zlib.crc32(raw[80:])
    assert joined(lay.segment_blocks(0)) == zlib.crc32(raw[:120])


def test_a_column_split_streams_each_chunk_from_full_row_blocks():
    shape, item = (6, 9), 4
    chunks = [((0, 0), (6, 4), 0), ((0, 4), (6, 5), 1)]
    lay = tensor_layout(shape, item, chunks, None, block_bytes=2 * 36)   # 2 full rows a block
    assert not lay.row_blocks
    assert [c.offsets for c in lay.chunks] == [(0, 0), (0, 4)]   # the given order
    assert [(b.start, b.rows) for b in lay.blocks] == [(0, 2), (2, 2), (4, 2)]
    assert all([p.chunk for p in b.pieces] == [0, 1] for b in lay.blocks)
    assert [p.nbytes for p in lay.blocks[1].pieces] == [2 * 16, 2 * 20] and lay.blocks[1].pieces[1].at == 40
    _covers(lay)
    # the pieces, gathered from each block's rows, are each chunk's row-major bytes
    t = torch.arange(54, dtype=torch.float32).reshape(shape)
    for i, c in enumerate(lay.chunks):
        want = t[:, c.offsets[1]:c.offsets[1] + c.sizes[1]].contiguous().numpy().tobytes()
        got = b"".join(t[b.start:b.start + b.rows, c.offsets[1]:c.offsets[1] + c.sizes[1]].contiguous().numpy().tobytes()
                       for b in lay.blocks for p in b.pieces if p.chunk == i)
        assert got == want


def test_a_block_holds_one_row_at_least_and_scalars_and_empty_tensors_do_not_stream():
    assert rows_per_block(row_bytes=100, block_bytes=10) == 1
    lay = tensor_layout((3, 100), 4, [((0, 0), (3, 100), 0)], None, block_bytes=8)
    assert [b.rows for b in lay.blocks] == [1, 1, 1]
    assert tensor_layout((), 4, [((), (), 0)], None, 1 << 20) is None
    assert tensor_layout((0, 4), 4, [((0, 0), (0, 4), 0)], None, 1 << 20) is None
    assert tensor_layout((4, 0), 4, [((0, 0), (4, 0), 0)], None, 1 << 20) is None


def test_empty_chunks_keep_the_sequential_writers_place_and_make_no_piece():
    shape = (4, 2)
    chunks = [((2, 0), (2, 2), 2), ((2, 0), (0, 2), 1), ((0, 0), (2, 2), 0)]
    assert row_blocks_in_order(shape, chunks) == [((0, 0), (2, 2), 0), ((2, 0), (0, 2), 1), ((2, 0), (2, 2), 2)]
    lay = tensor_layout(shape, 4, chunks, None, block_bytes=1 << 20)
    assert [c.file_index for c in lay.chunks] == [0, 1, 2] and lay.chunks[1].empty
    assert all(p.chunk != 1 for b in lay.blocks for p in b.pieces)
    _covers(lay)


@pytest.mark.parametrize("chunks", [
    [((0, 0), (4, 2), 0), ((3, 0), (1, 2), 1)],        # overlapping rows
    [((0, 1), (4, 1), 0), ((0, 0), (4, 1), 1)],        # columns
    [((1, 0), (3, 2), 0), ((0, 0), (1, 1), 1), ((0, 1), (1, 1), 2)],
])
def test_any_box_layout_that_is_not_row_blocks_is_kept_in_its_given_order(chunks):
    assert row_blocks_in_order((4, 2), chunks) is None
    lay = tensor_layout((4, 2), 4, chunks, None, block_bytes=8)
    assert [(c.offsets, c.sizes, c.file_index) for c in lay.chunks] == [tuple(map(tuple, c[:2])) + (c[2],) for c in chunks]
    _covers(lay)
    assert all(math.prod(c.sizes) * 4 == c.payload_bytes for c in lay.chunks)
