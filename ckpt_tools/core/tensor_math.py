"""Tensor arithmetic, in one place (pure: no I/O; torch).

W' = round_to(out_dtype, W32 + s * (B32 @ A32)): the base and both factors are upcast to fp32,
the delta is computed and added in fp32, and the result is rounded exactly once. Inputs are never
mutated; every result is a new tensor and is checked for non-finite values. The scale `s` is
`core.lora_math.lora_scale`; the shape rule `core.lora_math.check_shapes`.

The adapter check by value (`check_merged_values`): a merged element passes when it is a correct rounding
of W32 + s*B@A computed in fp32 by any kernel, i.e. when it lies between the roundings of x - e and x + e,
where x is the exact value (computed in fp64) and e a proven bound on any fp32 computation's error.

Also here: ulps between tensors, counting non-finite values from the bits, the bf16 rounding of a
Python float (`core.casts`'s, without torch), and whether a merged tensor rounds back to its base.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from .casts import bf16_round
from .dtypes import EXPONENT_MASKS, ITEMSIZE, torch_dtype
from .errors import FormatError
from .lora_math import check_shapes

__all__ = [
    "FP32_UNIT_ROUNDOFF",
    "FP64_UNIT_ROUNDOFF",
    "MARGIN_FLOOR",
    "MARGIN_ROUNDING",
    "LoraFactors64",
    "MergeCheck",
    "bf16_round",
    "check_finite",
    "check_merged_values",
    "check_merged_values_bounded",
    "count_nonfinite",
    "lora_delta",
    "lora_factors_fp64",
    "lora_product_fixed_order",
    "lora_product_rows_fp64",
    "merge_weight",
    "merge_weight_into",
    "nonfinite_error",
    "rounds_to_base",
    "sha256_of_tensor",
    "ulps_apart",
    "update_hash",
]


def lora_delta(
    a: torch.Tensor, b: torch.Tensor, scale: float, *, fan_in_fan_out: bool = False
) -> torch.Tensor:
    """s * (B @ A) in fp32, shaped like the base weight ([out, in], or [in, out] for fan_in_fan_out)."""
    delta = b.to(torch.float32) @ a.to(torch.float32)
    delta.mul_(scale)  # in place on a new tensor: one fp32 rounding, like PEFT's get_delta_weight
    return delta.T if fan_in_fan_out else delta


def merge_weight(
    weight: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float,
    *,
    out_dtype: torch.dtype,
    fan_in_fan_out: bool = False,
    name: str = "",
) -> torch.Tensor:
    """round_to(out_dtype, W32 + s * (B32 @ A32)); a new tensor, inputs untouched."""
    check_shapes(
        tuple(weight.shape), tuple(a.shape), tuple(b.shape), fan_in_fan_out=fan_in_fan_out, name=name
    )
    merged = weight.to(torch.float32, copy=True)
    merged.add_(lora_delta(a, b, scale, fan_in_fan_out=fan_in_fan_out))
    out = merged.to(out_dtype)
    check_finite(out, name)
    return out


def check_finite(t: torch.Tensor, name: str = "") -> None:
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise nonfinite_error(int((~torch.isfinite(t)).sum()), name)


def nonfinite_error(bad: int, name: str = "") -> FormatError:
    """The error for a merged tensor with `bad` inf/nan values (counted over the whole tensor)."""
    return FormatError(
        f"merged tensor has {bad} non-finite value(s) (inf/nan)",
        key=name,
        hint="the adapter or base holds inf/nan, or the output dtype overflows; try --dtype fp32",
    )


def ulps_apart(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Distance in units of last place between same-dtype float tensors (monotone integer mapping)."""
    if x.dtype != y.dtype:
        raise ValueError("ulps_apart needs equal dtypes")
    int_dtype = {2: torch.int16, 4: torch.int32, 8: torch.int64}[x.dtype.itemsize]
    xi = x.contiguous().view(int_dtype).to(torch.int64)
    yi = y.contiguous().view(int_dtype).to(torch.int64)
    sign = 1 << (8 * x.dtype.itemsize - 1)
    # map sign-magnitude to a monotone two's-complement line
    xi = torch.where(xi < 0, -(xi + sign), xi)
    yi = torch.where(yi < 0, -(yi + sign), yi)
    return (xi - yi).abs()


