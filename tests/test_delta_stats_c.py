"""The C statistics kernel (`sources/delta_stats_c.c`) against their definition, the torch path
(`compare.reference_chunk_stats`): counts, max |d| and the finite flag bit for bit, the two sums to
1e-12 relative (they are summed in another fixed order), on every dtype it covers, with inf/nan,
-0.0 and subnormals planted, on identical chunks, and on every fp16 and bf16 bit pattern."""
import math

import pytest
import torch

from ckpt_tools.core.accel import pure_python
from ckpt_tools.sources import compare
from ckpt_tools.sources.compare import ChunkStats, chunk_stats, identical_chunk_stats, reference_chunk_stats

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, torch.float64: 3}
SUBNORMAL = {torch.bfloat16: 1e-39, torch.float16: 3e-6, torch.float32: 1e-40, torch.float64: 1e-310}
LENGTHS = [0, 1, 3, 7, 8, 9, 17, 1000, 2**18]


# The tests of the C kernel itself; under CKPT_TOOLS_PURE_PYTHON=1 (CI's second pass) only the torch-path
# tests at the end run.
needs_c = pytest.mark.skipif(pure_python(), reason="CKPT_TOOLS_PURE_PYTHON=1: delta_stats_c is not loaded")


def test_the_c_fast_path_is_built_unless_turned_off():
    """`make install` compiles ckpt_tools/sources/delta_stats_c.c (gcc is on every machine we run on):
    without it every comparison below would check the torch path against itself. CKPT_TOOLS_PURE_PYTHON=1
    must keep it unloaded (this says which path the run tested)."""
    if pure_python():
        assert compare.accelerator is None, "CKPT_TOOLS_PURE_PYTHON=1 but delta_stats_c was loaded"
    else:
        assert compare.accelerator is not None, "delta_stats_c was not built: `make install` with gcc at hand"


def _raw(t: torch.Tensor):
    return t.view(torch.uint8).numpy()


def _sum_close(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b) or math.isinf(a) or math.isinf(b):
        return (math.isnan(a) and math.isnan(b)) or a == b
    return abs(a - b) <= 1e-12 * max(abs(a), abs(b))


def _assert_same(got: ChunkStats, want: ChunkStats) -> None:
    assert (got.numel, got.changed, got.nonfinite, got.finite) == (want.numel, want.changed, want.nonfinite,
                                                                  want.finite)
    assert got.max_abs == want.max_abs                     # bit for bit (both are +0.0 or the same value)
    assert math.copysign(1.0, got.max_abs) == math.copysign(1.0, want.max_abs)
    assert _sum_close(got.base_sq, want.base_sq), (got.base_sq, want.base_sq)
    assert _sum_close(got.delta_sq, want.delta_sq), (got.delta_sq, want.delta_sq)


