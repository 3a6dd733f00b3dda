"""The one planner of a PEFT adapter dir's layout, from the LoRA's modules and trained full tensors: which
tensors the dir holds (each an `OutTensor`: key, shape, dtype, where its values come from), its
adapter_config.json, and the warnings a consumer needs. extract-adapter, fix-adapter, average and
resize-adapter each say what their LoRA is (`ModuleFactors` per module, `FullTensor` per modules_to_save
tensor) and get the same layout rules:

- `--layout` (`core.keys.LAYOUTS`): `peft` writes grouped-expert modules as PEFT's fused expert LoRA
  (`experts.plan_fused`: reached through `target_parameters`), `vllm` / `prime-rl` as per-expert modules;
  a dense LoRA is the same dir in every layout;
- target_modules: the suffixes when they select exactly the LoRA's modules in the base, else the module
  names (`writer.target_modules_for`); modules_to_save under exact module names
  (`writer.exact_modules_to_save`);
- one `r` and `lora_alpha` (a checkpoint's LoRA or an export: alpha / r is the training scale), or each
  module at its own rank with scale 1 (a LoRA computed in delta space: the most common rank as `r`, the
  others in rank_pattern / alpha_pattern).

Pure: shapes and names in, the plan out (the base's tensor shapes are given, not read).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ...core.errors import FormatError, UsageError
from ...core.keys import LAYOUTS, expert_parts
from ...core.lora_math import lora_alpha_for_scale
from .config import PEFT_PREFIX
from .experts import FusedParam, fused_config, plan_fused
from .writer import (
    OutTensor,
    exact_modules_to_save,
    full_tensor_warning,
    peft_config,
    peft_key,
    target_modules_for,
)

__all__ = ["AdapterLayout", "FullTensor", "ModuleFactors", "check_layout", "plan_adapter_layout"]


def check_layout(layout: str) -> None:
    """`--layout` names one of `core.keys.LAYOUTS` (an op checks it with its other options, first)."""
    if layout not in LAYOUTS:
        raise UsageError(f"--layout {layout!r}: choose one of {', '.join(LAYOUTS)}")


@dataclass(frozen=True)
class ModuleFactors:
    """One LoRA module as the adapter writes it: its factors' shapes, the dtype each is written in, and
    where each one's values come from (what its `OutTensor.source` names)."""

    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]
    a_dtype: str
    b_dtype: str
    a_source: str
    b_source: str
    fan_in_fan_out: bool = False

    def shape(self, ab: str) -> tuple[int, ...]:
        return self.a_shape if ab == "A" else self.b_shape

    def dtype(self, ab: str) -> str:
        return self.a_dtype if ab == "A" else self.b_dtype

    def source(self, ab: str) -> str:
        return self.a_source if ab == "A" else self.b_source


@dataclass(frozen=True)
class FullTensor:
    """A trained full tensor (PEFT modules_to_save), written under its HF name."""

    shape: tuple[int, ...]
    dtype: str
    source: str


@dataclass(frozen=True)
class AdapterLayout:
    """The planned adapter dir: its tensors (sorted by key) and adapter_config.json, and what the plan
    decided on the way, for the callers' own plans and warnings."""

    tensors: tuple[OutTensor, ...]
    config: dict
    lora_alpha: float  # the config's (with one `rank`: scale * r; else the most common rank)
    experts: tuple[str, ...]  # the grouped-expert modules among the LoRA's
    fused: tuple[FusedParam, ...]  # --layout peft of a MoE: the fused LoRAs holding them
    per_module: tuple[str, ...]  # the modules written as modules (all but the fused ones)
    modules_to_save: tuple[str, ...]
    target_warning: str | None  # target_modules had to name the modules (they are not all a suffix's)
    full_warning: str | None  # what consumers do with modules_to_save (`writer.full_tensor_warning`)
    inexact_alphas: tuple[str, ...]  # fused blocks whose alpha / rank is not exactly the scale


