"""`ckpt extract-adapter`: a prime-rl DCP checkpoint's LoRA -> a PEFT adapter directory.

Plan, then execute. `plan_extract` works from `.metadata`, the run's orch.toml and (optionally)
the base model's safetensors headers; it decides every output key, dtype, shape and byte count and
the whole `adapter_config.json`. `run_extract` then streams: for each output tensor in key order,
read that one LoRA tensor (exactly its chunks' byte ranges), cast, write it at its precomputed
offset in `adapter_model.safetensors`, drop it. Memory: one LoRA tensor plus its cast copy (a
Qwen3-32B r=32 `gate_proj` B is 25600x32 fp32 = 3.3 MB), never the whole adapter.

Alpha is not in the checkpoint: it is resolved by `ckpt_tools.alpha` (--alpha, --run-config, the
run's orch.toml) and written as `lora_alpha` such that lora_alpha / r is the scale training used.

This module also holds what every PEFT-dir writer here shares (`peft_config`, `peft_key`,
`write_adapter_dir`), used by `ckpt fix-adapter` too.
"""
from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..alpha import find_run_configs, run_adapter_configs, run_outputs_dir
from ..atomic import AtomicOutputDir, write_new_file
from ..errors import CkptError, FormatError, UsageError
from ..inputs import read_json, read_toml
from ..keys import lora_key, module_suffix
from ..lora_source import DcpLoraSource
from ..peft_adapter import ADAPTER_CONFIG, PEFT_PREFIX, SAFETENSORS_NAME

log = logging.getLogger(__name__)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SAFETENSORS_METADATA = {"format": "pt"}
# Tensors of the output file are small: reserve this much beyond the exact sizes for the
# header and adapter_config.json in the disk-space pre-flight.
_SLACK_BYTES = 1 << 20

# adapter_config.json as PEFT's own `LoraConfig(...).to_dict()` writes it (the field set of the
# fixture's reference_peft_adapter, written by the peft library), with our values filled in by
# `peft_config`. A fixed table, not a live peft import: the output must not depend on which peft
# version happens to be installed, and every field here is one PEFT and vLLM accept.
PEFT_CONFIG_DEFAULTS: dict = {
    "alpha_pattern": {},
    "auto_mapping": None,
    "base_model_name_or_path": None,
    "bias": "none",
    "corda_config": None,
    "eva_config": None,
    "exclude_modules": None,
    "fan_in_fan_out": False,
    "inference_mode": True,
    "init_lora_weights": True,
    "layer_replication": None,
    "layers_pattern": None,
    "layers_to_transform": None,
    "loftq_config": {},
    "lora_alpha": None,
    "lora_bias": False,
    "lora_dropout": 0.0,
    "megatron_config": None,
    "megatron_core": "megatron.core",
    "modules_to_save": None,
    "peft_type": "LORA",
    "qalora_group_size": 16,
    "r": None,
    "rank_pattern": {},
    "revision": None,
    "target_modules": None,
    "target_parameters": None,
    "task_type": "CAUSAL_LM",
    "trainable_token_indices": None,
    "use_dora": False,
    "use_qalora": False,
    "use_rslora": False,
}


def peft_key(module: str, ab: str) -> str:
    """`model.layers.0.mlp.up_proj`, "A" -> `base_model.model.model.layers.0.mlp.up_proj.lora_A.weight`."""
    return f"{PEFT_PREFIX}{module}.lora_{ab}.weight"


def peft_config(*, r: int, lora_alpha: float, target_modules: list[str], base_model_name_or_path: str | None,
                modules_to_save: list[str] | None = None) -> dict:
    cfg = dict(PEFT_CONFIG_DEFAULTS)
    cfg.update(r=int(r), lora_alpha=float(lora_alpha), target_modules=list(target_modules),
               base_model_name_or_path=base_model_name_or_path,
               modules_to_save=sorted(modules_to_save) if modules_to_save else None)
    return cfg


def config_json(cfg: dict) -> str:
    """PEFT's own layout: sorted keys, 2-space indent."""
    return json.dumps(cfg, indent=2, sort_keys=True, allow_nan=False) + "\n"


