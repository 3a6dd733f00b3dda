"""The non-tensor state of a prime-rl trainer checkpoint, built from a few numbers (pure: no I/O).

A prime-rl checkpoint is `dcp.save({"app": AppState})` (see shared/docs/primerl-format.md §3) with
`AppState.state_dict() = {"model": ..., "optimizers": ..., "scheduler": ..., "progress": ...}`.
Everything here builds the parts that are not model weights, so that a checkpoint we write from
scratch (`ckpt adapter-to-dcp`) or patch (`ckpt rehydrate`, `ckpt restart-prep`) has exactly the
key set and values prime-rl's strict DCP loader expects:

- `optimizer_param_order(modules, slot)`: the LoRA param FQNs in prime-rl's optimizer order (per
  layer q, k, v, o, gate, up, down; A before B) -- the `params` list of param_groups.0;
- `adamw_param_group(lr, params, ...)`: param_groups.0 with prime-rl's AdamW defaults
  (`PRIMERL_ADAMW_DEFAULTS`) and the scheduler's `initial_lr`;
- `SchedulerSpec` + `scheduler_state(spec, lr, position)`: the scheduler's `state_dict()` exactly as
  prime-rl's `setup_scheduler` would have it after `position` steps;
- `progress_state(step)`: `dataclasses.asdict(Progress)`;
- `fresh_adamw_fields()`: what a fresh AdamW state is per param (zero moments, step 0);
- `flatten_state(obj, prefix)`: the (path, value) leaves DCP's planner makes of a nested state
  (`torch.distributed.checkpoint._traverse` rules), so keys and planner paths match a real save.

How the scheduler state is built: by running torch's own scheduler classes on a dummy AdamW over
one empty parameter (no tensors of any size, no files), configured as prime-rl's
`trainer/scheduler.py` configures them, and stepping it `position` times. That reproduces torch's
chainable-form arithmetic bit for bit (e.g. LinearLR ends its warmup at 0.0010000000000000002 for
lr 1e-3, not 1e-3), which a closed form would not.

Why a "fresh" AdamW is zero moments with `step` 0 rather than no state at all: DCP's
`get_state_dict` (called by prime-rl's `AppState` on load, too) first runs
`_init_optim_state`, which takes one zero-grad, zero-lr step so that every param HAS
`exp_avg`/`exp_avg_sq`/`step`. A strict load therefore requires those three keys for every LoRA
param. Stored as zeros with `step` 0.0, the first real step after resuming computes exactly what
a never-stepped AdamW computes (step becomes 1, bias corrections 1 - beta**1, moments lerp from 0).
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .keys import PROJ_W, layer_of, stacked_lora_key

__all__ = [
    "ADAMW_STATE_FIELDS",
    "PRIMERL_ADAMW_DEFAULTS",
    "PROGRESS_FIELDS",
    "PROJ_ORDER",
    "SCHEDULER_CLASSES",
    "SCHEDULER_TYPES",
    "OptimState",
    "SchedulerSpec",
    "adamw_param_group",
    "build_optim_state",
    "flat_key",
    "flatten_state",
    "fresh_adamw_fields",
    "lora_param_fqn",
    "lora_param_order",
    "optimizer_param_order",
    "progress_state",
    "scheduler_class",
]

# prime-rl's AdamW (trainer/optim.py: torch.optim.AdamW(params, lr, weight_decay, betas)) with torch
# defaults for the rest; the param_groups of the genuine fixture hold exactly these (format §3.3).
PRIMERL_ADAMW_DEFAULTS: dict = {
    "betas": (0.9, 0.999),
    "eps": 1e-08,
    "weight_decay": 0.01,
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": True,
}
ADAMW_STATE_FIELDS = ("exp_avg", "exp_avg_sq", "step")
# prime-rl applies LoRA module by module in model order; within a decoder layer that is
PROJ_ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# prime-rl's `[scheduler] type` values (its config), not torch classes: see SCHEDULER_CLASSES.
SCHEDULER_TYPES = ("constant", "linear", "cosine")
# The torch LR scheduler classes a checkpoint's scheduler state can be, each told by an attribute
# only it has (in this order: SequentialLR's state also holds its sub-schedulers').
SCHEDULER_CLASSES = (
    ("SequentialLR", "_milestones"),
    ("CosineAnnealingLR", "T_max"),
    ("LinearLR", "start_factor"),
    ("ConstantLR", "factor"),
    (
        "LambdaLR",
        "lr_lambdas",
    ),  # verl's and torchtitan's: lr = base_lr * lambda(step), lambda from the config
)
# prime-rl's Progress dataclass (trainer/runs.py), in asdict order.
PROGRESS_FIELDS = ("step", "total_tokens", "total_samples")


# ------------------------------------------------------------------------------------ optimizer
def _module_sort_key(module: str) -> tuple:
    layer = layer_of(module + ".")
    layer = -1 if layer is None else layer
    suffix = module.rsplit(".", 1)[-1]
    proj = PROJ_ORDER.index(suffix) if suffix in PROJ_ORDER else len(PROJ_ORDER)
    return (layer, proj, module)


def lora_param_fqn(module: str, ab: str, slot: int = 0) -> str:
    """Model-relative FQN of a LoRA param, as in optimizer state keys: `<module>.lora_A.<slot>`."""
    return f"{module}.lora_{ab}.{slot}"


def optimizer_param_order(modules: Iterable[str], slot: int = 0) -> list[str]:
    """LoRA param FQNs in prime-rl's optimizer order: by layer, then q, k, v, o, gate, up, down
    (other module names after those, by name), A before B."""
    out = []
    for m in sorted(set(modules), key=_module_sort_key):
        out += [lora_param_fqn(m, "A", slot), lora_param_fqn(m, "B", slot)]
    return out


def lora_param_order(dense: Iterable[str], stacks: Iterable[tuple[str, str]], slot: int = 0) -> list[str]:
    """prime-rl HEAD's `named_parameters` order of the LoRA params: by layer, the dense modules (q, k, v,
    o, gate, up, down; A before B: `optimizer_param_order`), then the layer's grouped experts' w1_A, w1_B,
    w2_A, w2_B, w3_A, w3_B (`stacks`: (experts module, HF projection) pairs)."""

    def layer(module: str) -> int:
        n = layer_of(module + ".")
        return -1 if n is None else n

    keyed: list[tuple[int, int, tuple, str]] = [
        (layer(fqn.rsplit(".lora_", 1)[0]), 0, (i,), fqn)
        for i, fqn in enumerate(optimizer_param_order(dense, slot))
    ]
    for experts, proj in stacks:
        for ab in "AB":
            fqn = stacked_lora_key(experts, proj, ab, slot).removeprefix("app.model.")
            keyed.append((layer(experts), 1, (PROJ_W[proj], ab), fqn))
    return [fqn for *_k, fqn in sorted(keyed, key=lambda t: t[:3])]  # t[2] compares within one kind only


def fresh_adamw_fields() -> dict[str, float]:
    """Per-param AdamW state of a fresh optimizer, as fill values: moments 0, step 0.0 (see the
    module docstring for why this equals "never stepped")."""
    return {"exp_avg": 0.0, "exp_avg_sq": 0.0, "step": 0.0}


def _check_hparams(h: dict) -> list[str]:
    problems = []
    b = h.get("betas")
    if not (
        isinstance(b, (tuple, list))
        and len(b) == 2
        and all(isinstance(x, (int, float)) for x in b)
        and all(0.0 <= float(x) < 1.0 for x in b)
    ):
        problems.append(f"betas {b!r} must be two numbers in [0, 1)")
    for name in ("eps", "weight_decay"):
        v = h.get(name)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            problems.append(f"{name} {v!r} must be a finite number >= 0")
    return problems


# ------------------------------------------------------------------------------------ scheduler
@dataclass(frozen=True)
class SchedulerSpec:
    """prime-rl's `[scheduler]` config: type constant | linear | cosine, with warmup_steps,
    decay_steps (linear), min_lr and the run's max_steps (needed by cosine and linear decay).
    Validated at construction with prime-rl's own rules (trainer/scheduler.py)."""

    kind: str = "constant"
    warmup_steps: int = 0
    decay_steps: int = 0
    max_steps: int | None = None
    min_lr: float = 0.0

    def __post_init__(self):
        p = self.problems()
        if p:
            raise ValueError("; ".join(p))

    def problems(self) -> list[str]:
        out = []
        if self.kind not in SCHEDULER_TYPES:
            return [f"scheduler {self.kind!r} is not one of {', '.join(SCHEDULER_TYPES)}"]
        if self.warmup_steps < 0 or self.decay_steps < 0:
            out.append("warmup and decay steps must be >= 0")
        if self.min_lr < 0 or not math.isfinite(self.min_lr):
            out.append(f"min lr {self.min_lr} must be a finite number >= 0")
        if self.kind == "constant" and (self.warmup_steps or self.decay_steps):
            out.append(
                "the constant scheduler takes no warmup or decay steps (prime-rl's ConstantLR(factor=1.0))"
            )
        if self.kind == "linear":
            if not (self.warmup_steps > 0 or self.decay_steps > 0):
                out.append("a linear scheduler needs warmup steps or decay steps (prime-rl asserts this)")
            if self.decay_steps > 0:
                if self.max_steps is None:
                    out.append("linear decay needs max_steps (decay starts at max_steps - decay_steps)")
                elif self.max_steps - self.decay_steps < self.warmup_steps:
                    out.append(
                        f"max_steps - decay_steps = {self.max_steps - self.decay_steps} is before the end "
                        f"of the warmup ({self.warmup_steps} steps)"
                    )
        if self.kind == "cosine":
            if self.decay_steps:
                out.append("the cosine scheduler takes no decay steps (it decays until max_steps)")
            if self.max_steps is None:
                out.append("the cosine scheduler needs max_steps")
            elif self.max_steps - self.warmup_steps <= 0:
                out.append(f"max_steps {self.max_steps} must exceed the warmup steps {self.warmup_steps}")
        return out

    @property
    def decay_end(self) -> int:
        """max_steps, where the schedule decays to it (linear decay, cosine: validated at construction)."""
        if self.max_steps is None:
            raise ValueError(f"the {self.kind} scheduler has no max_steps")
        return self.max_steps

    def describe(self) -> str:
        if self.kind == "constant":
            return "ConstantLR(factor=1.0)"
        parts = []
        if self.warmup_steps:
            parts.append(f"LinearLR warmup {self.warmup_steps} steps")
        if self.kind == "linear" and self.decay_steps:
            parts.append(
                f"constant until step {self.decay_end - self.decay_steps}, linear decay "
                f"{self.decay_steps} steps to min lr {self.min_lr:g}"
            )
        if self.kind == "cosine":
            parts.append(f"cosine to {self.min_lr:g} at step {self.max_steps}")
        return (" then ".join(parts)) + (" (SequentialLR)" if len(parts) > 1 else "")


