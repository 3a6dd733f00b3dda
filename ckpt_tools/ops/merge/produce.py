"""One output tensor of a merge plan, made and written by one worker thread, in bounded blocks.

Every job writes its own tensor into its shard's writer at the tensor's precomputed offset
(`StreamingSafetensorsWriter(strict_order=False)`), so no tensor is ever held whole:

  merge   row blocks of about MERGE_BLOCK_ELEMS elements: the block's base rows read into a reused
          buffer, P = B32[rows] @ A32 (for fan_in_fan_out, B32 @ A32[:, rows]), then
          round_to(out, W32 + s * P) (`core.tensor_math.merge_weight_into`), appended. Every block
          has >= MIN_BLOCK_ROWS rows (a short tail joins the block before it): with BLAS blocks that
          tall, each product row equals the same row of the one full-size matmul bit for bit (the
          kernels differ only for 1-3 rows; tests/test_merge_blocks.py holds this on the machine
          that runs it), so the output bytes equal the whole-tensor merge's.
  copy    an HF base tensor in the output dtype: its byte range copied from the base shard into the
          output shard by `copy_file_range` (in the kernel: the bytes never enter our memory).
  cast    and copies from a DCP base: row blocks of about COPY_BLOCK_BYTES, converted, appended.
  replace a `modules_to_save` tensor of the adapter, read whole (the adapter holds it whole).

Memory per worker: its block buffers (reused across jobs: no page faults per tensor), not its tensor.
"""

from __future__ import annotations

import math
import threading

import torch

from ...core.dtypes import dtype_name, torch_dtype
from ...core.errors import FormatError
from ...core.lora_math import check_shapes
from ...core.tensor_math import count_nonfinite, merge_weight_into, nonfinite_error, rounds_to_base
from ...formats.handle import tensor_bytes
from ...formats.safetensors.read import COPY_BLOCK_BYTES
from ...formats.safetensors.writer import StreamingSafetensorsWriter
from .guards import ZeroDelta
from .plan import COPY_THROUGH_BLOCK_BYTES, MergePlan, TensorJob, merge_row_blocks, streamed_by_writer
from .prepare import MergeSources
from .quantize import Fp8Figures, write_quantized

__all__ = ["JobRunner"]


