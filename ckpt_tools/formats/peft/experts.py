"""Grouped-expert LoRA in PEFT's fused layout (`--layout peft` of a MoE run), written and read exactly.

transformers 5 holds a Qwen3-MoE block's experts as two 3-D parameters, `mlp.experts.gate_up_proj`
[E, 2I, H] (gate rows, then up rows) and `mlp.experts.down_proj` [E, H, I]; PEFT 0.21 reaches them only
through `target_parameters` (its `ParamWrapper`): one LoRA per parameter with the experts folded into
the rank, `lora_A` [R*E, in] and `lora_B` [out, R*E], whose per-expert delta is (PeftModel's
`get_delta_weight`, for a parameter stored [E, out, in])

    delta[e] = scaling * B.reshape(out, R, E)[:, :, e] @ A.reshape(E, R, in)[e]

with `scaling = alpha / R` from `rank_pattern` / `alpha_pattern` matched against the parameter's name.

prime-rl trains separate gate (w1) and up (w3) LoRAs of rank r per expert. They are written exactly
as one rank-2r LoRA per expert in block form: A_e = [A_gate_e; A_up_e] (2r rows), B_e = [[B_gate_e, 0],
[0, B_up_e]] ([2I, 2r]), so B_e @ A_e = [B_gate_e @ A_gate_e; B_up_e @ A_up_e] and the zero blocks add
exact zeros; `rank_pattern` gives the fused gate_up parameter rank 2r and `alpha_pattern` the alpha
2r * scale, so PEFT's scaling is the training scale. down_proj is one rank-r LoRA per expert as is.
Reading inverts this, exactly: each per-expert projection's own A and B come back (the zero blocks are
checked to be zero). A gate_up LoRA that is not in block form (a PEFT-trained one: one shared A) is read
as gate = (A_e, B_e[:I]) and up = (A_e, B_e[I:]), rank R each, which is also exact.

The names and shapes here are pure (the metadata side imports no torch); `build_fused` places the
factors' bits with numpy (no torch), `read_view` takes torch tensors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ...core.errors import FormatError
from ...core.keys import (
    FUSED_EXPERT_PARAMS,
    expert_module,
    expert_parts,
    fused_param_name,
    fused_peft_modules,
    module_suffix,
)
from ...core.lora_math import lora_alpha_for_scale
from ..handle import RawTensor

if TYPE_CHECKING:
    import torch

__all__ = [
    "LAYOUT_FACTS",
    "ExpertView",
    "FusedParam",
    "build_fused",
    "fused_config",
    "fused_params_of_config",
    "parse_fused",
    "plan_fused",
    "read_view",
]

_PROJS = dict(FUSED_EXPERT_PARAMS)


@dataclass(frozen=True)
class FusedParam:
    """One fused expert parameter's LoRA: `experts`' `param`, holding projections `projs` (row order)."""

    experts: str  # e.g. model.layers.0.mlp.experts
    param: str  # gate_up_proj | down_proj
    projs: tuple[str, ...]  # HF per-expert projections, in the parameter's row order
    num_experts: int
    rank: int  # R: the fused LoRA's per-expert rank (2r for gate_up in block form)
    part_rank: int  # r: each projection's own rank (R when the A is shared)
    in_features: int
    out_rows: tuple[int, ...]  # rows of each projection
    peft_module: str  # the module PEFT saves it under (`experts` or `experts.base_layer`)

    @property
    def block(self) -> bool:
        return self.part_rank != self.rank

    @property
    def name(self) -> str:
        return fused_param_name(self.experts, self.param)

    @property
    def a_shape(self) -> tuple[int, int]:
        return (self.rank * self.num_experts, self.in_features)

    @property
    def b_shape(self) -> tuple[int, int]:
        return (sum(self.out_rows), self.rank * self.num_experts)

    def source(self, ab: str) -> str:
        """What an output tensor built from it names as its source."""
        return f"fused:{self.name}:{ab}"


@dataclass(frozen=True)
class ExpertView:
    """Where one per-expert projection's A and B lie inside a fused LoRA."""

    fused: FusedParam
    expert: int
    part: int  # index of the projection in `fused.projs`

    @property
    def a_shape(self) -> tuple[int, int]:
        return (self.fused.part_rank, self.fused.in_features)

    @property
    def b_shape(self) -> tuple[int, int]:
        return (self.fused.out_rows[self.part], self.fused.part_rank)