def bf16_round(x: float) -> float:
    return float(torch.tensor(float(x), dtype=torch.float32).to(torch.bfloat16).float())


def lora_alpha_for_scale(scale: float, r: int) -> float:
    """lora_alpha such that lora_alpha / r == scale (an integer value when it is one)."""
    a = scale * r
    return float(round(a)) if math.isclose(a, round(a), rel_tol=0, abs_tol=1e-9) else a


# ------------------------------------------------------------------------------------ base models
def locate_base(name: str | None, *, run_root: Path | None = None) -> tuple[Path | None, str | None]:
    """Find a base model dir from a name or path: as given (a local dir, or a hub id in the local
    HF cache, offline). With `run_root` (the name came from the run's orch.toml), a relative name
    is first looked up in the run's launch dir (`outputs/..`), where prime-rl resolved it.
    Returns (dir, None) or (None, why not)."""
    from ..formats.hf_dir import resolve_model_dir

    if not name:
        return None, "no base model named"
    if run_root is not None and not Path(name).is_absolute() and (run_root / name).is_dir():
        return run_root / name, None
    why = None
    try:
        return resolve_model_dir(name), None
    except CkptError as exc:
        why = exc.message
    return None, why


def base_module_shapes(base_dir: Path) -> tuple[dict[str, tuple[int, ...]], dict]:
    """{tensor name: shape} of a base model from its headers only, and its config."""
    from ..formats.hf_dir import HFModelDir

    with HFModelDir.open(base_dir) as m:
        return {k: tuple(m.info(k).shape) for k in m.keys()}, (m.config or {})


def check_against_base(shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]],
                       base_shapes: dict[str, tuple[int, ...]], base_dir: Path) -> None:
    """Every module's A [r, in] / B [out, r] must fit `<module>.weight` [out, in] of the base.
    All problems in one error; zero matching modules is an error too."""
    problems = []
    matched = 0
    for module, (a, b) in sorted(shapes.items()):
        w = base_shapes.get(f"{module}.weight")
        if w is None:
            problems.append(f"{module}: the base has no {module}.weight")
        elif len(w) != 2 or a[1] != w[1] or b[0] != w[0]:
            problems.append(f"{module}: A {list(a)} / B {list(b)} do not fit the base weight {list(w)} "
                            f"(expect A [r, {w[1] if len(w) == 2 else '?'}], B [{w[0]}, r])")
        else:
            matched += 1
    if matched == 0 or problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise FormatError(f"{matched} of {len(shapes)} LoRA modules match the base model: {shown}",
                          path=base_dir, hint="the adapter was trained on a different base model; pass the "
                                              "right one with --base")


def target_modules_for(modules: list[str], base_shapes: dict[str, tuple[int, ...]] | None) -> tuple[list[str], str | None]:
    """PEFT target_modules: the sorted suffixes when they select exactly our modules in the base
    (or when there is no base to check); else the explicit module names (PEFT matches an exact
    name too), so PEFT creates no LoRA layer that has no weights."""
    suffixes = sorted({module_suffix(m) for m in modules})
    if base_shapes is None:
        return suffixes, None
    selected = {k[:-len(".weight")] for k, s in base_shapes.items()
                if k.endswith(".weight") and len(s) == 2 and module_suffix(k[:-len(".weight")]) in suffixes}
    if selected == set(modules):
        return suffixes, None
    return sorted(modules), (f"the LoRA covers {len(modules)} of the {len(selected)} base modules named "
                             f"{', '.join(suffixes)}; target_modules lists the {len(modules)} module names "
                             "explicitly")


# ------------------------------------------------------------------------------------ writing
@dataclass(frozen=True)
class OutTensor:
    name: str                 # key in adapter_model.safetensors
    shape: tuple[int, ...]
    dtype: str                # "fp32" | "bf16"
    source: str               # where it comes from (DCP key, source file key)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


def safetensors_file_bytes(tensors: list[OutTensor]) -> int:
    from ..formats.safetensors_io import build_header

    entries = [(t.name, DTYPES[t.dtype], t.shape) for t in tensors]
    return len(build_header(entries, SAFETENSORS_METADATA)) + sum(t.nbytes for t in tensors)


