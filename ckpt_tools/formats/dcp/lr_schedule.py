"""The optimizer's and scheduler's lr state of a checkpoint, read (tiny byte items) and replayed: which
scheduler it is (`core.primerl_state.scheduler_class`), its decay phases, how `--min-lr` retargets
them, and a preview of the remaining schedule before and after (torch's own schedulers loaded from
the state, exactly what a resumed run does, minus the model)."""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

import torch

from ...core.errors import FormatError, UsageError
from ...core.keys import classify
from ...core.primerl_state import scheduler_class
from .model import BytesEntry
from .reader import DcpCheckpoint

__all__ = [
    "SchedState",
    "apply_to_state",
    "decays",
    "describe",
    "old_value",
    "preview_schedule",
    "read_sched_state",
    "schedule_end",
    "trace_schedule",
    "uniform",
]


@dataclass(frozen=True)
class SchedState:
    """The scheduler and param-group byte items, read (they are tiny)."""

    groups: dict  # group index -> {field: value}
    top: dict  # scheduler field -> value
    subs: dict  # j -> {field: value}
    keys: dict  # ("pg", i, field) | ("top", None, field) | ("sub", j, field) -> flat key

    @property
    def kind(self) -> str:
        return scheduler_class(set(self.top))

    def sub_kind(self, j: int) -> str:
        return scheduler_class(set(self.subs[j]))


def read_sched_state(ckpt: DcpCheckpoint) -> SchedState:
    groups: dict[int | None, dict] = {}
    top: dict[str | None, object] = {}
    subs: dict[int, dict] = {}
    keys: dict[tuple, str] = {}
    for key, e in ckpt.entries.items():
        info = classify(key, e.path)
        if info.group == "param_groups" and info.field != "params":
            if not isinstance(e, BytesEntry):
                raise FormatError(
                    "param_groups field stored as a tensor; set-lr patches byte items only", key=key
                )
            groups.setdefault(info.group_index, {})[info.field] = ckpt.read_object(key)
            keys[("pg", info.group_index, info.field)] = key
        elif info.group == "scheduler" and isinstance(e, BytesEntry):
            if info.sub_scheduler is None:
                top[info.field] = ckpt.read_object(key)
                keys[("top", None, info.field)] = key
            else:
                subs.setdefault(info.sub_scheduler, {})[info.field] = ckpt.read_object(key)
                keys[("sub", info.sub_scheduler, info.field)] = key
    if not groups:
        raise FormatError(
            "has no optimizer param_groups",
            path=ckpt.dir,
            hint="set-lr needs a training checkpoint with optimizer state",
        )
    return SchedState(groups, top, subs, keys)


def uniform(values, what: str) -> float:
    vals = list(values)
    if any(v != vals[0] for v in vals):
        raise UsageError(
            f"{what} differs between param groups ({vals}); --min-lr needs a single value",
            hint="use --scale or --lr without --min-lr",
        )
    return vals[0]


def decays(st: SchedState) -> list[tuple[str, int | None, dict, str, int]]:
    """(kind, j, fields, status, k) of every decaying scheduler: CosineAnnealingLR, or LinearLR
    with end_factor < start_factor. status: active | pending | finished; k = its last_epoch."""
    out = []
    if st.kind == "SequentialLR":
        idx = bisect_right(list(st.top.get("_milestones") or []), int(st.top.get("last_epoch", 0)))
        items = [
            (j, st.subs[j], "finished" if j < idx else "active" if j == idx else "pending")
            for j in sorted(st.subs)
        ]
    else:
        items = [(None, st.top, "active")]
    for j, f, status in items:
        kind = scheduler_class(set(f))
        is_decay = kind == "CosineAnnealingLR" or (
            kind == "LinearLR" and float(f.get("end_factor", 1.0)) < float(f.get("start_factor", 1.0))
        )
        if is_decay:
            k = int(f.get("last_epoch", 0))
            if kind == "LinearLR" and status == "active" and k >= int(f["total_iters"]):
                status = "finished"
            out.append((kind, j, f, status, k))
    return out


def old_value(st: SchedState, key: str):
    for (where, idx, fld), k in st.keys.items():
        if k == key:
            return (st.groups[idx] if where == "pg" else st.top if where == "top" else st.subs[idx])[fld]
    raise KeyError(key)


def describe(st: SchedState) -> str:
    if st.kind == "SequentialLR":
        return "SequentialLR(" + ", ".join(st.sub_kind(j) for j in sorted(st.subs)) + ")"
    return st.kind


def apply_to_state(st: SchedState, new: dict) -> SchedState:
    groups = {i: dict(g) for i, g in st.groups.items()}
    top = dict(st.top)
    subs = {j: dict(s) for j, s in st.subs.items()}
    for (where, idx, fld), key in st.keys.items():
        if key in new:
            (groups[idx] if where == "pg" else top if where == "top" else subs[idx])[fld] = new[key]
    return SchedState(groups, top, subs, st.keys)


