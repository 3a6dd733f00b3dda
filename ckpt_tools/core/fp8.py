"""Block FP8 (e4m3), the format vLLM, SGLang and transformers load (DeepSeek's and Qwen's FP8 checkpoints).

A quantized weight W [O, I] is stored as `weight` (float8_e4m3fn, [O, I]) and `weight_scale_inv` (float32,
[ceil(O/128), ceil(I/128)]): real = fp8 * weight_scale_inv, one scale per 128x128 block, partial blocks at
the right and bottom edges. The rule (one rounding from the exact fp32 value W32, never through bf16):

    scale = amax(|W32| over the block) / 448        (fp32 division; 1 where that is 0: an all-zero block)
    q     = e4m3(clamp(W32 / scale, -448, 448))     (fp32 division, round to nearest even)

Pure (no I/O); torch. Row blocks handed to `quantize_rows_into` start at a multiple of the block height, so a
streamed tensor gets the scales and codes of the whole-tensor rule (`fp8_row_blocks` makes such blocks).
Dequantization is fl32(q * scale), what transformers and the GEMM epilogues compute. The error figures'
one-pass kernel is `fp8_error_c.c` (built at install where a C compiler is at hand; `error_sq` falls back to
`reference_error_sq`, which defines the figure); the codes and scales are always torch's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .accel import load_accelerator

if TYPE_CHECKING:
    import torch

__all__ = [
    "BLOCK",
    "FP8_DTYPE",
    "FP8_MAX",
    "MIN_FP8_BLOCK_ROWS",
    "QUANTIZED_PROJECTIONS",
    "SCALE_SUFFIX",
    "QuantSums",
    "accelerator",
    "block_amax",
    "dequantize_rows_into",
    "error_sq",
    "fp8_row_blocks",
    "grid_shape",
    "is_quantized_weight",
    "quantize_rows_into",
    "reference_error_sq",
    "scale_name",
    "scales_from_amax",
]

FP8_DTYPE = "float8_e4m3fn"
FP8_MAX = 448.0  # the largest finite e4m3fn value
BLOCK = 128  # weight_block_size [128, 128]
SCALE_SUFFIX = "_scale_inv"  # `X.weight` -> `X.weight_scale_inv`
# A streamed row block holds at least this many rows (merge's MIN_BLOCK_ROWS: fewer rows change the BLAS
# kernel)
MIN_FP8_BLOCK_ROWS = 64


# The error figure's one-pass C kernel (`fp8_error_c.c`), or None: not built, or CKPT_TOOLS_PURE_PYTHON=1
accelerator = load_accelerator("ckpt_tools.core.fp8_error_c")

# Which weights an FP8 output quantizes: the attention and MLP / expert projections, as Qwen's and
# DeepSeek's FP8
# checkpoints do (Qwen3-30B-A3B-FP8 keeps lm_head, the norms and each layer's router `mlp.gate`
# unquantized, in its
# modules_to_not_convert). Everything else (embeddings, lm_head, norms, routers) stays bf16.
QUANTIZED_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def is_quantized_weight(name: str, shape: tuple[int, ...]) -> bool:
    """Whether an FP8 output stores tensor `name` as fp8 codes + scales: a 2-D `.weight` of a projection."""
    if len(shape) != 2 or not name.endswith(".weight"):
        return False
    return name.removesuffix(".weight").rsplit(".", 1)[-1] in QUANTIZED_PROJECTIONS


@dataclass
class QuantSums:
    """Sums over the quantized elements, for the error figures: ||W32||^2 and ||deq(q) - W32||^2 (fp64)."""

    w_sq: float = 0.0
    err_sq: float = 0.0

    def fold(self, other: QuantSums) -> None:
        self.w_sq += other.w_sq
        self.err_sq += other.err_sq

    @property
    def rel_error(self) -> float:
        """||deq(q) - W32|| / ||W32|| (0 for an all-zero tensor)."""
        return math.sqrt(self.err_sq / self.w_sq) if self.w_sq > 0 else 0.0


def grid_shape(shape: tuple[int, ...], block: tuple[int, int] = (BLOCK, BLOCK)) -> tuple[int, int]:
    """The scale grid of a 2-D weight: [ceil(O / bn), ceil(I / bk)]."""
    rows, cols = shape
    return -(-rows // block[0]), -(-cols // block[1])


def scale_name(weight_name: str) -> str:
    """`X.weight` -> `X.weight_scale_inv` (the name vLLM, SGLang and transformers read)."""
    return weight_name + SCALE_SUFFIX


def fp8_row_blocks(rows: int, cols: int, block_elems: int):
    """(start, count) row blocks for streaming a quantized tensor: about `block_elems` elements each, a
    multiple
    of BLOCK rows (so every block starts at a scale row), a tail shorter than MIN_FP8_BLOCK_ROWS joined to the
    block before it (the merge product's rows stay BLAS-stable)."""
    step = max(BLOCK, (block_elems // max(1, cols)) // BLOCK * BLOCK)
    s = 0
    while s < rows:
        n = step if rows - s - step >= MIN_FP8_BLOCK_ROWS else rows - s
        yield s, n
        s += n


def _slabs(n: int, size: int):
    """(start, stop, groups) of the full groups of `size` and the partial tail, over [0, n)."""
    full = n // size * size
    if full:
        yield 0, full, full // size
    if full < n:
        yield full, n, 1


def block_amax(w: torch.Tensor, block: tuple[int, int] = (BLOCK, BLOCK)) -> torch.Tensor:
    """max |w| per block of a 2-D fp32 tensor whose first row starts a block: [ceil(n/bn), ceil(c/bk)], no
    full-size temporary (max and -min per block)."""
    import torch

    n, c = w.shape
    out = torch.empty(grid_shape((n, c), block), dtype=torch.float32)
    for r0, r1, gr in _slabs(n, block[0]):
        for c0, c1, gc in _slabs(c, block[1]):
            t = w[r0:r1, c0:c1].reshape(gr, (r1 - r0) // gr, gc, (c1 - c0) // gc)
            # along each row's contiguous columns first, then down the block: twice as fast as both dims
            # at once (a max is exact in any order)
            hi = t.amax(dim=3).amax(dim=1)
            lo = t.amin(dim=3).amin(dim=1)
            out[r0 // block[0] : r0 // block[0] + gr, c0 // block[1] : c0 // block[1] + gc] = torch.maximum(
                hi, lo.neg()
            )
    return out


def scales_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 in fp32; 1 where that is 0 (an all-zero block, or one whose amax / 448 underflows)."""
    import torch

    s = amax.to(torch.float32) / FP8_MAX
    return torch.where(s == 0, torch.ones_like(s), s)


def quantize_rows_into(
    w32: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    *,
    sums: QuantSums | None = None,
    scratch: torch.Tensor | None = None,
) -> None:
    """Quantize rows of a weight by the rule: `w32` (fp32 [n, cols], contiguous, its first row a multiple of
    BLOCK; clobbered: it holds W32 / scale afterwards) into `codes` (float8_e4m3fn [n, cols]) and `scales`
    (fp32 [ceil(n/128), ceil(cols/128)]). `sums`: ||W32||^2 and the quantization error's, added to it
    (`error_sq`; `scratch`: an fp32 buffer of >= n * cols elements for its reference path, else one is
    allocated if that path runs)."""
    import torch

    n, c = w32.shape
    if not n or not c:
        return
    if sums is not None:
        flat = w32.reshape(-1)
        sums.w_sq += float(torch.dot(flat, flat))
    scales.copy_(scales_from_amax(block_amax(w32)))
    for r0, r1, gr in _slabs(n, BLOCK):
        for c0, c1, gc in _slabs(c, BLOCK):
            t = w32[r0:r1, c0:c1].view(gr, (r1 - r0) // gr, gc, (c1 - c0) // gc)  # a view: divided in place
            g0, h0 = r0 // BLOCK, c0 // BLOCK
            t.div_(scales[g0 : g0 + gr, h0 : h0 + gc].reshape(gr, 1, gc, 1))
    w32.clamp_(-FP8_MAX, FP8_MAX)
    codes.copy_(w32)  # the one rounding: fp32 -> e4m3, to nearest even
    if sums is not None:
        sums.err_sq += error_sq(w32, codes, scales, scratch)


def error_sq(
    scaled: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, scratch: torch.Tensor | None = None
) -> float:
    """||deq(q) - W32||^2 of a row block (`scaled`: the clamped W32 / scale the codes were cast from,
    `scales` its scale rows): one pass of the C kernel, or `reference_error_sq` where it is not built or
    defers (a buffer it cannot read, a NaN code). The two differ only in the sum's last bits (the kernel
    sums in fp64, the reference in fp32); `scratch` is the reference's buffer."""
    import torch

    if (
        accelerator is not None
        and scaled.is_contiguous()
        and codes.is_contiguous()
        and scales.is_contiguous()
    ):
        n, c = scaled.shape
        got = accelerator.error_sq(scaled.numpy(), codes.view(torch.uint8).numpy(), scales.numpy(), n, c)
        if got is not None:
            return float(got)
    return reference_error_sq(scaled, codes, scales, scratch)


def reference_error_sq(
    scaled: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, scratch: torch.Tensor | None = None
) -> float:
    """The error figure's definition: ||deq(q) - W32||^2 = sum over blocks of scale^2 * ||q - W32 /
    scale||^2: the codes decoded by a 256-entry table (numpy's gather: 2.5x faster than torch's fp8 cast on
    a CPU), less the scaled values, times each block's scale, then one dot product (fp32)."""
    import numpy as np
    import torch

    n, c = scaled.shape
    if scratch is None or scratch.numel() < n * c:
        scratch = torch.empty(n * c, dtype=torch.float32)
    d = scratch.reshape(-1)[: n * c].view(n, c)
    # mode="clip": an out= take in the default mode "raise" is buffered (a temporary of the block);
    # the codes index all 256 entries, so clipping never applies
    np.take(_decode_table(), codes.view(torch.uint8).numpy(), out=d.numpy(), mode="clip")
    d.sub_(scaled)
    for r0, r1, gr in _slabs(n, BLOCK):
        for c0, c1, gc in _slabs(c, BLOCK):
            g0, h0 = r0 // BLOCK, c0 // BLOCK
            t = d[r0:r1, c0:c1].view(gr, (r1 - r0) // gr, gc, (c1 - c0) // gc)
            t.mul_(scales[g0 : g0 + gr, h0 : h0 + gc].reshape(gr, 1, gc, 1))
    flat = d.reshape(-1)
    return float(torch.dot(flat, flat))


_TABLE: list = []


def _decode_table():
    """The float32 value of each of the 256 e4m3fn codes (torch's own cast, once)."""
    if not _TABLE:
        import torch

        _TABLE.append(torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy())
    return _TABLE[0]


def dequantize_rows_into(
    codes: torch.Tensor,
    scales: torch.Tensor,
    first_row: int,
    out: torch.Tensor,
    block: tuple[int, int] = (BLOCK, BLOCK),
) -> None:
    """fl32(q * scale) of rows [first_row, first_row + n) of a block-quantized weight into `out` (fp32 [n,
    cols]):
    `codes` are those rows (float8_e4m3fn [n, cols]), `scales` the whole scale grid."""
    n, c = codes.shape
    out.copy_(codes)
    bn, bk = block
    full = c // bk * bk
    r = 0
    while r < n:
        g = (first_row + r) // bn
        r1 = min(n, (g + 1) * bn - first_row)
        seg = out[r:r1]
        if full:
            seg[:, :full].view(r1 - r, full // bk, bk).mul_(scales[g, : full // bk].reshape(1, -1, 1))
        if full < c:
            seg[:, full:].mul_(scales[g, full // bk])
        r = r1
