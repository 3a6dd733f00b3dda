"""`ckpt diff-vs-base --adapter` of a block-FP8 WEIGHTS: is each quantized weight exactly the quantization
(`core.fp8`'s rule) of the W32 the adapter implies?

W32 per element is known up to an interval [lo, hi] of fp32 values: exactly for an untargeted weight (the
base's value: a bf16 upcast, an fp32 master, fl32(q * scale) of an FP8 base) and a modules_to_save one (the
adapter's tensor); for a targeted one, every fp32 value a correct merge W0 + s * B@A can give, whatever its
kernel (the exact value in fp64 and the proven bound on fp32's error, as the bf16 check's
`core.tensor_math`). Then, per 128x128 block, the stored scale must be amax / 448 for an amax the interval
allows (1 for an all-zero block), and each code must lie between e4m3(clamp(lo / scale)) and
e4m3(clamp(hi / scale)): the rule is monotone in W32. Elements whose bounds quantize to two codes are ties
(either passes), as the bf16 check's. Also per weight: the quantization error ||deq(q) - W32|| against ||W32||
and, for a targeted one, ||s * B@A|| against that error (a delta smaller than the rounding mostly vanishes).
Rows are processed in 128-row slabs of about SLAB_ELEMS elements.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ...core.fp8 import BLOCK, FP8_MAX, block_amax
from ...core.tensor_math import FP32_UNIT_ROUNDOFF, MARGIN_FLOOR, MARGIN_ROUNDING, lora_factors_fp64
from .plan import REPLACED, TARGETED, PairPlan

__all__ = ["FP8_CHECK_BYTES", "SLAB_ELEMS", "check_quantized", "fp8_summary"]

SLAB_ELEMS = 1 << 20
FP8_CHECK_BYTES = SLAB_ELEMS * 48  # the slab's fp64 value, bound and product, its fp32 bounds and codes


def _codes_table() -> np.ndarray:
    return torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()


def _q(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The rule's code of fp32 values `v` under per-element `scale`, as fp32 values."""
    return (v / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


def _expand(s: torch.Tensor, n: int, c: int) -> torch.Tensor:
    return s.repeat_interleave(BLOCK, 0)[:n].repeat_interleave(BLOCK, 1)[:, :c]


class _Bounds:
    """[lo, hi] of W32 for rows of one pair, and its best estimate (fp64) for the error figures."""

    def __init__(self, base, lora, p: PairPlan):
        self.base, self.p = base, p
        self.factors = self.full = None
        self.scale = 0.0
        self.delta_norm: float | None = None
        if p.role == TARGETED:
            spec = lora.modules[p.module]
            a, b = lora.read_pair(p.module)
            self.factors = lora_factors_fp64(a, b, fan_in_fan_out=spec.fan_in_fan_out)
            self.scale = spec.scale
            a64, b64 = a.double(), b.double()
            self.delta_norm = abs(spec.scale) * math.sqrt(
                max(0.0, float(((b64.T @ b64) * (a64 @ a64.T)).sum()))
            )
        elif p.role == REPLACED:
            self.full = lora.read_full(p.name).to(torch.float32)

    def rows(self, r0: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.full is not None:
            v = self.full[r0 : r0 + n]
            return v, v, v.double()
        w0 = self.base.read_rows(self.p.name, r0, n).to(torch.float32)
        if self.factors is None:
            return w0, w0, w0.double()
        f, c = self.factors, w0.shape[1]
        sp = (f.left[r0 : r0 + n] @ f.right) * self.scale
        lr = torch.outer(f.left_norms[r0 : r0 + n], f.right_norms)
        x = w0.double() + sp
        mag = sp.abs() + x.abs()
        e = ((mag * FP32_UNIT_ROUNDOFF) + (lr * f.gamma) * abs(self.scale)) * 2.0
        m = (lr * f.margin_per_norms(self.scale) + (mag + e) * MARGIN_ROUNDING) + MARGIN_FLOOR
        lo, hi = (x - e - m).to(torch.float32), (x + e + m).to(torch.float32)
        return lo.view(n, c), hi.view(n, c), x.view(n, c)


def check_quantized(weights, base, lora, p: PairPlan) -> dict:
    """The adapter check of one quantized weight of WEIGHTS (see the module docstring)."""
    rows, cols = p.weights.shape
    table = _codes_table()
    scales = weights.read_scales(p.name)
    bounds = _Bounds(base, lora, p)
    step = max(BLOCK, SLAB_ELEMS // max(1, cols) // BLOCK * BLOCK)
    off = ties = bad_scales = 0
    err_sq = w_sq = 0.0
    for r0 in range(0, rows, step):
        n = min(step, rows - r0)
        lo, hi, x = bounds.rows(r0, n)
        codes = torch.from_numpy(table[weights.read_codes(p.name, r0, n).numpy()]).view(n, cols)
        s = scales[r0 // BLOCK : -(-(r0 + n) // BLOCK)]
        bad_scales += _scale_problems(lo, hi, s)
        se = _expand(s, n, cols)
        q_lo, q_hi = _q(lo, se), _q(hi, se)
        low, high = torch.minimum(q_lo, q_hi), torch.maximum(q_lo, q_hi)
        off += int(((codes < low) | (codes > high)).sum())
        ties += int((low != high).sum())
        d = codes.double() * se.double() - x
        err_sq += float((d * d).sum())
        w_sq += float((x * x).sum())
    err, norm = math.sqrt(err_sq), math.sqrt(w_sq)
    what = {TARGETED: f"W0 + {bounds.scale:g} * B @ A", REPLACED: "the adapter's tensor"}.get(
        p.role or "", "W0"
    )
    out = {
        "expected": f"fp8 e4m3 block quantization of {what} (scale = amax / 448 per 128x128 block)",
        "ok": off == 0 and bad_scales == 0,
        "elements_off": off,
        "max_ulps": None,
        "ties": ties,
        "scales_off": bad_scales,
        "quantization_error": err / norm if norm else 0.0,
        "error_norm": err,
        "weight_norm": norm,
    }
    if bounds.delta_norm is not None:
        out.update(module=p.module, delta_norm=bounds.delta_norm, delta_survives=bounds.delta_norm > err)
    return out


def _scale_problems(lo: torch.Tensor, hi: torch.Tensor, s: torch.Tensor) -> int:
    """Blocks whose stored scale is no amax / 448 the interval [lo, hi] allows (1 where amax may be 0)."""
    amax_hi = block_amax(torch.maximum(lo.abs(), hi.abs()))
    straddle = (lo <= 0) & (hi >= 0)
    amax_lo = block_amax(torch.where(straddle, torch.zeros_like(lo), torch.minimum(lo.abs(), hi.abs())))
    s_lo, s_hi = amax_lo / FP8_MAX, amax_hi / FP8_MAX  # fp32 division is monotone: every scale in between
    fine = ((s >= s_lo) & (s <= s_hi) & (s > 0)) | ((s_lo == 0) & (s == 1.0))
    return int((~fine).sum())


def fp8_summary(compared) -> dict:
    """The adapter summary's FP8 part ({} without quantized weights): how many were checked against the rule,
    the worst quantization error, and the targeted modules whose delta is smaller than their rounding."""
    fp8 = [t for t in compared if t.adapter_check and "scales_off" in t.adapter_check]
    if not fp8:
        return {}
    below = sorted(t.name for t in fp8 if t.adapter_check.get("delta_survives") is False)
    return {
        "fp8_checked": len(fp8),
        "fp8_ties": sum(t.adapter_check["ties"] for t in fp8),
        "fp8_error_max": max(t.adapter_check["quantization_error"] for t in fp8),
        "fp8_delta_below_error": below,
    }
