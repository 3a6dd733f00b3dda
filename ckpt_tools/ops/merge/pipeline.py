"""`ckpt merge`, executed: the plan's tensors produced by a pool of workers with bounded read-ahead,
written shard by shard into an `AtomicOutputDir` (nothing appears at OUT unless complete).

Memory: `threads` workers read and compute at most `threads` tensors ahead of the writer, within the
plan's `window_budget` (a job bigger than the budget runs alone); each reads its base tensor straight
into a pooled buffer (`Source.read_into`: one copy, from the page cache); verbatim copies of an HF base
stream in COPY_BLOCK_BYTES blocks, so the largest tensor (the embedding) is never held when it is not
modified. A finished shard is fsynced in the background while the next one is written.

Test-only hook: env CKPT_TOOLS_TEST_SLOW_WRITE=<seconds> sleeps after each tensor is written, so a
test can kill a merge midway. It has no other use.
"""
from __future__ import annotations

import math
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ...core.dtypes import dtype_name, torch_dtype
from ...core.errors import FormatError, UsageError
from ...core.progress import Progress, ProgressEvent
from ...core.tensor_math import merge_weight_into, rounds_to_base
from ...dist import Group, SoloGroup
from ...formats.hf_dir.config import rewrite_config
from ...formats.hf_dir.names import INDEX_NAME
from ...formats.hf_dir.shards import index_json
from ...formats.safetensors.read import COPY_BLOCK_BYTES
from ...formats.safetensors.writer import StreamingSafetensorsWriter
from ...io.copy import copy_input_file
from ...io.files import atomic_write_text, fsync_path
from ...io.inputs import read_json
from ...io.staging import SharedOutputDir
from ...sources.base import tensor_bytes
from ...sources.hf import HFSource
from .guards import ZeroDelta
from .plan import OUTPUT_METADATA, MergePlan, TensorJob, job_working_bytes, streamed_by_writer, window_budget
from .prepare import MergeSources

__all__ = ["SLOW_WRITE_ENV", "COPY_BLOCK_BYTES", "MergeResult", "MergeReport", "Buffers", "run_merge",
           "check_unchanged"]

SLOW_WRITE_ENV = "CKPT_TOOLS_TEST_SLOW_WRITE"


@dataclass(frozen=True)
class MergeResult:
    out: str
    seconds: float
    tensors: int
    merged_modules: int
    bytes_read: int
    bytes_written: int
    files: tuple[str, ...]
    counts: dict = field(default_factory=dict)


@dataclass(frozen=True)
class MergeReport:
    """What `ckpt merge` reports: the plan, and what was written (None for a dry run)."""
    plan: MergePlan
    result: MergeResult | None = None

    def to_json(self) -> dict:
        if self.result is None:
            return {"dry_run": True, "out": self.plan.out, "plan": self.plan.to_json()}
        return {"dry_run": False, "out": self.plan.out, "result": asdict(self.result),
                "plan": self.plan.to_json(jobs=False)}


class Buffers:
    """Reusable byte buffers for tensors in flight. Fresh multi-MB allocations are mmapped by malloc
    and page-faulted (and zeroed by the kernel) on every use: for a 1.7B merge that was 2 GB of
    faults and seconds of system time. Buffers here are reused instead. A buffer that is too small
    is released when a bigger one is needed, so no more buffers are alive than are in use at once
    (at most 2 per worker + 1 being written)."""

    def __init__(self, keep_bytes: int) -> None:
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()
        self.keep_bytes = keep_bytes       # larger one-off buffers are released, not kept

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:   # (indices, not list.remove: == on tensors compares elements)
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
            if self._free:   # none fits: release the largest (too small) one before allocating
                self._free.pop(max(range(len(self._free)), key=lambda i: self._free[i].numel()))
        return torch.empty(max(nbytes, 1), dtype=torch.uint8)

    def give(self, buf: torch.Tensor | None) -> None:
        if buf is not None and buf.numel() <= self.keep_bytes:
            with self._lock:
                self._free.append(buf)

    @staticmethod
    def view(buf: torch.Tensor, dtype, shape: tuple[int, ...]) -> torch.Tensor:
        dt = torch_dtype(dtype)
        n = math.prod(shape) * dt.itemsize
        return buf[:n].view(dt).view(shape)


