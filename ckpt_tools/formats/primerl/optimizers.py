"""Which optimizer a prime-rl checkpoint's optimizer items say, which parameters it trained, and what it
holds (docs/reference/primerl-head-format.md, "since August 2026").

- AdamW (both generations): per-parameter state `exp_avg`, `exp_avg_sq`, `step`; its param group holds
  `betas`, `eps`, `fused` ... (`fused` None at 16e747c, False inside HEAD's default CPUOffloadOptimizer,
  True without it since #3305).
- SignSGD (#3303): **no per-parameter state at all**; its param group holds `lr`, `weight_decay`,
  `initial_lr` and `params` only. Its checkpoint has no moments to keep, carry or report.
- Full CPU offload (`model.full_offload`, AdamW or SignSGD): each parameter's FP32 master is optimizer state
  `prime_rl_master_weight` (source only: no fixture of that mode).

`trained_params(ckpt)`: the parameters the optimizer trained, from their state or, when there is no state
at all (a stateless optimizer), from its param groups' `params` (the FQNs it was given: every
`requires_grad` parameter at HEAD; a few KB read only then). Every op that must tell trained weights from
frozen ones asks this, not the state alone: a SignSGD full fine-tune has no state and all of it is trained.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from ...core.keys import KeyInfo, classify, trainable_params

__all__ = ["MASTER_WEIGHT_FIELD", "MOMENTS", "OptimizerFacts", "optimizer_facts", "trained_params"]

MOMENTS = ("exp_avg", "exp_avg_sq")
MASTER_WEIGHT_FIELD = "prime_rl_master_weight"  # full offload's FP32 master (trainer/optim/offload.py:1071)
_ADAMW_GROUP = {"betas", "eps", "amsgrad"}
_SGD_GROUP = {"momentum", "nesterov", "dampening"}
_SIGN_SGD_GROUP = {"lr", "weight_decay", "initial_lr", "params"}


class _Checkpoint(Protocol):
    entries: Any

    def read_object(self, key: str) -> Any: ...


@dataclass(frozen=True)
class OptimizerFacts:
    name: str  # "AdamW", "SignSGD", "SGD", "unknown"
    wrapper: str | None  # "CPUOffloadOptimizer" (HEAD's default: fused False), None
    state_fields: tuple[str, ...]  # per-parameter state fields present, sorted
    group_fields: tuple[str, ...]  # param group 0's fields

    @property
    def stateless(self) -> bool:
        return not self.state_fields

    @property
    def has_moments(self) -> bool:
        return any(f in self.state_fields for f in MOMENTS)

    @property
    def absent(self) -> str | None:
        """What an Adam-minded reader would look for and not find, or None."""
        if self.has_moments or not self.group_fields:
            return None
        why = (
            "SignSGD keeps no optimizer state (prime-rl #3303)"
            if self.name == "SignSGD"
            else f"{self.name} keeps no {'/'.join(MOMENTS)}"
        )
        return f"no optimizer moments (exp_avg/exp_avg_sq/step): {why}"

    def describe(self) -> str:
        inner = self.name + ("" if self.has_moments or not self.stateless else " (stateless: no moments)")
        return (
            f"{self.wrapper}({self.name}), state of the inner {self.name}"
            if self.wrapper and self.has_moments
            else (f"{self.wrapper}({inner})" if self.wrapper else inner)
        )


def optimizer_facts(infos: Iterable[KeyInfo], fused: object = None) -> OptimizerFacts:
    """The optimizer of a checkpoint from its keys (`core.keys.classify`); `fused`: param group 0's value."""
    infos = list(infos)
    group = {i.field for i in infos if i.group == "param_groups" and i.group_index == 0 and i.field}
    state = {i.field for i in infos if i.group == "optimizer_state" and i.field}
    if group & _ADAMW_GROUP or state & set(MOMENTS):
        name = "AdamW"
    elif group & _SGD_GROUP:
        name = "SGD"
    elif group and group <= _SIGN_SGD_GROUP:
        name = "SignSGD"
    else:
        name = "unknown"
    wrapper = "CPUOffloadOptimizer" if name == "AdamW" and fused is False else None
    return OptimizerFacts(name, wrapper, tuple(sorted(state)), tuple(sorted(group)))


def trained_params(ckpt: _Checkpoint) -> set[str]:
    """FQNs of the parameters the optimizer trained: those with per-parameter state, and those its param
    groups list (a stateless optimizer leaves no state; see the module doc)."""
    paths = {k: e.path for k, e in ckpt.entries.items()}
    out = trainable_params(paths)
    if out:  # an optimizer with state keeps it for every parameter it stepped: the list adds nothing
        return out
    for key, path in paths.items():
        info = classify(key, path)
        if info.group == "param_groups" and info.field == "params":
            listed = ckpt.read_object(key)
            if isinstance(listed, (list, tuple)):
                out |= {p for p in listed if isinstance(p, str)}
    return out
