"""The adapter check's C kernel (`sources/delta_stats_c.c: value_check`, reached through
`compare.value_check_chunk`) against its definition, `core.tensor_math.check_merged_values` in torch: the
same off / ties / max_ulps / finite on chunks that start and end inside a row, on every base dtype, for W in
bf16 and fp32, with correct merges from two kernels, planted one-ulp and large errors, a wrong scale, and
inf/nan planted. Under CKPT_TOOLS_PURE_PYTHON=1 `value_check_chunk` is the torch path, and only its slicing
of the bound is tested."""
from __future__ import annotations

import math

import pytest
import torch

from ckpt_tools.core.tensor_math import (
    FP32_UNIT_ROUNDOFF, LoraFactors64, check_merged_values, check_merged_values_bounded, lora_factors_fp64,
    lora_product_rows_fp64,
)
from ckpt_tools.sources import compare
from ckpt_tools.sources.compare import value_check_chunk

ROWS, COLS, RANK = 96, 320, 16
BASE_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
# (first, n) of chunks of the flattened block: whole, inside one row, across rows at odd offsets, empty
CHUNKS = [(0, ROWS * COLS), (5, 17), (COLS - 3, 2 * COLS + 7), (7 * COLS + 11, 20 * COLS + 1), (100, 0)]


def _setup(w0_dtype, out_dtype, seed, *, fan_in_fan_out=False):
    g = torch.Generator().manual_seed(seed)
    shape_a, shape_b = ((RANK, COLS), (ROWS, RANK)) if not fan_in_fan_out else ((RANK, ROWS), (COLS, RANK))
    a = (torch.randn(*shape_a, generator=g) * 0.05).to(torch.bfloat16).float()
    b = (torch.randn(*shape_b, generator=g) * 0.05).to(torch.bfloat16).float()
    w0 = (torch.randn(ROWS, COLS, generator=g, dtype=torch.float64) * 0.1).to(w0_dtype)
    delta = b @ a
    if fan_in_fan_out:
        delta = delta.T
    merged = (w0.to(torch.float32) + 1.7 * delta).to(out_dtype)   # PEFT's fp32 merge, scale not a power of 2
    return a, b, w0, merged, lora_factors_fp64(a, b, fan_in_fan_out=fan_in_fan_out), g


def _reference(w, w0, f, first, scale):
    return check_merged_values(w, w0, f, 0, first, scale)


def _both(w, w0, f, scale):
    """value_check_chunk (C where it covers W's dtype) and the definition, on every chunk of CHUNKS; the
    chunks are taken as a diff's row block starting at row 0 would pass them."""
    prod_all = lora_product_rows_fp64(f, 0, ROWS)
    wf, w0f = w.reshape(-1), w0.reshape(-1)
    for first, n in CHUNKS:
        sl = slice(first, first + n)
        got = value_check_chunk(wf[sl], w0f[sl], prod_all[sl], f, 0, first, scale)
        want = _reference(wf[sl], w0f[sl], f, first, scale)
        assert got == want, (first, n, got, want)
    return value_check_chunk(wf, w0f, prod_all, f, 0, 0, scale)


needs_c = pytest.mark.skipif(compare.accelerator is None, reason="delta_stats_c not loaded (CKPT_TOOLS_PURE_PYTHON=1)")


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("w0_dtype", BASE_DTYPES)
def test_a_correct_merge_gives_the_same_counts_as_the_definition_and_passes(w0_dtype, out_dtype):
    _a, _b, w0, merged, f, _g = _setup(w0_dtype, out_dtype, 1)
    whole = _both(merged, w0, f, 1.7)
    assert whole.off == 0 and whole.finite and whole.max_ulps == 0
    if out_dtype != torch.float32:
        assert whole.ties > 0   # bf16/fp16 roundings of fp32 values: some land within the bound of a boundary


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("w0_dtype", [torch.bfloat16, torch.float32])
def test_planted_errors_and_a_wrong_scale_give_the_same_counts_as_the_definition(w0_dtype, out_dtype):
    _a, _b, w0, merged, f, g = _setup(w0_dtype, out_dtype, 2)
    bad = merged.clone().reshape(-1)
    ints = bad.view({torch.bfloat16: torch.int16, torch.float32: torch.int32}[out_dtype])
    at = torch.randperm(bad.numel(), generator=g)[:40]
    ints[at[:20]] += 1                           # one ulp up (a tie may still pass it)
    ints[at[20:30]] -= 3
    bad[at[30:35]] = -bad[at[30:35]]             # sign flips
    bad[at[35]], bad[at[36]], bad[at[37]] = math.inf, -math.inf, math.nan
    whole = _both(bad.view(ROWS, COLS), w0, f, 1.7)
    # fp32: every window holds a few fp32 values (other kernels differ by ulps), so only the far ones fail
    assert (18 if out_dtype == torch.bfloat16 else 8) <= whole.off <= 40 and whole.max_ulps > 3
    wrong = _both(merged, w0, f, 1.7 * 1.01)     # alpha off by 1%
    assert wrong.off > merged.numel() // 10     # (delta / W0 ~ 0.1 here: a 1% change of it moves many roundings)


