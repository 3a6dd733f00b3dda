"""`ckpt set-lr` planned: every byte item that holds a learning rate, with its old and new value.

Which keys hold the lr (a table, never a substring match: `_get_lr_called_within_step` is a bool):
`param_groups.<i>.{lr, initial_lr}` and, for the scheduler and each of SequentialLR's
`_schedulers.<j>`, `{base_lrs, _last_lr, eta_min}`. torch's chainable schedulers compute the next
lr from the current one and from these absolute values, so scaling all of them by one factor
scales the whole remaining schedule (exactly, for a power-of-two factor). `--min-lr` retargets the
decay's end instead of scaling it (see `plan_set_lr`). Here, in sources/ (what ops share), because
`ckpt set-lr` writes this plan and `ckpt report` draws the schedule it gives
(`formats.dcp.lr_schedule.trace_schedule`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..core.errors import FormatError, UsageError
from ..formats.dcp.lr_schedule import (
    SchedState,
    apply_to_state,
    decays,
    describe,
    old_value,
    preview_schedule,
    read_sched_state,
    uniform,
)
from ..formats.dcp.reader import DcpCheckpoint

__all__ = [
    "LR_FIELDS",
    "MAX_LR",
    "Change",
    "SetLrPlan",
    "check_lr_value",
    "current_lr",
    "lr_factor",
    "plan_lr_state",
    "plan_set_lr",
    "scale_value",
    "scaled_lr_fields",
]

# (group, field) of every byte item that holds an absolute learning rate. Sub-schedulers of
# SequentialLR (`_schedulers.<j>.<field>`) are matched by the same scheduler fields.
LR_FIELDS: frozenset[tuple[str, str]] = frozenset(
    {
        ("param_groups", "lr"),
        ("param_groups", "initial_lr"),
        ("scheduler", "base_lrs"),
        ("scheduler", "_last_lr"),
        ("scheduler", "eta_min"),
    }
)
MAX_LR = 10.0  # an optimizer lr above this is a typo or a crafted value, not a schedule


def check_lr_value(v: Any, key: str) -> None:
    """Every learning-rate value written (a float or a list of them) is finite, >= 0 and <= MAX_LR."""
    vals = list(v) if isinstance(v, (list, tuple)) else [v]
    for x in vals:
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            continue
        if not (math.isfinite(x) and 0 <= x <= MAX_LR):
            raise UsageError(
                f"the new value {x!r} is not a learning rate (finite, in [0, {MAX_LR:g}])",
                key=key,
                hint="check --lr / --scale / --min-lr, and the checkpoint's current lr values",
            )


def scale_value(v: Any, factor: float, key: str, exact: tuple[float, float] | None = None) -> Any:
    """Scale a float, or a list/tuple of floats, keeping its type. `exact=(old, new)`: a value
    equal to `old` becomes exactly `new` (so `--lr X` shows X, not X*(1+1e-16))."""
    if isinstance(v, bool) or v is None:
        raise FormatError(f"expected a learning rate, found {type(v).__name__} {v!r}", key=key)
    if isinstance(v, torch.Tensor):
        raise FormatError(
            "the learning rate is stored as a tensor; set-lr patches Python floats only",
            key=key,
            hint="this optimizer was built with a tensor lr; patch it with your own script",
        )
    if isinstance(v, (list, tuple)):
        return type(v)(scale_value(x, factor, key, exact) for x in v)
    if isinstance(v, int):
        if v == 0:
            return v
        return float(v) * factor
    if isinstance(v, float):
        if exact is not None and v == exact[0]:
            return exact[1]
        return v * factor
    raise FormatError(f"expected a learning rate, found {type(v).__name__} {v!r}", key=key)


@dataclass(frozen=True)
class Change:
    key: str
    before: Any
    after: Any
    why: str = ""


@dataclass(frozen=True)
class SetLrPlan:
    source: str
    factor: float
    lr_before: float
    lr_after: float
    min_lr: float | None
    scheduler: str
    changes: tuple[Change, ...]
    preview: dict | None
    warnings: tuple[str, ...]

    def to_json(self) -> dict:
        return {
            "source": self.source,
            "factor": self.factor,
            "lr_before": self.lr_before,
            "lr_after": self.lr_after,
            "min_lr": self.min_lr,
            "scheduler": self.scheduler,
            "changes": [
                {"key": c.key, "before": c.before, "after": c.after, "why": c.why} for c in self.changes
            ],
            "preview": self.preview,
            "warnings": list(self.warnings),
        }


def plan_set_lr(
    ckpt: DcpCheckpoint,
    *,
    lr: float | None = None,
    scale: float | None = None,
    min_lr: float | None = None,
    preview: bool = True,
) -> SetLrPlan:
    """Compute every byte item of a DCP checkpoint to patch: `plan_lr_state` over its scheduler and
    param-group items, with prime-rl's note on a CPU-offload optimizer's param groups."""
    if (lr is None) == (scale is None):
        raise UsageError("give exactly one of --lr or --scale")
    st = read_sched_state(ckpt)
    return plan_lr_state(
        st, str(ckpt.dir), lr=lr, scale=scale, min_lr=min_lr, preview=preview, warnings=_offload_warning(ckpt)
    )


def plan_lr_state(
    st: SchedState,
    source: str,
    *,
    lr: float | None = None,
    scale: float | None = None,
    min_lr: float | None = None,
    preview: bool = True,
    warnings: list[str] | tuple[str, ...] = (),
) -> SetLrPlan:
    """Every lr field of the optimizer and scheduler state `st` (a DCP checkpoint's, a verl checkpoint's)
    with its new value. Exactly one of `lr` (the current lr becomes `lr`; factor = lr / current lr of
    param group 0) or `scale` (factor). `preview` replays the remaining schedule before and after with
    torch's schedulers (building a torch optimizer imports torch._dynamo: seconds, so the real run skips
    it).

    `min_lr` retargets the end of the decay instead of scaling it: CosineAnnealingLR's `eta_min`
    is set to it; a LinearLR decay that has not started gets `end_factor = min_lr / base_lr`
    (its new base lr); one in progress at step k of T gets the end factor that makes torch's
    chainable LinearLR go linearly from the current lr to `min_lr` at T:
    `e = min_lr * s * (T - k) / (lr * T - min_lr * k)`."""
    if (lr is None) == (scale is None):
        raise UsageError("give exactly one of --lr or --scale")
    current = current_lr(st, source)
    factor, exact = lr_factor(current, lr, scale)
    if min_lr is not None and not (math.isfinite(min_lr) and min_lr >= 0):
        raise UsageError(f"--min-lr must be a finite number >= 0, got {min_lr}")
    new, why = scaled_lr_fields(st, factor, exact)
    notes = []
    if min_lr is not None:
        _apply_min_lr(st, new, why, min_lr, factor, exact)
    if len(st.groups) > 1 and lr is not None:
        notes.append(f"{len(st.groups)} param groups: all scaled by the factor of group 0 ({factor:g})")
    if st.kind in ("unknown",):
        notes.append("unrecognised scheduler: only lr fields known by name were patched")
    notes.extend(warnings)
    for key, v in new.items():
        check_lr_value(v, key)
    changes = tuple(
        Change(k, old_value(st, k), v, why[k]) for k, v in sorted(new.items()) if old_value(st, k) != v
    )
    shown = None
    if preview:
        try:
            shown = {"before": preview_schedule(st), "after": preview_schedule(apply_to_state(st, new))}
        except Exception as exc:  # a scheduler we cannot rebuild only costs the preview
            notes.append(f"no schedule preview: {type(exc).__name__}: {exc}")
    return SetLrPlan(
        source=source,
        factor=factor,
        lr_before=current,
        lr_after=new[st.keys[("pg", min(st.groups), "lr")]],
        min_lr=min_lr,
        scheduler=describe(st),
        changes=changes,
        preview=shown,
        warnings=tuple(notes),
    )


def scaled_lr_fields(st: SchedState, factor: float, exact) -> tuple[dict[str, Any], dict[str, str]]:
    """Every lr field of `st` (LR_FIELDS) scaled by `factor`: ({key: new value}, {key: why})."""
    new: dict[str, Any] = {}
    why: dict[str, str] = {}
    for (where, idx, fld), key in sorted(st.keys.items(), key=lambda kv: kv[1]):
        group = "param_groups" if where == "pg" else "scheduler"
        if (group, fld) in LR_FIELDS:
            old = (st.groups[idx] if where == "pg" else st.top if where == "top" else st.subs[idx])[fld]
            new[key] = scale_value(old, factor, key, exact)
            why[key] = f"x{factor:g}"
    return new, why


def current_lr(st: SchedState, source: str) -> float:
    """Param group 0's lr: a finite float >= 0 (a new lr is derived from it)."""
    current = st.groups[min(st.groups)].get("lr")
    if not isinstance(current, float):
        raise FormatError(
            f"param group lr is {type(current).__name__} {current!r}, expected a float",
            key=st.keys.get(("pg", min(st.groups), "lr")),
        )
    if not math.isfinite(current) or current < 0:
        raise FormatError(
            f"the checkpoint's lr is {current!r}: not a finite number >= 0, so no new lr can be "
            "derived from it",
            path=source,
            key=st.keys.get(("pg", min(st.groups), "lr")),
            hint="the checkpoint is damaged or crafted; `ckpt set` can write a finite lr",
        )
    return current


