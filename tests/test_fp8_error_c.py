"""The FP8 error figure's C kernel (`core/fp8_error_c.c`) against its definition, the torch and numpy path
(`core.fp8.reference_error_sq`), and both against plain fp64 arithmetic: every e4m3fn code decoded as torch
decodes it; the sum equal to the fp64 sum of the same fp32 per-element terms to 1e-12 relative (another fixed
order), and to the reference's fp32 dot product to 1e-4; on blocks with partial 128x128 blocks, widths that are
not multiples of the vector width, all-zero blocks and subnormal codes. A NaN code or a buffer it cannot read
sends it to the reference. The codes and scales are never the kernel's: `quantize_rows_into` is checked here to
give the same bytes and figures with and without it."""

import math
import platform

import numpy as np
import pytest
import torch

from ckpt_tools.core import fp8
from ckpt_tools.core.accel import pure_python
from ckpt_tools.core.fp8 import QuantSums, error_sq, grid_shape, quantize_rows_into, reference_error_sq

# The tests of the C kernel itself; under CKPT_TOOLS_PURE_PYTHON=1 (CI's second pass) only the reference's run.
needs_c = pytest.mark.skipif(pure_python(), reason="CKPT_TOOLS_PURE_PYTHON=1: fp8_error_c is not loaded")

