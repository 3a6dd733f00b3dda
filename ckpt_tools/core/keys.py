"""The prime-rl key model: what every DCP key is, from its planner_data path alone (pure, no I/O).

prime-rl saves `{"app": AppState}` whose state dict is
`{"model": ..., "optimizers": ..., "scheduler": ..., "progress": ...}`. Model FQNs contain dots and
are ONE path element, so keys are classified from `planner_data` paths, never by splitting the flat
key on dots. The rules are a table; a key no rule claims goes to the "other" group, which every
command but `inspect` refuses (`require_known`). Model keys are a second table (`MODEL_RULES`), the
same for both prime-rl generations: dense LoRA, HEAD's grouped-expert LoRA (stacked [E, r, in]),
prime-format stacked expert weights and the MoE router, HF-named weights. A stacked tensor's experts
are named by HF's per-expert names (`expert_hf_name`), so every op sees one naming.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from .errors import FormatError

__all__ = [
    "DEFAULT_LAYOUT",
    "EXPERT_PROJ",
    "EXPERT_WILDCARD",
    "FROZEN_GROUPS",
    "FUSED_EXPERT_PARAMS",
    "FUSED_PARAM_OF",
    "GROUPS",
    "HF_DECODER_LAYER",
    "LAYER_NUMBER",
    "LAYOUTS",
    "LORA_FQN",
    "MODEL_RULES",
    "OPTIM_FIELDS",
    "PEFT_LORA_KEY",
    "PROGRESS_STEP_KEY",
    "PROJ_W",
    "RULES",
    "STEP_DIR",
    "GroupStats",
    "KeyInfo",
    "LoraStats",
    "ModelRule",
    "base_key",
    "base_path",
    "classify",
    "expert_hf_name",
    "expert_index_clashes",
    "expert_module",
    "expert_module_pattern",
    "expert_names",
    "expert_parts",
    "fused_param_name",
    "fused_peft_modules",
    "is_stacked_pattern",
    "layer_of",
    "lora_key",
    "lora_path",
    "module_suffix",
    "optimizer_state_key",
    "optimizer_state_path",
    "peft_target",
    "require_known",
    "router_prime_name",
    "stacked_base_key",
    "stacked_hf_pattern",
    "stacked_lora_key",
    "stacked_lora_path",
    "step_of",
    "summarize_groups",
    "summarize_lora",
    "trainable_params",
    "unknown_keys",
    "world_size_from_chunks",
]

GROUPS = ("base", "lora", "optimizer_state", "param_groups", "scheduler", "progress", "other")
# The frozen group: fp32 master copies of the base weights, recoverable from the public base model.
FROZEN_GROUPS = frozenset({"base"})

LORA_FQN = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.(?P<slot>\d+)$")
# A LoRA factor's key in an adapter file, every spelling PEFT and prime-rl's exports write: the optional
# PEFT prefix, the module, A/B, prime-rl's optional adapter slot, `.weight` (PEFT's own: prefix, no slot).
PEFT_LORA_KEY = re.compile(
    r"^(?P<prefix>base_model\.model\.)?(?P<module>.+?)\.lora_(?P<ab>[AB])(?:\.(?P<slot>\d+))?\.weight$"
)
# A decoder layer's number in a module or tensor name (`model.layers.3.mlp...`, `layers.3.`), and in an HF
# model's own tensor names, where the decoder's layers are `model.layers.N.` (a vision tower's are not).
LAYER_NUMBER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
HF_DECODER_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# A prime-rl step directory's name (`checkpoints/step_N`, `weights/step_N`, `broadcasts/step_N`): fullmatch.
STEP_DIR = re.compile(r"step_(\d+)")
OPTIM_FIELDS = ("exp_avg", "exp_avg_sq", "step")

# prime-rl's grouped experts (HEAD, `MultiLoRAGroupedExperts` over torchtitan's `GroupedExperts`): one
# stacked tensor per projection, dim 0 the expert index. w1 = gate, w3 = up ([E, inter, hidden]),
# w2 = down ([E, hidden, inter]); each per-expert slice is exactly the HF `nn.Linear` weight.
EXPERT_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


@dataclass(frozen=True)
class KeyInfo:
    key: str
    group: str
    hf_name: str | None = None  # base: HF parameter name (None for stacked experts: see expert_hf_name)
    module: str | None = None  # lora: module FQN (HF naming), e.g. model.layers.0.mlp.up_proj;
    #                                 stacked expert LoRA: the experts module, e.g. model.layers.0.mlp.experts
    ab: str | None = None  # lora: "A" or "B"
    slot: int | None = None  # lora: adapter slot (`lora_A.<slot>`)
    param: str | None = None  # optimizer_state: param FQN (no app.model. prefix)
    field: str | None = None  # optimizer_state/param_groups/scheduler/progress field name
    group_index: int | None = None  # param_groups: group i
    sub_scheduler: int | None = None  # scheduler: SequentialLR `_schedulers.<j>`
    expert_proj: str | None = (
        None  # stacked experts (base or LoRA): the HF projection, gate_proj/up_proj/down_proj
    )

    @property
    def stacked(self) -> bool:
        """A prime-format grouped-expert tensor: dim 0 is the expert index."""
        return self.expert_proj is not None


def expert_module(experts: str, expert: int | str, proj: str) -> str:
    """`model.layers.0.mlp.experts`, 3, `gate_proj` -> `model.layers.0.mlp.experts.3.gate_proj` (HF names)."""
    return f"{experts}.{expert}.{proj}"


def expert_hf_name(info: KeyInfo, expert: int | str) -> str:
    """The HF per-expert weight name of expert `expert` of a stacked base tensor."""
    if info.module is None or info.expert_proj is None:
        raise ValueError(f"{info.key} is not a stacked expert tensor")
    return expert_module(info.module, expert, info.expert_proj) + ".weight"


EXPERT_WILDCARD = "*"


def stacked_hf_pattern(info: KeyInfo) -> str:
    """The HF names of a stacked base tensor's experts as one pattern, `...mlp.experts.*.gate_proj.weight`:
    what a slim manifest records, so that rehydrate stacks the base's per-expert weights back."""
    return expert_hf_name(info, EXPERT_WILDCARD)


