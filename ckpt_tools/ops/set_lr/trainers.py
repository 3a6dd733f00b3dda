"""`ckpt set-lr` and `ckpt set` on other trainers' checkpoints: verl's (patched), torchtitan's (refused).

verl (0.9.1) resumes the optimizer and the scheduler from the checkpoint (`FSDPCheckpointManager.
load_checkpoint`: `optimizer.load_state_dict`, `lr_scheduler.load_state_dict(extra_state["lr_scheduler"])`),
so, as for prime-rl, the config's lr is not what a resumed run uses. Its schedulers are `LambdaLR`s
(`verl/utils/torch_functional.py`: constant and cosine with warmup): lr = base_lr * lambda(step), lambda a
function of the run config. Scaling the param groups' `lr` / `initial_lr` and the scheduler's `base_lrs` /
`_last_lr` by one factor therefore scales every later lr by it (exactly for a power of two), warmup and
decay floor (`min_lr_ratio`, relative to base_lr) included; the floor itself lives in the config, so
`--min-lr` is refused with that reason. The plan is `sources.lr_plan.plan_lr_state` over the state of
rank 0 (every rank checked to hold the same), written into every rank's file (`formats.verl.patch`).

torchtitan saves only the scheduler's `last_epoch` and rebuilds its lr from the config (`TORCHTITAN_SET_LR`).
"""

from __future__ import annotations

import difflib
from pathlib import Path

from ...core.errors import FormatError, UsageError
from ...formats.dcp.lr_schedule import SchedState
from ...formats.verl.layout import resolve_actor_dir
from ...formats.verl.patch import VerlPatchResult, plan_edits, write_patched
from ...formats.verl.reader import VerlCheckpoint
from ...formats.verl.state import VerlTrainState
from ...io.inputs import local_dir
from ...sources.lr_plan import LR_FIELDS, Change, SetLrPlan, check_lr_value, plan_lr_state
from .plan import SetValuesPlan, parse_value

__all__ = ["TORCHTITAN_SET_LR", "plan_verl_set_lr", "plan_verl_set_values", "verl_patch"]

TORCHTITAN_SET_LR = (
    "a torchtitan checkpoint holds no learning-rate schedule to change: its scheduler saves only last_epoch "
    "(LRSchedulersContainer.state_dict), and on resume each LambdaLR recomputes its lr from base_lrs taken "
    "from the config's optimizer.lr, so the config is the setting"
)
TORCHTITAN_HINT = (
    "resume with the new lr in the config (--optimizer.lr X, or [optimizer] lr in the TOML); only the first "
    "resumed step runs at the checkpoint's param-group lr (docs/reference/torchtitan-format.md)"
)
_MIN_LR = (
    "--min-lr: verl's scheduler is a LambdaLR (lr = base_lr x lambda(step)), and its floor is lambda's "
    "min_lr_ratio, a setting of the run config (actor_rollout_ref.actor.optim.min_lr_ratio), relative to "
    "base_lr: not in the checkpoint"
)


def _unit(path) -> tuple[Path, Path]:
    """(role dir, the dir an OUT copies: the role dir itself when given, else the global_step dir above)."""
    actor = resolve_actor_dir(path)
    given = Path(path)
    return actor, (actor if given.resolve() == actor.resolve() else actor.parent)


def _lr_types(st: SchedState) -> None:
    for (where, idx, fld), key in st.keys.items():
        group = "param_groups" if where == "pg" else "scheduler"
        v = (st.groups[idx] if where == "pg" else st.top if where == "top" else st.subs[idx])[fld]
        vals = v if isinstance(v, (list, tuple)) else [v]
        if (group, fld) in LR_FIELDS and any(type(x) not in (float, int) for x in vals):
            raise FormatError(
                f"the learning rate is stored as {type(vals[0]).__name__}, not a float (an optimizer built "
                "with a tensor lr, torchao's for one): set-lr changes Python floats only",
                key=key,
                hint="set the lr in the run config and resume without the optimizer state",
            )


def plan_verl_set_lr(
    state: VerlTrainState, *, lr: float | None, scale: float | None, min_lr: float | None
) -> SetLrPlan:
    """The new value of every lr field of rank 0's optimizer and scheduler state (every rank's is the
    same)."""
    st = state.sched_state()
    if not st.top:
        raise UsageError(
            "the checkpoint holds no scheduler state (no extra_state files, or lr_scheduler None): on resume "
            "verl's scheduler rebuilds its lr from the config, so a changed optimizer lr would last one step",
            path=state.source,
            hint="set the lr in the run config (actor_rollout_ref.actor.optim.lr)",
        )
    if min_lr is not None and st.kind == "LambdaLR":
        raise UsageError(_MIN_LR, hint="drop --min-lr (--lr and --scale move the floor along with base_lr)")
    _lr_types(st)
    return plan_lr_state(st, state.source, lr=lr, scale=scale, min_lr=min_lr, preview=False)


