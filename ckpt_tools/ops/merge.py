"""`ckpt merge`: a LoRA merged into base weights, written as an HF model directory, streamed.

Two steps, the first pure data:

- `prepare_merge(...) -> MergePlan` opens headers only (safetensors headers + index, or the DCP
  `.metadata`; `adapter_config.json`), resolves alpha, matches every LoRA module to a base weight
  and decides, per output tensor: its source, its action, its output shard, its bytes. The plan is
  built by the pure `plan_merge` from `BaseFacts` + `AdapterFacts`; `--dry-run` / `--json` print
  it.
- `execute_merge(plan, out, progress=cb)` re-opens the sources named by the plan, checks they
  still match it, and writes OUT through `AtomicOutputDir` (a hidden temp dir renamed into place;
  nothing at OUT unless complete).

Actions (one per output tensor):
  copy     raw bytes of an HF base tensor whose dtype is the output dtype, copied verbatim in
           bounded blocks (no decode); from a DCP base: decoded from its chunks, same dtype
  cast     a base tensor converted to the output dtype (e.g. prime-rl's fp32 masters -> bf16)
  merge    round_to(out_dtype, W32 + s * (B32 @ A32)), `lora_math.merge_weight_into`
  replace  a `modules_to_save` tensor of the adapter, converted to the output dtype

Memory: a pool of `threads` workers reads and computes at most `threads` tensors ahead of the
writer (the bounded read-ahead); verbatim copies stream in COPY_BLOCK_BYTES blocks, so the
largest tensor (the embedding) is never held when it is not modified. The plan states the bound.

Test-only hook: env CKPT_TOOLS_TEST_SLOW_WRITE=<seconds> sleeps after each tensor is written, so a
test can kill a merge midway. It has no other use.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..atomic import copy_input_file, fsync_path
from ..errors import CkptError, FormatError, MissingFileError, UsageError
from ..formats.safetensors_io import COPY_BLOCK_BYTES, build_header, copy_raw, dtype_code, safetensors_save_order
from ..inputs import check_input, read_json
from ..lora_math import check_shapes, merge_weight_into
from .merge_guards import ZeroDelta, check_masters_match_base, check_target_modules, default_out_dtype, rounds_to_base

log = logging.getLogger(__name__)

SLOW_WRITE_ENV = "CKPT_TOOLS_TEST_SLOW_WRITE"
OUTPUT_METADATA = {"format": "pt"}          # what transformers' save_pretrained writes
DEFAULT_MAX_SHARD = "5GB"
# Workers ahead of the writer: 2 on a small machine, up to 4 where cores are idle. Measured on a
# 16-core host (docs/benchmarks.md): 2 workers 1.30x the I/O floor, 4 workers 1.10x, 8 workers 1.09x
# with 40% more memory; so 4 is where more workers stop paying.
DEFAULT_THREADS = max(2, min(4, os.cpu_count() or 1))

# --dtype spellings -> torch dtype
DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}
# Floating dtypes we convert between. Others (ints, float8 with their scales) are never cast.
_CASTABLE = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
# Weights a LoRA can be merged into (fp32 compute is exact for these inputs).
_MERGEABLE = (torch.bfloat16, torch.float16, torch.float32)

# (output embedding, input embedding) names that tie_word_embeddings ties, per architecture family.
TIED_PAIRS: tuple[tuple[str, str], ...] = (
    ("lm_head.weight", "model.embed_tokens.weight"),     # Llama, Qwen2/3, Mistral, Gemma, ...
    ("lm_head.weight", "transformer.wte.weight"),        # GPT-2 style
)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")


def dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def parse_dtype(text: str) -> torch.dtype:
    try:
        return DTYPES[str(text).lower()]
    except KeyError:
        raise UsageError(f"unknown --dtype {text!r}", hint="use bf16, fp16 or fp32") from None


# ============================================================================================
# facts in, plan out (pure)


@dataclass(frozen=True)
class SourceTensor:
    """One base tensor as the planner sees it."""
    name: str                  # HF name
    dtype: str                 # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    file: str | None           # HF shard file name; None for a DCP base
    key: str                   # the HF name again, or the DCP key


@dataclass(frozen=True)
class LoraFact:
    module: str                # HF module FQN; merged into module + ".weight"
    rank: int
    scale: float
    fan_in_fan_out: bool
    a_key: str
    b_key: str
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]


@dataclass(frozen=True)
class FullFact:
    """A modules_to_save tensor of the adapter (replaces the base tensor of the same name)."""
    name: str
    key: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class BaseFacts:
    kind: str                               # "hf" | "dcp"
    path: str
    tensors: tuple[SourceTensor, ...]       # in output order preference (HF: disk order)
    config: dict | None                     # config.json of the output (from the base or --config-from)
    config_path: str | None
    files: tuple[tuple[str, int], ...]      # non-weight files to carry: (absolute path, bytes), by name
    skipped: tuple[str, ...] = ()           # entries of the config dir not carried (reported)


@dataclass(frozen=True)
class AdapterFacts:
    kind: str                               # "peft" | "dcp"
    path: str
    slot: int | None
    modules: tuple[LoraFact, ...]
    full: tuple[FullFact, ...]
    describe: dict
    resident_bytes: int                     # adapter bytes held for the whole run (.bin adapters)
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class TensorJob:
    name: str                  # output tensor name
    action: str                # copy | cast | merge | replace
    src: str                   # HF name / DCP key of the base tensor, or the adapter key (replace)
    src_file: str | None       # HF base shard file holding `src`; None for DCP or adapter sources
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

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class FileJob:
    name: str                  # file name in OUT
    src: str                   # absolute source path
    action: str                # "copy" (bytes verbatim) | "rewrite" (config.json with `changes`)
    changes: tuple[tuple[str, object, object], ...] = ()   # (field, old, new)


@dataclass(frozen=True)
class ShardOut:
    file_name: str
    tensors: tuple[str, ...]   # in the file's layout order (safetensors save order)
    data_bytes: int
    file_bytes: int            # header included


@dataclass(frozen=True)
class MergePlan:
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
    jobs: tuple[TensorJob, ...]            # in write order
    shards: tuple[ShardOut, ...]
    index: dict | None                     # model.safetensors.index.json content, None for one shard
    files: tuple[FileJob, ...]
    omitted: tuple[tuple[str, str], ...]   # (base tensor, why it is not written)
    tie_word_embeddings: tuple[object, object]   # (in the config, in the output config)
    read_bytes: int
    write_bytes: int
    memory_bound_bytes: int
    total_parameters: int
    warnings: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ()           # paths OUT must not be inside
    out_dtype_reason: str = ""             # why this output dtype (merge_guards.default_out_dtype)
    allow_zero_delta: bool = False         # a merge equal to the base is written, not refused
    masters_checked: dict | None = None    # DCP adapter + HF base: the master rows compared with the base

    @property
    def merged_modules(self) -> int:
        return sum(1 for j in self.jobs if j.action == "merge")

    def count(self, action: str) -> int:
        return sum(1 for j in self.jobs if j.action == action)

    def to_dict(self, *, jobs: bool = True) -> dict:
        d = asdict(self)
        if not jobs:
            d.pop("jobs")
        d["counts"] = {a: self.count(a) for a in ("merge", "copy", "cast", "replace")}
        d["merged_modules"] = self.merged_modules
        return d


def _out_itemsize(dt: str) -> int:
    return getattr(torch, dt).itemsize


def _tied(config: dict | None, names: set[str]) -> tuple[tuple[str, str] | None, object]:
    """(the tied pair present in this model or None, the config's tie_word_embeddings value)."""
    flag = (config or {}).get("tie_word_embeddings")
    for out_name, in_name in TIED_PAIRS:
        if in_name in names:
            if flag is True or (flag is None and out_name not in names):
                return (out_name, in_name), flag
            return None, flag
    return None, flag


def plan_merge(base: BaseFacts, adapter: AdapterFacts, *, out_dtype: torch.dtype, max_shard_bytes: int,
               threads: int = DEFAULT_THREADS, trust_pickle: bool = False,
               plan_shards=None) -> MergePlan:
    """The whole merge as data. Raises one FormatError listing every problem (unmatched modules,
    shape mismatches, conflicts) before a byte of tensor data is read."""
    if plan_shards is None:
        from ..formats.hf_dir import plan_shards
    if threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")
    out_dt = dtype_name(out_dtype)
    by_name = {t.name: t for t in base.tensors}
    if not by_name:
        raise FormatError("the base holds no tensors", path=base.path)
    problems: list[str] = []
    warnings: list[str] = list(adapter.warnings)
    if base.config and base.config.get("quantization_config"):
        qc = base.config["quantization_config"]
        method = qc.get("quant_method", "?") if isinstance(qc, dict) else "?"
        raise FormatError(f"the base is quantized (quantization_config, quant_method {method!r}); merging "
                          "a LoRA into quantized weights is not exact", path=base.config_path,
                          hint="merge into the unquantized (bf16) base model, then quantize the result")

    pair, tie_flag = _tied(base.config, set(by_name))
    lora_by_target = {m.module + ".weight": m for m in adapter.modules}
    full_by_name = {f.name: f for f in adapter.full}
    for n in sorted(set(lora_by_target) & set(full_by_name)):
        problems.append(f"{n}: the adapter has both a LoRA and a modules_to_save replacement for it")

    # Which tensor is each target's base? Normally itself; the output embedding of a tied model
    # whose file lacks it is materialized from the input embedding.
    def base_for(name: str) -> SourceTensor | None:
        if name in by_name:
            return by_name[name]
        if pair and name == pair[0] and pair[1] in by_name:
            return by_name[pair[1]]
        return None

    modified: set[str] = set()
    for target, m in sorted(lora_by_target.items()):
        src = base_for(target)
        if src is None:
            continue
        if getattr(torch, src.dtype) not in _MERGEABLE:
            problems.append(f"{target}: base weight is {src.dtype}; a LoRA merges only into bf16/fp16/fp32 "
                            "weights (dequantize the base first)")
            continue
        try:
            check_shapes(src.shape, m.a_shape, m.b_shape, fan_in_fan_out=m.fan_in_fan_out, name=target)
        except FormatError as exc:
            problems.append(f"{target}: {exc.message}")
            continue
        modified.add(target)
    for name, f in sorted(full_by_name.items()):
        src = base_for(name)
        if src is None:
            continue
        if tuple(f.shape) != tuple(src.shape):
            problems.append(f"{name}: modules_to_save tensor is {list(f.shape)}, the base's is {list(src.shape)}")
            continue
        modified.add(name)
    unmatched = sorted(n for n in list(lora_by_target) + list(full_by_name) if base_for(n) is None)
    if unmatched:
        sample = ", ".join(sorted(by_name)[:3])
        problems.append(f"{len(unmatched)} adapter target(s) have no base weight: "
                        + ", ".join(unmatched[:8]) + (f" and {len(unmatched) - 8} more" if len(unmatched) > 8 else "")
                        + f" (base names look like: {sample})")
    if problems:
        raise FormatError("the adapter does not fit this base: " + "; ".join(problems), path=adapter.path,
                          hint="merge into the base model the adapter was trained on")
    if not modified:
        raise FormatError("the adapter holds no LoRA module or modules_to_save tensor: merging it would write "
                          "the base back unchanged", path=adapter.path,
                          hint="check that this is the trained adapter (a 'merged' model identical to the base "
                               "is the bug this refuses to ship)")

    # Tied embeddings: write both and untie when one side changes; omit a DCP's duplicate otherwise.
    out_names: list[str] = [t.name for t in base.tensors]
    omitted: list[tuple[str, str]] = []
    tie_out = tie_flag
    materialize: str | None = None
    if pair is not None:
        out_e, in_e = pair
        diverge = out_e in modified or in_e in modified
        if diverge:
            tie_out = False
            if out_e not in by_name:
                materialize = out_e
                out_names.append(out_e)
            why = ("modified" if out_e in modified else "unchanged") + f" {out_e} and " + \
                ("modified" if in_e in modified else "unchanged") + f" {in_e}"
            warnings.append(f"tied embeddings diverge ({why}): both are written and config.json gets "
                            "tie_word_embeddings=false")
        elif out_e in by_name and tie_flag is True and base.kind == "dcp":
            # FSDP state dicts carry the tied parameter under both names; HF files hold it once.
            out_names.remove(out_e)
            omitted.append((out_e, f"tied to {in_e} (tie_word_embeddings=true): the same tensor"))

    # One job per output tensor (before sharding; order = out_names).
    proto: dict[str, dict] = {}
    for name in out_names:
        src = base_for(name) if name == materialize else by_name[name]
        sdt = getattr(torch, src.dtype)
        common = dict(src=src.key, src_file=src.file, src_dtype=src.dtype, shape=tuple(src.shape),
                      note=f"materialized from {src.name} (tied in the base)"
                      if name == materialize and name not in full_by_name else None)
        numel = math.prod(src.shape)
        if name in lora_by_target:
            m = lora_by_target[name]
            proto[name] = dict(common, action="merge", out_dtype=out_dt, module=m.module, rank=m.rank,
                               scale=m.scale, fan_in_fan_out=m.fan_in_fan_out, lora_a=m.a_key, lora_b=m.b_key,
                               read_bytes=numel * sdt.itemsize + (math.prod(m.a_shape) + math.prod(m.b_shape))
                               * 4)
        elif name in full_by_name:
            f = full_by_name[name]
            proto[name] = dict(common, action="replace", src=f.key, src_file=None, src_dtype=f.dtype,
                               out_dtype=out_dt if getattr(torch, f.dtype) in _CASTABLE else f.dtype,
                               read_bytes=numel * getattr(torch, f.dtype).itemsize)
        else:
            castable = sdt in _CASTABLE and sdt != out_dtype
            proto[name] = dict(common, action="cast" if castable else "copy",
                               out_dtype=out_dt if castable else src.dtype, read_bytes=numel * sdt.itemsize)
        proto[name]["out_bytes"] = numel * _out_itemsize(proto[name]["out_dtype"])

    split = plan_shards([(n, proto[n]["out_bytes"]) for n in out_names], max_shard_bytes)
    jobs: list[TensorJob] = []
    shards: list[ShardOut] = []
    for spec in split.shards:
        entries = safetensors_save_order([(n, dtype_code(getattr(torch, proto[n]["out_dtype"])), proto[n]["shape"])
                                          for n in spec.tensor_names])
        header = build_header(entries, OUTPUT_METADATA)
        shards.append(ShardOut(spec.file_name, tuple(e[0] for e in entries), spec.nbytes, len(header) + spec.nbytes))
        for e in entries:
            jobs.append(TensorJob(name=e[0], out_file=spec.file_name, **proto[e[0]]))
    total_parameters = sum(j.numel for j in jobs)
    index = None
    if split.is_sharded:
        index = {"metadata": {"total_parameters": total_parameters, "total_size": split.total_size_bytes},
                 "weight_map": dict(sorted(split.weight_map.items()))}

    files, tie_change = _plan_files(base, out_dt, tie_out)
    if base.config is None:
        warnings.append(f"{base.path} has no config.json: the output will hold weights only and transformers "
                        "cannot load it without one")
    read_bytes = sum(j.read_bytes for j in jobs)
    index_bytes = len(json.dumps(index, indent=2, sort_keys=True)) + 1 if index else 0
    sizes = dict(base.files)
    write_bytes = sum(s.file_bytes for s in shards) + index_bytes + \
        sum(sizes[f.src] + (256 if f.action == "rewrite" else 0) for f in files)
    return MergePlan(
        base_kind=base.kind, base_path=base.path, adapter_kind=adapter.kind, adapter_path=adapter.path,
        adapter=adapter.describe, slot=adapter.slot, trust_pickle=trust_pickle, out_dtype=out_dt,
        max_shard_bytes=max_shard_bytes, threads=threads, jobs=tuple(jobs), shards=tuple(shards), index=index,
        files=files, omitted=tuple(omitted), tie_word_embeddings=(tie_flag, tie_change),
        read_bytes=read_bytes, write_bytes=write_bytes,
        memory_bound_bytes=memory_bound(jobs, threads, adapter.resident_bytes, base.kind),
        total_parameters=total_parameters, warnings=tuple(warnings),
        inputs=tuple(sorted({base.path, adapter.path} | ({str(Path(base.config_path).parent)}
                                                          if base.config_path else set()))))


def job_working_bytes(job: TensorJob, base_kind: str) -> int:
    """Bytes one worker holds while producing `job` (its output included)."""
    if job.action == "copy" and base_kind == "hf":
        return 0                                       # streamed by the writer in blocks, never whole
    if job.action == "merge":
        # base weight + fp32 product (the worker's reusable scratch) + output + fp32 A, B
        return job.read_bytes + 4 * job.numel + job.out_bytes
    if job.action == "copy":
        return job.read_bytes                          # decoded from DCP chunks, written as is
    return job.read_bytes + job.out_bytes


def window_budget(jobs, threads: int, base_kind: str) -> int:
    """Bytes the read-ahead may hold at once: `threads` of the largest merges. A job larger than
    that (an fp32 embedding cast from a DCP base, say) runs alone, never beside another."""
    merges = [job_working_bytes(j, base_kind) for j in jobs if j.action == "merge"]
    every = [job_working_bytes(j, base_kind) for j in jobs]
    return threads * max(merges or every or [0])


def memory_bound(jobs, threads: int, adapter_resident: int, base_kind: str) -> int:
    """Upper estimate of tensor memory in flight: the read-ahead window (or the largest single job,
    which runs alone), the writer's copy block, and adapter bytes held for the whole run. The
    interpreter and torch themselves (~0.3 GB) come on top."""
    work = max([window_budget(jobs, threads, base_kind)] + [job_working_bytes(j, base_kind) for j in jobs])
    copy_block = max((min(j.out_bytes, COPY_BLOCK_BYTES) for j in jobs if j.action == "copy" and base_kind == "hf"),
                     default=0)
    return work + copy_block + adapter_resident


def _plan_files(base: BaseFacts, out_dt: str, tie_out) -> tuple[tuple[FileJob, ...], object]:
    jobs = []
    tie_change = tie_out
    for p, _nbytes in base.files:
        name = os.path.basename(p)
        if name == "config.json" and base.config is not None:
            changes = _config_changes(base.config, out_dt, tie_out)
            jobs.append(FileJob(name, p, "rewrite" if changes else "copy", tuple(changes)))
            continue
        jobs.append(FileJob(name, p, "copy"))
    return tuple(jobs), tie_change


def _config_changes(config: dict, out_dt: str, tie_out) -> list[tuple[str, object, object]]:
    changes = []
    # transformers >= 4.56 writes "dtype"; older versions "torch_dtype". Keep whichever is there.
    fields = [f for f in ("dtype", "torch_dtype") if f in config] or ["dtype"]
    for f in fields:
        if config.get(f) != out_dt:
            changes.append((f, config.get(f), out_dt))
    if tie_out is False and config.get("tie_word_embeddings") is not False:
        changes.append(("tie_word_embeddings", config.get("tie_word_embeddings"), False))
    return changes


def rewrite_config(config: dict, changes) -> str:
    new = dict(config)
    for f, _old, value in changes:
        new[f] = value
    return json.dumps(new, indent=2, ensure_ascii=False) + "\n"


# ============================================================================================
# gathering facts (I/O: headers and metadata only)


def _carry_files(d: Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Top-level regular files of `d` to carry into a model dir: all but weights and hidden files.
    Each is checked as an input of the tree `d` (a symlink out of it is refused now)."""
    carry, skip = [], []
    for e in sorted(os.scandir(d), key=lambda e: e.name):
        ok = e.is_file() and not e.name.startswith(".") and not e.name.endswith(_WEIGHT_SUFFIXES) \
            and not e.name.endswith(".index.json")
        if ok:
            check_input(Path(d) / e.name, root=d, what="model file")
        (carry if ok else skip).append(str(Path(d) / e.name) if ok else e.name)
    return tuple(carry), tuple(skip)


def _with_sizes(paths) -> tuple[tuple[str, int], ...]:
    return tuple((str(p), os.path.getsize(p)) for p in paths)


def _load_config(d: Path, *, required: bool) -> tuple[dict | None, str | None]:
    p = Path(d) / "config.json"
    if not os.path.lexists(p):
        if required:
            raise MissingFileError("no config.json here", path=d,
                                   hint="--config-from needs an HF model dir or the run's outputs/weights/step_N")
        return None, None
    cfg = read_json(p, root=d, what="config.json")
    if not isinstance(cfg, dict):
        raise FormatError("config.json is not a JSON object", path=p)
    return cfg, str(p)


def hf_base_facts(name_or_dir: str | Path) -> BaseFacts:
    from ..formats.hf_dir import HFModelDir, resolve_model_dir

    path = resolve_model_dir(name_or_dir)
    with HFModelDir.open(path) as model:
        tensors = []
        for name in model.keys():
            info = model.info(name)
            tensors.append(SourceTensor(name, dtype_name(info.torch_dtype), tuple(info.shape), info.path.name, name))
        files = _with_sizes(model.non_weight_files())
        skipped = tuple(model.skipped_entries())
        config = model.config
    cfg_path = str(path / "config.json") if config is not None else None
    return BaseFacts("hf", str(path), tuple(tensors), config, cfg_path, files, skipped)


def dcp_base_facts(ckpt, config_from: str | Path | None) -> BaseFacts:
    """Base = the checkpoint's own fp32 masters (`app.model.<HF name>`); config/tokenizer from
    `config_from`."""
    from ..dcp.reader import METADATA_NAME, TensorEntry
    from ..formats.hf_dir import resolve_model_dir
    from ..keys import classify

    tensors = []
    for key, e in ckpt.entries.items():
        ki = classify(key, e.path)
        if ki.group == "base" and isinstance(e, TensorEntry):
            tensors.append(SourceTensor(ki.hf_name, dtype_name(e.dtype), tuple(e.shape), None, key))
    if not tensors:
        raise FormatError("the checkpoint holds no base weights (no app.model.<name> tensors)",
                          path=ckpt.dir / METADATA_NAME,
                          hint="a slim checkpoint has none: `ckpt rehydrate` it first, or merge into the HF base")
    if config_from is None:
        cands = sorted(Path(ckpt.dir).resolve().parents[2].glob("weights/step_*/config.json")) \
            if len(Path(ckpt.dir).resolve().parents) > 2 else []
        hint = "pass --config-from DIR: the HF base model dir or hub id, or the run's outputs/weights/step_N"
        if cands:
            hint += f" (e.g. {cands[-1].parent})"
        raise UsageError("--base-from-checkpoint needs --config-from: the checkpoint holds no config or tokenizer",
                         path=ckpt.dir, hint=hint)
    cdir = resolve_model_dir(config_from)
    config, cfg_path = _load_config(cdir, required=True)
    carry, skipped = _carry_files(cdir)
    files = _with_sizes(carry)
    tensors.sort(key=lambda t: t.name)
    _check_config_fits(config, cfg_path, {t.name: t for t in tensors})
    return BaseFacts("dcp", str(ckpt.dir), tuple(tensors), config, cfg_path, files, skipped)


def _check_config_fits(config: dict, cfg_path: str, tensors: dict[str, SourceTensor]) -> None:
    """--config-from must describe the checkpoint's model: a config of another model would give a
    directory transformers loads wrongly or not at all."""
    problems = []
    for out_name, in_name in TIED_PAIRS:
        emb = tensors.get(in_name)
        if emb is None or len(emb.shape) != 2:
            continue
        if "vocab_size" in config and config["vocab_size"] != emb.shape[0]:
            problems.append(f"vocab_size {config['vocab_size']} but {in_name} has {emb.shape[0]} rows")
        if "hidden_size" in config and config["hidden_size"] != emb.shape[1]:
            problems.append(f"hidden_size {config['hidden_size']} but {in_name} has {emb.shape[1]} columns")
        break
    layers = {int(m.group(1)) for n in tensors for m in [re.search(r"\.layers\.(\d+)\.", n)] if m}
    if layers and "num_hidden_layers" in config and config["num_hidden_layers"] != max(layers) + 1:
        problems.append(f"num_hidden_layers {config['num_hidden_layers']} but the checkpoint has "
                        f"{max(layers) + 1} layers")
    if problems:
        raise FormatError("config does not describe the checkpoint's model: " + "; ".join(problems),
                          path=cfg_path, hint="pass the --config-from of the model this run trained")


def adapter_facts(src) -> AdapterFacts:
    """Facts of an open `LoraSource` (PEFT dir or DCP checkpoint)."""
    mods, full, resident = [], [], 0
    if src.kind == "dcp":
        from ..keys import lora_key

        for m, spec in sorted(src.modules.items()):
            ka, kb = lora_key(m, "A", src.slot), lora_key(m, "B", src.slot)
            mods.append(LoraFact(m, spec.rank, spec.scale, False, ka, kb, tuple(src.ckpt.entries[ka].shape),
                                 tuple(src.ckpt.entries[kb].shape)))
    else:
        ad = src.adapter
        for m, am in sorted(ad.modules.items()):
            spec = src.modules[m]
            mods.append(LoraFact(m, spec.rank, spec.scale, spec.fan_in_fan_out, am.a_key, am.b_key,
                                 tuple(ad._shapes[am.a_key]), tuple(ad._shapes[am.b_key])))
        for name, key in sorted(src.full_tensors.items()):
            full.append(FullFact(name, key, dtype_name(ad._dtypes[key]), tuple(ad._shapes[key])))
        if ad.weights_path.suffix == ".bin":
            resident = ad.nbytes   # a torch pickle is loaded whole
    describe = src.describe()
    return AdapterFacts(src.kind, str(src.path), getattr(src, "slot", None), tuple(mods), tuple(full),
                        describe, resident, tuple(src.warnings))


def _check_dcp_trained_on(base: BaseFacts, ckpt) -> list[str]:
    """A DCP adapter records the base it trained on (fp32 masters): their names and shapes must
    match the HF base, or the merge would silently pair a LoRA with the wrong model."""
    from ..dcp.reader import TensorEntry
    from ..keys import classify

    by_name = {t.name: t for t in base.tensors}
    tied_out = {o for o, i in TIED_PAIRS if i in by_name and o not in by_name}
    problems = []
    for key, e in ckpt.entries.items():
        ki = classify(key, e.path)
        if ki.group != "base" or not isinstance(e, TensorEntry):
            continue
        t = by_name.get(ki.hf_name)
        if t is None:
            if ki.hf_name not in tied_out:
                problems.append(f"{ki.hf_name} is in the checkpoint but not in the base")
        elif tuple(t.shape) != tuple(e.shape):
            problems.append(f"{ki.hf_name} is {list(e.shape)} in the checkpoint, {list(t.shape)} in the base")
    return problems


def prepare_merge(base: str | Path | None, adapter: str | Path, *, base_from_checkpoint: bool = False,
                  config_from: str | Path | None = None, alpha: float | None = None,
                  run_config: str | Path | None = None, slot: int = 0, dtype: str | torch.dtype | None = None,
                  max_shard_size: str | int = DEFAULT_MAX_SHARD, threads: int | None = None,
                  trust_pickle: bool = False, allow_zero_delta: bool = False) -> MergePlan:
    """Open headers, resolve alpha, plan. `base`: an HF model dir or hub id (local HF cache only);
    with `base_from_checkpoint`, a DCP checkpoint whose fp32 masters are the base (None: the
    adapter itself, which must then be a DCP checkpoint), config and tokenizer from `config_from`.
    `dtype` None: `merge_guards.default_out_dtype` (an fp16 base stays fp16). Refused here, before
    any tensor is read: a PEFT adapter whose target_modules misses its own modules, a DCP
    checkpoint whose fp32 masters disagree with the HF base (`merge_guards`)."""
    from ..dcp.reader import DcpCheckpoint, resolve_checkpoint_dir
    from ..formats.hf_dir import parse_size
    from ..lora_source import is_dcp, open_lora_source

    out_dtype = dtype if isinstance(dtype, torch.dtype) or dtype is None else parse_dtype(dtype)
    max_shard_bytes = parse_size(max_shard_size)
    if max_shard_bytes <= 0:
        raise UsageError("--max-shard-size must be positive")
    threads = DEFAULT_THREADS if threads is None else int(threads)
    if not base_from_checkpoint and config_from is not None:
        raise UsageError("--config-from applies only with --base-from-checkpoint (an HF base brings its own "
                         "config and tokenizer)")
    if base_from_checkpoint:
        base = adapter if base is None else base
        if not is_dcp(Path(base)):
            raise UsageError("--base-from-checkpoint: not a DCP checkpoint (no .metadata here or in trainer/)",
                             path=base, hint="pass the trainer dir, e.g. outputs/checkpoints/step_N/trainer")
    elif base is None:
        raise UsageError("no BASE given", hint="pass an HF model dir or hub id, or use --base-from-checkpoint")

    src = open_lora_source(adapter, alpha=alpha, run_config=run_config, slot=slot, trust_pickle=trust_pickle)
    masters = None
    try:
        if src.kind == "peft":
            check_target_modules(src.adapter)
        afacts = adapter_facts(src)
        if base_from_checkpoint:
            same = src.kind == "dcp" and Path(src.path).resolve() == resolve_checkpoint_dir(base).resolve()
            if same:
                bfacts = dcp_base_facts(src.ckpt, config_from)
            else:
                with DcpCheckpoint.open(base, trust_pickle=trust_pickle) as ck:
                    bfacts = dcp_base_facts(ck, config_from)
        else:
            bfacts = hf_base_facts(base)
            if src.kind == "dcp":
                problems = _check_dcp_trained_on(bfacts, src.ckpt)
                if problems:
                    raise FormatError(f"the checkpoint was not trained on this base: {len(problems)} difference(s): "
                                      + "; ".join(problems[:6]), path=bfacts.path,
                                      hint="merge into the base model the run trained (prime-rl's [model] name)")
                masters = check_masters_match_base(bfacts.path, src.ckpt)
    finally:
        src.close()
    reason = f"--dtype {dtype_name(out_dtype)}" if out_dtype is not None else ""
    if out_dtype is None:
        out_dtype, reason = default_out_dtype(bfacts, afacts)
    plan = plan_merge(bfacts, afacts, out_dtype=out_dtype, max_shard_bytes=max_shard_bytes, threads=threads,
                      trust_pickle=trust_pickle)
    warnings = plan.warnings + ((reason,) if out_dtype == torch.float16 and not dtype else ())
    return dataclasses.replace(plan, out_dtype_reason=reason, allow_zero_delta=bool(allow_zero_delta),
                               masters_checked=masters, warnings=warnings)


# ============================================================================================
# execution


@dataclass(frozen=True)
class MergeProgress:
    """One event per tensor written (and one with done == 0 at the start)."""
    done: int
    total: int
    bytes_done: int
    bytes_total: int
    name: str | None
    action: str | None
    elapsed_s: float


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


class _Buffers:
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
    def view(buf: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        n = math.prod(shape) * dtype.itemsize
        return buf[:n].view(dtype).view(shape)


def _pread_exact(fd: int, dest: torch.Tensor, offset: int, *, path, key: str) -> None:
    """Fill contiguous CPU tensor `dest` with the bytes at `offset` of `fd` (short reads looped)."""
    from ..errors import TruncatedFileError

    mv = memoryview(dest.view(torch.uint8).reshape(-1).numpy())
    done, total = 0, len(mv)
    while done < total:
        n = os.preadv(fd, [mv[done:done + 0x7FFFF000]], offset + done)
        if n == 0:
            raise TruncatedFileError(f"file ended at byte {offset + done} while reading [{offset}, {offset + total})",
                                     path=path, key=key, hint="the file shrank or is truncated; re-copy it")
        done += n


class _Sources:
    """The inputs named by a plan, re-opened for execution and checked against the plan."""

    def __init__(self, plan: MergePlan):
        self.plan = plan
        self.hf = None
        self.dcp = None
        self.adapter_dcp = None
        self.peft = None
        self._local = threading.local()
        merges = [j for j in plan.jobs if j.action == "merge"]
        self.buffers = _Buffers(max((max(j.read_bytes, j.out_bytes) for j in merges), default=0))
        self.zero = ZeroDelta()   # merged tensors that came out equal to their base

    def __enter__(self):
        from ..dcp.reader import DcpCheckpoint
        from ..formats.hf_dir import HFModelDir
        from ..peft_adapter import open_peft_adapter

        p = self.plan
        try:
            if p.base_kind == "hf":
                self.hf = HFModelDir.open(p.base_path)
            else:
                self.dcp = DcpCheckpoint.open(p.base_path, trust_pickle=p.trust_pickle)
            if p.adapter_kind == "dcp":
                same = self.dcp is not None and Path(p.adapter_path).resolve() == self.dcp.dir.resolve()
                self.adapter_dcp = self.dcp if same else DcpCheckpoint.open(p.adapter_path,
                                                                            trust_pickle=p.trust_pickle)
            else:
                self.peft = open_peft_adapter(p.adapter_path, strict=True)
            self._check()
            if self.hf is not None:
                for header in self.hf.headers.values():   # open every shard fd now, before threads start
                    if header.tensors:
                        self.hf.fd(next(iter(header.tensors)))
        except BaseException:
            self.close()
            raise
        return self

    def _check(self) -> None:
        problems = []
        for j in self.plan.jobs:
            if j.action == "replace":
                shape, dt = tuple(self.peft._shapes.get(j.src, ())), self.peft._dtypes.get(j.src)
                if dt is None or shape != j.shape or dtype_name(dt) != j.src_dtype:
                    problems.append(f"adapter tensor {j.src}")
            elif self.hf is not None:
                info = self.hf._tensors.get(j.src)
                if info is None or info.path.name != j.src_file or tuple(info.shape) != j.shape \
                        or dtype_name(info.torch_dtype) != j.src_dtype:
                    problems.append(f"base tensor {j.src}")
            else:
                e = self.dcp.entries.get(j.src)
                if e is None or tuple(getattr(e, "shape", ())) != j.shape or dtype_name(e.dtype) != j.src_dtype:
                    problems.append(f"checkpoint tensor {j.src}")
        if problems:
            raise FormatError("the inputs changed since the merge was planned: " + ", ".join(problems[:6]),
                              path=self.plan.base_path, hint="plan again (rerun the command)")

    def close(self) -> None:
        for h in {id(x): x for x in (self.hf, self.dcp, self.adapter_dcp) if x is not None}.values():
            h.close()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reads (thread-safe: pread on shared fds)
    def base_tensor(self, job: TensorJob) -> torch.Tensor:
        if self.hf is not None:
            return self.hf.read_tensor(job.src)
        return self.dcp.read_tensor(job.src)

    def lora(self, job: TensorJob) -> tuple[torch.Tensor, torch.Tensor]:
        if self.adapter_dcp is not None:
            a, b = self.adapter_dcp.read_tensor(job.lora_a), self.adapter_dcp.read_tensor(job.lora_b)
        else:
            a, b = self.peft.read(job.lora_a), self.peft.read(job.lora_b)
        return a.to(torch.float32), b.to(torch.float32)

    def scratch(self, numel: int) -> torch.Tensor:
        """This worker's fp32 buffer for the LoRA product, grown to the largest merge it has seen."""
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.numel() < numel:
            self._local.buf = None
            buf = self._local.buf = torch.empty(numel, dtype=torch.float32)
        return buf

    def _read_base_into_buffer(self, job: TensorJob) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The base tensor of `job`: from an HF shard straight into a pooled buffer (returned so the
        caller gives it back); from a DCP checkpoint, a new tensor assembled from its chunks."""
        if self.hf is None:
            return self.base_tensor(job), None
        info = self.hf.info(job.src)
        buf = self.buffers.take(info.nbytes)
        try:
            t = _Buffers.view(buf, info.torch_dtype, tuple(info.shape))
            if info.nbytes:
                _pread_exact(self.hf.fd(job.src), t, info.begin, path=info.path, key=job.src)
        except BaseException:
            self.buffers.give(buf)
            raise
        return t, buf

    # -- one output tensor (runs in a worker thread)
    def produce(self, job: TensorJob) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the output tensor, the pooled buffer holding it or None): give the buffer back after writing."""
        out_dt = getattr(torch, job.out_dtype)
        if job.action == "replace":
            src, src_buf = self.peft.read(job.src), None
        else:
            src, src_buf = self._read_base_into_buffer(job)
        try:
            if job.action == "copy":
                return src.contiguous(), src_buf
            out_buf = self.buffers.take(job.out_bytes)
            try:
                out = _Buffers.view(out_buf, out_dt, job.shape)
                if job.action == "merge":
                    a, b = self.lora(job)
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


def check_output(plan: MergePlan, out: str | Path) -> None:
    """Refuse early (before any reading) what `AtomicOutputDir` would refuse at the start of
    writing: OUT exists, OUT inside an input (or an input inside OUT), too little free disk."""
    from ..atomic import AtomicOutputDir

    a = AtomicOutputDir(out, inputs=plan.inputs, need_bytes=plan.write_bytes)
    a._check_paths()
    if os.path.lexists(a.out):
        from ..errors import OutputExistsError

        raise OutputExistsError("already exists", path=a.out, hint="pass a new output path")
    if a.out.parent.is_dir():
        a._check_space()


def _slow_write_seconds() -> float:
    v = os.environ.get(SLOW_WRITE_ENV)
    if not v:
        return 0.0
    try:
        return max(0.0, float(v))
    except ValueError:
        raise UsageError(f"{SLOW_WRITE_ENV}={v!r} is not a number of seconds (a test-only hook)") from None


def execute_merge(plan: MergePlan, out: str | Path, *, progress: Callable[[MergeProgress], None] | None = None,
                  overwrite: bool = False) -> MergeResult:
    """Write the merged model to `out` (atomically: nothing appears there unless complete)."""
    from ..atomic import AtomicOutputDir, atomic_write_text

    t0 = time.perf_counter()
    out = Path(out)
    slow = _slow_write_seconds()
    with _Sources(plan) as src, AtomicOutputDir(out, inputs=plan.inputs, need_bytes=plan.write_bytes,
                                                overwrite=overwrite) as tmp:
        _write_tensors(plan, src, tmp, progress, slow, t0)
        for f in plan.files:   # read through the input checks, written as new files
            if f.action == "rewrite":
                cfg = read_json(f.src, root=Path(f.src).parent, what="config.json")
                atomic_write_text(tmp / f.name, rewrite_config(cfg, f.changes))
            else:
                copy_input_file(f.src, tmp / f.name, root=Path(f.src).parent, what="model file")
        if plan.index is not None:
            from ..formats.hf_dir import INDEX_NAME

            atomic_write_text(tmp / INDEX_NAME, json.dumps(plan.index, indent=2, sort_keys=True) + "\n")
        names = tuple(sorted(os.listdir(tmp)))
        written = sum(os.path.getsize(tmp / n) for n in names)
    return MergeResult(str(out), time.perf_counter() - t0, len(plan.jobs), plan.merged_modules, plan.read_bytes,
                       written, names, {a: plan.count(a) for a in ("merge", "copy", "cast", "replace")})


def _write_tensors(plan: MergePlan, src: _Sources, tmp: Path, progress, slow: float, t0: float) -> None:
    from ..formats.safetensors_io import StreamingSafetensorsWriter

    jobs = plan.jobs
    total_bytes = sum(j.out_bytes for j in jobs)
    last_of_shard = {s.file_name: s.tensors[-1] for s in plan.shards}
    shard_entries = {s.file_name: s for s in plan.shards}
    by_name = {j.name: j for j in jobs}

    def raw_copy(j: TensorJob) -> bool:
        return j.action == "copy" and src.hf is not None

    if progress:
        progress(MergeProgress(0, len(jobs), 0, total_bytes, None, None, 0.0))
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
    budget = window_budget(jobs, plan.threads, plan.base_kind)
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
                pending[ahead] = pool.submit(src.produce, jobs[ahead])
                in_flight += ws[ahead]
                ahead += 1
            if writer is None:
                s = shard_entries[job.out_file]
                entries = [(n, dtype_code(getattr(torch, by_name[n].out_dtype)), by_name[n].shape)
                           for n in s.tensors]
                writer = StreamingSafetensorsWriter(tmp / job.out_file, entries, OUTPUT_METADATA, fsync=False)
            if raw_copy(job):
                info = src.hf.info(job.src)
                copy_raw(info, src.hf.fd(job.src), writer, name=job.name, block_bytes=COPY_BLOCK_BYTES)
            else:
                t, buf = pending.pop(i).result()
                in_flight -= ws[i]
                writer.write(job.name, t)
                del t
                src.buffers.give(buf)
            if job.name == last_of_shard[job.out_file]:
                writer.close()            # checks every byte is there; the fsync runs in the background
                flushes.append(flusher.submit(fsync_path, writer.path))
                writer = None
            done_bytes += job.out_bytes
            if progress:
                progress(MergeProgress(i + 1, len(jobs), done_bytes, total_bytes, job.name, job.action,
                                       time.perf_counter() - t0))
            if slow:
                time.sleep(slow)
        src.zero.check(plan)              # a merge equal to its base is refused before OUT appears
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


def merge(base, adapter, out, *, progress=None, **kw) -> tuple[MergePlan, MergeResult]:
    """prepare_merge + execute_merge (the library entry point scripts use)."""
    plan = prepare_merge(base, adapter, **kw)
    return plan, execute_merge(plan, out, progress=progress)


__all__ = ["MergePlan", "TensorJob", "FileJob", "ShardOut", "BaseFacts", "AdapterFacts", "SourceTensor",
           "LoraFact", "FullFact", "MergeProgress", "MergeResult", "plan_merge", "prepare_merge",
           "execute_merge", "merge", "memory_bound", "window_budget", "check_output", "parse_dtype", "DTYPES", "TIED_PAIRS", "CkptError"]