def expert_module_pattern(experts: str, proj: str) -> str:
    """The module pattern of a stack's experts, `...mlp.experts.*.gate_proj` (see `expert_names`)."""
    return expert_module(experts, EXPERT_WILDCARD, proj)


def expert_names(pattern: str, start: int, count: int) -> list[str]:
    """Experts [start, start + count) of a `stacked_hf_pattern` (the rows of the stacked tensor)."""
    return [pattern.replace(f".{EXPERT_WILDCARD}.", f".{e}.", 1) for e in range(start, start + count)]


def is_stacked_pattern(name: str) -> bool:
    return f".{EXPERT_WILDCARD}." in name


@dataclass(frozen=True)
class ModelRule:
    """One shape of `app.model.<fqn>` key: a regex over the FQN and what a match means."""

    name: str  # what the rule recognises, for docs and errors
    group: str
    pattern: re.Pattern
    hf_name: str | None = None  # base: format string over the match groups -> the HF name


# The model keys of both prime-rl generations (16e747c: dense only; HEAD: + grouped experts and the
# prime-format router). The first rule that matches wins; an FQN no rule matches is "other", which every
# command refuses (`unknown_keys`).
MODEL_RULES: tuple[ModelRule, ...] = (
    ModelRule(
        "grouped-expert LoRA factor [E, r, in] / [E, out, r]",
        "lora",
        re.compile(r"^(?P<module>.+\.mlp\.experts)\.(?P<w>w[123])_lora_(?P<ab>[AB])\.(?P<slot>\d+)$"),
    ),
    ModelRule("dense LoRA factor [r, in] / [out, r]", "lora", LORA_FQN),
    ModelRule(
        "prime-format stacked expert weight [E, out, in]",
        "base",
        re.compile(r"^(?P<module>.+\.mlp\.experts)\.(?P<w>w[123])$"),
    ),
    ModelRule(
        "prime-format MoE router weight",
        "base",
        re.compile(r"^(?P<prefix>.+\.mlp)\.router\.gate\.weight$"),
        hf_name="{prefix}.gate.weight",
    ),
    ModelRule(
        "HF-named weight or bias", "base", re.compile(r"^(?P<name>(.+\.)?(weight|bias))$"), hf_name="{name}"
    ),
)