def _resolve(st: SchedState, name: str) -> str:
    fields = sorted(st.keys.values())
    for cand in (name, f"optim.{name}", f"extra_state.{name}"):
        if cand in fields:
            return cand
    by_field: dict[str, list[str]] = {}
    for f in fields:
        by_field.setdefault(f.rsplit(".", 1)[-1], []).append(f)
    close = (
        difflib.get_close_matches(name, fields, n=3)
        or [
            f
            for m in difflib.get_close_matches(name.rsplit(".", 1)[-1], list(by_field), n=3)
            for f in by_field[m]
        ][:3]
    )
    raise UsageError(
        "no such optimizer or scheduler field in the checkpoint (`ckpt set` changes param_groups and "
        "lr_scheduler fields; not the per-parameter state nor the RNG states)",
        key=name,
        hint=f"did you mean {', '.join(close)}?" if close else f"one of: {', '.join(fields[:12])}",
    )


def plan_verl_set_values(state: VerlTrainState, assignments: list[str]) -> SetValuesPlan:
    """Every KEY=VALUE as a change of that field on every rank, the new value of the old value's type."""
    st = state.sched_state()
    kinds = {key: ("param_groups" if w == "pg" else "scheduler", f) for (w, _i, f), key in st.keys.items()}
    changes, warnings, seen = [], [], set()
    for a in assignments:
        if "=" not in a:
            raise UsageError(
                f"{a!r} is not KEY=VALUE", hint="e.g. ckpt set CKPT OUT lr_scheduler.last_epoch=4"
            )
        name, text = a.split("=", 1)
        key = _resolve(st, name.strip())
        if key in seen:
            raise UsageError("assigned twice", key=key)
        seen.add(key)
        old = state.value(key)
        new = parse_value(text, old, key)
        if kinds[key] in LR_FIELDS:
            check_lr_value(new, key)
            warnings.append(
                f"{key}: changing one lr field alone desynchronises the schedule; "
                "`ckpt set-lr` patches all of them consistently"
            )
        if kinds[key] == ("param_groups", "params"):
            warnings.append(f"{key}: param_groups params must name the optimizer's parameters in order")
        changes.append(Change(key, old, new, "set"))
    return SetValuesPlan(state.source, tuple(changes), tuple(warnings))


def _out_warnings(actor: Path, unit: Path, out: Path | None) -> list[str]:
    notes = []
    if (
        out is not None
        and unit != actor
        and not (out.name.startswith("global_step_") and out.name.removeprefix("global_step_").isdigit())
    ):
        notes.append(
            "verl resumes from a dir named global_step_N (trainer.resume_from_path; "
            f"ray_trainer._load_checkpoint reads N from the name): rename {out.name} to {unit.name} to "
            "resume from it"
        )
    critic = unit / "critic"
    if unit != actor and critic != actor and critic.is_dir():
        notes.append(f"critic/ keeps its own optimizer and lr: run set-lr on {critic} for it")
    return notes


def verl_patch(path, out, build_plan, *, in_place: bool, dry_run: bool, overwrite: bool):
    """Open the verl checkpoint at `path`, plan with `build_plan(state)` (set-lr's or set's plan), and unless
    `dry_run` write it: (plan, VerlPatchResult | None)."""
    local_dir(
        path,
        "set-lr and set change a local verl checkpoint",
        hint="copy the global_step_N dir here first (the rank files are rewritten whole)",
    )
    actor, unit = _unit(path)
    with VerlCheckpoint.open(actor) as ckpt:
        state = VerlTrainState(ckpt.files, ckpt.world_size, str(ckpt.dir))
        plan = build_plan(state)
        if dry_run:
            return plan, None
        values = {c.key: c.after for c in plan.changes}
        edits = plan_edits(state, values)
        target = None if in_place else Path(out)
        result: VerlPatchResult = write_patched(
            state, actor, values, edits, out=target, unit=unit, overwrite=overwrite
        )
    result.warnings.extend(_out_warnings(actor, unit, target))
    return plan, result
