"""The numbers `ckpt report` draws, from metadata and the bytes they need, never a product B@A.

- A LoRA module's change: ||s B A||_F^2 = s^2 trace((B^T B)(A A^T)), from the two r x r Gram
  matrices, in fp64 (`lora_delta_sq`): O(r^2 (in + out)) work and memory, however large the weight.
- A weight's norm ||W||_F: streamed through the source in blocks, fp64 sums (`weight_sq`), read once
  per run (the frozen base weights are the same at every step of a LoRA run).
- A trained base weight's change (a full fine-tune, modules_to_save): ||W - W0||_F of the fp32 master
  against the bf16 base, streamed by `sources.compare.stream_stats` (the statistics diff-vs-base reports).
- Adam's moments: ||exp_avg||_F and ||exp_avg_sq||_F of every trained parameter, summed (in squares)
  over a module group.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from ...core.keys import EXPERT_PROJ, LAYER_NUMBER
from ...formats.handle import Source
from ...sources.compare import BLOCK_BYTES, stream_stats

__all__ = [
    "MOMENT_FIELDS",
    "ModuleChange",
    "lora_delta_sq",
    "module_group",
    "param_module",
    "trained_delta",
    "weight_sq",
]

MOMENT_FIELDS = ("exp_avg", "exp_avg_sq")
_INDEX = re.compile(r"\.\d+(?=\.|$)")


@dataclass(frozen=True)
class ModuleChange:
    """One module's (HF name, `.weight` dropped) change at one step: sums of squares in fp64."""

    module: str
    delta_sq: float
    weight_sq: float
    max_abs_delta: float | None = None  # masters vs base only (a LoRA's is not computed: no B@A)
    changed_fraction: float | None = None

    @property
    def delta_fro(self) -> float:
        return math.sqrt(self.delta_sq)

    @property
    def weight_fro(self) -> float:
        return math.sqrt(self.weight_sq)

    @property
    def rel_delta(self) -> float | None:
        return self.delta_fro / self.weight_fro if self.weight_sq > 0 else None

    def to_json(self) -> dict:
        out = {"delta_fro": self.delta_fro, "weight_fro": self.weight_fro, "rel_delta": self.rel_delta}
        if self.max_abs_delta is not None:
            out["max_abs_delta"] = self.max_abs_delta
            out["changed_fraction"] = self.changed_fraction
        return out


def lora_delta_sq(a: torch.Tensor, b: torch.Tensor, scale: float) -> float:
    """||scale * B @ A||_F^2 from A [r, in] and B [out, r]: scale^2 * trace((B^T B)(A A^T)), fp64.
    Both Gram matrices are symmetric, so the trace of their product is the sum of their elementwise
    product."""
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    gram_a = a64 @ a64.T  # r x r
    gram_b = b64.T @ b64  # r x r
    return float(scale) ** 2 * float((gram_a * gram_b).sum())


def weight_sq(src: Source, name: str, block_bytes: int = BLOCK_BYTES) -> float:
    """sum(W^2) of tensor `name`, streamed `block_bytes` at a time, accumulated in fp64."""
    f = src.facts(name)
    per = max(1, block_bytes // f.itemsize)
    total = 0.0
    for start in range(0, f.numel, per):
        t = src.read_elems(name, start, min(per, f.numel - start)).to(torch.float64)
        total += float((t * t).sum())
    src.release()
    return total


def trained_delta(weights: Source, base: Source, name: str, module: str) -> ModuleChange:
    """||W - W0|| of a trained weight (an fp32 master) against its base (bf16, upcast exactly)."""
    st = stream_stats(weights, base, name)
    weights.release()
    base.release()
    return ModuleChange(
        module, st.sum_sq_delta, st.sum_sq_base, st.max_abs, st.changed / st.numel if st.numel else 0.0
    )


def module_group(module: str) -> str:
    """The module's kind, the same in every layer (and for every expert): `self_attn.q_proj`,
    `mlp.experts.gate_proj`, `embed_tokens`, `lm_head`, `input_layernorm`."""
    m = LAYER_NUMBER.search(module)
    rest = module[m.end() :] if m else module.removeprefix("model.")
    return _INDEX.sub("", "." + rest)[1:] if rest else module


def param_module(param: str) -> str:
    """The HF module of an optimizer state's param FQN: `X.lora_A.0` -> `X`; a grouped experts' stacked
    factor `X.experts.w1_lora_A.0` -> `X.experts.gate_proj` (one module per projection, every expert);
    a base weight `X.weight` -> `X`; prime-format stacked experts `X.experts.w1` -> `X.experts.gate_proj`."""
    if ".lora_" in param:
        return param.rsplit(".lora_", 1)[0]
    if "_lora_" in param:
        param = param.rsplit("_lora_", 1)[0]  # `experts.w1_lora_A.0` -> `experts.w1`
    head, _, last = param.rpartition(".")
    if last in EXPERT_PROJ and head.endswith("experts"):
        return f"{head}.{EXPERT_PROJ[last]}"
    return head if last in ("weight", "bias") else param