def lr_factor(
    current: float, lr: float | None, scale: float | None
) -> tuple[float, tuple[float, float] | None]:
    """The factor every lr field is scaled by, and (current, lr) when --lr gives it exactly."""
    if lr is not None:
        if not (math.isfinite(lr) and 0 < lr <= MAX_LR):
            raise UsageError(f"--lr must be a finite number in (0, {MAX_LR:g}], got {lr}")
        if current <= 0:
            raise UsageError(
                f"the current lr is {current}, so --lr cannot be turned into a factor", hint="use --scale"
            )
        return lr / current, (current, lr)
    assert scale is not None  # exactly one of the two (plan_lr_state checked)
    if not (math.isfinite(scale) and scale > 0):
        raise UsageError(f"--scale must be a positive finite number, got {scale}")
    return scale, None


def _offload_warning(ckpt: DcpCheckpoint) -> list[str]:
    """prime-rl HEAD's CPU-offload optimizer (param group fused=False) ignores the patched param groups."""
    fused = next(
        (
            ckpt.read_object(k)
            for k, e in ckpt.entries.items()
            if e.path[2:5] == ("param_groups", "0", "fused") or e.path[2:5] == ("param_groups", 0, "fused")
        ),
        None,
    )
    if fused is not False:
        return []
    return [
        "param_groups fused=False: prime-rl HEAD's CPU-offload optimizer (optim_cpu_offload, the "
        "default) wrote this, and its resume skips the optimizer's set_state_dict (trainer/ckpt.py:"
        "104-124): the param groups' lr comes from the freshly built scheduler, not from this "
        "checkpoint. The patched scheduler state still loads; to be sure of the lr, also set the "
        "run config's optim.lr (or run with optim_cpu_offload=false)"
    ]


