"""A merge's FP8 side, planned: which output tensors an `--dtype fp8` merge quantizes (`core.fp8`'s rule) and
which it keeps in bf16, what each quantized job writes (codes + `weight_scale_inv`), and which bases it reads
(block-FP8 bases dequantized exactly: `formats.hf_dir.fp8`).

Actions on an FP8 output: a quantized weight is `merge` (W32 = W_base32 + s * B@A, quantized), `quantize` (W32
= the base's value: a bf16 weight upcast, a checkpoint's fp32 master, or fl32(q * scale) of an FP8 base) or
`replace` (a modules_to_save tensor); kept tensors (embeddings, lm_head, norms, routers) are written bf16 as
merge writes them today.
"""

from __future__ import annotations

import math

from ...core.dtypes import itemsize, safetensors_code
from ...core.errors import FormatError
from ...core.fp8 import FP8_DTYPE, grid_shape, is_quantized_weight, scale_name
from ...formats.hf_dir.fp8 import unsupported_quantization
from .facts import BaseFacts

__all__ = [
    "ACTIONS",
    "KEPT_DTYPE",
    "check_quantized_base",
    "counted_actions",
    "declared_entries",
    "declared_tensors",
    "fp8_protos",
    "fp8_summary",
    "scale_map",
]

ACTIONS = ("merge", "copy", "cast", "replace", "quantize")  # a plan's job actions, as its counts list them


def counted_actions(out_dtype: str) -> tuple[str, ...]:
    """The actions a plan's counts list: `quantize` only for an FP8 output."""
    return ACTIONS if out_dtype == FP8_DTYPE else ACTIONS[:-1]


KEPT_DTYPE = (
    "bfloat16"  # what an FP8 output stores unquantized tensors as (Qwen's and DeepSeek's FP8 checkpoints)
)


def fp8_protos(proto: dict[str, dict], out_dt: str) -> tuple[str, ...]:
    """Turn a plan's per-tensor job fields into an FP8 output's (in place): quantized weights get fp8 codes
    and
    a scale grid, the rest bf16. Returns the modules kept unquantized (the config's modules_to_not_convert);
    () for any other output dtype."""
    if out_dt != FP8_DTYPE:
        return ()
    kept = []
    for name, p in proto.items():
        if p["out_dtype"] != FP8_DTYPE:  # a copy of a dtype merge never casts (ints): as it is
            continue
        shape = tuple(p["shape"])
        numel = math.prod(shape)
        if is_quantized_weight(name, shape):
            grid = grid_shape(shape)
            p.update(scale_name=scale_name(name), scale_shape=grid)
            if p["action"] in ("cast", "copy"):
                p["action"] = "quantize"
            p["out_bytes"] = numel + math.prod(grid) * 4
            continue
        p["out_dtype"] = KEPT_DTYPE
        if p["action"] in ("cast", "copy"):
            p["action"] = "copy" if p["src_dtype"] == KEPT_DTYPE else "cast"
        p["out_bytes"] = numel * itemsize(KEPT_DTYPE)
        if name.endswith(".weight"):
            kept.append(name.removesuffix(".weight"))
    return tuple(sorted(kept))


def declared_entries(name: str, p: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    """The safetensors entries one job writes: its tensor, and a quantized weight's scale grid beside it."""
    out = [(name, safetensors_code(p["out_dtype"]), tuple(p["shape"]))]
    if p.get("scale_name"):
        out.append((p["scale_name"], "F32", tuple(p["scale_shape"])))
    return out


def scale_map(jobs) -> dict[str, str]:
    """{scale tensor: its shard file} for the index's weight_map."""
    return {j.scale_name: j.out_file for j in jobs if j.scale_name}


def check_quantized_base(base: BaseFacts) -> None:
    """A quantized base is merged only when it is block FP8 (dequantized exactly by its reader); any other
    quantization is refused: merging a LoRA into its weights would not be exact."""
    why = unsupported_quantization(base.config)
    if why is None:
        return
    raise FormatError(
        f"the base is quantized ({why}); merging a LoRA into these quantized weights is not exact",
        path=base.config_path,
        hint="merge into the unquantized (bf16) base model or a block-FP8 one, then quantize the result",
    )


def declared_tensors(jobs) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor: (dtype, shape)} of what `jobs` write, scale grids included (a shard writer's entries)."""
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for j in jobs:
        out[j.name] = (j.out_dtype, tuple(j.shape))
        if j.scale_name:
            out[j.scale_name] = ("float32", tuple(j.scale_shape))
    return out


def fp8_summary(plan, figures: dict[str, dict]) -> dict | None:
    """An FP8 output's report: the quantized and kept tensors, per quantized tensor its figures (`quantize.
    Fp8Figure`), the worst relative error, and the merged modules whose LoRA delta is smaller than their
    quantization error (the warning: such a delta mostly rounds away in FP8). None for another output."""
    if plan.out_dtype != FP8_DTYPE:
        return None
    quantized = sorted(j.name for j in plan.jobs if j.scale_name)
    kept = sorted(j.name for j in plan.jobs if not j.scale_name)
    below = sorted(n for n, f in figures.items() if f.get("delta_survives") is False)
    rel = [f["rel_error"] for f in figures.values()]
    warnings: list[str] = []
    summary = {
        "quantized": len(quantized),
        "kept": kept,
        "rel_error_max": max(rel, default=0.0),
        "rel_error_mean": sum(rel) / len(rel) if rel else 0.0,
        "delta_below_error": below,
        "tensors": dict(sorted(figures.items())),
        "warnings": warnings,
    }
    if below:
        warnings.append(
            f"{len(below)} of {sum(1 for f in figures.values() if f.get('delta_norm') is not None)} merged "
            f"module(s) have a LoRA delta smaller than their FP8 quantization error (e.g. {below[0]}): "
            "in FP8 most of that update rounds away; `ckpt diff-vs-base OUT BASE --adapter A` counts the "
            "codes it changed"
        )
    return summary
