"""One quantized weight of an `--dtype fp8` merge, made and written by one worker, in row blocks (`core.fp8`):

    W32 = W_base32 + s * B@A  (merge: `core.tensor_math.merge_weight_into` into an fp32 block, bit for bit
                               the W32 a bf16 merge rounds)
        | the base's value    (quantize: a bf16 weight upcast, an fp32 master, fl32(q * scale) of an FP8 base)
        | the adapter's tensor (replace: modules_to_save)
    scale = amax / 448 per 128x128 block, q = e4m3(clamp(W32 / scale))

Each row block starts at a multiple of 128 rows (`core.fp8.fp8_row_blocks`), so its scale rows are whole and
the codes equal the whole-tensor rule's. The codes are appended to the tensor in the shard; the scale grid is
written once the last block is in. Figures per tensor (`Fp8Figure`): ||W32||, the quantization error
||deq(q) - W32|| and, for a merge, ||s * B@A|| (from the factors, fp64): the report's, and its warning when a
LoRA delta is smaller than the rounding it goes through.
"""

from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass

import torch

from ...core.errors import FormatError
from ...core.fp8 import QuantSums, accelerator, fp8_row_blocks, grid_shape, quantize_rows_into
from ...core.lora_math import check_shapes
from ...core.tensor_math import count_nonfinite, merge_weight_into, rounds_to_base
from ...formats.handle import tensor_bytes
from ...formats.safetensors.writer import StreamingSafetensorsWriter
from .plan import FP8_BLOCK_ELEMS, TensorJob

__all__ = ["Fp8Figure", "Fp8Figures", "delta_norm", "write_quantized"]


@dataclass(frozen=True)
class Fp8Figure:
    """One quantized tensor's figures (Frobenius norms)."""

    action: str
    weight_norm: float  # ||W32||
    error_norm: float  # ||deq(q) - W32||
    delta_norm: float | None = None  # ||s * B@A|| of a merge

    @property
    def rel_error(self) -> float:
        return self.error_norm / self.weight_norm if self.weight_norm else 0.0

    @property
    def delta_survives(self) -> bool | None:
        """A merge's delta is larger than its quantization error (None: not a merge)."""
        return None if self.delta_norm is None else self.delta_norm > self.error_norm

    def to_json(self) -> dict:
        return {**asdict(self), "rel_error": self.rel_error, "delta_survives": self.delta_survives}


class Fp8Figures:
    """Thread-safe {tensor: Fp8Figure} (workers add)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.by_name: dict[str, Fp8Figure] = {}

    def add(self, name: str, fig: Fp8Figure) -> None:
        with self._lock:
            self.by_name[name] = fig


def delta_norm(a: torch.Tensor, b: torch.Tensor, scale: float) -> float:
    """||s * B@A||_F from the factors in fp64: |s| sqrt(sum((B^T B) * (A A^T))), never the full product."""
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    return abs(scale) * math.sqrt(max(0.0, float(((b64.T @ b64) * (a64 @ a64.T)).sum())))


def write_quantized(runner, job: TensorJob, writer: StreamingSafetensorsWriter) -> Fp8Figure:
    """Make and write `job`'s codes and scale grid (see the module docstring). `runner`: the worker's
    `produce.JobRunner` (sources, buffers, the zero-delta tally)."""
    rows, cols = job.shape
    scales = torch.empty(grid_shape((rows, cols)), dtype=torch.float32)
    sums = QuantSums()
    src = _Rows(runner, job)
    unchanged = True
    for s, n in fp8_row_blocks(rows, cols, FP8_BLOCK_ELEMS):
        w32, same = src.fill(s, n)
        unchanged = same and unchanged
        codes = runner.buffer("codes", torch.float8_e4m3fn, (n, cols))
        # the reference error figure's buffer, only where the C kernel is not built
        scratch = None if accelerator is not None else runner.buffer("error", torch.float32, (n * cols,))
        quantize_rows_into(w32, codes, scales[s // 128 : -(-(s + n) // 128)], sums=sums, scratch=scratch)
        writer.write_chunk(job.name, tensor_bytes(codes))
    if not job.out_bytes:
        writer.write(job.name, b"")
    assert job.scale_name is not None
    writer.write(job.scale_name, scales)
    if job.action == "merge":
        runner.zero.add(unchanged, src.zero_factor)
    return Fp8Figure(job.action, math.sqrt(sums.w_sq), math.sqrt(sums.err_sq), src.delta_norm)


class _Rows:
    """W32 of a job, row block by row block."""

    def __init__(self, runner, job: TensorJob):
        self.runner, self.job = runner, job
        self.base, self.name = runner.sources.base, runner.base_name(job)
        self.delta_norm: float | None = None
        self.zero_factor = False
        self.whole: torch.Tensor | None = None
        if job.action == "merge":
            adapter = runner.sources.adapter
            self.a = adapter.read_ref(job.lora_a).to(torch.float32)
            self.b = adapter.read_ref(job.lora_b).to(torch.float32)
            check_shapes(
                job.shape,
                tuple(self.a.shape),
                tuple(self.b.shape),
                fan_in_fan_out=job.fan_in_fan_out,
                name=job.name,
            )
            self.zero_factor = not bool(self.a.any()) or not bool(self.b.any())
            self.delta_norm = delta_norm(self.a, self.b, job.scale or 0.0)
        elif job.action == "replace":
            self.whole = runner.sources.adapter.read_key(job.src)

    def fill(self, s: int, n: int) -> tuple[torch.Tensor, bool]:
        """Rows [s, s + n) of W32, in one of the worker's buffers; and for a merge, whether they equal the
        base's (the delta rounded away in fp32). A merge makes W32 in place of its product B@A (one fp32
        buffer, not two). Non-finite values are refused, counted over the block."""
        job, cols = self.job, self.job.shape[1]
        if job.action == "merge":
            w = self.runner.buffer("weight", job.src_dtype, (n, cols))
            self.base.read_into(self.name, w, rows=(s, n))
            a, b = (self.a[:, s : s + n], self.b) if job.fan_in_fan_out else (self.a, self.b[s : s + n])
            prod = self.runner.buffer("product", torch.float32, (n, cols))
            # fan_in_fan_out's product is the transpose of W32's rows: made beside them, not in place
            w32 = self.runner.buffer("w32", torch.float32, (n, cols)) if job.fan_in_fan_out else prod
            merge_weight_into(
                w32, w, a, b, job.scale or 0.0, fan_in_fan_out=job.fan_in_fan_out, name=job.name, scratch=prod
            )
            return w32, rounds_to_base(w32, w)
        w32 = self.runner.buffer("w32", torch.float32, (n, cols))
        if self.whole is not None:
            w32.copy_(self.whole[s : s + n])
        elif job.src_dtype == "float32":
            self.base.read_into(self.name, w32, rows=(s, n))
        else:
            w = self.runner.buffer("weight", job.src_dtype, (n, cols))
            self.base.read_into(self.name, w, rows=(s, n))
            w32.copy_(w)
        if not math.isfinite(float(w32.sum(dtype=torch.float32))):
            bad = count_nonfinite(w32)
            if bad:
                raise FormatError(
                    f"{bad} value(s) are not finite",
                    key=job.name,
                    hint="the source holds inf/nan: FP8 cannot hold them",
                )
        return w32, True