def write_adapter_dir(directory: Path, tensors: list[OutTensor], read: Callable[[OutTensor], torch.Tensor],
                      config: dict) -> int:
    """Write adapter_model.safetensors (tensors in the given order, which callers sort by name)
    and adapter_config.json into `directory`; `read` returns one tensor at a time. Returns the
    safetensors file size."""
    from ..formats.safetensors_io import StreamingSafetensorsWriter

    entries = [(t.name, DTYPES[t.dtype], t.shape) for t in tensors]
    with StreamingSafetensorsWriter(directory / SAFETENSORS_NAME, entries, SAFETENSORS_METADATA) as w:
        for t in tensors:
            value = read(t).to(DTYPES[t.dtype]).contiguous()
            if tuple(value.shape) != t.shape:
                raise FormatError(f"read {list(value.shape)}, planned {list(t.shape)}", key=t.source)
            w.write(t.name, value)
            del value
        size = w.file_bytes
    write_new_file(directory / ADAPTER_CONFIG, config_json(config))
    return size


# ------------------------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class ExtractPlan:
    checkpoint: Path
    out: Path
    slot: int
    dtype: str
    modules: int
    rank: int
    alpha: float
    alpha_source: str
    scale: float
    lora_alpha: float
    base_model_name_or_path: str | None
    base_checked: Path | None
    tensors: tuple[OutTensor, ...]
    config: dict = field(repr=False)
    lora_item_bytes: int = 0        # stored bytes of the LoRA items read (what --json calls bytes to read)
    lora_payload_bytes: int = 0     # fp32 values in them
    out_file_bytes: int = 0
    warnings: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        d = asdict(self)
        d["checkpoint"], d["out"] = str(self.checkpoint), str(self.out)
        d["base_checked"] = str(self.base_checked) if self.base_checked else None
        d["tensors"] = [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "source": t.source}
                        for t in self.tensors]
        d["warnings"] = list(self.warnings)
        return d