def plan_adapter_layout(
    modules: Mapping[str, ModuleFactors],
    full: Mapping[str, FullTensor],
    *,
    layout: str,
    base_model_name_or_path: str | None,
    rank: int | None = None,
    scale: float = 1.0,
    base_shapes: Mapping[str, tuple[int, ...]] | None = None,
    base_dir: Path | None = None,
    target_modules: list[str] | None = None,
    path: Path | str | None = None,
    fuse_hint: str | None = None,
) -> AdapterLayout:
    """The layout of `modules` (in the caller's order) and `full` as a PEFT adapter dir. `rank`: the one
    `r` (lora_alpha is then `scale * r`, exactly where it can be); None: each module at its own rank with
    scale 1. `base_shapes`: the base's tensor shapes, which target_modules and modules_to_save are checked
    against (`base_dir` names it in errors). `target_modules`: a caller's own list, kept when no module is
    fused. `path`: the adapter's source, named in errors; `fuse_hint`: the remedy when the experts of a
    projection cannot be fused."""
    check_layout(layout)
    experts = tuple(m for m in modules if expert_parts(m) is not None)
    fused = _fuse(modules, experts, layout, path, fuse_hint)
    per_module = tuple(m for m in modules if not fused or m not in set(experts))
    if target_modules is not None and not fused:
        targets, target_warning = list(target_modules), None
    else:
        targets, target_warning = target_modules_for(list(per_module), _dict(base_shapes))
    mts = exact_modules_to_save(list(full), base_shapes, path=base_dir) if full else []
    if rank is None:
        cfg = _per_module_ranks_config(modules, per_module, fused, targets, mts, base_model_name_or_path)
        inexact: tuple[str, ...] = ()
    else:
        lora_alpha = lora_alpha_for_scale(scale, rank)
        cfg = peft_config(
            r=rank,
            lora_alpha=lora_alpha,
            target_modules=targets,
            base_model_name_or_path=base_model_name_or_path,
            modules_to_save=mts or None,
            fused=fused_config(list(fused), scale) if fused else None,
        )
        inexact = tuple(
            f"{f.name}: alpha {lora_alpha_for_scale(scale, f.rank)!r} / rank {f.rank} is not exactly "
            f"the scale {scale!r} in floating point (PEFT computes alpha / r)"
            for f in fused
            if f.block and lora_alpha_for_scale(scale, f.rank) / f.rank != scale
        )
    return AdapterLayout(
        tensors=_out_tensors(modules, full, experts, fused, per_module),
        config=cfg,
        lora_alpha=cfg["lora_alpha"],
        experts=experts,
        fused=fused,
        per_module=per_module,
        modules_to_save=tuple(mts),
        target_warning=target_warning,
        full_warning=full_tensor_warning(mts),
        inexact_alphas=inexact,
    )


def _dict(shapes: Mapping[str, tuple[int, ...]] | None) -> dict[str, tuple[int, ...]] | None:
    return shapes if shapes is None or isinstance(shapes, dict) else dict(shapes)


def _fuse(
    modules: Mapping[str, ModuleFactors],
    experts: tuple[str, ...],
    layout: str,
    path: Path | str | None,
    hint: str | None,
) -> tuple[FusedParam, ...]:
    """--layout peft of a MoE LoRA: the fused LoRAs holding every expert module (none otherwise)."""
    if layout != "peft" or not experts:
        return ()
    try:
        return tuple(plan_fused({m: (modules[m].a_shape, modules[m].b_shape) for m in experts}, path))
    except FormatError as exc:
        if hint is None:
            raise
        raise FormatError(exc.message, path=path, hint=hint) from None


def _per_module_ranks_config(
    modules: Mapping[str, ModuleFactors],
    per_module: tuple[str, ...],
    fused: tuple[FusedParam, ...],
    targets: list[str],
    mts: list[str],
    base_model_name_or_path: str | None,
) -> dict:
    """adapter_config.json with each module at its own rank and scale 1: the most common rank as `r`,
    the others in rank_pattern / alpha_pattern (lora_alpha = rank)."""
    ranks = {m: modules[m].a_shape[0] for m in per_module}
    r = Counter(ranks.values()).most_common(1)[0][0] if ranks else (fused[0].part_rank if fused else 1)
    others = {m: k for m, k in sorted(ranks.items()) if k != r}
    cfg = peft_config(
        r=r,
        lora_alpha=float(r),
        target_modules=targets,
        base_model_name_or_path=base_model_name_or_path,
        modules_to_save=mts or None,
        fused=fused_config(list(fused), 1.0) if fused else None,
    )
    cfg["fan_in_fan_out"] = any(f.fan_in_fan_out for f in modules.values())
    cfg["rank_pattern"] = {**cfg.get("rank_pattern", {}), **others}
    cfg["alpha_pattern"] = {**cfg.get("alpha_pattern", {}), **{m: float(k) for m, k in others.items()}}
    return cfg


def _out_tensors(
    modules: Mapping[str, ModuleFactors],
    full: Mapping[str, FullTensor],
    experts: tuple[str, ...],
    fused: tuple[FusedParam, ...],
    per_module: tuple[str, ...],
) -> tuple[OutTensor, ...]:
    """Every tensor of the dir, sorted by key: each module's A and B, each fused LoRA's (in the dtype of
    the first expert module's factor), each full tensor under its HF name."""
    outs = [
        OutTensor(peft_key(m, ab), modules[m].shape(ab), modules[m].dtype(ab), modules[m].source(ab))
        for m in per_module
        for ab in "AB"
    ]
    outs += [
        OutTensor(
            peft_key(f.peft_module, ab),
            f.a_shape if ab == "A" else f.b_shape,
            modules[experts[0]].dtype(ab),
            f.source(ab),
        )
        for f in fused
        for ab in "AB"
    ]
    outs += [OutTensor(PEFT_PREFIX + name, t.shape, t.dtype, t.source) for name, t in full.items()]
    return tuple(sorted(outs, key=lambda t: t.name))
