"""The merge pipeline makes a merged weight in row blocks (`plan.merge_row_blocks`), each with its own
product `B32[rows] @ A32`. That is byte-identical to the one whole-tensor merge only if this machine's
BLAS gives every product row the same bits whatever the number of rows in the call (it does not for
1-3 rows on MKL: hence MIN_BLOCK_ROWS). Checked here, at the shapes of the real models, on the BLAS
that runs the suite, with one intra-op thread as in the workers."""
from __future__ import annotations

import pytest
import torch

from ckpt_tools.core.tensor_math import merge_weight, merge_weight_into
from ckpt_tools.ops.merge.plan import MIN_BLOCK_ROWS, merge_row_blocks

# (rows, cols) of Qwen3 projections: 0.6B/1.7B/8B widths (q/o, k/v, gate/up, down); fan_in_fan_out too
SHAPES = [((2048, 1024), 16, False), ((1024, 3072), 32, False), ((6144, 2048), 32, False), ((1024, 4096), 32, False),
          ((12288, 4096), 32, False), ((4096, 12288), 32, False), ((3072, 1024), 8, True), ((4096, 1024), 32, True)]


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("shape,r,fifo", SHAPES, ids=lambda v: str(v))
def test_row_blocks_merge_to_the_whole_tensors_bytes(shape, r, fifo):
    g = torch.Generator().manual_seed(sum(shape) + r)
    w = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    out_f, in_f = (shape[1], shape[0]) if fifo else shape
    a, b = torch.randn(r, in_f, generator=g) * 0.02, torch.randn(out_f, r, generator=g) * 0.02
    whole = merge_weight(w, a, b, 2.0, out_dtype=torch.bfloat16, fan_in_fan_out=fifo)
    blocks = list(merge_row_blocks(shape))
    assert sum(n for _, n in blocks) == shape[0] and all(n >= MIN_BLOCK_ROWS for _, n in blocks)
    for s, n in blocks:
        a_rows, b_rows = (a[:, s:s + n], b) if fifo else (a, b[s:s + n])
        got = merge_weight_into(torch.empty((n, shape[1]), dtype=torch.bfloat16), w[s:s + n], a_rows, b_rows, 2.0,
                                fan_in_fan_out=fifo)
        assert torch.equal(got.view(torch.int16), whole[s:s + n].view(torch.int16)), (shape, s, n)


def test_small_blocks_of_64_rows_and_a_joined_tail(monkeypatch):
    monkeypatch.setattr("ckpt_tools.ops.merge.plan.MERGE_BLOCK_ELEMS", 64 * 512)
    shape = (64 * 7 + 40, 512)             # 7 blocks of 64 rows; the 40-row tail joins the last
    blocks = list(merge_row_blocks(shape))
    assert blocks[-1] == (64 * 6, 104) and len(blocks) == 7
    test_row_blocks_merge_to_the_whole_tensors_bytes(shape, 8, False)
    test_row_blocks_merge_to_the_whole_tensors_bytes((shape[1], shape[0]), 8, True)


@pytest.mark.parametrize("shape", [(512, 1024), (130, 4096), (64, 162)], ids=str)
def test_w32_made_in_place_of_its_product_has_the_bits_of_a_separate_output(shape):
    """An FP8 merge makes W32 in the fp32 product's own buffer (`out` is `scratch`): the same bits as W32
    written to a buffer of its own; a fan_in_fan_out product (the transpose of W32's rows) or an `out` that
    shares the scratch at another offset is refused, never silently overwritten."""
    g = torch.Generator().manual_seed(sum(shape))
    w = (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)
    a, b = torch.randn(16, shape[1], generator=g) * 0.02, torch.randn(shape[0], 16, generator=g) * 0.02
    apart = merge_weight_into(torch.empty(shape), w, a, b, 2.0, scratch=torch.empty(shape[0] * shape[1]))
    space = torch.empty(shape[0] * shape[1] + 8)
    inplace = space[: shape[0] * shape[1]].view(shape)
    got = merge_weight_into(inplace, w, a, b, 2.0, scratch=space)
    assert got.data_ptr() == space.data_ptr()
    assert torch.equal(got.view(torch.int32), apart.view(torch.int32))
    assert torch.equal(apart, merge_weight(w, a, b, 2.0, out_dtype=torch.float32))
    with pytest.raises(ValueError, match="only as its start"):
        merge_weight_into(space[8:].view(shape), w, a, b, 2.0, scratch=space)
    with pytest.raises(ValueError, match="only as its start"):
        merge_weight_into(inplace.view(shape[1], shape[0]), w.T.contiguous(), a, b, 2.0, fan_in_fan_out=True,
                          scratch=space)