def plan_fused(modules: dict[str, tuple[tuple[int, ...], tuple[int, ...]]], path) -> list[FusedParam]:
    """The fused LoRAs that hold every per-expert module of `modules` ({module: (A shape, B shape)}),
    written in block form. Every expert 0..E-1 of each projection must be there, gate with up."""
    groups: dict[tuple[str, str], dict[int, tuple]] = {}
    for m, ab_shapes in modules.items():
        ex = expert_parts(m)
        if ex is not None:
            groups.setdefault((ex[0], ex[2]), {})[ex[1]] = ab_shapes
    by_experts: dict[str, dict[str, dict[int, tuple]]] = {}
    for (experts, proj), per in groups.items():
        by_experts.setdefault(experts, {})[proj] = per
    out = []
    for experts in sorted(by_experts):
        projs_present = by_experts[experts]
        params = [p for p, projs in FUSED_EXPERT_PARAMS if any(q in projs_present for q in projs)]
        names = fused_peft_modules(experts, params)
        for param in params:
            projs = _PROJS[param]
            missing = [q for q in projs if q not in projs_present]
            if missing:
                raise FormatError(
                    f"{experts}: LoRA on {', '.join(q for q in projs if q in projs_present)} but not "
                    f"on {', '.join(missing)}: the fused {param} LoRA PEFT loads needs both",
                    path=path,
                    hint="write this adapter with --layout vllm (per-expert modules)",
                )
            n = {len(projs_present[q]) for q in projs}
            if len(n) != 1 or any(
                sorted(projs_present[q]) != list(range(len(projs_present[q]))) for q in projs
            ):
                raise FormatError(
                    f"{experts}: the expert LoRAs of {param} do not cover experts 0..E-1 alike", path=path
                )
            shapes = {(q, e): s for q in projs for e, s in projs_present[q].items()}
            ranks = {a[0] for a, _ in shapes.values()}
            ins = {a[1] for a, _ in shapes.values()}
            outs = [{b[0] for (q2, _e), (_a, b) in shapes.items() if q2 == q} for q in projs]
            if len(ranks) != 1 or len(ins) != 1 or any(len(o) != 1 for o in outs):
                raise FormatError(
                    f"{experts}.*.{{{','.join(projs)}}}: ranks, inputs or outputs differ across experts",
                    path=path,
                )
            r = ranks.pop()
            out.append(
                FusedParam(
                    experts,
                    param,
                    projs,
                    n.pop(),
                    r * len(projs),
                    r,
                    ins.pop(),
                    tuple(o.pop() for o in outs),
                    names[param],
                )
            )
    return out


def fused_config(fused: list[FusedParam], scale: float) -> dict:
    """The adapter_config.json fields that make PEFT (and vLLM) apply them at the training scale:
    `target_parameters` (`experts.gate_up_proj`: PEFT matches a parameter's name or dotted suffix),
    and `rank_pattern`/`alpha_pattern` for the parameters whose fused rank is not the config's `r`."""
    targets, rank_pattern, alpha_pattern = set(), {}, {}
    for f in fused:
        t = f"{module_suffix(f.experts)}.{f.param}"
        targets.add(t)
        if f.block:
            rank_pattern[t] = f.rank
            alpha_pattern[t] = lora_alpha_for_scale(scale, f.rank)
    return {
        "target_parameters": sorted(targets),
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
    }


def build_fused(
    f: FusedParam, ab: str, read_factor: Callable[[str, str], torch.Tensor | RawTensor]
) -> RawTensor:
    """The fused A [R*E, in] or B [out, R*E] of `f` from the per-expert factors (`read_factor(module, ab)`:
    torch
    tensors or `RawTensor`s), in the factors' dtype: placement only, no arithmetic (the values' bits are moved
    with numpy; the zero blocks are +0.0)."""
    import numpy as np  # lazy: the names and shapes above are the metadata side's

    E, R, r = f.num_experts, f.rank, f.part_rank
    out = None
    dtype = ""
    if ab == "A":
        for e in range(E):
            for j, proj in enumerate(f.projs):
                a = RawTensor.of(read_factor(expert_module(f.experts, e, proj), "A"))
                if out is None:
                    dtype = a.dtype
                    out = np.zeros((E, R, f.in_features), dtype=a.bits().dtype)
                out[e, j * r : (j + 1) * r] = a.bits()
                del a
        assert out is not None  # a fused LoRA has experts and projections
        return RawTensor.from_bits(dtype, out.reshape(R * E, f.in_features))
    row = 0
    for j, (proj, rows) in enumerate(zip(f.projs, f.out_rows)):
        for e in range(E):
            b = RawTensor.of(read_factor(expert_module(f.experts, e, proj), "B"))
            if out is None:
                dtype = b.dtype
                out = np.zeros((sum(f.out_rows), R, E), dtype=b.bits().dtype)
            out[row : row + rows, j * r : (j + 1) * r, e] = b.bits()
            del b
        row += rows
    assert out is not None  # a fused LoRA has experts and projections
    return RawTensor.from_bits(dtype, out.reshape(sum(f.out_rows), R * E))


def fused_params_of_config(target_parameters) -> set[str]:
    """The fused expert parameters a config's `target_parameters` names (by their last component)."""
    return {t.rsplit(".", 1)[-1] for t in target_parameters or ()} & set(_PROJS)


