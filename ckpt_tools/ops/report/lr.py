"""The learning rate of every step of a run: the past (what each step up to the checkpoint's used), the
plan to `max_steps` (what a resumed run will use: prime-rl restores the checkpoint's scheduler state),
and, with `--set-lr X` / `--scale F`, the plan `ckpt set-lr` would give.

All three are torch's own schedulers replayed (`formats.dcp.lr_schedule.trace_schedule`): the past by
building the schedule the checkpoint's scheduler fields describe from step 0, as the run built it; the
plan by loading the checkpoint's state, as a resume does; the set-lr plan by loading the state set-lr's
own plan (`sources.lr_plan.plan_set_lr`) writes. Step k (1-based) uses the lr after k - 1 scheduler
steps: prime-rl steps the scheduler once after each optimizer step, so a checkpoint of step N has
`last_epoch` N, and its current lr is the one step N + 1 will use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...formats.dcp.lr_schedule import (
    apply_to_state,
    describe,
    read_sched_state,
    schedule_end,
    trace_schedule,
)
from ...formats.dcp.reader import DcpCheckpoint
from ...sources.lr_plan import plan_set_lr

__all__ = ["LrCurves", "lr_curves"]


@dataclass(frozen=True)
class LrCurves:
    step: int  # the checkpoint's step (the scheduler's last_epoch)
    scheduler: str
    past: dict[int, float]  # step -> the lr that step used, 1..step
    planned: dict[int, float]  # step -> the lr it will use on resume, step+1..max_steps
    max_steps: int
    max_steps_from: str
    set_lr: dict | None  # {"factor", "lr_after", "planned": {step: lr}, "changes"} with --set-lr/--scale
    warnings: tuple[str, ...]

    def to_json(self) -> dict:
        out = {
            "step": self.step,
            "scheduler": self.scheduler,
            "max_steps": self.max_steps,
            "max_steps_from": self.max_steps_from,
            "past": {str(k): v for k, v in self.past.items()},
            "planned": {str(k): v for k, v in self.planned.items()},
            "set_lr": None,
        }
        if self.set_lr is not None:
            out["set_lr"] = dict(self.set_lr, planned={str(k): v for k, v in self.set_lr["planned"].items()})
        return out


def lr_curves(
    ckpt: DcpCheckpoint,
    *,
    progress_step: int | None,
    max_steps: int | None,
    max_steps_from: str,
    set_lr: float | None = None,
    scale: float | None = None,
) -> LrCurves:
    st = read_sched_state(ckpt)
    epoch = int(st.top.get("last_epoch", 0))
    warnings = []
    if progress_step is not None and progress_step != epoch:
        warnings.append(
            f"the scheduler has stepped {epoch} times but progress.step is {progress_step}: the steps "
            f"are numbered by the scheduler (step k used the lr after k - 1 scheduler steps)"
        )
    replay = trace_schedule(st, epoch + 1, from_start=True)
    now = float(st.groups[min(st.groups)]["lr"])
    if not math.isclose(replay[-1], now, rel_tol=1e-12, abs_tol=0.0):
        warnings.append(
            f"the schedule replayed from step 0 reaches lr {replay[-1]:.6g}, not the checkpoint's "
            f"{now:.6g}: its lr state was changed after training (ckpt set-lr?), so the past shown is "
            "the schedule its current fields describe"
        )
    past = {k + 1: lr for k, lr in enumerate(replay[:-1])}
    if max_steps is None:
        max_steps = max(schedule_end(st), epoch)  # `max_steps_from` (the plan's) says so, and why
    remaining = max(0, max_steps - epoch)
    planned = {epoch + 1 + i: lr for i, lr in enumerate(trace_schedule(st, remaining))}
    overlay = None
    if set_lr is not None or scale is not None:
        plan = plan_set_lr(ckpt, lr=set_lr, scale=scale, preview=False)
        patched = apply_to_state(st, {c.key: c.after for c in plan.changes})
        overlay = {
            "factor": plan.factor,
            "lr_before": plan.lr_before,
            "lr_after": plan.lr_after,
            "planned": {epoch + 1 + i: lr for i, lr in enumerate(trace_schedule(patched, remaining))},
            "changes": len(plan.changes),
        }
        warnings += list(plan.warnings)
    return LrCurves(epoch, describe(st), past, planned, max_steps, max_steps_from, overlay, tuple(warnings))