def _model(key: str, path: tuple) -> KeyInfo | None:
    if len(path) != 3 or not isinstance(path[2], str):
        return None
    for rule in MODEL_RULES:
        m = rule.pattern.match(path[2])
        if m is None:
            continue
        g = m.groupdict()
        proj = EXPERT_PROJ[g["w"]] if "w" in g else None
        if rule.group == "lora":
            return KeyInfo(key, "lora", module=g["module"], ab=g["ab"], slot=int(g["slot"]), expert_proj=proj)
        if proj is not None:
            return KeyInfo(key, "base", module=g["module"], expert_proj=proj)
        assert rule.hf_name is not None  # every base rule without experts names its HF weight
        return KeyInfo(key, "base", hf_name=rule.hf_name.format(**g))
    return None


def _optim_state(key: str, path: tuple) -> KeyInfo | None:
    if len(path) != 5 or not isinstance(path[3], str) or not isinstance(path[4], str):
        return None
    return KeyInfo(key, "optimizer_state", param=path[3], field=path[4])


def _param_groups(key: str, path: tuple) -> KeyInfo | None:
    if len(path) != 5 or not isinstance(path[4], str):
        return None
    try:
        gi = int(path[3])
    except (TypeError, ValueError):
        return None
    return KeyInfo(key, "param_groups", group_index=gi, field=path[4])


def _scheduler(key: str, path: tuple) -> KeyInfo | None:
    rest = path[2:]
    if len(rest) == 1 and isinstance(rest[0], str):
        return KeyInfo(key, "scheduler", field=rest[0])
    if len(rest) == 3 and rest[0] == "_schedulers" and isinstance(rest[2], str):
        try:
            return KeyInfo(key, "scheduler", sub_scheduler=int(rest[1]), field=rest[2])
        except (TypeError, ValueError):
            return None
    return None


def _progress(key: str, path: tuple) -> KeyInfo | None:
    if len(path) != 3 or not isinstance(path[2], str):
        return None
    return KeyInfo(key, "progress", field=path[2])


# (path prefix, parser). The first rule whose prefix matches and whose parser accepts wins.
RULES: tuple[tuple[tuple, Callable[[str, tuple], KeyInfo | None]], ...] = (
    (("app", "model"), _model),
    (("app", "optimizers", "state"), _optim_state),
    (("app", "optimizers", "param_groups"), _param_groups),
    (("app", "scheduler"), _scheduler),
    (("app", "progress"), _progress),
)


def classify(key: str, path: tuple) -> KeyInfo:
    path = tuple(path)
    for prefix, parse in RULES:
        if path[: len(prefix)] == prefix:
            info = parse(key, path)
            if info is not None:
                return info
    return KeyInfo(key, "other")


def lora_key(module: str, ab: str, slot: int) -> str:
    """Flat DCP key of a LoRA param (the inverse of classify for the lora group)."""
    return f"app.model.{module}.lora_{ab}.{slot}"


def lora_path(module: str, ab: str, slot: int) -> tuple:
    return ("app", "model", f"{module}.lora_{ab}.{slot}")


PROJ_W = {proj: w for w, proj in EXPERT_PROJ.items()}


def stacked_lora_key(experts: str, proj: str, ab: str, slot: int) -> str:
    """Flat DCP key of a grouped-expert LoRA factor: `app.model.<experts>.w1_lora_A.<slot>` for gate_proj."""
    return f"app.model.{experts}.{PROJ_W[proj]}_lora_{ab}.{slot}"


def stacked_lora_path(experts: str, proj: str, ab: str, slot: int) -> tuple:
    return ("app", "model", f"{experts}.{PROJ_W[proj]}_lora_{ab}.{slot}")


def stacked_base_key(experts: str, proj: str) -> str:
    """Flat DCP key of a prime-format stacked expert weight: `app.model.<experts>.w1` for gate_proj."""
    return f"app.model.{experts}.{PROJ_W[proj]}"


def unknown_keys(infos) -> list[str]:
    """Keys no rule of the key model recognises (sorted): every command refuses a checkpoint with any."""
    return sorted(i.key for i in infos if i.group == "other")


def require_known(infos, metadata_path) -> None:
    """Refuse a checkpoint holding keys the key model does not recognise (never silently dropped)."""
    unknown = unknown_keys(infos)
    if unknown:
        shown = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise FormatError(
            f"{len(unknown)} key(s) match no rule of the prime-rl key model: {shown}",
            path=metadata_path,
            hint="this layout is not supported yet; `ckpt inspect --keys` lists them: please report "
            "it with that listing",
        )


