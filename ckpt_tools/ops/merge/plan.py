"""The merge plan, from facts alone (pure): per output tensor its source, action, output shard and
bytes; the files carried; the memory bound of the pipeline.

Actions (one per output tensor):
  copy     raw bytes of an HF base tensor whose dtype is the output dtype, copied verbatim in
           bounded blocks (no decode); from a DCP base: decoded from its chunks, same dtype
  cast     a base tensor converted to the output dtype (e.g. prime-rl's fp32 masters -> bf16)
  merge    round_to(out_dtype, W32 + s * (B32 @ A32)), `core.tensor_math.merge_weight_into`
  replace  a `modules_to_save` tensor of the adapter, converted to the output dtype

A plan's work units are its output shards (`MergePlan.units`): each is written from its own jobs
alone, so ranks could split them and rank 0 commit.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import asdict, dataclass

from ...core.dtypes import dtype_name, itemsize
from ...core.errors import FormatError, UsageError
from ...core.fp8 import BLOCK, FP8_DTYPE
from ...core.fp8 import accelerator as fp8_accelerator
from ...core.lora_math import check_shapes
from ...core.tied import tied_pair
from ...formats.hf_dir.config import output_config_changes
from ...formats.hf_dir.fp8 import fp8_quantization_config
from ...formats.hf_dir.shards import index_json, plan_shards
from ...formats.safetensors.read import COPY_BLOCK_BYTES
from ...formats.safetensors.writer import build_header, safetensors_save_order
from ...io.inputs import as_input
from .facts import AdapterFacts, BaseFacts, FullFact, LoraFact, SourceTensor
from .fp8 import check_quantized_base, counted_actions, declared_entries, fp8_protos, scale_map

__all__ = [
    "CASTABLE",
    "COPY_THROUGH_BLOCK_BYTES",
    "DEFAULT_MAX_SHARD",
    "DEFAULT_THREADS",
    "FP8_BLOCK_ELEMS",
    "IN_FLIGHT_CAP_BYTES",
    "IN_FLIGHT_FLOOR_BYTES",
    "MERGEABLE",
    "MERGE_BLOCK_ELEMS",
    "MIN_BLOCK_ROWS",
    "OUTPUT_METADATA",
    "FileJob",
    "MergePlan",
    "ShardOut",
    "TensorJob",
    "fp8_block_rows",
    "job_working_bytes",
    "memory_bound",
    "merge_block_rows",
    "merge_row_blocks",
    "plan_from_facts",
    "streamed_by_writer",
    "window_budget",
]

OUTPUT_METADATA = {"format": "pt"}  # what transformers' save_pretrained writes
DEFAULT_MAX_SHARD = "5GB"
# Workers ahead of the writer: 2 on a small machine, up to 4 where cores are idle. Measured on a
# 16-core host (docs/benchmarks.md): 2 workers 1.30x the I/O floor, 4 workers 1.10x, 8 workers 1.09x
# with 40% more memory; so 4 is where more workers stop paying.
DEFAULT_THREADS = max(2, min(4, os.cpu_count() or 1))
# An FP8 output's quantized weight is made in row blocks of about this many elements (a multiple of 128 rows):
# the base rows, W32 made in place of the fp32 product, the codes (7 bytes an element from a bf16 base: 14 MiB
# a block, against a bf16 merge block's 32 MiB), on the same workers as any merge (DEFAULT_THREADS).
FP8_BLOCK_ELEMS = 2 * 2**20
# A merged tensor is made in row blocks of about this many elements (fp32 product 16 MiB, bf16 base
# and output 8 MiB each): big enough that BLAS and pread/pwrite run at full speed, small enough that
# a worker holds tens of MB whatever the model (`produce.JobRunner._merge`).
MERGE_BLOCK_ELEMS = 4 * 2**20
# ... and never fewer rows than this per block (fewer change the BLAS kernel and the product's low bits).
MIN_BLOCK_ROWS = 64
# An untouched tensor is copied through by copy_file_range in calls of this many bytes (the buffer of
# the pread + pwrite fallback, where the kernel refuses it).
COPY_THROUGH_BLOCK_BYTES = 16 * 2**20
# The read-ahead's byte budget: `threads` of the largest job's working set, at least the floor (a
# small job never starves the workers), at most the cap (the interpreter and torch take 0.25-0.6 GiB:
# with the cap on top a merge stays near 1 GiB at any --threads; at the default threads the blocks
# in flight are ~150 MiB). A job larger than the cap runs alone.
IN_FLIGHT_FLOOR_BYTES = 256 * 2**20
IN_FLIGHT_CAP_BYTES = 512 * 2**20
# Floating dtypes we convert between. Others (ints, float8 with their scales) are never cast.
CASTABLE = ("bfloat16", "float16", "float32", "float64")
# Weights a LoRA can be merged into (fp32 compute is exact for these inputs).
MERGEABLE = ("bfloat16", "float16", "float32")


@dataclass(frozen=True)
class TensorJob:
    name: str  # output tensor name
    action: str  # copy | cast | merge | replace
    src: str  # HF name / DCP key of the base tensor, or the adapter key (replace)
    src_file: str | None  # HF base shard file holding `src`; None for DCP or adapter sources
    src_dtype: str
    shape: tuple[int, ...]
    out_dtype: str
    out_file: str
    read_bytes: int
    out_bytes: int
    module: str | None = None
    rank: int | None = None
    scale: float | None = None
    fan_in_fan_out: bool = False
    lora_a: str | None = None
    lora_b: str | None = None
    note: str | None = None
    scale_name: str | None = None  # an FP8 output's `weight_scale_inv`, written by this job beside its codes
    scale_shape: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class FileJob:
    name: str  # file name in OUT
    src: str  # absolute source path
    action: str  # "copy" (bytes verbatim) | "rewrite" (config.json with `changes`)
    changes: tuple[tuple[str, object, object], ...] = ()  # (field, old, new)


@dataclass(frozen=True)
class ShardOut:
    file_name: str
    tensors: tuple[str, ...]  # in the file's layout order (safetensors save order)
    data_bytes: int
    file_bytes: int  # header included


@dataclass(frozen=True)
class MergePlan:
    out: str  # where the merged model goes (not in to_json: the report says it)
    base_kind: str
    base_path: str
    adapter_kind: str
    adapter_path: str
    adapter: dict
    slot: int | None
    trust_pickle: bool
    out_dtype: str
    max_shard_bytes: int
    threads: int
    jobs: tuple[TensorJob, ...]  # in write order
    shards: tuple[ShardOut, ...]
    index: dict | None  # model.safetensors.index.json content, None for one shard
    files: tuple[FileJob, ...]
    omitted: tuple[tuple[str, str], ...]  # (base tensor, why it is not written)
    tie_word_embeddings: tuple[object, object]  # (in the config, in the output config)
    read_bytes: int
    write_bytes: int
    memory_bound_bytes: int
    total_parameters: int
    warnings: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ()  # paths OUT must not be inside
    out_dtype_reason: str = ""  # why this output dtype (merge_guards.default_out_dtype)
    allow_zero_delta: bool = False  # a merge equal to the base is written, not refused
    masters_checked: dict | None = None  # DCP adapter + HF base: the master rows compared with the base

    @property
    def merged_modules(self) -> int:
        return sum(1 for j in self.jobs if j.action == "merge")

    def count(self, action: str) -> int:
        return sum(1 for j in self.jobs if j.action == action)

    def cast_to(self) -> str:
        """The dtype the cast tensors are written in: `out_dtype`, except an FP8 output's, which keeps them
        bf16 (its kept tensors)."""
        got = sorted({j.out_dtype for j in self.jobs if j.action == "cast"})
        return ", ".join(got) if got else self.out_dtype

    @property
    def units(self) -> tuple[ShardOut, ...]:
        """The independent work units: one output shard each (its tensors, in write order)."""
        return self.shards

    def to_json(self, *, jobs: bool = True) -> dict:
        d = asdict(self)
        d.pop("out")
        if not jobs:
            d.pop("jobs")
        d["counts"] = {a: self.count(a) for a in counted_actions(self.out_dtype)}
        d["merged_modules"] = self.merged_modules
        return d


def plan_from_facts(
    base: BaseFacts,
    adapter: AdapterFacts,
    *,
    out_dtype,
    max_shard_bytes: int,
    threads: int = DEFAULT_THREADS,
    trust_pickle: bool = False,
    plan_shards=plan_shards,
    out: str = "",
) -> MergePlan:
    """The whole merge as data, from facts alone (pure). Raises one FormatError listing every problem
    (unmatched modules, shape mismatches, conflicts) before a byte of tensor data is read. `out_dtype`:
    a dtype name (or a torch dtype); `plan_shards`: the shard splitter (huggingface_hub's rule)."""
    if threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")
    out_dt = dtype_name(out_dtype)
    if not base.tensors:
        raise FormatError("the base holds no tensors", path=base.path)
    warnings: list[str] = list(adapter.warnings)
    check_quantized_base(base)
    fit = _fit(base, adapter)
    tie = _ties(base, fit, warnings)
    proto = {name: _job_proto(name, fit, tie.materialize, out_dt) for name in tie.out_names}
    kept = fp8_protos(proto, out_dt)
    jobs, shards, index, total_parameters = _shard(proto, tie.out_names, max_shard_bytes, plan_shards)
    files, tie_change = _plan_files(base, out_dt, tie.tie_out, kept)
    if base.config is None:
        warnings.append(
            f"{base.path} has no config.json: the output will hold weights only and transformers "
            "cannot load it without one"
        )
    sizes = dict(base.files)
    write_bytes = (
        sum(s.file_bytes for s in shards)
        + (len(index_json(index)) if index else 0)
        + sum(sizes[f.src] + (256 if f.action == "rewrite" else 0) for f in files)
    )
    return MergePlan(
        out=str(out),
        base_kind=base.kind,
        base_path=base.path,
        adapter_kind=adapter.kind,
        adapter_path=adapter.path,
        adapter=adapter.describe,
        slot=adapter.slot,
        trust_pickle=trust_pickle,
        out_dtype=out_dt,
        max_shard_bytes=max_shard_bytes,
        threads=threads,
        jobs=tuple(jobs),
        shards=tuple(shards),
        index=index,
        files=files,
        omitted=tuple(tie.omitted),
        tie_word_embeddings=(fit.tie_flag, tie_change),
        read_bytes=sum(j.read_bytes for j in jobs),
        write_bytes=write_bytes,
        memory_bound_bytes=memory_bound(jobs, threads, adapter.resident_bytes, base.kind),
        total_parameters=total_parameters,
        warnings=tuple(warnings),
        inputs=tuple(
            sorted(
                {base.path, adapter.path}
                | ({str(as_input(base.config_path).parent)} if base.config_path else set())
            )
        ),
    )


@dataclass(frozen=True)
class _Fit:
    """The adapter matched against the base: each target's base tensor, what the merge modifies."""

    by_name: dict[str, SourceTensor]
    pair: tuple[str, str] | None  # (output, input) embedding names of a tied model
    tie_flag: object  # config.json's tie_word_embeddings
    lora_by_target: dict[str, LoraFact]
    full_by_name: dict[str, FullFact]
    modified: frozenset[str]

    def base_for(self, name: str) -> SourceTensor | None:
        """The base tensor a target merges into: normally itself; the output embedding of a tied model
        whose file lacks it is materialized from the input embedding."""
        if name in self.by_name:
            return self.by_name[name]
        if self.pair and name == self.pair[0] and self.pair[1] in self.by_name:
            return self.by_name[self.pair[1]]
        return None


def _fit(base: BaseFacts, adapter: AdapterFacts) -> _Fit:
    """Every LoRA target a 2-D mergeable base weight of its shape, every modules_to_save tensor a base
    tensor of its shape; all problems in one FormatError. Refuses an adapter that modifies nothing."""
    by_name = {t.name: t for t in base.tensors}
    pair, tie_flag = tied_pair(base.config, set(by_name))
    lora_by_target = {m.module + ".weight": m for m in adapter.modules}
    full_by_name = {f.name: f for f in adapter.full}
    fit = _Fit(by_name, pair, tie_flag, lora_by_target, full_by_name, frozenset())
    _refuse_non_linear_targets(fit, adapter)
    problems = [
        f"{n}: the adapter has both a LoRA and a modules_to_save replacement for it"
        for n in sorted(set(lora_by_target) & set(full_by_name))
    ]
    modified = _modified(fit, problems)
    unmatched = sorted(n for n in list(lora_by_target) + list(full_by_name) if fit.base_for(n) is None)
    if unmatched:
        sample = ", ".join(sorted(by_name)[:3])
        problems.append(
            f"{len(unmatched)} adapter target(s) have no base weight: "
            + ", ".join(unmatched[:8])
            + (f" and {len(unmatched) - 8} more" if len(unmatched) > 8 else "")
            + f" (base names look like: {sample})"
        )
    if problems:
        raise FormatError(
            "the adapter does not fit this base: " + "; ".join(problems),
            path=adapter.path,
            hint="merge into the base model the adapter was trained on",
        )
    if not modified and adapter.kind != "none":  # "none": a full fine-tune's export, the base is the model
        raise FormatError(
            "the adapter holds no LoRA module or modules_to_save tensor: merging it would write "
            "the base back unchanged",
            path=adapter.path,
            hint="check that this is the trained adapter (a 'merged' model identical to the base "
            "is the bug this refuses to ship)",
        )
    return dataclasses.replace(fit, modified=frozenset(modified))


def _refuse_non_linear_targets(fit: _Fit, adapter: AdapterFacts) -> None:
    not_linear = [
        (t, src.shape)
        for t in sorted(fit.lora_by_target)
        if (src := fit.base_for(t)) is not None and len(src.shape) != 2
    ]
    if not_linear:
        raise FormatError(
            f"{len(not_linear)} LoRA module(s) target a weight that is not a 2-D linear weight: "
            + ", ".join(f"{t} {list(shape)}" for t, shape in not_linear[:8])
            + ": B @ A is a matrix, a LoRA cannot apply to it",
            path=adapter.path,
            key=not_linear[0][0],
            hint="drop these modules from the adapter (keys and target_modules); a trained norm or "
            "embedding belongs in modules_to_save as a full tensor",
        )


def _modified(fit: _Fit, problems: list[str]) -> set[str]:
    """The base tensors the merge changes (each target that fits); what does not fit, in `problems`."""
    modified: set[str] = set()
    for target, m in sorted(fit.lora_by_target.items()):
        src = fit.base_for(target)
        if src is None:
            continue
        if src.dtype not in MERGEABLE:
            problems.append(
                f"{target}: base weight is {src.dtype}; a LoRA merges only into bf16/fp16/fp32 "
                "weights (dequantize the base first)"
            )
            continue
        try:
            check_shapes(src.shape, m.a_shape, m.b_shape, fan_in_fan_out=m.fan_in_fan_out, name=target)
        except FormatError as exc:
            problems.append(f"{target}: {exc.message}")
            continue
        modified.add(target)
    for name, f in sorted(fit.full_by_name.items()):
        src = fit.base_for(name)
        if src is None:
            continue
        if tuple(f.shape) != tuple(src.shape):
            problems.append(
                f"{name}: modules_to_save tensor is {list(f.shape)}, the base's is {list(src.shape)}"
            )
            continue
        modified.add(name)
    return modified


@dataclass(frozen=True)
class _Ties:
    """The output's tensor names and what tied embeddings decided: written both and untied when one side
    changes (the output one materialized where the base file lacks it), a DCP's duplicate omitted else."""

    out_names: list[str]
    omitted: list[tuple[str, str]]
    tie_out: object
    materialize: str | None


def _ties(base: BaseFacts, fit: _Fit, warnings: list[str]) -> _Ties:
    out_names: list[str] = [t.name for t in base.tensors]
    omitted: list[tuple[str, str]] = []
    tie_out, materialize = fit.tie_flag, None
    if fit.pair is None:
        return _Ties(out_names, omitted, tie_out, materialize)
    out_e, in_e = fit.pair
    if out_e in fit.modified or in_e in fit.modified:
        tie_out = False
        if out_e not in fit.by_name:
            materialize = out_e
            out_names.append(out_e)
        why = (
            ("modified" if out_e in fit.modified else "unchanged")
            + f" {out_e} and "
            + ("modified" if in_e in fit.modified else "unchanged")
            + f" {in_e}"
        )
        warnings.append(
            f"tied embeddings diverge ({why}): both are written and config.json gets "
            "tie_word_embeddings=false"
        )
    elif out_e in fit.by_name and fit.tie_flag is True and base.kind == "dcp":
        # FSDP state dicts carry the tied parameter under both names; HF files hold it once.
        out_names.remove(out_e)
        omitted.append((out_e, f"tied to {in_e} (tie_word_embeddings=true): the same tensor"))
    return _Ties(out_names, omitted, tie_out, materialize)


def _job_proto(name: str, fit: _Fit, materialize: str | None, out_dt: str) -> dict:
    """One output tensor's job, before sharding: merge, replace (modules_to_save), cast or copy."""
    src = fit.base_for(name) if name == materialize else fit.by_name[name]
    assert src is not None  # every out name has its base tensor (`_ties`)
    common = dict(
        src=src.key,
        src_file=src.file,
        src_dtype=src.dtype,
        shape=tuple(src.shape),
        note=f"materialized from {src.name} (tied in the base)"
        if name == materialize and name not in fit.full_by_name
        else None,
    )
    numel = math.prod(src.shape)
    if name in fit.lora_by_target:
        m = fit.lora_by_target[name]
        proto = dict(
            common,
            action="merge",
            out_dtype=out_dt,
            module=m.module,
            rank=m.rank,
            scale=m.scale,
            fan_in_fan_out=m.fan_in_fan_out,
            lora_a=m.a_key,
            lora_b=m.b_key,
            read_bytes=numel * itemsize(src.dtype) + (math.prod(m.a_shape) + math.prod(m.b_shape)) * 4,
        )
    elif name in fit.full_by_name:
        f = fit.full_by_name[name]
        proto = dict(
            common,
            action="replace",
            src=f.key,
            src_file=None,
            src_dtype=f.dtype,
            out_dtype=out_dt if f.dtype in CASTABLE else f.dtype,
            read_bytes=numel * itemsize(f.dtype),
        )
    else:
        castable = src.dtype in CASTABLE and src.dtype != out_dt
        proto = dict(
            common,
            action="cast" if castable else "copy",
            out_dtype=out_dt if castable else src.dtype,
            read_bytes=numel * itemsize(src.dtype),
        )
    proto["out_bytes"] = numel * itemsize(proto["out_dtype"])
    return proto


def _shard(
    proto: dict[str, dict], out_names: list[str], max_shard_bytes: int, plan_shards
) -> tuple[list[TensorJob], list[ShardOut], dict | None, int]:
    """The jobs in shard order (each shard's tensors in safetensors' save order), the shards, the index
    of a sharded output, and the total parameter count."""
    split = plan_shards([(n, proto[n]["out_bytes"]) for n in out_names], max_shard_bytes)
    jobs: list[TensorJob] = []
    shards: list[ShardOut] = []
    for spec in split.shards:
        entries = safetensors_save_order(
            [e for n in spec.tensor_names for e in declared_entries(n, proto[n])]
        )
        header = build_header(entries, OUTPUT_METADATA)
        shards.append(
            ShardOut(spec.file_name, tuple(e[0] for e in entries), spec.nbytes, len(header) + spec.nbytes)
        )
        for e in entries:
            if e[0] in proto:  # (a quantized weight's scale is written by the weight's job)
                jobs.append(TensorJob(name=e[0], out_file=spec.file_name, **proto[e[0]]))
    total_parameters = sum(j.numel + (math.prod(j.scale_shape) if j.scale_shape else 0) for j in jobs)
    index = None
    if split.is_sharded:
        index = {
            "metadata": {"total_parameters": total_parameters, "total_size": split.total_size_bytes},
            "weight_map": dict(sorted({**split.weight_map, **scale_map(jobs)}.items())),
        }
    return jobs, shards, index, total_parameters


def streamed_by_writer(job: TensorJob, base_kind: str) -> bool:
    """Jobs streamed by their worker, never held whole: verbatim copies of an HF base (its bytes copied
    through by the kernel), and every other copy or cast with rows, in COPY_BLOCK_BYTES row blocks (a
    DCP base's fp32 masters cast one block at a time: the embedding is never in memory whole)."""
    if job.action == "copy" and base_kind == "hf":
        return True
    return job.action in ("copy", "cast") and len(job.shape) >= 1 and job.shape[0] > 0


def merge_block_rows(shape: tuple[int, ...]) -> int:
    """Rows per block of a merged tensor of `shape` (see MERGE_BLOCK_ELEMS and MIN_BLOCK_ROWS)."""
    cols = max(1, math.prod(shape[1:]))
    return max(MIN_BLOCK_ROWS, MERGE_BLOCK_ELEMS // cols)


def fp8_block_rows(cols: int) -> int:
    """Rows per block of a quantized tensor with `cols` columns (`core.fp8.fp8_row_blocks`' step)."""
    return max(BLOCK, (FP8_BLOCK_ELEMS // max(1, cols)) // BLOCK * BLOCK)


def merge_row_blocks(shape: tuple[int, ...]):
    """(start, count) row blocks of a merged tensor of `shape`: `merge_block_rows` each, a tail shorter
    than MIN_BLOCK_ROWS joined to the block before it (so no block has fewer rows, unless the whole
    tensor has)."""
    rows, step, s = shape[0], merge_block_rows(shape), 0
    while s < rows:
        n = step if rows - s - step >= MIN_BLOCK_ROWS else rows - s
        yield s, n
        s += n


def job_working_bytes(job: TensorJob, base_kind: str) -> int:
    """Bytes one worker holds while producing `job`: its block buffers, not its tensor (except for
    the few jobs read whole: an adapter's modules_to_save tensor, a base scalar)."""
    rows = job.shape[0] if job.shape else 1
    if job.scale_name is not None:  # FP8 (`quantize.write_quantized`): a row block of the source, W32, codes
        cols = job.numel // max(1, rows)
        block_rows = min(rows, fp8_block_rows(cols) + MIN_BLOCK_ROWS - 1)
        whole = job.read_bytes if job.action == "replace" else 0
        factors = job.read_bytes - job.numel * itemsize(job.src_dtype) if job.action == "merge" else 0
        # W32 beside a fan_in_fan_out product; the reference error figure's buffer without the C kernel
        extra = 4 * job.fan_in_fan_out + (4 if fp8_accelerator is None else 0)
        return block_rows * cols * (itemsize(job.src_dtype) + 4 + 1 + extra) + factors + whole
    if job.action == "merge":
        # one block (a short tail joins the last: up to MIN_BLOCK_ROWS - 1 more rows) of the base
        # rows + the fp32 product + the output rows; and the fp32 A, B, held for the whole tensor
        block_rows = min(rows, merge_block_rows(job.shape) + MIN_BLOCK_ROWS - 1)
        factors = job.read_bytes - job.numel * itemsize(job.src_dtype)
        return (
            block_rows * (job.numel // max(1, rows)) * (itemsize(job.src_dtype) + 4 + itemsize(job.out_dtype))
            + factors
        )
    if job.action == "copy" and base_kind == "hf":
        return min(job.out_bytes, COPY_THROUGH_BLOCK_BYTES)  # 0 by copy_file_range; the fallback's buffer
    if streamed_by_writer(job, base_kind):
        row_bytes = max(1, job.read_bytes // rows)
        block = max(1, COPY_BLOCK_BYTES // row_bytes) * row_bytes
        return min(job.read_bytes, block) + min(
            job.out_bytes, block * job.out_bytes // max(1, job.read_bytes)
        )
    return job.read_bytes + job.out_bytes  # read whole


def window_budget(jobs, threads: int, base_kind: str) -> int:
    """Bytes the read-ahead may hold at once, sized from the job: `threads` of the largest working
    set, within [IN_FLIGHT_FLOOR_BYTES, IN_FLIGHT_CAP_BYTES]. A job larger than that runs alone."""
    largest = max((job_working_bytes(j, base_kind) for j in jobs), default=0)
    return min(IN_FLIGHT_CAP_BYTES, max(IN_FLIGHT_FLOOR_BYTES, threads * largest))


def memory_bound(jobs, threads: int, adapter_resident: int, base_kind: str) -> int:
    """Upper estimate of tensor memory in flight: the jobs the read-ahead lets run at once (at most
    `threads`, within the window budget; a job over the budget alone), and adapter bytes held for the
    whole run. The interpreter and torch themselves (0.25-0.6 GB) come on top."""
    ws = sorted((job_working_bytes(j, base_kind) for j in jobs), reverse=True)
    budget = window_budget(jobs, threads, base_kind)
    together = 0
    for w in ws[:threads]:  # the largest `threads` that fit the budget together
        if together + w > budget and together:
            break
        together += w
    return max(together, ws[0] if ws else 0) + adapter_resident


def _plan_files(base: BaseFacts, out_dt: str, tie_out, kept) -> tuple[tuple[FileJob, ...], object]:
    jobs = []
    tie_change = tie_out
    for p, _nbytes in base.files:
        name = os.path.basename(p)
        if name == "config.json" and base.config is not None:
            qc = fp8_quantization_config(kept) if out_dt == FP8_DTYPE else None
            changes = output_config_changes(
                base.config, "bfloat16" if qc else out_dt, tie_out, quantization=qc
            )
            jobs.append(FileJob(name, p, "rewrite" if changes else "copy", tuple(changes)))
            continue
        jobs.append(FileJob(name, p, "copy"))
    return tuple(jobs), tie_change