def check_unchanged(plan: MergePlan, sources: MergeSources) -> None:
    """The sources still hold what the plan was made from (names, shapes, dtypes, shards)."""
    problems = []
    base = sources.base
    refs = {} if isinstance(base, HFSource) else {base.ref(n): base.facts(n) for n in base.names()}
    for j in plan.jobs:
        if j.action == "replace":
            try:
                f = sources.adapter.key_facts(j.src)
            except (KeyError, FormatError):
                f = None
            if f is None or tuple(f.shape) != j.shape or f.dtype != j.src_dtype:
                problems.append(f"adapter tensor {j.src}")
        elif isinstance(base, HFSource):
            info = base.model_dir.tensors.get(j.src)
            if info is None or info.path.name != j.src_file or tuple(info.shape) != j.shape \
                    or info.dtype_name != j.src_dtype:
                problems.append(f"base tensor {j.src}")
        else:
            f = refs.get(j.src)
            if f is None or tuple(f.shape) != j.shape or f.dtype != j.src_dtype:
                problems.append(f"checkpoint tensor {j.src}")
    if problems:
        raise FormatError("the inputs changed since the merge was planned: " + ", ".join(problems[:6]),
                          path=plan.base_path, hint="plan again (rerun the command)")


class _Producer:
    """Makes one output tensor of the plan (runs in a worker thread; reads are thread-safe)."""

    def __init__(self, plan: MergePlan, sources: MergeSources):
        self.plan = plan
        self.sources = sources
        self._local = threading.local()
        merges = [j for j in plan.jobs if j.action == "merge"]
        self.buffers = Buffers(max((max(j.read_bytes, j.out_bytes) for j in merges), default=0))
        self.zero = ZeroDelta()   # merged tensors that came out equal to their base
        # the base's name of each job's source (a DCP base names tensors by HF name, jobs by DCP key)
        base = sources.base
        self._name = {} if isinstance(base, HFSource) else {base.ref(n): n for n in base.names()}

    def base_name(self, job: TensorJob) -> str:
        return self._name.get(job.src, job.src)

    def scratch(self, numel: int) -> torch.Tensor:
        """This worker's fp32 buffer for the LoRA product, grown to the largest merge it has seen."""
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < numel:
            self._local.buf = None
            buf = self._local.buf = torch.empty(numel, dtype=torch.float32)
        return buf

    def read_base(self, job: TensorJob) -> tuple[torch.Tensor, torch.Tensor]:
        """The base tensor of `job`, read into a pooled buffer (returned too: the caller gives it back)."""
        buf = self.buffers.take(math.prod(job.shape) * torch_dtype(job.src_dtype).itemsize)
        try:
            t = Buffers.view(buf, job.src_dtype, job.shape)
            if t.numel():
                self.sources.base.read_into(self.base_name(job), t)
        except BaseException:
            self.buffers.give(buf)
            raise
        return t, buf

    def produce(self, job: TensorJob) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the output tensor, the pooled buffer holding it or None): give the buffer back after writing."""
        if job.action == "replace":
            src, src_buf = self.sources.adapter.read_key(job.src), None
        else:
            src, src_buf = self.read_base(job)
        try:
            if job.action == "copy":
                return src.contiguous(), src_buf
            out_buf = self.buffers.take(job.out_bytes)
            try:
                out = Buffers.view(out_buf, job.out_dtype, job.shape)
                if job.action == "merge":
                    a = self.sources.adapter.read_ref(job.lora_a).to(torch.float32)
                    b = self.sources.adapter.read_ref(job.lora_b).to(torch.float32)
                    zero_factor = not bool(a.any()) or not bool(b.any())
                    merge_weight_into(out, src, a, b, job.scale, fan_in_fan_out=job.fan_in_fan_out,
                                      name=job.name, scratch=self.scratch(job.numel))
                    self.zero.add(rounds_to_base(out, src), zero_factor)
                else:
                    out.copy_(src)
                    if out.is_floating_point() and not math.isfinite(float(out.sum(dtype=torch.float32))) \
                            and not bool(torch.isfinite(out).all()):
                        bad = int((~torch.isfinite(out)).sum())
                        raise FormatError(f"{bad} value(s) are not finite after conversion to {job.out_dtype}",
                                          key=job.name, hint="the tensor overflows this dtype; use --dtype bf16 or fp32")
            except BaseException:
                self.buffers.give(out_buf)
                raise
            return out, out_buf
        finally:
            if job.action != "copy":
                self.buffers.give(src_buf)


def _slow_write_seconds() -> float:
    v = os.environ.get(SLOW_WRITE_ENV)
    if not v:
        return 0.0
    try:
        return max(0.0, float(v))
    except ValueError:
        raise UsageError(f"{SLOW_WRITE_ENV}={v!r} is not a number of seconds (a test-only hook)") from None


def run_merge(plan: MergePlan, sources: MergeSources, progress: Progress | None = None, *,
              overwrite: bool = False, group: Group | None = None) -> MergeReport:
    """Write the merged model to `plan.out` (atomically: nothing appears there unless complete).

    Under torchrun (`group` from `ckpt_tools.dist.current()`), this rank writes only its share of the
    plan's output shards (`group.part`); rank 0 also writes config, tokenizer and index, and commits
    once every rank's shards are on disk. Each shard's bytes do not depend on which rank wrote it."""
    t0 = time.perf_counter()
    group = group or SoloGroup()
    out = Path(plan.out)
    slow = _slow_write_seconds()
    check_unchanged(plan, sources)
    if isinstance(sources.base, HFSource):
        sources.base.open_all()   # every shard fd now, before worker threads start
    mine = {plan.units[i].file_name for i in group.part.mine([s.data_bytes for s in plan.units])}
    jobs = tuple(j for j in plan.jobs if j.out_file in mine)
    with SharedOutputDir(out, group, inputs=plan.inputs, need_bytes=plan.write_bytes, overwrite=overwrite) as tmp:
        zero = _write_tensors(plan, jobs, sources, tmp, progress, slow, t0)
        # a merge equal to its base is refused before OUT appears: counted over every rank's tensors
        zero.merged, zero.unchanged, zero.zero_factor = group.sum(
            [zero.merged, zero.unchanged, zero.zero_factor], "the zero-delta check")
        zero.check(plan)
        if group.leader:
            _write_files(plan, tmp)
    names = tuple(sorted(os.listdir(out)))
    written = sum(os.path.getsize(out / n) for n in names)
    result = MergeResult(str(out), time.perf_counter() - t0, len(plan.jobs), plan.merged_modules, plan.read_bytes,
                         written, names, {a: plan.count(a) for a in ("merge", "copy", "cast", "replace")})
    return MergeReport(plan, result)


def _write_files(plan: MergePlan, tmp: Path) -> None:
    """The non-tensor files and the index (the leader's, after its shards)."""
    for f in plan.files:   # read through the input checks, written as new files
        if f.action == "rewrite":
            cfg = read_json(f.src, root=Path(f.src).parent, what="config.json")
            atomic_write_text(tmp / f.name, rewrite_config(cfg, f.changes))
        else:
            copy_input_file(f.src, tmp / f.name, root=Path(f.src).parent, what="model file")
    if plan.index is not None:
        atomic_write_text(tmp / INDEX_NAME, index_json(plan.index))


def _copy_blocks(base: HFSource, job: TensorJob, writer: StreamingSafetensorsWriter) -> None:
    """A verbatim copy of an HF base tensor, in COPY_BLOCK_BYTES blocks (no decode, bounded memory)."""
    e = writer.declared(job.name)
    f = base.facts(job.src)
    if (dtype_name(f.dtype), tuple(f.shape)) != (job.out_dtype, e.shape):
        raise FormatError(f"declared {e.dtype}{list(e.shape)} but the source {base.path} holds "
                          f"{f.dtype}{list(f.shape)}", path=writer.path, key=job.name)
    if f.nbytes == 0:
        writer.write(job.name, b"")
        return
    buf = bytearray(min(COPY_BLOCK_BYTES, f.nbytes))
    mv = memoryview(buf)
    for start in range(0, f.nbytes, len(buf)):
        n = min(len(buf), f.nbytes - start)
        base.read_span(job.src, start, mv[:n])
        writer.write_chunk(job.name, mv[:n])


def _cast_rows(base, name: str, job: TensorJob, writer: StreamingSafetensorsWriter) -> None:
    """A copy or cast of any base tensor with rows, in blocks of about COPY_BLOCK_BYTES of the source:
    read the rows, convert (elementwise: the bytes equal a whole-tensor conversion), append. The
    finiteness check of a cast counts every block before the error."""
    rows = job.shape[0]
    row_bytes = max(1, job.read_bytes // rows)
    step = max(1, COPY_BLOCK_BYTES // row_bytes)
    out_dt = torch_dtype(job.out_dtype)
    bad = 0
    for s in range(0, rows, step):
        block = base.read_rows(name, s, min(step, rows - s))
        out = block if block.dtype == out_dt else block.to(out_dt)
        if job.action == "cast" and out.is_floating_point() and \
                not math.isfinite(float(out.sum(dtype=torch.float32))):
            bad += int((~torch.isfinite(out)).sum())
        writer.write_chunk(job.name, tensor_bytes(out.contiguous()))
        del block, out
    if bad:
        raise FormatError(f"{bad} value(s) are not finite after conversion to {job.out_dtype}",
                          key=job.name, hint="the tensor overflows this dtype; use --dtype bf16 or fp32")


def _write_tensors(plan: MergePlan, jobs: tuple[TensorJob, ...], sources: MergeSources, tmp: Path,
                   progress: Progress | None, slow: float, t0: float) -> ZeroDelta:
    """Write `jobs` (whole shards of the plan, in write order); returns the zero-delta tally."""
    producer = _Producer(plan, sources)
    total_bytes = sum(j.out_bytes for j in jobs)
    last_of_shard = {s.file_name: s.tensors[-1] for s in plan.shards}
    shard_entries = {s.file_name: s for s in plan.shards}
    by_name = {j.name: j for j in jobs}
    hf_base = sources.base if isinstance(sources.base, HFSource) else None

    def raw_copy(j: TensorJob) -> bool:   # written by the writer itself, in blocks (never whole)
        return streamed_by_writer(j, plan.base_kind)

    def event(done: int, done_bytes: int, job: TensorJob | None) -> ProgressEvent:
        return ProgressEvent("merge", done, len(jobs), unit="tensors", name=job.name if job else None,
                             action=job.action if job else None, bytes_done=done_bytes, bytes_total=total_bytes,
                             elapsed_s=time.perf_counter() - t0)

    if progress:
        progress(event(0, 0, None))
    # Parallelism comes from the workers, one tensor each. torch's own intra-op threads on top of
    # them oversubscribe the cores, and OpenMP's spinning barriers then burn ~8x the CPU time on a
    # busy machine (measured: 122 s vs 15 s of CPU for a 1.7B merge), so they are off meanwhile.
    intra_op = torch.get_num_threads()
    torch.set_num_threads(1)
    pool = ThreadPoolExecutor(max_workers=plan.threads, thread_name_prefix="ckpt-merge")
    # A finished shard is fsynced by this thread while the next shard is computed and written, so
    # the pipeline does not stall for a whole shard's flush (the disk, not the CPU, is then busy).
    flusher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-merge-fsync")
    flushes: list[Future] = []
    pending: dict[int, Future] = {}
    ahead = 0
    writer = None
    done_bytes = 0
    ws = [job_working_bytes(j, plan.base_kind) for j in jobs]
    budget = window_budget(plan.jobs, plan.threads, plan.base_kind)   # the plan's memory bound, on every rank
    in_flight = 0
    try:
        for i, job in enumerate(jobs):
            # bounded read-ahead: at most `threads` tensors and `budget` bytes ahead of the writer
            # (a job bigger than the budget runs alone)
            while ahead < len(jobs) and len(pending) < plan.threads:
                if raw_copy(jobs[ahead]):
                    ahead += 1
                    continue
                if pending and in_flight + ws[ahead] > budget:
                    break
                pending[ahead] = pool.submit(producer.produce, jobs[ahead])
                in_flight += ws[ahead]
                ahead += 1
            if writer is None:
                s = shard_entries[job.out_file]
                entries = [(n, by_name[n].out_dtype, by_name[n].shape) for n in s.tensors]
                writer = StreamingSafetensorsWriter(tmp / job.out_file, entries, OUTPUT_METADATA, fsync=False)
            if raw_copy(job) and job.action == "copy" and hf_base is not None:
                _copy_blocks(hf_base, job, writer)
            elif raw_copy(job):
                _cast_rows(sources.base, producer.base_name(job), job, writer)
            else:
                t, buf = pending.pop(i).result()
                in_flight -= ws[i]
                writer.write(job.name, t)
                del t
                producer.buffers.give(buf)
            if job.name == last_of_shard[job.out_file]:
                writer.close()            # checks every byte is there; the fsync runs in the background
                flushes.append(flusher.submit(fsync_path, writer.path))
                writer = None
            done_bytes += job.out_bytes
            if progress:
                progress(event(i + 1, done_bytes, job))
            if slow:
                time.sleep(slow)
        for f in flushes:
            f.result()                    # every shard is on disk before OUT may be renamed into place
        ok = True
    except BaseException:
        ok = False
        if writer is not None:
            writer.abort()
        for f in pending.values():
            f.cancel()
        raise
    finally:
        # On an error or a signal, never wait for the workers: each is bounded (one tensor, inputs
        # that cannot block: inputs.open_input refuses FIFOs) and ends on its own, but the command
        # must stop now (a blocking join once kept a merge alive through SIGTERM for 16 minutes).
        pool.shutdown(wait=ok, cancel_futures=True)
        flusher.shutdown(wait=ok)
        torch.set_num_threads(intra_op)
    return producer.zero