def _apply_min_lr(st: SchedState, new: dict, why: dict, y: float, factor: float, exact) -> None:
    todo = [d for d in decays(st) if d[3] != "finished"]
    if not todo:
        raise UsageError(
            f"--min-lr: the scheduler ({describe(st)}) has no decay phase left to retarget",
            hint="drop --min-lr; the lr stays where the schedule ends",
        )
    lr_key = st.keys[("pg", min(st.groups), "lr")]
    cur_new = uniform([scale_value(g["lr"], factor, lr_key, exact) for g in st.groups.values()], "lr")
    for kind, j, f, status, k in todo:
        where = ("top", None) if j is None else ("sub", j)
        if kind == "CosineAnnealingLR":
            key = st.keys[where + ("eta_min",)]
            new[key] = float(y)
            why[key] = "--min-lr"
            continue
        key = st.keys[where + ("end_factor",)]
        s, T = float(f["start_factor"]), int(f["total_iters"])
        if status == "pending":
            base_new = uniform(new[st.keys[where + ("base_lrs",)]], "base_lrs")
            e = y / base_new
        else:  # active at step k < T, chainable from the current lr
            if y > cur_new:
                raise UsageError(
                    f"--min-lr {y:g} is above the current lr {cur_new:g} of a decay in progress", key=key
                )
            e = y * s * (T - k) / (cur_new * T - y * k)
        new[key] = e
        why[key] = "--min-lr"
