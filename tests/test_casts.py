"""core/casts.py casts raw bytes with numpy exactly as torch's CPU casts do: every bf16 value upcast, fp32
values of every class (normal, subnormal, zero, inf, NaN, the rounding ties, overflow) rounded to bf16, and
the bf16 rounding of a Python float."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ckpt_tools.core.casts import bf16_round, cast_into, exact_cast
from ckpt_tools.formats.handle import RawTensor


def torch_bf16_bits(u32: np.ndarray) -> np.ndarray:
    return torch.from_numpy(u32.view(np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def test_every_bf16_value_upcasts_to_torchs_fp32_bits():
    b = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    out = np.empty(b.size, np.uint32)
    cast_into("bfloat16", "float32", b, out)
    ref = torch.from_numpy(b.view(np.int16)).view(torch.bfloat16).float().view(torch.int32).numpy().view(np.uint32)
    assert np.array_equal(out, ref)


EDGES = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x00008000,
         0x00018000, 0x00017FFF, 0x00007FFF, 0x3F808000, 0x3F818000, 0x3F80FFFF, 1, 0x807FFFFF,
         0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7FFFFFFF, 0xFF800001]   # ties, overflow, NaNs of any sign/payload


def test_fp32_rounds_to_torchs_bf16_bits_on_every_class_of_value():
    rng = np.random.default_rng(22)
    u = np.concatenate([np.array(EDGES, np.uint32), rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint64).astype(np.uint32),
                        (rng.integers(0, 1 << 16, 1 << 16, dtype=np.uint32) << 16) | 0x8000])   # every tie
    out = np.empty(u.size, np.uint16)
    cast_into("float32", "bfloat16", u, out)
    assert np.array_equal(out, torch_bf16_bits(u))


@pytest.mark.parametrize("x", [0.5, 2.0, 1 / 3, 7 / 3, 1.0000001, 1e-45, 3.3895313892515355e38, 1e39, -1e39,
                               float("inf"), -0.0, 64 / 32])
def test_bf16_round_of_a_float_is_torchs(x):
    ref = float(torch.tensor(float(x), dtype=torch.float32).to(torch.bfloat16).float())
    assert bf16_round(x) == ref and np.signbit(bf16_round(x)) == np.signbit(ref)


def test_only_exact_pairs_are_cast_and_a_size_mismatch_is_refused():
    assert exact_cast("bfloat16", "float32") and exact_cast("float32", "bfloat16") and exact_cast("int8", "int8")
    assert not exact_cast("float16", "float32")
    with pytest.raises(ValueError):
        cast_into("float16", "float32", bytes(4), bytearray(8))
    with pytest.raises(ValueError):
        cast_into("bfloat16", "float32", bytes(4), bytearray(4))


def test_a_raw_tensor_casts_as_torch_whatever_the_pair():
    """A pair numpy does not cast exactly (fp16 -> fp32) goes through torch: the same bits either way."""
    t = torch.randn(5, 3).to(torch.float16)
    got = RawTensor.of(t).cast("float32")
    assert got.shape == (5, 3) and bytes(got.data) == t.float().numpy().tobytes()
    f = torch.randn(7, 2)
    assert bytes(RawTensor.of(f).cast("bfloat16").data) == f.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    with pytest.raises(ValueError):
        RawTensor("float32", (2, 2), bytearray(12))
