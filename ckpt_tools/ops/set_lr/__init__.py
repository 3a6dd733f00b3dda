"""`ckpt set-lr` and `ckpt set`: change byte items (lr, scheduler state, progress) by surgery.

prime-rl's resume restores the optimizer's and scheduler's state from the checkpoint and ignores
the config's lr, so changing the lr of a resumed run takes surgery: `plan` decides every byte item's
new value (`schedule` reads and replays the scheduler state), `formats.dcp.patch` writes them in
O(KB) (hard links + one patch file + a new `.metadata`, or in place with a backup). One contract:
`plan_set_lr(ckpt, options) -> SetLrPlan`, `run_patch(plan, ckpt, options) -> PatchReport`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ...core.errors import UsageError
from ...core.keys import classify
from ...core.progress import Progress
from ...formats.dcp.patch import PatchResult, patch_checkpoint
from ...formats.dcp.reader import DcpCheckpoint
from ...formats.primerl.optimizers import optimizer_facts
from ...formats.sniff import TORCHTITAN, VERL
from ...formats.trainers import trainer_kind
from ...formats.verl.patch import VerlPatchResult
from .plan import SetLrPlan, SetValuesPlan, plan_set_lr, plan_set_values
from .trainers import TORCHTITAN_HINT, TORCHTITAN_SET_LR, plan_verl_set_lr, plan_verl_set_values, verl_patch

__all__ = [
    "PatchOptions",
    "PatchReport",
    "SetLrPlan",
    "SetValuesPlan",
    "plan_set_lr",
    "plan_set_values",
    "run_patch",
    "set_lr",
    "set_values",
]


@dataclass(frozen=True)
class PatchOptions:
    out: str | Path | None = None
    in_place: bool = False
    overwrite: bool = False
    dry_run: bool = False


@dataclass(frozen=True)
class PatchReport:
    plan: SetLrPlan | SetValuesPlan
    result: PatchResult | VerlPatchResult | None = None  # None: a dry run

    def to_json(self) -> dict:
        rep = {"plan": self.plan.to_json(), "dry_run": self.result is None}
        if self.result is not None:
            rep["result"] = self.result.to_json()
        return rep


def run_patch(
    plan: SetLrPlan | SetValuesPlan,
    ckpt: DcpCheckpoint,
    options: PatchOptions,
    progress: Progress | None = None,
) -> PatchReport:
    """Write the plan's changes (O(KB), whatever the checkpoint's size: nothing to report progress of)."""
    values = {c.key: c.after for c in plan.changes}
    return PatchReport(
        plan,
        patch_checkpoint(
            ckpt,
            None if options.in_place or options.out is None else Path(options.out),
            values,
            in_place=options.in_place,
            overwrite=options.overwrite,
        ),
    )


def set_lr(
    ckpt_path,
    out,
    *,
    lr: float | None = None,
    scale: float | None = None,
    min_lr: float | None = None,
    in_place: bool = False,
    dry_run: bool = False,
    overwrite: bool = False,
    trust_pickle: bool = False,
) -> PatchReport:
    """Library entry point of `ckpt set-lr`."""
    if in_place and out is not None:
        raise UsageError("give either OUT or --in-place, not both")
    if not in_place and out is None and not dry_run:
        raise UsageError("give an output directory OUT, or --in-place")
    kind = trainer_kind(ckpt_path)
    if kind == TORCHTITAN:
        raise UsageError(TORCHTITAN_SET_LR, path=ckpt_path, hint=TORCHTITAN_HINT)
    if kind == VERL:
        return PatchReport(
            *verl_patch(
                ckpt_path,
                out,
                lambda st: plan_verl_set_lr(st, lr=lr, scale=scale, min_lr=min_lr),
                in_place=in_place,
                dry_run=dry_run,
                overwrite=overwrite,
            )
        )
    options = PatchOptions(out, in_place, overwrite, dry_run)
    with DcpCheckpoint.open(ckpt_path, trust_pickle=trust_pickle) as ckpt:
        # the preview replays the schedule with torch's schedulers (building an optimizer imports
        # torch._dynamo: seconds), so the real run skips it
        plan = plan_set_lr(ckpt, lr=lr, scale=scale, min_lr=min_lr, preview=dry_run)
        absent = optimizer_facts(classify(k, e.path) for k, e in ckpt.entries.items()).absent
        if absent:  # SignSGD: no moments to keep; the lr changes the same way
            plan = replace(plan, warnings=(*plan.warnings, absent))
        return PatchReport(plan) if dry_run else run_patch(plan, ckpt, options)


def set_values(
    ckpt_path,
    out,
    assignments: list[str],
    *,
    in_place: bool = False,
    dry_run: bool = False,
    overwrite: bool = False,
    trust_pickle: bool = False,
) -> PatchReport:
    """Library entry point of `ckpt set`."""
    if in_place and out is not None:
        raise UsageError("give either OUT or --in-place, not both")
    kind = trainer_kind(ckpt_path)
    if kind == TORCHTITAN:
        raise UsageError(
            "`ckpt set` does not change torchtitan checkpoints yet",
            path=ckpt_path,
            hint="for the lr: " + TORCHTITAN_HINT,
        )
    if kind == VERL:
        if not in_place and out is None and not dry_run:
            raise UsageError("give an output directory OUT, or --in-place")
        return PatchReport(
            *verl_patch(
                ckpt_path,
                out,
                lambda st: plan_verl_set_values(st, assignments),
                in_place=in_place,
                dry_run=dry_run,
                overwrite=overwrite,
            )
        )
    options = PatchOptions(out, in_place, overwrite, dry_run)
    with DcpCheckpoint.open(ckpt_path, trust_pickle=trust_pickle) as ckpt:
        plan = plan_set_values(ckpt, assignments)
        if dry_run:
            return PatchReport(plan)
        if not in_place and out is None:
            raise UsageError("give an output directory OUT, or --in-place")
        return run_patch(plan, ckpt, options)