# ---------------------------------------------------------------------------------------- preview
_PREVIEW_STEPS_MAX = 100_000


def _build_scheduler(opt, kind: str, f: dict):
    from torch.optim import lr_scheduler as L

    if kind == "LinearLR":
        return L.LinearLR(
            opt, start_factor=f["start_factor"], end_factor=f["end_factor"], total_iters=f["total_iters"]
        )
    if kind == "CosineAnnealingLR":
        return L.CosineAnnealingLR(opt, T_max=f["T_max"], eta_min=f["eta_min"])
    if kind == "ConstantLR":
        return L.ConstantLR(opt, factor=f["factor"], total_iters=f["total_iters"])
    raise ValueError(f"cannot rebuild a {kind}")


def _sched_end(kind: str, f: dict) -> int:
    return int(f.get("total_iters", f.get("T_max", 0)))


def _optimizer(st: SchedState, fresh: bool):
    """A dummy SGD with the checkpoint's param groups: at their current lr, or (fresh) at the base lr
    the schedule started from (`initial_lr`, else the scheduler's `base_lrs`)."""
    groups = []
    base_lrs = list(st.top.get("base_lrs") or [])
    for n, i in enumerate(sorted(st.groups)):
        g = st.groups[i]
        start = g.get("initial_lr", base_lrs[n] if n < len(base_lrs) else g["lr"])
        groups.append(
            {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": start if fresh else g["lr"]}
            | ({} if fresh else {"initial_lr": g.get("initial_lr", g["lr"])})
        )
    return torch.optim.SGD(groups, lr=1.0)


def _scheduler(st: SchedState, opt, fresh: bool):
    """torch's own scheduler of this state's kind and fields on `opt`: loaded with the state (a resumed
    run), or built fresh at step 0 (the run's start)."""
    if st.kind == "SequentialLR":
        subs = [_build_scheduler(opt, st.sub_kind(j), st.subs[j]) for j in sorted(st.subs)]
        sched = torch.optim.lr_scheduler.SequentialLR(opt, subs, milestones=list(st.top["_milestones"]))
        state = dict(st.top)
        state["_schedulers"] = [dict(st.subs[j]) for j in sorted(st.subs)]
    else:
        sched = _build_scheduler(opt, st.kind, st.top)
        state = dict(st.top)
    if not fresh:
        sched.load_state_dict(state)
        for i, g in zip(sorted(st.groups), opt.param_groups):
            g["lr"] = st.groups[i]["lr"]
            g["initial_lr"] = st.groups[i].get("initial_lr", g["lr"])
    return sched


def schedule_end(st: SchedState) -> int:
    """The scheduler epoch the schedule's last phase ends at (e.g. warmup + T_max)."""
    if st.kind == "SequentialLR":
        last = max(st.subs)
        return int(st.top["_milestones"][-1]) + _sched_end(st.sub_kind(last), st.subs[last])
    return _sched_end(st.kind, st.top)


def trace_schedule(st: SchedState, steps: int, *, from_start: bool = False) -> list[float]:
    """Param group 0's lr over `steps` scheduler epochs, replayed by torch's own schedulers: from this
    state on (`[lr now, after 1 step, ...]`: what a resumed run uses), or (`from_start`) from epoch 0
    of the schedule these fields describe, built fresh as the run built it (`[lr at epoch 0, 1, ...]`:
    what its steps used). No optimizer step is taken: the lr does not depend on it."""
    import warnings

    if not 0 <= steps <= _PREVIEW_STEPS_MAX:
        raise UsageError(f"{steps} scheduler steps to replay: more than {_PREVIEW_STEPS_MAX}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # stepping a scheduler without optimizer steps warns
        opt = _optimizer(st, from_start)
        sched = _scheduler(st, opt, from_start)
        trace = []
        for n in range(steps):
            if n:
                sched.step()
            trace.append(float(opt.param_groups[0]["lr"]))
    return trace


def preview_schedule(st: SchedState, steps: int | None = None) -> dict:
    """Replay the remaining schedule with torch's own schedulers loaded from this state (exactly
    what a resumed run does, minus the model): the lr now, at the peak, and at the end."""
    now_epoch = int(st.top.get("last_epoch", 0))
    n = steps if steps is not None else max(1, min(_PREVIEW_STEPS_MAX, schedule_end(st) - now_epoch + 1))
    trace = trace_schedule(st, n + 1)[1:]
    return {
        "now": float(st.groups[min(st.groups)]["lr"]),
        "steps": n,
        "peak": max(trace),
        "end": trace[-1],
        "trace_head": trace[:8],
    }