def scheduler_class(fields: set[str]) -> str:
    """The torch scheduler class whose `state_dict()` has these fields ("unknown"; "none" when empty)."""
    for name, attr in SCHEDULER_CLASSES:
        if attr in fields:
            return name
    return "unknown" if fields else "none"


def _build_scheduler(optimizer, spec: SchedulerSpec, lr: float):
    """prime-rl's trainer/scheduler.py `_setup_scheduler`, for one optimizer."""
    # lazy, as in build_optim_state: the facts of this module import without torch
    from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, LinearLR, LRScheduler, SequentialLR

    if spec.kind == "constant":
        return ConstantLR(optimizer, factor=1.0)
    min_lr_factor = spec.min_lr / lr if spec.min_lr > 0 else 1e-8
    schedulers: list[LRScheduler] = []
    milestones: list[int] = []
    if spec.warmup_steps > 0:
        schedulers.append(
            LinearLR(optimizer, start_factor=min_lr_factor, end_factor=1.0, total_iters=spec.warmup_steps)
        )
        milestones.append(spec.warmup_steps)
    if spec.kind == "linear":
        if spec.decay_steps > 0:
            decay_start = spec.decay_end - spec.decay_steps
            schedulers.append(
                LinearLR(
                    optimizer, start_factor=1.0, end_factor=1.0, total_iters=decay_start - spec.warmup_steps
                )
            )
            schedulers.append(
                LinearLR(
                    optimizer, start_factor=1.0, end_factor=min_lr_factor, total_iters=spec.decay_steps - 1
                )
            )
            milestones.append(decay_start)
    else:  # cosine
        schedulers.append(
            CosineAnnealingLR(optimizer, T_max=spec.decay_end - spec.warmup_steps, eta_min=spec.min_lr)
        )
    if len(schedulers) == 1:
        return schedulers[0]
    return SequentialLR(optimizer, schedulers, milestones=milestones)