SHAPES = [(512, 1024), (128, 12288 // 8), (200, 162), (64, 1000), (384, 130), (130, 7), (1, 1), (3, 9)]


def test_the_c_fast_path_is_built_unless_turned_off():
    """`make install` compiles ckpt_tools/core/fp8_error_c.c (gcc is on every machine we run on): without it
    every comparison below would check the reference against itself. CKPT_TOOLS_PURE_PYTHON=1 must keep it
    unloaded (this says which path the run tested)."""
    if pure_python():
        assert fp8.accelerator is None, "CKPT_TOOLS_PURE_PYTHON=1 but fp8_error_c was loaded"
    else:
        assert fp8.accelerator is not None, "fp8_error_c was not built: `make install` with gcc at hand"


def quantized(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(W32, the clamped W32 / scale, codes, scales) of a random block with zeros, tiny values and a zero
    128x128 block planted."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w[: min(rows, 128), : min(cols, 128)] = 0.0  # an all-zero block: scale 1, codes 0
    if rows > 130 and cols > 130:
        w[129, 129] = 1e-9  # beside larger values: a subnormal code
        w[130, 129:140] = -3e-7
    x = w.clone()
    codes = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scales = torch.empty(grid_shape((rows, cols)))
    quantize_rows_into(x, codes, scales)
    return w, x, codes, scales


def terms_fp64(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> float:
    """The definition's per-element fp32 terms, scale * (decode(q) - x), summed in fp64."""
    rows, cols = x.shape
    s = scales.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    d = (codes.float() - x) * s
    return float((d.double() ** 2).sum())


@needs_c
def test_the_kernel_decodes_every_code_as_torch_does():
    ours = torch.tensor(fp8.accelerator.decode_all(), dtype=torch.float32)
    torch_values = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite = [k for k in range(256) if k & 0x7F != 0x7F]  # 0x7f, 0xff: NaN
    assert len(finite) == 254
    for k in finite:
        assert ours[k].item() == torch_values[k].item(), k
        assert math.copysign(1.0, ours[k].item()) == math.copysign(1.0, torch_values[k].item()), k  # -0.0


@needs_c
@pytest.mark.parametrize("shape", SHAPES)
def test_the_kernel_sums_the_definitions_terms(shape):
    _, x, codes, scales = quantized(*shape, seed=sum(shape))
    got = fp8.accelerator.error_sq(x.numpy(), codes.view(torch.uint8).numpy(), scales.numpy(), *shape)
    want = terms_fp64(x, codes, scales)
    assert got == pytest.approx(want, rel=1e-12, abs=1e-300)
    assert reference_error_sq(x, codes, scales) == pytest.approx(want, rel=1e-4)
    assert error_sq(x, codes, scales) == got  # the dispatcher takes the kernel's answer


@needs_c
@pytest.mark.parametrize("shape", SHAPES)
def test_every_vector_path_gives_the_scalar_paths_bits(shape):
    """Scalar, SSE2 and AVX2 (those this machine has: x86-64 has SSE2, the GPU host and this one AVX2) add the
    same terms into the same lanes in the same order: the figure does not depend on the CPU."""
    _, x, codes, scales = quantized(*shape, seed=3 * sum(shape))
    best = fp8.accelerator.best_path()
    if platform.machine() in ("x86_64", "AMD64"):
        assert best >= 1  # every x86-64 build has SSE2
    got = [
        fp8.accelerator.error_sq(x.numpy(), codes.view(torch.uint8).numpy(), scales.numpy(), *shape, path)
        for path in range(best + 1)
    ]
    assert all(g == got[0] for g in got), got


@pytest.mark.parametrize("shape", SHAPES)
def test_the_figures_are_the_quantization_error_against_w32(shape):
    """Whichever path runs: ||W32||^2 and ||deq(q) - W32||^2 as plain fp64 arithmetic on the output."""
    w, _, codes, scales = quantized(*shape, seed=7 + sum(shape))
    sums = QuantSums()
    x = w.clone()
    codes2 = torch.empty_like(codes)
    scales2 = torch.empty_like(scales)
    quantize_rows_into(x, codes2, scales2, sums=sums)
    assert torch.equal(codes2.view(torch.uint8), codes.view(torch.uint8)) and torch.equal(scales2, scales)
    rows, cols = shape
    deq = codes.double() * scales.double().repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    assert sums.w_sq == pytest.approx(float((w.double() ** 2).sum()), rel=1e-5)
    assert sums.err_sq == pytest.approx(float(((deq - w.double()) ** 2).sum()), rel=1e-4)


@needs_c
def test_a_nan_code_or_an_unreadable_buffer_goes_to_the_reference():
    _, x, codes, scales = quantized(256, 300, seed=3)
    raw = codes.view(torch.uint8).clone()
    raw[200, 17] = 0x7F  # NaN (never cast from a clamped finite value)
    bad = raw.view(torch.float8_e4m3fn)
    assert fp8.accelerator.error_sq(x.numpy(), raw.numpy(), scales.numpy(), 256, 300) is None
    assert math.isnan(error_sq(x, bad, scales))  # the reference's answer: the NaN code decodes to NaN
    # an fp32 buffer one byte off its alignment
    space = np.zeros(x.numel() * 4 + 1, dtype=np.uint8)
    shifted = space[1:].view(np.uint8)
    shifted[:] = x.numpy().view(np.uint8).reshape(-1)
    assert fp8.accelerator.error_sq(shifted, raw.numpy(), scales.numpy(), 256, 300) is None
    # a column slice is not contiguous: the reference
    part = x[:, :128]
    assert error_sq(part, codes[:, :128].contiguous(), scales[:, :1].contiguous()) == pytest.approx(
        terms_fp64(part, codes[:, :128], scales[:, :1]), rel=1e-4
    )


@needs_c
def test_wrong_buffer_sizes_are_refused():
    _, x, codes, scales = quantized(128, 256, seed=5)
    with pytest.raises(ValueError, match="bytes for a 128 x 300 block"):
        fp8.accelerator.error_sq(x.numpy(), codes.view(torch.uint8).numpy(), scales.numpy(), 128, 300)


def test_the_reference_runs_without_the_kernel(monkeypatch):
    """CKPT_TOOLS_PURE_PYTHON's path, in any run: the dispatcher with no kernel gives the reference's figure."""
    _, x, codes, scales = quantized(300, 260, seed=11)
    monkeypatch.setattr(fp8, "accelerator", None)
    assert error_sq(x, codes, scales) == reference_error_sq(x, codes, scales)