def _pair(n: int, dtype: torch.dtype, seed: int, plant: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w0 = (torch.randn(n, generator=g, dtype=torch.float64) * 3).to(dtype)
    moved = torch.rand(n, generator=g) < 0.5          # about half the elements change
    w = torch.where(moved, (w0.double() + 1e-2 * torch.randn(n, generator=g, dtype=torch.float64)).to(dtype), w0)
    if plant and n:
        specials = [math.inf, -math.inf, math.nan, -0.0, 0.0, SUBNORMAL[dtype], -SUBNORMAL[dtype]]
        for side in (w, w0):
            idx = torch.randint(0, n, (min(n, 12),), generator=g)
            for k, i in enumerate(idx.tolist()):
                side[i] = specials[k % len(specials)]
    return w, w0


@needs_c
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", LENGTHS)
def test_random_chunks_match_the_torch_path(dtype, n):
    for seed, plant in ((n, False), (n + 1, True)):
        w, w0 = _pair(n, dtype, seed, plant)
        got, want = chunk_stats(w, w0), reference_chunk_stats(w, w0)
        assert compare.accelerator.chunk_stats(_raw(w), _raw(w0), CODES[dtype]) is not None   # the C path ran
        _assert_same(got, want)
        if plant and n >= 24:
            assert not want.finite and want.nonfinite    # the planted inf/nan were seen (the test can fail)


@needs_c
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", LENGTHS)
def test_identical_chunks(dtype, n):
    for plant in (False, True):
        w, w0 = _pair(n, dtype, 7 * n + 3, plant)
        same = w0.clone()
        _assert_same(chunk_stats(same, w0), reference_chunk_stats(same, w0))
        c, ref = identical_chunk_stats(w0), reference_chunk_stats(w0, w0)
        _assert_same(c, ref)
        # ||W0||^2 has the same bits whether the chunk came out identical or not (one order in C)
        if n and not plant:
            assert c.base_sq == chunk_stats(w, w0).base_sq


@needs_c
def test_signed_zero_and_nan_payloads_count_as_changed():
    w0 = torch.tensor([0.0, 1.0, math.nan, 2.0, 0.0, 0.0, 0.0, 0.0, 0.0], dtype=torch.float32)
    w = w0.clone()
    w[0] = -0.0                                                   # d = 0, but the bits differ
    w.view(torch.int32)[2] = w0.view(torch.int32)[2] ^ 1          # another nan payload
    got, want = chunk_stats(w, w0), reference_chunk_stats(w, w0)
    _assert_same(got, want)
    assert got.changed == 2 and got.nonfinite == 1 and got.max_abs == 0.0 and not got.finite


@needs_c
def test_fp64_overflow_is_not_finite_without_nonfinite_elements():
    """Squares past fp64's range: the sums are inf though every d is finite, as torch.dot's."""
    w0 = torch.tensor([1e200, 1.0, -3e200, 2.0, 5.0], dtype=torch.float64)
    w = w0 + torch.tensor([0.0, 1e-3, 0.0, 1.0, 0.0], dtype=torch.float64)
    got, want = chunk_stats(w, w0), reference_chunk_stats(w, w0)
    _assert_same(got, want)
    assert not got.finite and got.nonfinite == 0 and math.isinf(got.base_sq)


@needs_c
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 8])
def test_every_16_bit_pattern_converts_exactly(dtype, n):
    """Each of the 65536 patterns x, in a chunk of n (1: the scalar tail; 8: the vector loads, x in lane
    x % 8) against W0 = 1.0 there and 0 elsewhere: max |d| = |fp64(x) - 1| and ||d||^2 its square,
    exactly as torch converts x; inf/nan counted as non-finite. A wrong sign, exponent or subnormal
    in the conversion changes |x - 1|."""
    patterns = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16)
    d = (patterns.view(dtype).to(torch.float64) - 1.0).tolist()
    w, w0 = torch.zeros(n, dtype=torch.int16), torch.zeros(n, dtype=dtype)
    w_raw, w0_raw, code = _raw(w), _raw(w0), CODES[dtype]
    for p, bits in enumerate(patterns.tolist()):
        lane = p % n
        w.zero_()
        w0.zero_()
        w[lane], w0[lane] = bits, 1.0
        changed, base_sq, delta_sq, nonfinite, max_abs, finite = compare.accelerator.chunk_stats(w_raw, w0_raw, code)
        dp = d[p]
        assert (changed, base_sq) == (1 if dp != 0 else 0, 1.0), p
        if math.isfinite(dp):
            assert (max_abs, delta_sq, nonfinite, finite) == (abs(dp), dp * dp if dp else 0.0, 0, True), p
        else:
            assert (max_abs, delta_sq, nonfinite, finite) == (0.0, 0.0, 1, False), p


@needs_c
def test_a_misaligned_buffer_is_left_to_the_torch_path():
    buf = bytearray(2 * 9 + 1)
    view = memoryview(buf)[1:]                                    # odd address: not aligned to bf16
    assert compare.accelerator.chunk_stats(view, view, 0) is None
    assert compare.accelerator.base_sq(view, 0) is None
    with pytest.raises(ValueError):
        compare.accelerator.chunk_stats(bytearray(6), bytearray(4), 2)


@needs_c
def test_same_bytes():
    same = compare.accelerator.same_bytes
    a = bytearray(range(256)) * 2048
    b = bytearray(a)
    assert same(a, b) and same(bytearray(), bytearray())
    b[-1] ^= 1
    assert not same(a, b) and not same(a, a[:-1])


def test_without_the_extension_the_torch_path_answers(monkeypatch):
    w, w0 = _pair(1000, torch.bfloat16, 5, True)
    with_c = chunk_stats(w, w0)
    monkeypatch.setattr(compare, "accelerator", None)
    _assert_same(chunk_stats(w, w0), reference_chunk_stats(w, w0))
    _assert_same(with_c, chunk_stats(w, w0))


def test_other_dtypes_take_the_torch_path():
    w0 = torch.arange(20, dtype=torch.int32)
    w = w0.clone()
    w[3] = 100
    st = chunk_stats(w, w0)
    assert (st.changed, st.max_abs, st.delta_sq) == (1, 97.0, 97.0 ** 2)


def test_diff_vs_base_reports_the_same_with_and_without_the_extension(monkeypatch):
    """The whole read path (chunks handed to C as the bytearrays they were read into, identical chunks
    folded from BASE alone): the fixture's merged model against its base, in small blocks so every
    tensor spans many chunks, as the torch path reports it."""
    from ckpt_tools.ops.diff.run import diff_vs_base

    from .conftest import BASE, FIXTURE

    def report():
        return {t.name: t for t in diff_vs_base(FIXTURE / "expected_merged_hf", BASE, block_bytes=4096).tensors}

    with_c = report()
    monkeypatch.setattr(compare, "accelerator", None)
    torch_only = report()
    assert with_c.keys() == torch_only.keys() and any(t.changed_elements for t in with_c.values())
    for name, t in torch_only.items():
        c = with_c[name]
        assert (c.status, c.changed_elements, c.max_abs_delta, c.nonfinite) == (
            t.status, t.changed_elements, t.max_abs_delta, t.nonfinite), name
        assert _sum_close(c.rel_fro, t.rel_fro), (name, c.rel_fro, t.rel_fro)
