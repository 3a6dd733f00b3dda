"""The prime-rl key model: what every DCP key is, from its planner_data path alone (pure, no I/O).

prime-rl saves `{"app": AppState}` whose state dict is
`{"model": ..., "optimizers": ..., "scheduler": ..., "progress": ...}`. Model FQNs contain dots and
are ONE path element, so keys are classified from `planner_data` paths, never by splitting the flat
key on dots. The rules are a table; a key no rule claims goes to the "other" group, visibly.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "GROUPS", "FROZEN_GROUPS", "LORA_FQN", "OPTIM_FIELDS", "PROGRESS_STEP_KEY", "KeyInfo", "RULES", "classify",
    "lora_key", "lora_path", "base_key", "base_path", "optimizer_state_key", "optimizer_state_path",
    "module_suffix", "trainable_params", "GroupStats", "LoraStats", "summarize_groups", "summarize_lora", "world_size_from_chunks",
]

GROUPS = ("base", "lora", "optimizer_state", "param_groups", "scheduler", "progress", "other")
# The frozen group: fp32 master copies of the base weights, recoverable from the public base model.
FROZEN_GROUPS = frozenset({"base"})

LORA_FQN = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.(?P<slot>\d+)$")
OPTIM_FIELDS = ("exp_avg", "exp_avg_sq", "step")


@dataclass(frozen=True)
class KeyInfo:
    key: str
    group: str
    hf_name: str | None = None      # base: HF parameter name
    module: str | None = None       # lora: module FQN (HF naming), e.g. model.layers.0.mlp.up_proj
    ab: str | None = None           # lora: "A" or "B"
    slot: int | None = None         # lora: adapter slot (`lora_A.<slot>`)
    param: str | None = None        # optimizer_state: param FQN (no app.model. prefix)
    field: str | None = None        # optimizer_state/param_groups/scheduler/progress field name
    group_index: int | None = None  # param_groups: group i
    sub_scheduler: int | None = None  # scheduler: SequentialLR `_schedulers.<j>`


def _model(key: str, path: tuple) -> KeyInfo | None:
    if len(path) != 3 or not isinstance(path[2], str):
        return None
    m = LORA_FQN.match(path[2])
    if m:
        return KeyInfo(key, "lora", module=m["module"], ab=m["ab"], slot=int(m["slot"]))
    return KeyInfo(key, "base", hf_name=path[2])


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


def module_suffix(module: str) -> str:
    """`model.layers.0.self_attn.q_proj` -> `q_proj` (PEFT's target_modules are such suffixes)."""
    return module.rsplit(".", 1)[-1]


def trainable_params(paths: dict[str, tuple]) -> set[str]:
    """Param FQNs that have optimizer state ({key: planner path} of a checkpoint): trained, never frozen,
    never recoverable from the base."""
    return {i.param for i in (classify(k, p) for k, p in paths.items()) if i.group == "optimizer_state"}


# ---------------------------------------------------------------------------- summary (pure)
@dataclass(frozen=True)
class GroupStats:
    count: int
    bytes: int          # bytes stored on disk (item lengths)
    tensor_bytes: int   # payload bytes of tensors


@dataclass(frozen=True)
class LoraStats:
    modules: int
    rank: int | None                  # the rank when uniform; None when it varies
    ranks: dict                       # module -> rank (slot 0, or the first slot)
    targets: tuple[str, ...]
    slots: tuple[int, ...]
    bytes: int


def summarize_groups(infos: list[KeyInfo], stored: dict[str, int], payload: dict[str, int]) -> dict[str, GroupStats]:
    out = {}
    for g in GROUPS:
        keys = [i.key for i in infos if i.group == g]
        out[g] = GroupStats(len(keys), sum(stored[k] for k in keys), sum(payload.get(k, 0) for k in keys))
    return out


def summarize_lora(infos: list[KeyInfo], shapes: dict[str, tuple], payload: dict[str, int]) -> LoraStats:
    lora = [i for i in infos if i.group == "lora"]
    slots = sorted({i.slot for i in lora})
    ranks: dict[str, int] = {}
    for i in sorted(lora, key=lambda i: (i.slot, i.key)):
        if i.ab == "A" and i.module not in ranks:
            ranks[i.module] = shapes[i.key][0]  # lora_A is [r, in]
    uniq = set(ranks.values())
    return LoraStats(
        modules=len({i.module for i in lora}),
        rank=uniq.pop() if len(uniq) == 1 else None,
        ranks=ranks,
        targets=tuple(sorted({module_suffix(i.module) for i in lora})),
        slots=tuple(slots),
        bytes=sum(payload.get(i.key, 0) for i in lora),
    )


def world_size_from_chunks(chunk_counts: list[int]) -> int | None:
    """FSDP2 writes one chunk per rank for every sharded tensor (empty trailing chunks may be
    deduplicated), so the largest chunk count is the world size."""
    return max(chunk_counts) if chunk_counts else None