def test_a_fan_in_fan_out_weight_and_a_nonfinite_expected_value_give_the_same_counts():
    _a, _b, w0, merged, f, _g = _setup(torch.float32, torch.bfloat16, 3, fan_in_fan_out=True)
    assert _both(merged, w0, f, 1.7).off == 0
    w0 = w0.clone()
    w0[3, 4] = math.inf
    w0[50, 0] = math.nan
    w0[1, 1] = 3.3e38                            # finite in fp32, its merge overflows bf16: not finite
    got = _both(merged, w0, f, 1.7)
    assert not got.finite and got.off >= 3


@needs_c
def test_the_c_kernel_runs_for_bf16_and_fp32_weights_and_defers_for_fp16(monkeypatch):
    _a, _b, w0, merged, f, _g = _setup(torch.bfloat16, torch.bfloat16, 4)
    prod = lora_product_rows_fp64(f, 0, ROWS)
    calls = []

    def reference(*args, **kw):
        calls.append(1)
        return check_merged_values_bounded(*args, **kw)

    monkeypatch.setattr(compare, "check_merged_values_bounded", reference)
    value_check_chunk(merged.reshape(-1), w0.reshape(-1), prod, f, 0, 0, 1.7)
    value_check_chunk(merged.float().reshape(-1), w0.reshape(-1), prod, f, 0, 0, 1.7)
    assert calls == []
    value_check_chunk(merged.half().reshape(-1), w0.reshape(-1), prod, f, 0, 0, 1.7)
    assert calls == [1]


def raw(t: torch.Tensor):
    return t.view(torch.uint8).numpy()


@needs_c
def test_the_c_kernel_refuses_buffers_that_do_not_describe_a_chunk():
    f = lora_factors_fp64(torch.ones(2, 4), torch.ones(3, 2))
    w = torch.zeros(8, dtype=torch.bfloat16)
    prod = torch.zeros(8, dtype=torch.float64)
    with pytest.raises(ValueError, match="do not describe one chunk"):   # 8 elements from col 1: 3 rows, 2 norms
        compare.accelerator.value_check(raw(w), 0, raw(w), 0, raw(prod), raw(f.left_norms[:2]),
                                        raw(f.right_norms), raw(f.left[:2]), raw(f.right), 1, 4, 1.0, f.gamma)
    with pytest.raises(ValueError, match="do not describe one chunk"):   # P shorter than W
        compare.accelerator.value_check(raw(w), 0, raw(w), 0, raw(prod[:4]), raw(f.left_norms),
                                        raw(f.right_norms), raw(f.left), raw(f.right), 0, 4, 1.0, f.gamma)
    with pytest.raises(ValueError, match="do not describe one chunk"):   # L's rows do not match their norms
        compare.accelerator.value_check(raw(w[:4]), 0, raw(w[:4]), 0, raw(prod[:4]), raw(f.left_norms),
                                        raw(f.right_norms), raw(f.left[:1]), raw(f.right), 0, 4, 1.0, f.gamma)


# --- the counts do not depend on which kernel computed P ------------------------------------------------------
def one_by_one_factors(l: float) -> LoraFactors64:
    """Rank-1 factors of one element: P = l * 1, exactly l in its fixed order (0 + l*1)."""
    left, right = torch.tensor([[l]], dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64)
    return LoraFactors64(left, right, left.norm(dim=1), right.norm(dim=0), 1)