@dataclass(frozen=True)
class OptimState:
    """param_groups.0 and the scheduler state after `position` scheduler steps, plus the lr the
    next optimizer steps will use (for plans and tests)."""

    param_group: dict  # without "params"
    scheduler: dict
    lr_now: float
    lr_next: tuple[float, ...]


def build_optim_state(
    lr: float, spec: SchedulerSpec, position: int, *, hparams: Mapping | None = None, preview_steps: int = 5
) -> OptimState:
    """param_groups.0 (minus `params`) and `scheduler.state_dict()` of prime-rl's AdamW + scheduler
    configured with base lr `lr`, after `position` steps of the schedule. `hparams` overrides
    PRIMERL_ADAMW_DEFAULTS (betas, eps, weight_decay, ...). Raises ValueError on bad input."""
    # lazy: building the state runs torch's own optimizer and scheduler classes; every name and fact
    # above (keys, defaults, SchedulerSpec) is used by commands that never need torch
    import torch

    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr {lr!r} must be a positive finite number")
    if position < 0:
        raise ValueError(f"scheduler position {position} must be >= 0")
    h = dict(PRIMERL_ADAMW_DEFAULTS)
    h.update(hparams or {})
    unknown = sorted(set(h) - set(PRIMERL_ADAMW_DEFAULTS))
    problems = _check_hparams(h) + ([f"unknown AdamW options {unknown}"] if unknown else [])
    if problems:
        raise ValueError("; ".join(problems))
    h["betas"] = tuple(float(b) for b in h["betas"])
    param = torch.nn.Parameter(torch.zeros(0))
    accepted = set(inspect.signature(torch.optim.AdamW.__init__).parameters)
    opt = torch.optim.AdamW([param], lr=float(lr), **{k: v for k, v in h.items() if k in accepted})
    # fields AdamW fixes itself (decoupled_weight_decay is always True for AdamW) go in as stored
    opt.param_groups[0].update({k: v for k, v in h.items() if k not in accepted})
    with warnings.catch_warnings():
        # stepping a scheduler without optimizer steps warns; we only want its state
        warnings.simplefilter("ignore")
        sched = _build_scheduler(opt, spec, float(lr))
        for _ in range(position):
            sched.step()
        group = {k: v for k, v in opt.state_dict()["param_groups"][0].items() if k != "params"}
        state = sched.state_dict()
        lr_now = float(opt.param_groups[0]["lr"])
        nxt = []
        for _ in range(preview_steps):
            sched.step()
            nxt.append(float(opt.param_groups[0]["lr"]))
    return OptimState(group, state, lr_now, tuple(nxt))