def merge_weight_into(
    out: torch.Tensor,
    weight: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float,
    *,
    fan_in_fan_out: bool = False,
    name: str = "",
    block_elems: int = 1 << 18,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """`merge_weight`, bit for bit, written into `out` (whose dtype is the output dtype).

    Same operations in the same order: P = B32 @ A32 as ONE full matmul (splitting it into row
    blocks lets the BLAS pick other kernels for other shapes, which changes low bits), then per
    element round_to(out.dtype, W32 + s * P). Only the elementwise part runs over row blocks of
    about `block_elems`, so its fp32 temporaries stay in cache and no full-size fp32 copy of W is
    made. `scratch`: an optional fp32 buffer of >= out.numel() elements to hold P (reused across
    calls, it saves page-faulting a fresh allocation per tensor); for an fp32 `out` (not fan_in_fan_out)
    it may be `out` itself: W32 is then made in place of P, with no second buffer. Every block is checked
    for non-finite values. Inputs are not modified; returns `out`."""
    check_shapes(
        tuple(weight.shape), tuple(a.shape), tuple(b.shape), fan_in_fan_out=fan_in_fan_out, name=name
    )
    if tuple(out.shape) != tuple(weight.shape):
        raise ValueError(f"out has shape {list(out.shape)}, the weight {list(weight.shape)}")
    if (
        scratch is not None
        and out.untyped_storage().data_ptr() == scratch.untyped_storage().data_ptr()
        and (fan_in_fan_out or out.dtype != torch.float32 or out.data_ptr() != scratch.data_ptr())
    ):
        raise ValueError("out may share scratch's memory only as its start, fp32, not fan_in_fan_out")
    a32, b32 = a.to(torch.float32), b.to(torch.float32)
    rows_p, cols_p = b32.shape[0], a32.shape[1]
    if scratch is not None and scratch.dtype == torch.float32 and scratch.numel() >= rows_p * cols_p:
        prod = scratch.reshape(-1)[: rows_p * cols_p].view(rows_p, cols_p)
        torch.matmul(b32, a32, out=prod)
    else:
        prod = b32 @ a32
    delta = prod.T if fan_in_fan_out else prod
    rows = weight.shape[0]
    step = max(1, block_elems // max(1, weight.shape[1]))
    finite = True
    for s in range(0, rows, step):
        d = delta[s : s + step]
        d.mul_(scale)  # s * P, rounded as in lora_delta
        d.add_(weight[s : s + step])  # + W32 (exact upcast; fp32 addition is commutative)
        o = out[s : s + step]
        if o.data_ptr() != d.data_ptr():  # (else `out` is the scratch: W32 is made in place)
            o.copy_(d)  # the one rounding to out.dtype
        # A sum is non-finite whenever an element is (and ~20x cheaper than isfinite().all());
        # a finite block whose sum overflows only costs the exact check below.
        if finite and o.is_floating_point() and not math.isfinite(float(o.sum(dtype=torch.float32))):
            finite = False
    if not finite:
        check_finite(out, name)  # exact count, and the error naming the tensor
    return out


# a value is inf/nan iff all exponent bits are set (core.dtypes.EXPONENT_MASKS): one integer pass
_EXP_MASKS = {
    torch_dtype(name): ({2: torch.int16, 4: torch.int32, 8: torch.int64}[ITEMSIZE[name]], mask)
    for name, mask in EXPONENT_MASKS.items()
}


def count_nonfinite(t: torch.Tensor) -> int:
    spec = _EXP_MASKS.get(t.dtype)
    if spec is not None:
        int_dtype, mask = spec
        return int(torch.count_nonzero((t.view(int_dtype) & mask) == mask))
    return int(t.numel() - torch.count_nonzero(torch.isfinite(t.float() if t.element_size() == 1 else t)))


def rounds_to_base(out: torch.Tensor, weight: torch.Tensor, block_elems: int = 1 << 18) -> bool:
    """True when every element of `out` equals `weight` rounded to out's dtype: this merge changed
    nothing. Row blocks, so a cast of `weight` is never made whole; a real merge differs in its
    first block, so the check costs one block."""
    if tuple(out.shape) != tuple(weight.shape):
        return False
    if out.dim() < 2:
        return bool(torch.equal(out, weight.to(out.dtype)))
    step = max(1, block_elems // max(1, math.prod(weight.shape[1:])))
    for s in range(0, weight.shape[0], step):
        w = weight[s : s + step]
        if not torch.equal(out[s : s + step], w if w.dtype == out.dtype else w.to(out.dtype)):
            return False
    return True


def update_hash(h, t: torch.Tensor) -> None:
    """Fold a tensor's bytes (its dtype, row-major, little-endian: the slim manifest's HASH_INPUT) in `h`."""
    if t.numel():
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().data)


def sha256_of_tensor(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes in row-major order (the slim manifest's content hash)."""
    h = hashlib.sha256()
    update_hash(h, t.detach().cpu())
    return h.hexdigest()


# --- the adapter check by value ----------------------------------------------------------------------------
FP32_UNIT_ROUNDOFF = 2.0**-24
FP64_UNIT_ROUNDOFF = 2.0**-53
# The margin over which a given P's roundings are trusted to be the fixed-order P's
# (`check_merged_values_bounded`):
# m = (|L_i| |R_j|) * 4 |s| gamma64_r + (|sp| + |x| + e) * MARGIN_ROUNDING + MARGIN_FLOOR. Two products of any
# order differ by at most 2 gamma64_r |L_i| |R_j| (doubled for the norms' own rounding); the roundings of sp,
# x, e
# and x -/+ e after it move the result by at most 16 u64 (|sp| + |x| + e) (doubled: 2^-48); subnormal results
# carry an absolute error of up to 2^-1075 per operation.
MARGIN_ROUNDING = 2.0**-48
MARGIN_FLOOR = 2.0**-1060


@dataclass(frozen=True)
class LoraFactors64:
    """W = W0 + s * L @ R row by row: L [rows, r], R [r, cols] in fp64 (B and A, or A^T and B^T for a
    fan_in_fan_out weight), with the norms that bound any fp32 product's error."""

    left: torch.Tensor
    right: torch.Tensor
    left_norms: torch.Tensor  # ||L_i,:||_2 per row
    right_norms: torch.Tensor  # ||R_:,j||_2 per column
    rank: int

    @property
    def gamma(self) -> float:
        """gamma_r = r*u / (1 - r*u): |fl32(L_i . R_j) - L_i . R_j| <= gamma_r * ||L_i|| * ||R_j||."""
        ru = self.rank * FP32_UNIT_ROUNDOFF
        return ru / (1.0 - ru)

    def margin_per_norms(self, scale: float) -> float:
        """4 |s| gamma64_r: the margin's share per |L_i| |R_j| (`MARGIN_ROUNDING`'s comment)."""
        ru = self.rank * FP64_UNIT_ROUNDOFF
        return 4.0 * abs(scale) * (ru / (1.0 - ru))

    def to(self, device) -> LoraFactors64:
        """The same factors and norms on `device` (copied bit for bit: the norms are not recomputed there)."""
        return LoraFactors64(
            self.left.to(device),
            self.right.to(device),
            self.left_norms.to(device),
            self.right_norms.to(device),
            self.rank,
        )


def lora_factors_fp64(a: torch.Tensor, b: torch.Tensor, *, fan_in_fan_out: bool = False) -> LoraFactors64:
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    left, right = (a64.T.contiguous(), b64.T.contiguous()) if fan_in_fan_out else (b64, a64.contiguous())
    return LoraFactors64(left.contiguous(), right, left.norm(dim=1), right.norm(dim=0), int(a.shape[0]))


def lora_product_rows_fp64(
    f: LoraFactors64, r0: int, r1: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """P = L @ R for rows [r0, r1), flattened, in fp64, by the BLAS (any kernel, any threads: the check's
    counts do not depend on P's last bits, `check_merged_values_bounded`). `out`: an fp64 buffer of
    (r1 - r0) * cols elements to write it into (reused across blocks, it saves page-faulting a fresh 4 MiB
    per block)."""
    if out is None:
        return (f.left[r0:r1] @ f.right).reshape(-1)
    torch.matmul(f.left[r0:r1], f.right, out=out.view(r1 - r0, f.right.shape[1]))
    return out


def lora_product_fixed_order(f: LoraFactors64, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """P at the elements (rows[k], cols[k]) in its one fixed order: p = 0, then p = p + L_ik * R_kj for k = 0,
    1, ..., r-1, each one rounded fp64 operation (a multiplication, then an addition: nothing fused). The same
    bits on any machine and device; `sources/delta_stats_c.c: canonical_p` is the same loop."""
    left, right = f.left[rows], f.right[:, cols]
    p = torch.zeros(rows.shape, dtype=torch.float64, device=left.device)
    for k in range(f.rank):
        p = p + left[:, k] * right[k]
    return p


@dataclass
class MergeCheck:
    """What `check_merged_values` found over the elements it was given."""

    off: int = 0  # elements no correct fp32 merge can give
    ties: int = (
        0  # elements whose exact value is within the bound of a rounding boundary (either side passes)
    )
    max_ulps: int = 0  # the worst off element's distance from round(x) (a finite one), in ulps of W's dtype
    finite: bool = True  # every expected value is finite (a merge refuses inf/nan)

    def fold(self, other: MergeCheck) -> None:
        self.off += other.off
        self.ties += other.ties
        self.max_ulps = max(self.max_ulps, other.max_ulps)
        self.finite = self.finite and other.finite


def _elements(f: LoraFactors64, n: int, r0: int, first: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of elements [first, first + n) of the row block that starts at row r0."""
    cols = f.right.shape[1]
    idx = torch.arange(first, first + n, dtype=torch.int64, device=device)
    return idx // cols + r0, idx % cols


def _round_to(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp64 -> fp32 -> `dtype` (round to nearest even each time), as the C kernel and torch's own .to() do."""
    v32 = v.to(torch.float32)
    return v32 if dtype == torch.float32 else v32.to(dtype)


def _window(w0: torch.Tensor, sp: torch.Tensor, lr: torch.Tensor, f: LoraFactors64, scale: float):
    """x = W0 + sp and e = ((|sp| + |x|) * u + (|L_i||R_j| * gamma) * |s|) * 2, one IEEE operation at a time
    in
    this order (the C kernel's), and |sp| + |x|."""
    x = w0.to(torch.float64) + sp
    mag = sp.abs() + x.abs()
    e = ((mag * FP32_UNIT_ROUNDOFF) + (lr * f.gamma) * abs(scale)) * 2.0
    return x, e, mag


def _counts(w: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, expected: torch.Tensor) -> MergeCheck:
    wd = w.to(torch.float64)
    ok = (wd >= lo.to(torch.float64)) & (wd <= hi.to(torch.float64))
    off = int(ok.numel() - torch.count_nonzero(ok))
    floating = w.dtype.is_floating_point
    finite = bool(torch.isfinite(expected).all()) if floating else True
    ties = int(torch.count_nonzero(lo != hi))
    # (over the off elements whose expected value is finite: a NaN's bits are the kernel's choice, and a
    # non-finite expected value makes the check an error anyway, as the merge refuses it)
    far = ~ok & torch.isfinite(expected) if off and floating else ~ok
    max_ulps = int(ulps_apart(w[far], expected[far]).max()) if off and bool(far.any()) else 0
    return MergeCheck(off, ties, max_ulps, finite)


def check_merged_values(
    w: torch.Tensor, w0: torch.Tensor, f: LoraFactors64, r0: int, first: int, scale: float
) -> MergeCheck:
    """The definition. Is each merged element `w` (elements [first, first + n) of the row block that starts at
    row r0, in its output dtype) a correct rounding of y, for some y that a correct fp32 merge round(W0_32 +
    s * fl32(B@A)) can compute? x = W0 + s*P in fp64 is the exact value to within fp64's rounding (W0's upcast
    is exact; P is `lora_product_fixed_order`, so x has the same bits on every machine); an fp32 merge's y is
    within e_32 = |s|*bound + u*|s*P| + u*|x| (+ second-order terms) of x: the product's error, then one
    rounding each for s*P and for the sum. Rounding is monotone, so the values a correct merge can give are
    exactly those between round(x - e) and round(x + e); with e = 2*e_32 the second-order terms, fp64's own
    errors and the fp64 -> fp32 -> bf16 conversion's double rounding are covered. A wrong alpha, factors or
    base moves x by far more than e for most elements. Any device (the tensors' own).

    `check_merged_values_bounded` and `sources/delta_stats_c.c: value_check` give these counts from a P of
    any kernel; this computes the fixed-order P of every element (slow: a reference)."""
    rows, cols = _elements(f, w.numel(), r0, first, w.device)
    sp = lora_product_fixed_order(f, rows, cols) * scale
    x, e, _mag = _window(w0, sp, f.left_norms[rows] * f.right_norms[cols], f, scale)
    return _counts(w, _round_to(x - e, w.dtype), _round_to(x + e, w.dtype), _round_to(x, w.dtype))


def check_merged_values_bounded(
    w: torch.Tensor, w0: torch.Tensor, prod: torch.Tensor, f: LoraFactors64, r0: int, first: int, scale: float
) -> MergeCheck:
    """`check_merged_values`' counts, from `prod`: P of these elements by any kernel (a BLAS, a GPU's), which
    is
    within 2 gamma64_r |L_i||R_j| of the fixed-order P. Each rounding is made at both ends of a margin m that
    covers that and every fp64 rounding after it (`MARGIN_ROUNDING`); where both ends round alike, that is the
    fixed-order P's rounding too (rounding is monotone), and where they do not (a value within ~1e-15 relative
    of
    a rounding boundary), the fixed-order P is computed for that element. Any device (the tensors' own): the
    GPU
    path of the check, and the CPU's where the C kernel does not run."""
    rows, cols = _elements(f, w.numel(), r0, first, w.device)
    lr = f.left_norms[rows] * f.right_norms[cols]
    sp = prod * scale
    x, e, mag = _window(w0, sp, lr, f, scale)
    m = (lr * f.margin_per_norms(scale) + (mag + e) * MARGIN_ROUNDING) + MARGIN_FLOOR
    a, b, dt = x - e, x + e, w.dtype
    lo, hi = _round_to(a - m, dt), _round_to(b + m, dt)
    tie = lo != hi
    expected = torch.where(tie, _round_to(x - m, dt), lo)
    sure = (
        (lo == _round_to(a + m, dt))
        & (hi == _round_to(b - m, dt))
        & (~tie | (expected == _round_to(x + m, dt)))
    )
    unsure = torch.nonzero(~sure).reshape(-1)
    if unsure.numel():  # within the margin of a boundary: the fixed-order product decides
        sp_u = lora_product_fixed_order(f, rows[unsure], cols[unsure]) * scale
        x_u, e_u, _mag = _window(w0[unsure], sp_u, lr[unsure], f, scale)
        lo[unsure], hi[unsure] = _round_to(x_u - e_u, dt), _round_to(x_u + e_u, dt)
        expected[unsure] = _round_to(x_u, dt)
    return _counts(w, lo, hi, expected)