def window_lower_end(l: float, w0: float, scale: float) -> float:
    """round_bf16(x - e) for P = l (the definition's window, one IEEE operation at a time)."""
    f = one_by_one_factors(l)
    sp = torch.tensor([l], dtype=torch.float64) * scale
    x = torch.tensor([w0], dtype=torch.float64) + sp
    e = ((sp.abs() + x.abs()) * FP32_UNIT_ROUNDOFF + ((f.left_norms * f.right_norms) * f.gamma) * abs(scale)) * 2.0
    return float((x - e).to(torch.float32).to(torch.bfloat16))


def boundary_pair(lo: float, hi: float, w0: float = 0.0, scale: float = 1.0) -> tuple[float, float]:
    """Two adjacent fp64 values of P (one ulp apart: two kernels' products of the same factors can differ so)
    on either side of a rounding boundary of the check's window: bisected over fp64's bit patterns."""
    bits = lambda v: torch.tensor([v], dtype=torch.float64).view(torch.int64).item()   # noqa: E731
    value = lambda b: torch.tensor([b], dtype=torch.int64).view(torch.float64).item()  # noqa: E731
    a, b = sorted((bits(lo), bits(hi)))   # (adjacent patterns are adjacent values, for either sign)
    first = window_lower_end(value(a), w0, scale)
    assert window_lower_end(value(b), w0, scale) != first
    while b - a > 1:
        m = (a + b) // 2
        a, b = (m, b) if window_lower_end(value(m), w0, scale) == first else (a, m)
    return value(a), value(b)


BOUNDARY_CASES = [(1.0, 1.01, 0.0, 1.0), (-1.01, -1.0, 0.0, 1.0), (0.5, 0.51, 0.25, 1.7), (3.0, 3.1, -0.125, 0.5)]


@pytest.mark.parametrize("lo, hi, w0, scale", BOUNDARY_CASES)
def test_where_ps_last_bit_moves_a_rounding_every_kernels_p_gives_the_fixed_order_products_counts(lo, hi, w0, scale):
    """Two products of the same factors one ulp apart straddle a boundary of the window: the definition
    computed with each gives other counts (a tie and a pass, or no tie and one element off), so a check fed
    the BLAS's P would answer by the BLAS. Fed either, the C kernel and the torch path give the fixed-order
    product's counts."""
    pa, pb = boundary_pair(lo, hi, w0, scale)
    base = torch.tensor([w0], dtype=torch.float32)
    for truth in (pa, pb):
        f = one_by_one_factors(truth)
        for w in (window_lower_end(pa, w0, scale), window_lower_end(pb, w0, scale)):
            merged = torch.tensor([w], dtype=torch.bfloat16)
            want = check_merged_values(merged, base, f, 0, 0, scale)
            for given in (pa, pb):
                prod = torch.tensor([given], dtype=torch.float64)
                assert check_merged_values_bounded(merged, base, prod, f, 0, 0, scale) == want, (truth, w, given)
                assert value_check_chunk(merged, base, prod, f, 0, 0, scale) == want, (truth, w, given)
    merged = torch.tensor([window_lower_end(pa, w0, scale)], dtype=torch.bfloat16)
    assert check_merged_values(merged, base, one_by_one_factors(pa), 0, 0, scale) != \
        check_merged_values(merged, base, one_by_one_factors(pb), 0, 0, scale)   # (P's last bit matters to the window)


def test_a_p_from_a_row_blocked_product_gives_the_same_counts_as_the_blas_p():
    """On a whole random block: P by one matmul and by rows of 7 (other kernels, other last bits) give the same
    counts, equal to the definition's (a check by value, not by the BLAS)."""
    _a, _b, w0, merged, f, _g = _setup(torch.bfloat16, torch.bfloat16, 5)
    whole = lora_product_rows_fp64(f, 0, ROWS)
    blocked = torch.cat([lora_product_rows_fp64(f, r, min(ROWS, r + 7)) for r in range(0, ROWS, 7)])
    perturbed = whole + whole.abs() * 2.0 ** -52 * torch.sign(torch.randn(whole.shape, dtype=torch.float64))
    want = check_merged_values(merged.reshape(-1), w0.reshape(-1), f, 0, 0, 1.7)
    for prod in (whole, blocked, perturbed):
        assert value_check_chunk(merged.reshape(-1), w0.reshape(-1), prod, f, 0, 0, 1.7) == want
        assert check_merged_values_bounded(merged.reshape(-1), w0.reshape(-1), prod, f, 0, 0, 1.7) == want