def adamw_param_group(group_without_params: Mapping, params: list[str]) -> dict:
    g = dict(group_without_params)
    g["params"] = list(params)
    return g


def progress_state(step: int, total_tokens: int = 0, total_samples: int = 0) -> dict:
    """`dataclasses.asdict(prime_rl.trainer.runs.Progress)`."""
    if step < 0:
        raise ValueError(f"step {step} must be >= 0")
    return {"step": int(step), "total_tokens": int(total_tokens), "total_samples": int(total_samples)}


# ------------------------------------------------------------------------------------ flattening
def _is_terminal(value, is_tensor) -> bool:
    if isinstance(value, Mapping):
        return False
    if not isinstance(value, list):
        return True
    for entry in value:
        if isinstance(entry, (Mapping, list)) and not _is_terminal(entry, is_tensor):
            return False
        if is_tensor(entry):
            return False
    return True


def flatten_state(obj, prefix: tuple = ()) -> list[tuple[tuple, object]]:
    """The leaves DCP's DefaultSavePlanner makes of `obj` under `prefix`, as (planner path, value),
    by `torch.distributed.checkpoint._traverse.traverse_state_dict`'s rules: mappings are
    descended (keys become str), a list only when it holds a tensor, a mapping or such a list
    (then by int index), tuples and everything else are leaves. The flat key of a leaf is
    `".".join(map(str, path))`."""

    def is_tensor(v):
        return type(v).__name__ in ("Tensor", "Parameter", "DTensor") and hasattr(v, "dtype")

    out: list[tuple[tuple, object]] = []

    def walk(path, value):
        if isinstance(value, Mapping):
            for k, v in value.items():
                walk(path + (str(k),), v)
        elif _is_terminal(value, is_tensor):
            out.append((path, value))
        else:
            for i, v in enumerate(value):
                walk(path + (i,), v)

    walk(tuple(prefix), obj)
    return out


def flat_key(path: tuple) -> str:
    return ".".join(map(str, path))