def parse_fused(
    module: str,
    a_shape,
    b_shape,
    params: set[str],
    rank_for: Callable[[str], int],
    partner_rank: Callable[[str, str], int | None],
    path,
    *,
    r: int | None = None,
) -> list[tuple[str, ExpertView]] | None:
    """The per-expert views of the saved PEFT module `module` (`...experts` or `...experts.base_layer`)
    when it is a fused expert LoRA; None when it is not one. `rank_for(param name)` is the config's rank;
    `partner_rank(experts, param)` the fused rank of another parameter of the same block (or None): a
    gate_up LoRA of twice down_proj's rank (without down_proj: twice the config's `r`) is our block form,
    else its A is shared."""
    experts = module
    while experts.endswith(".base_layer"):
        experts = experts[: -len(".base_layer")]
    if module_suffix(experts) != "experts" or not params:
        return None
    inv = {v: p for p, v in fused_peft_modules(experts, params).items()}
    param = inv.get(module)
    if param is None:
        return None
    projs = _PROJS[param]
    R = rank_for(fused_param_name(experts, param))
    if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] % R or b_shape[1] != a_shape[0]:
        raise FormatError(
            f"{module}: fused expert LoRA A {list(a_shape)} / B {list(b_shape)} is not [R*E, in] / "
            f"[out, R*E] with the config's rank R={R} for {param}",
            path=path,
        )
    E = a_shape[0] // R
    if b_shape[0] % len(projs):
        raise FormatError(
            f"{module}: {param} LoRA B has {b_shape[0]} rows, not {len(projs)} equal projections", path=path
        )
    other = partner_rank(experts, "down_proj") if param == "gate_up_proj" else None
    other = r if other is None and param == "gate_up_proj" else other
    block = len(projs) > 1 and other is not None and len(projs) * other == R
    r = R // len(projs) if block else R
    rows = b_shape[0] // len(projs)
    f = FusedParam(experts, param, projs, E, R, r, a_shape[1], (rows,) * len(projs), module)
    return [
        (expert_module(experts, e, proj), ExpertView(f, e, j))
        for e in range(E)
        for j, proj in enumerate(projs)
    ]


def read_view(v: ExpertView, ab: str, fused_tensor: torch.Tensor, *, key: str, path) -> torch.Tensor:
    """One projection's own A or B out of the fused tensor (a copy; in block form the other blocks of
    its B are checked to be exact zeros, else this is not the layout it claims)."""
    f, e, j = v.fused, v.expert, v.part
    E, R, r = f.num_experts, f.rank, f.part_rank
    cols = slice(j * r, (j + 1) * r) if f.block else slice(0, R)
    if ab == "A":
        return fused_tensor.reshape(E, R, f.in_features)[e, cols].clone()
    b3 = fused_tensor.reshape(sum(f.out_rows), R, E)
    start = sum(f.out_rows[:j])
    rows = slice(start, start + f.out_rows[j])
    if f.block:
        own = b3[:, cols, e]
        if own[:start].any() or own[rows.stop :].any():
            raise FormatError(
                f"expert {e}'s {f.projs[j]} columns of the fused {f.param} LoRA B are not zero outside "
                f"its rows: not the block form its rank_pattern ({R} = {len(f.projs)} x {r}) says",
                path=path,
                key=key,
            )
    return b3[rows, cols, e].clone()


# What each adapter layout (`PeftAdapter.layout`) is, which `--layout` writes it, and which consumer loads it,
# from the tests that load them (tests/test_moe_layouts.py, tests/test_vllm_cpu.py; docs/adapters.md).
LAYOUT_FACTS: dict[str, dict] = {
    "dense": {
        "written_by": ["peft", "vllm", "prime-rl"],
        "consumers": {
            "peft": "loads (PeftModel.from_pretrained; every module applied)",
            "vllm": "loads",
            "prime-rl": "loads",
        },
    },
    "peft": {
        "written_by": ["peft"],
        "consumers": {
            "peft": "loads with transformers 5 (target_parameters on the fused mlp.experts.gate_up_proj / "
            "down_proj; "
            "every expert delta applied exactly)",
            "vllm": "Qwen3-MoE (2-D MoE LoRA): refuses it unless the engine runs with "
            "enable_mixed_moe_lora_format=True "
            "and the LoRARequest sets is_3d_lora_weight=True, then loads it; vLLM's 3-D MoE models "
            "(is_3d_moe_weight) read this layout",
            "prime-rl": "its inference (vLLM) expects per-expert modules: use --layout prime-rl",
        },
    },
    "per-expert": {
        "written_by": ["vllm", "prime-rl"],
        "consumers": {
            "peft": "refuses with transformers 5 (`Target module Qwen3MoeExperts ... is not supported`): the "
            "experts "
            "are fused parameters there; use --layout peft",
            "vllm": "loads in stock vLLM's Qwen3-MoE (its 2-D per-expert MoE LoRA: experts.<e>.<proj>)",
            "prime-rl": "loads (prime-rl's own broadcast layout)",
        },
    },
}
