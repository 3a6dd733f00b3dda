"""`ckpt merge`, executed: the plan's tensors made and written by a pool of workers, shard by shard, into
an `AtomicOutputDir` (nothing appears at OUT unless complete).

Each worker makes one tensor and writes it itself, in bounded blocks, at its offset in its shard
(`produce.JobRunner`): merged weights in row blocks, untouched tensors copied from the base shard by
`copy_file_range` (in the kernel), casts in row blocks. So memory is the workers' block buffers, sized
from the job (`plan.job_working_bytes`), never a tensor: at most `threads` jobs run at once, within
the plan's `window_budget` (a job over the budget runs alone). A finished job holds nothing, so one
slow job does not stall the others. The main thread accounts for the jobs in write order, reports progress,
and closes a shard once its last tensor
is in; the shard is fsynced in the background while the next ones are written. Each shard's sha256
(the output's SHA256SUMS, `formats.hf_dir.digests`) is computed behind the workers on its own thread
(`_ShardHash`).

Test-only hook: env CKPT_TOOLS_TEST_SLOW_WRITE=<seconds> sleeps after each tensor is written, so a
test can kill a merge midway. It has no other use.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ...core.dry_run import DryRunReport
from ...core.errors import DiskSpaceError, FormatError, UsageError
from ...core.pool import DaemonPool, one_intra_op_thread
from ...core.progress import Progress, ProgressEvent
from ...dist import Group, SoloGroup, current
from ...formats.hf_dir.config import rewrite_config
from ...formats.hf_dir.digests import SUMS_NAME, format_sums
from ...formats.hf_dir.names import INDEX_NAME
from ...formats.hf_dir.shards import index_json
from ...formats.safetensors.writer import StreamingSafetensorsWriter
from ...io.copy import copy_input_file
from ...io.files import WrittenFileHasher, atomic_write_text, fsync_path, hash_written_file, write_new_file
from ...io.inputs import as_input, read_json
from ...io.staging import SharedOutputDir, describe_output
from .fp8 import counted_actions, declared_tensors, fp8_summary
from .guards import ZeroDelta
from .plan import OUTPUT_METADATA, MergePlan, TensorJob, job_working_bytes, window_budget
from .prepare import MergeSources, check_output
from .produce import JobRunner

__all__ = ["SLOW_WRITE_ENV", "MergeReport", "MergeResult", "check_unchanged", "finish_merge", "run_merge"]

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
    fp8: dict | None = None  # an FP8 output: quantized / kept tensors and the error figures (`fp8_summary`)


@dataclass(frozen=True)
class MergeReport:
    """What `ckpt merge` reports: the plan, and what was written (None for a dry run)."""

    plan: MergePlan
    result: MergeResult | None = None

    def to_json(self) -> dict:
        if self.result is None:
            return {"dry_run": True, "out": self.plan.out, "plan": self.plan.to_json()}
        return {
            "dry_run": False,
            "out": self.plan.out,
            "result": {k: v for k, v in asdict(self.result).items() if k != "fp8" or v is not None},
            "plan": self.plan.to_json(jobs=False),
        }


def check_unchanged(plan: MergePlan, sources: MergeSources) -> None:
    """The sources still hold what the plan was made from (names, shapes, dtypes, shards)."""
    problems = []
    base = sources.base
    refs = {base.ref(n): n for n in base.names()}  # a job names its base tensor by `ref` (a DCP key)
    for j in plan.jobs:
        if j.action == "replace":
            try:
                f = sources.adapter.key_facts(j.src)
            except (KeyError, FormatError):
                f = None
            if f is None or tuple(f.shape) != j.shape or f.dtype != j.src_dtype:
                problems.append(f"adapter tensor {j.src}")
            continue
        name = refs.get(j.src)
        f = None if name is None else base.facts(name)
        if (
            name is None
            or f is None
            or tuple(f.shape) != j.shape
            or f.dtype != j.src_dtype
            or (j.src_file is not None and base.file_of(name) != j.src_file)
        ):
            # an HF base's jobs name the shard of their tensor
            problems.append(f"{'base' if j.src_file is not None else 'checkpoint'} tensor {j.src}")
    if problems:
        raise FormatError(
            "the inputs changed since the merge was planned: " + ", ".join(problems[:6]),
            path=plan.base_path,
            hint="plan again (rerun the command)",
        )


def _slow_write_seconds() -> float:
    v = os.environ.get(SLOW_WRITE_ENV)
    if not v:
        return 0.0
    try:
        return max(0.0, float(v))
    except ValueError:
        raise UsageError(f"{SLOW_WRITE_ENV}={v!r} is not a number of seconds (a test-only hook)") from None


def run_merge(
    plan: MergePlan,
    sources: MergeSources,
    progress: Progress | None = None,
    *,
    overwrite: bool = False,
    group: Group | None = None,
) -> MergeReport:
    """Write the merged model to `plan.out` (atomically: nothing appears there unless complete).

    Under torchrun (`group` from `ckpt_tools.dist.current()`), this rank writes only its share of the
    plan's output shards (`group.part`); rank 0 also writes config, tokenizer and index, and commits
    once every rank's shards are on disk. Each shard's bytes do not depend on which rank wrote it."""
    t0 = time.perf_counter()
    group = group or SoloGroup()
    out = Path(plan.out)
    slow = _slow_write_seconds()
    check_unchanged(plan, sources)
    sources.base.open_all()  # every shard fd now, before worker threads start
    mine = {plan.units[i].file_name for i in group.part.mine([s.data_bytes for s in plan.units])}
    jobs = tuple(j for j in plan.jobs if j.out_file in mine)
    with SharedOutputDir(
        out, group, inputs=plan.inputs, need_bytes=plan.write_bytes, overwrite=overwrite
    ) as tmp:
        zero, digests, figures = _write_tensors(plan, jobs, sources, tmp, progress, slow, t0)
        # a merge equal to its base is refused before OUT appears: counted over every rank's tensors
        zero.merged, zero.unchanged, zero.zero_factor = group.sum(
            [zero.merged, zero.unchanged, zero.zero_factor], "the zero-delta check"
        )
        zero.check(plan)
        every = group.gather(digests, "the shards' sha256")
        figures_every = group.gather(figures, "the FP8 figures")
        if group.leader:
            assert every is not None  # the leader gathers every rank's
            _write_files(plan, tmp)
            _write_sums(tmp, {k: v for d in every for k, v in d.items()})
    names = tuple(sorted(os.listdir(out)))
    written = sum(os.path.getsize(out / n) for n in names)
    result = MergeResult(
        str(out),
        time.perf_counter() - t0,
        len(plan.jobs),
        plan.merged_modules,
        plan.read_bytes,
        written,
        names,
        {a: plan.count(a) for a in counted_actions(plan.out_dtype)},
        fp8_summary(plan, {k: v for d in figures_every or [] for k, v in d.items()}),
    )
    return MergeReport(plan, result)


def finish_merge(
    plan: MergePlan,
    sources: MergeSources,
    out: str | Path,
    *,
    dry_run: bool,
    overwrite: bool,
    progress: Progress | None = None,
    group: Group | None = None,
) -> MergeReport | DryRunReport:
    """The end of merge and export (one plan, one pipeline), OUT checked as the real run checks it: a dry
    run reports what the real run would refuse (too little disk) as a warning of its plan; the real run
    refuses it, then runs over `group` (None: `dist.current()`, asked once the inputs are open and planned,
    since the ranks then compare them)."""
    if dry_run:
        output = describe_output(out, overwrite=overwrite)  # refuses the OUTs the real run refuses
        try:
            check_output(plan, out, overwrite=overwrite)
        except DiskSpaceError as exc:
            plan = dataclasses.replace(plan, warnings=plan.warnings + (f"the real run would refuse: {exc}",))
        return DryRunReport(MergeReport(plan), output)
    check_output(plan, out, overwrite=overwrite)
    return run_merge(
        plan, sources, progress, overwrite=overwrite, group=current() if group is None else group
    )


def _write_files(plan: MergePlan, tmp: Path) -> None:
    """The non-tensor files and the index (the leader's, after its shards)."""
    for f in plan.files:  # read through the input checks, written as new files
        if f.action == "rewrite":
            cfg = read_json(f.src, root=as_input(f.src).parent, what="config.json")
            atomic_write_text(tmp / f.name, rewrite_config(cfg, f.changes))
        else:
            copy_input_file(f.src, tmp / f.name, root=as_input(f.src).parent, what="model file")
    if plan.index is not None:
        atomic_write_text(tmp / INDEX_NAME, index_json(plan.index))


def _write_sums(tmp: Path, shard_digests: dict[str, str]) -> None:
    """SHA256SUMS over every file of the output (`formats.hf_dir.digests`): the shards' digests as the
    workers' shards were hashed, the small files (config, tokenizer, index) hashed here."""
    digests = dict(shard_digests)
    for name in sorted(os.listdir(tmp)):
        if name not in digests and name != SUMS_NAME and not name.startswith(".") and (tmp / name).is_file():
            digests[name] = hash_written_file(tmp / name)
    write_new_file(tmp / SUMS_NAME, format_sums(digests))


class _ShardHash:
    """The sha256 of one shard, computed on its own thread behind the workers: each time a job is
    accounted for (its tensor's bytes are all written), the shard's prefix of finished tensors is hashed
    up to there, read back from the page cache (workers write a shard's tensors out of order, and copied
    tensors never pass through our memory); at close only the last tensors are left."""

    def __init__(self, writer: StreamingSafetensorsWriter):
        self.hasher = WrittenFileHasher(writer.path)
        self.thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-merge-sha256")
        self.last: Future | None = None
        self._order = sorted(writer.entries, key=lambda e: e.begin)  # file order
        self._start = writer.data_start
        self._done: set[str] = set()
        self._next = 0

    def tensor_done(self, name: str, also: str | None = None) -> None:
        self._done.add(name)
        if also is not None:  # a quantized weight's scale, written by the same job
            self._done.add(also)
        before = self._next
        while self._next < len(self._order) and self._order[self._next].name in self._done:
            self._next += 1
        if self._next == before:
            return
        end = self._start + (
            self._order[self._next].begin
            if self._next < len(self._order)
            else self._order[-1].begin + self._order[-1].nbytes
        )
        if self.last is not None and self.last.done():
            self.last.result()  # a failed read is raised now
        self.last = self.thread.submit(self.hasher.hash_to, end)

    def finish(self, end: int) -> str:
        self.thread.submit(self.hasher.hash_to, end).result()
        self.thread.shutdown(wait=True)
        return self.hasher.hexdigest()

    def abort(self) -> None:
        self.thread.shutdown(wait=False, cancel_futures=True)


def _finish_shard(path: Path, sha: _ShardHash, end: int) -> tuple[str, str]:
    """A closed shard: the rest of its sha256, then fsync."""
    digest = sha.finish(end)
    fsync_path(path)
    return path.name, digest


def _write_tensors(
    plan: MergePlan,
    jobs: tuple[TensorJob, ...],
    sources: MergeSources,
    tmp: Path,
    progress: Progress | None,
    slow: float,
    t0: float,
) -> tuple[ZeroDelta, dict[str, str], dict[str, dict]]:
    """Write `jobs` (whole shards of the plan, in write order); returns the zero-delta tally, each
    written shard's sha256 and the FP8 figures of each quantized tensor."""
    runner = JobRunner(plan, sources)
    total_bytes = sum(j.out_bytes for j in jobs)

    def event(done: int, done_bytes: int, job: TensorJob | None) -> ProgressEvent:
        return ProgressEvent(
            "merge",
            done,
            len(jobs),
            unit="tensors",
            name=job.name if job else None,
            action=job.action if job else None,
            bytes_done=done_bytes,
            bytes_total=total_bytes,
            elapsed_s=time.perf_counter() - t0,
        )

    if progress:
        progress(event(0, 0, None))
    # Parallelism comes from the workers, one tensor each. torch's own intra-op threads on top of
    # them oversubscribe the cores, and OpenMP's spinning barriers then burn ~8x the CPU time on a
    # busy machine (measured: 122 s vs 15 s of CPU for a 1.7B merge), so they are off meanwhile.
    intra_op = torch.get_num_threads()
    torch.set_num_threads(1)
    pool = DaemonPool(plan.threads, "ckpt-merge", initializer=one_intra_op_thread)
    shards = _Shards(plan, jobs, tmp)
    window = _Window(plan, jobs, lambda job: pool.submit(runner.run, job, shards.writer_for(job.out_file)))
    done_bytes = 0
    ok = False
    try:
        for i, job in enumerate(jobs):
            window.wait_for(i)
            shards.tensor_written(job)
            done_bytes += job.out_bytes
            if progress:
                progress(event(i + 1, done_bytes, job))
            if slow:
                time.sleep(slow)
        digests = shards.digests()  # every shard is on disk before OUT may be renamed
        ok = True
    except BaseException:
        window.cancel()
        shards.abort()
        raise
    finally:
        # On an error or a signal, never wait for the workers: each is bounded (one tensor, inputs
        # that cannot block: inputs.open_input refuses FIFOs) and ends on its own, but the command
        # must stop now (a blocking join once kept a merge alive through SIGTERM for 16 minutes).
        pool.shutdown(wait=ok)  # (the futures not started were cancelled above)
        shards.shutdown(block=ok)
        torch.set_num_threads(intra_op)
    return runner.zero, digests, {n: f.to_json() for n, f in runner.fp8.by_name.items()}


class _Window:
    """The jobs submitted ahead of the one the writer waits for: at most `threads` running and `budget`
    bytes of their working sets at once (a job bigger than the budget runs alone). A finished job holds
    nothing, so a slow job (a 1 GB embedding copied) does not stall the others: those after it run
    while it does."""

    def __init__(self, plan: MergePlan, jobs: tuple[TensorJob, ...], submit: Callable[[TensorJob], Future]):
        self.jobs, self.submit, self.threads = jobs, submit, plan.threads
        self.ws = [job_working_bytes(j, plan.base_kind) for j in jobs]
        self.budget = window_budget(
            plan.jobs, plan.threads, plan.base_kind
        )  # the plan's bound, on every rank
        self.pending: dict[int, Future] = {}  # submitted, not yet accounted for in write order
        self.running: dict[Future, int] = {}  # submitted and not finished: these hold memory
        self.ahead = 0
        self.in_flight = 0

    def wait_for(self, i: int) -> None:
        """Job `i` done (its error raised), the jobs after it submitted as slots and budget free up."""
        jobs, ws, pending, running = self.jobs, self.ws, self.pending, self.running
        while True:
            for f in [f for f in running if f.done()]:  # a finished job holds nothing: its slot is free
                self.in_flight -= ws[running.pop(f)]
                if f.exception() is not None:
                    f.result()  # fail now, not when the writer gets there
            while (
                self.ahead < len(jobs)
                and len(running) < self.threads
                and (not running or self.in_flight + ws[self.ahead] <= self.budget)
            ):
                f = pending[self.ahead] = self.submit(jobs[self.ahead])
                running[f] = self.ahead
                self.in_flight += ws[self.ahead]
                self.ahead += 1
            if pending[i].done():
                break
            wait(list(running), return_when=FIRST_COMPLETED)
        pending.pop(i).result()

    def cancel(self) -> None:
        for f in self.pending.values():
            f.cancel()


class _Shards:
    """The output shards being written: each opened when its first job is submitted, hashed behind its
    writers (`_ShardHash`), closed once its last tensor is in, then its hash completed and it fsynced
    by the flusher's threads while the next shards are written, so the pipeline does not stall for a
    whole shard's hash or flush."""

    def __init__(self, plan: MergePlan, jobs: tuple[TensorJob, ...], tmp: Path):
        self.tmp = tmp
        self.shard_entries = {s.file_name: s for s in plan.shards}
        self.declared = declared_tensors(jobs)
        self.left: dict[str, int] = {}  # jobs of each shard not yet finished
        for j in jobs:
            self.left[j.out_file] = self.left.get(j.out_file, 0) + 1
        self.writers: dict[str, StreamingSafetensorsWriter] = {}
        self.hashes: dict[str, _ShardHash] = {}
        self.flusher = ThreadPoolExecutor(
            max_workers=max(1, min(plan.threads, len(self.shard_entries))),
            thread_name_prefix="ckpt-merge-fsync",
        )
        self.flushes: list[Future] = []

    def writer_for(self, file_name: str) -> StreamingSafetensorsWriter:
        # opened when its first job is submitted; each job writes at its own offset (any order)
        if file_name not in self.writers:
            s = self.shard_entries[file_name]
            entries = [(n, *self.declared[n]) for n in s.tensors]
            # fsync=False: the flusher fsyncs a closed shard in the background; writeback: the disk
            # starts on each block as it is written, so that fsync finds little left to do and the
            # disk works from the first block, not from the first closed 5 GB shard
            self.writers[file_name] = StreamingSafetensorsWriter(
                self.tmp / file_name,
                entries,
                OUTPUT_METADATA,
                strict_order=False,
                fsync=False,
                writeback=True,
            )
            self.hashes[file_name] = _ShardHash(self.writers[file_name])
        return self.writers[file_name]

    def tensor_written(self, job: TensorJob) -> None:
        """`job`'s tensor is all written: its shard closed if it was the last, else hashed up to it."""
        self.left[job.out_file] -= 1
        if not self.left[job.out_file]:
            w = self.writers.pop(job.out_file)
            w.close()  # checks every byte is there; the hash's end and fsync run in the background
            self.flushes.append(
                self.flusher.submit(_finish_shard, w.path, self.hashes.pop(job.out_file), w.file_bytes)
            )
        else:
            self.hashes[job.out_file].tensor_done(job.name, job.scale_name)

    def digests(self) -> dict[str, str]:
        """Each closed shard's sha256, once it is on disk."""
        return dict(f.result() for f in self.flushes)

    def abort(self) -> None:
        for w in self.writers.values():  # a worker still writing finishes into the unlinked file
            w.abort()
        for h in self.hashes.values():
            h.abort()

    def shutdown(self, block: bool) -> None:
        self.flusher.shutdown(wait=block)