def base_key(hf_name: str) -> str:
    return f"app.model.{hf_name}"


def base_path(hf_name: str) -> tuple:
    return ("app", "model", hf_name)


def optimizer_state_key(param_fqn: str, field: str) -> str:
    """Flat DCP key of one AdamW state field of a param: `app.optimizers.state.<fqn>.<field>`."""
    return f"app.optimizers.state.{param_fqn}.{field}"


def optimizer_state_path(param_fqn: str, field: str) -> tuple:
    return ("app", "optimizers", "state", param_fqn, field)


PROGRESS_STEP_KEY = "app.progress.step"


def step_of(name: str) -> int | None:
    """N for a directory named `step_N` (`STEP_DIR`), else None."""
    m = STEP_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def layer_of(name: str) -> int | None:
    """The decoder layer a module or tensor name is in (`LAYER_NUMBER`), None outside the layers."""
    m = LAYER_NUMBER.search(name)
    return int(m.group(1)) if m else None


def module_suffix(module: str) -> str:
    """`model.layers.0.self_attn.q_proj` -> `q_proj` (PEFT's target_modules are such suffixes)."""
    return module.rsplit(".", 1)[-1]


def peft_target(module: str) -> str:
    """The PEFT `target_modules` entry that selects `module`, as prime-rl's broadcasts write it: the
    suffix (`q_proj`), and `experts` for every per-expert projection (`...mlp.experts.3.gate_proj`)."""
    return "experts" if _is_expert_module(module) else module_suffix(module)


def trainable_params(paths: dict[str, tuple]) -> set[str]:
    """Param FQNs that have optimizer state ({key: planner path} of a checkpoint): trained, never frozen,
    never recoverable from the base."""
    infos = (classify(k, p) for k, p in paths.items())
    return {i.param for i in infos if i.group == "optimizer_state" and i.param is not None}


# ---------------------------------------------------------------------------- summary (pure)
@dataclass(frozen=True)
class GroupStats:
    count: int
    bytes: int  # bytes stored on disk (item lengths)
    tensor_bytes: int  # payload bytes of tensors


@dataclass(frozen=True)
class LoraStats:
    modules: int
    rank: int | None  # the rank when uniform; None when it varies
    ranks: dict  # module -> rank (slot 0, or the first slot)
    targets: tuple[str, ...]
    slots: tuple[int, ...]
    bytes: int
    expert_modules: int = 0  # of `modules`: per-expert modules of grouped-expert LoRA


def summarize_groups(
    infos: list[KeyInfo], stored: dict[str, int], payload: dict[str, int]
) -> dict[str, GroupStats]:
    out = {}
    for g in GROUPS:
        keys = [i.key for i in infos if i.group == g]
        out[g] = GroupStats(len(keys), sum(stored[k] for k in keys), sum(payload.get(k, 0) for k in keys))
    return out


def summarize_lora(infos: list[KeyInfo], shapes: dict[str, tuple], payload: dict[str, int]) -> LoraStats:
    """Per-module LoRA facts; a stacked grouped-expert factor [E, r, in] counts as E expert modules
    (`<experts>.<e>.<proj>`), each of rank r, and its PEFT target is `experts`."""
    # (classify gives every LoRA key its module and slot)
    lora = [
        (i, i.module, i.slot)
        for i in infos
        if i.group == "lora" and i.module is not None and i.slot is not None
    ]
    slots = sorted({slot for _i, _m, slot in lora})
    ranks: dict[str, int] = {}
    modules: set[str] = set()
    for i, module, _slot in sorted(lora, key=lambda t: (t[2], t[0].key)):
        if i.expert_proj is not None:  # stacked
            shape = shapes[i.key]
            names = [expert_module(module, e, i.expert_proj) for e in range(shape[0])] if shape else []
            modules.update(names)
            if i.ab == "A":
                for n in names:
                    ranks.setdefault(n, shape[1])  # [E, r, in]
            continue
        modules.add(module)
        if i.ab == "A" and module not in ranks:
            ranks[module] = shapes[i.key][0]  # lora_A is [r, in]
    uniq = set(ranks.values())
    return LoraStats(
        modules=len(modules),
        rank=uniq.pop() if len(uniq) == 1 else None,
        ranks=ranks,
        targets=tuple(sorted({peft_target(m) for m in modules})),
        slots=tuple(slots),
        bytes=sum(payload.get(i.key, 0) for i, _m, _s in lora),
        expert_modules=sum(1 for m in modules if _is_expert_module(m)),
    )