def _orch_model_name(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        data, _ = read_toml(path, root=run_outputs_dir(path) if run_outputs_dir(path) else None,
                            what="orchestrator config")
        name = (data.get("model") or {}).get("name") if isinstance(data.get("model"), dict) else None
    except CkptError:   # only a default for base_model_name_or_path: an unreadable config costs it
        return None
    return name if isinstance(name, str) and name else None


def _run_root(orch: Path | None) -> Path | None:
    """The run's launch dir: `<root>/outputs/<run>/configs/orch.toml` -> `<root>`."""
    if orch is None:
        return None
    p = Path(orch).resolve()
    return p.parents[3] if len(p.parents) > 3 else None


def plan_extract(src: DcpLoraSource, out: str | Path, *, base: str | None = None, dtype: str = "fp32") -> ExtractPlan:
    """Decide everything from metadata (see module docstring). `src` is an open DcpLoraSource
    (its alpha already resolved)."""
    if dtype not in ("fp32", "bf16"):
        raise UsageError(f"--dtype {dtype!r}: choose fp32 (exact) or bf16")
    out = Path(out)
    ckpt = src.ckpt
    modules = sorted(src.modules)
    if not modules:  # DcpLoraSource refuses this already; a zero-module adapter must never be written
        raise FormatError("zero LoRA modules to export", path=ckpt.dir)
    warnings = list(src.warnings)
    ranks = sorted({s.rank for s in src.modules.values()})
    if len(ranks) != 1:
        raise FormatError(f"LoRA ranks vary across modules ({ranks}); prime-rl trains one rank and "
                          "this export writes one `r`", path=ckpt.dir)
    rank = ranks[0]
    scale = src.alpha / rank
    lora_alpha = lora_alpha_for_scale(scale, rank)
    if bf16_round(scale) != scale:
        warnings.append(f"scale {scale!r} (alpha {src.alpha:g} / r {rank}) is not exact in bf16; prime-rl "
                        f"applied bf16({scale:.6g}) = {bf16_round(scale)!r} during training. The adapter keeps "
                        "alpha / r exactly, as PEFT and vLLM compute it")

    shapes = {}
    for m in modules:
        ea, eb = ckpt.entries[lora_key(m, "A", src.slot)], ckpt.entries[lora_key(m, "B", src.slot)]
        shapes[m] = (tuple(ea.shape), tuple(eb.shape))

    # base model: for base_model_name_or_path, and to verify shapes + target_modules when found
    orch = src.resolution.config_path
    if orch is None:
        found = find_run_configs(ckpt.dir)
        orch = found[0] if len(found) == 1 else None
    base_name = base if base is not None else _orch_model_name(orch)
    if base_name is None:
        warnings.append("no base model name: pass --base NAME_OR_DIR (the run's orch.toml [model] name was not "
                        "found); base_model_name_or_path is left null, so PEFT/vLLM users must supply the base")
    base_dir, why = locate_base(base_name, run_root=None if base is not None else _run_root(orch)) \
        if base_name else (None, None)
    base_shapes = None
    if base_dir is not None:
        base_shapes, _cfg = base_module_shapes(base_dir)
        check_against_base(shapes, base_shapes, base_dir)
    elif base_name is not None:
        warnings.append(f"base model {base_name!r} not found locally ({why}); LoRA shapes were not checked "
                        "against it")
    targets, twarn = target_modules_for(modules, base_shapes)
    if twarn:
        warnings.append(twarn)

    # modules_to_save: the DCP cannot tell a trained full tensor from a frozen one; the run's own
    # adapter configs can. vLLM refuses embed/lm_head modules_to_save, so we export LoRA only.
    mts = set()
    for c in run_adapter_configs(ckpt.dir):
        try:
            found = read_json(c, root=run_outputs_dir(ckpt.dir), what="adapter_config.json").get("modules_to_save")
            mts.update(m for m in (found or []) if isinstance(m, str))
        except (CkptError, AttributeError, TypeError):
            continue
    if mts:
        warnings.append(f"the run's adapter configs list modules_to_save {sorted(mts)}: this adapter holds the LoRA "
                        "only (vLLM rejects embed/lm_head modules_to_save). prime-rl's LoRA optimizer never "
                        "updates those tensors (format §6.3), so the base's own values are the trained ones")

    tensors = tuple(sorted((OutTensor(peft_key(m, ab), shapes[m][0 if ab == "A" else 1], dtype,
                                      lora_key(m, ab, src.slot)) for m in modules for ab in "AB"),
                           key=lambda t: t.name))
    cfg = peft_config(r=rank, lora_alpha=lora_alpha, target_modules=targets, base_model_name_or_path=base_name)
    entries = [ckpt.entries[t.source] for t in tensors]
    return ExtractPlan(
        checkpoint=ckpt.dir, out=out, slot=src.slot, dtype=dtype, modules=len(modules), rank=rank,
        alpha=src.alpha, alpha_source=src.alpha_source, scale=scale, lora_alpha=lora_alpha,
        base_model_name_or_path=base_name, base_checked=base_dir, tensors=tensors, config=cfg,
        lora_item_bytes=sum(e.stored_bytes for e in entries), lora_payload_bytes=sum(e.nbytes for e in entries),
        out_file_bytes=safetensors_file_bytes(list(tensors)), warnings=tuple(warnings))


def run_extract(plan: ExtractPlan, src: DcpLoraSource) -> dict:
    """Execute `plan` into an AtomicOutputDir; returns the report (plan + measured figures)."""
    t0 = time.perf_counter()
    before = src.ckpt.stats.bytes_read
    inputs = [plan.checkpoint] + ([plan.base_checked] if plan.base_checked else [])   # --base is read too
    with AtomicOutputDir(plan.out, inputs=inputs, need_bytes=plan.out_file_bytes + _SLACK_BYTES) as tmp:
        size = write_adapter_dir(tmp, list(plan.tensors), lambda t: src.ckpt.read_tensor(t.source), plan.config)
    read = src.ckpt.stats.bytes_read - before
    rep = plan.to_dict()
    rep.update(written_file_bytes=size, bytes_read=read, seconds=round(time.perf_counter() - t0, 3),
               read_ratio=round(read / plan.lora_item_bytes, 4) if plan.lora_item_bytes else None)
    return rep