class JobRunner:
    """Makes and writes one job of the plan (`run`, in a worker thread; sources' reads are thread-safe)."""

    def __init__(self, plan: MergePlan, sources: MergeSources):
        self.plan = plan
        self.sources = sources
        self._local = threading.local()
        self.zero = ZeroDelta()  # merged tensors that came out equal to their base
        self.fp8 = Fp8Figures()  # an FP8 output's quantized tensors' figures
        # the base's name of each job's source (a DCP base names tensors by HF name, jobs by DCP key)
        base = sources.base
        self._name = {base.ref(n): n for n in base.names()}

    def base_name(self, job: TensorJob) -> str:
        return self._name.get(job.src, job.src)

    def buffer(self, role: str, dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """This worker's reusable buffer `role`, grown to the largest block it has needed, viewed as
        `dtype[shape]`."""
        bufs = getattr(self._local, "bufs", None)
        if bufs is None:
            bufs = self._local.bufs = {}
        dt = torch_dtype(dtype)
        n = max(1, math.prod(shape) * dt.itemsize)
        buf = bufs.get(role)
        if buf is None or buf.numel() < n:
            bufs[role] = None
            buf = bufs[role] = torch.empty(n, dtype=torch.uint8)
        return buf[: math.prod(shape) * dt.itemsize].view(dt).view(shape)

    def run(self, job: TensorJob, writer: StreamingSafetensorsWriter) -> None:
        if job.scale_name is not None:  # an FP8 output's quantized weight: codes + scales (`quantize`)
            self.fp8.add(job.name, write_quantized(self, job, writer))
        elif job.action == "merge":
            self._merge(job, writer)
        elif job.action == "copy" and job.src_file is not None:  # an HF base's tensor: its shard's bytes
            self._copy_through(job, writer)
        elif streamed_by_writer(job, self.plan.base_kind):
            self._cast_rows(job, writer)
        else:
            self._whole(job, writer)

    # ------------------------------------------------------------------ the actions
    def _merge(self, job: TensorJob, writer: StreamingSafetensorsWriter) -> None:
        assert job.lora_a is not None and job.lora_b is not None and job.scale is not None  # a merge job's
        a = self.sources.adapter.read_ref(job.lora_a).to(torch.float32)
        b = self.sources.adapter.read_ref(job.lora_b).to(torch.float32)
        check_shapes(
            job.shape, tuple(a.shape), tuple(b.shape), fan_in_fan_out=job.fan_in_fan_out, name=job.name
        )
        zero_factor = not bool(a.any()) or not bool(b.any())
        _rows, cols = job.shape
        unchanged, bad = True, 0
        base, name = self.sources.base, self.base_name(job)
        if not job.out_bytes:  # no rows to merge: an empty tensor, equal to its base
            writer.write(job.name, b"")
        for s, n in merge_row_blocks(job.shape):
            w = self.buffer("weight", job.src_dtype, (n, cols))
            base.read_into(name, w, rows=(s, n))
            out = self.buffer("out", job.out_dtype, (n, cols))
            a_rows, b_rows = (a[:, s : s + n], b) if job.fan_in_fan_out else (a, b[s : s + n])
            try:
                merge_weight_into(
                    out,
                    w,
                    a_rows,
                    b_rows,
                    job.scale,
                    fan_in_fan_out=job.fan_in_fan_out,
                    name=job.name,
                    scratch=self.buffer("product", torch.float32, (n * cols,)),
                )
            except FormatError:
                block_bad = count_nonfinite(out)  # the block is complete; count every block before the error
                if not block_bad:
                    raise
                bad += block_bad
            if bad:
                continue
            unchanged = unchanged and rounds_to_base(out, w)
            writer.write_chunk(job.name, tensor_bytes(out))
        if bad:
            raise nonfinite_error(bad, job.name)
        self.zero.add(unchanged, zero_factor)

    def _copy_through(self, job: TensorJob, writer: StreamingSafetensorsWriter) -> None:
        """A verbatim copy of a base tensor stored as one byte range (an HF shard's): by the kernel."""
        base, name = self.sources.base, self.base_name(job)
        e = writer.declared(job.name)
        f = base.facts(name)
        if (dtype_name(f.dtype), tuple(f.shape)) != (job.out_dtype, e.shape):
            raise FormatError(
                f"declared {e.dtype}{list(e.shape)} but the source {base.path} holds "
                f"{f.dtype}{list(f.shape)}",
                path=writer.path,
                key=job.name,
            )
        if f.nbytes == 0:
            writer.write(job.name, b"")
            return
        r = base.copy_range(name)
        if r is None:  # not stored as one range: read and write it
            return self._cast_rows(job, writer) if job.shape and job.shape[0] else self._whole(job, writer)
        writer.copy_range_from(
            job.name, r.fd, r.offset, r.nbytes, path=r.path, block_bytes=COPY_THROUGH_BLOCK_BYTES
        )

    def _cast_rows(self, job: TensorJob, writer: StreamingSafetensorsWriter) -> None:
        """A copy or cast of any base tensor with rows, in blocks of about COPY_BLOCK_BYTES of the source:
        read the rows, convert (elementwise: the bytes equal a whole-tensor conversion), append. The
        finiteness check of a cast counts every block before the error."""
        rows = job.shape[0]
        row_bytes = max(1, job.read_bytes // rows)
        step = max(1, COPY_BLOCK_BYTES // row_bytes)
        out_dt = torch_dtype(job.out_dtype)
        name = self.base_name(job)
        bad = 0
        for s in range(0, rows, step):
            block = self.sources.base.read_rows(name, s, min(step, rows - s))
            out = block if block.dtype == out_dt else block.to(out_dt)
            if (
                job.action == "cast"
                and out.is_floating_point()
                and not math.isfinite(float(out.sum(dtype=torch.float32)))
            ):
                bad += int((~torch.isfinite(out)).sum())
            writer.write_chunk(job.name, tensor_bytes(out.contiguous()))
            del block, out
        if bad:
            raise _overflow_error(bad, job)

    def _whole(self, job: TensorJob, writer: StreamingSafetensorsWriter) -> None:
        """A replacement from the adapter, or a base tensor without rows (a scalar): whole."""
        if job.action == "replace":
            src = self.sources.adapter.read_key(job.src)
        else:
            src = self.sources.base.read_tensor(self.base_name(job))
        out = src.contiguous() if job.action == "copy" else src.to(torch_dtype(job.out_dtype)).contiguous()
        if (
            job.action != "copy"
            and out.is_floating_point()
            and not math.isfinite(float(out.sum(dtype=torch.float32)))
            and not bool(torch.isfinite(out).all())
        ):
            raise _overflow_error(int((~torch.isfinite(out)).sum()), job)
        writer.write(job.name, out)


def _overflow_error(bad: int, job: TensorJob) -> FormatError:
    return FormatError(
        f"{bad} value(s) are not finite after conversion to {job.out_dtype}",
        key=job.name,
        hint="the tensor overflows this dtype; use --dtype bf16 or fp32",
    )