def _is_expert_module(module: str) -> bool:
    return expert_parts(module) is not None


def expert_parts(module: str) -> tuple[str, int, str] | None:
    """`model.layers.0.mlp.experts.3.gate_proj` -> (`model.layers.0.mlp.experts`, 3, `gate_proj`): an HF
    per-expert projection of a grouped-experts module; None for anything else."""
    parts = module.rsplit(".", 3)
    if len(parts) == 4 and parts[1] == "experts" and parts[2].isdigit() and parts[3] in PROJ_W:
        return f"{parts[0]}.experts", int(parts[2]), parts[3]
    return None


def expert_index_clashes(modules) -> list[tuple[str, str, int]]:
    """Pairs of module names that `expert_parts` reads as one expert of one projection, spelled two ways
    (`experts.3.gate_proj` and `experts.03.gate_proj`), with the expert they both name: which one is expert 3
    is ambiguous."""
    seen: dict[tuple[str, int, str], str] = {}
    out = []
    for m in sorted(modules):
        parts = expert_parts(m)
        if parts is None:
            continue
        if parts in seen:
            out.append((seen[parts], m, parts[1]))
        else:
            seen[parts] = m
    return out


def router_prime_name(hf_name: str) -> str | None:
    """HF `...mlp.gate.weight` (a Qwen3-MoE router) -> prime-rl's `...mlp.router.gate.weight`."""
    return (
        hf_name[: -len(".gate.weight")] + ".router.gate.weight"
        if hf_name.endswith(".mlp.gate.weight")
        else None
    )


def world_size_from_chunks(chunk_counts: list[int]) -> int | None:
    """FSDP2 writes one chunk per rank for every sharded tensor (empty trailing chunks may be
    deduplicated), so the largest chunk count is the world size."""
    return max(chunk_counts) if chunk_counts else None


# ---------------------------------------------------------------------------- adapter layouts (pure)
# The layouts `extract-adapter --layout` writes (docs/adapters.md says which consumer loads which). For a
# dense LoRA they are one and the same file; they differ only in how grouped-expert LoRA is written:
#   peft     -- transformers 5 fuses a Qwen3-MoE block's experts into 3-D parameters; PEFT reaches them
#               through `target_parameters` (one LoRA per fused parameter, experts folded into the rank)
#   vllm     -- what stock vLLM's Qwen3-MoE LoRA loader reads (its model is not `is_3d_moe_weight`): the
#               2-D per-expert modules `...mlp.experts.<e>.<proj>`
#   prime-rl -- prime-rl's own broadcast layout: the same per-expert modules
LAYOUTS = ("peft", "vllm", "prime-rl")
DEFAULT_LAYOUT = "peft"

# transformers 5's fused expert parameters of a Qwen3-MoE block, in their nn.Parameter order (the order
# PEFT wraps them in: see `fused_peft_modules`), and the HF per-expert projections each one stacks along
# its output rows: `gate_up_proj` [E, 2I, H] is gate rows [0, I) then up rows [I, 2I); `down_proj` [E, H, I].
FUSED_EXPERT_PARAMS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("gate_up_proj", ("gate_proj", "up_proj")),
    ("down_proj", ("down_proj",)),
)
FUSED_PARAM_OF = {proj: param for param, projs in FUSED_EXPERT_PARAMS for proj in projs}


def fused_param_name(experts: str, param: str) -> str:
    """`model.layers.0.mlp.experts`, `gate_up_proj` -> `model.layers.0.mlp.experts.gate_up_proj`."""
    return f"{experts}.{param}"


def fused_peft_modules(experts: str, params) -> dict[str, str]:
    """The PEFT module name each targeted fused parameter's LoRA is saved under. PEFT wraps the experts
    module once per parameter, in nn.Parameter order, each wrapper around the previous one: the last one
    wrapped is `experts` itself, the one before it `experts.base_layer`, and so on (with both:
    gate_up_proj -> `experts.base_layer`, down_proj -> `experts`, as vLLM's loader reads them too)."""
    ordered = [p for p, _ in FUSED_EXPERT_PARAMS if p in set(params)]
    n = len(ordered)
    return {p: experts + ".base_layer" * (n - 1 - i) for i, p in enumerate(ordered)}
