"""`ckpt report`, run: each step's numbers (one checkpoint open at a time), the lr curves of the newest
step, then the page and the PNGs (`page.py`, matplotlib imported only there)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ...core.errors import FormatError, UsageError
from ...formats.dcp.model import TensorEntry
from ...formats.dcp.reader import DcpCheckpoint
from ...formats.dcp.summary import summarize
from ...formats.handle import Source
from ...formats.primerl.optimizers import optimizer_facts, trained_params
from ...io.inputs import as_input
from ...sources.open import open_weights
from .lr import LrCurves, lr_curves
from .numbers import (
    MOMENT_FIELDS,
    ModuleChange,
    lora_delta_sq,
    module_group,
    param_module,
    trained_delta,
    weight_sq,
)
from .plan import MERGED, ReportPlan

if TYPE_CHECKING:
    from ...formats.dcp.views import DcpBaseSource

__all__ = ["ReportResult", "StepNumbers", "compute_report", "group_totals"]


@dataclass
class StepNumbers:
    step: str
    path: str
    slim: bool
    training: str  # LoRA | full fine-tune | merged
    modules: dict[str, ModuleChange] = field(default_factory=dict)
    moments: dict[str, dict[str, float]] = field(default_factory=dict)  # group -> field -> sum of squares
    lr: float | None = None
    scale: float | None = None
    bytes: dict | None = None
    experts: dict | None = None

    def to_json(self) -> dict:
        groups = group_totals(self.modules, self.moments)
        ranked = [((-m.rel_delta, m.module), m) for m in self.modules.values() if m.rel_delta is not None]
        largest = [m for _key, m in sorted(ranked, key=lambda t: t[0])[:10]]
        return {
            "path": self.path,
            "slim": self.slim,
            "training": self.training,
            "lr": self.lr,
            "lora_scale": self.scale,
            "modules": {k: m.to_json() for k, m in sorted(self.modules.items())},
            "groups": groups,
            "largest": [m.module for m in largest],
            "bytes": self.bytes,
            "experts": self.experts,
        }


def group_totals(modules: dict[str, ModuleChange], moments: dict[str, dict[str, float]]) -> dict[str, dict]:
    """Per module group (`numbers.module_group`): the Frobenius norms of the group's stacked change and
    weights (sqrt of the summed squares) and of its Adam moments."""
    acc: dict[str, dict[str, float]] = {}
    for m in modules.values():
        tot = acc.setdefault(module_group(m.module), {"delta_sq": 0.0, "weight_sq": 0.0, "modules": 0})
        tot["delta_sq"] += m.delta_sq
        tot["weight_sq"] += m.weight_sq
        tot["modules"] += 1
    out: dict[str, dict] = {}
    for g in sorted(set(acc) | set(moments)):
        a = acc.get(g, {"delta_sq": 0.0, "weight_sq": 0.0, "modules": 0})
        d, w = math.sqrt(a["delta_sq"]), math.sqrt(a["weight_sq"])
        row: dict[str, float | None] = {
            "modules": a["modules"],
            "delta_fro": d,
            "weight_fro": w,
            "rel_delta": d / w if w > 0 else None,
        }
        for f in MOMENT_FIELDS:
            row[f"{f}_fro"] = math.sqrt(moments[g][f]) if g in moments and f in moments[g] else None
        out[g] = row
    return out


@dataclass(frozen=True)
class ReportResult:
    plan: ReportPlan
    steps: dict[str, StepNumbers]
    lr: LrCurves | None
    warnings: tuple[str, ...]
    bytes_read: int
    seconds: float

    def to_json(self) -> dict:
        return {
            "path": self.plan.path,
            "kind": self.plan.kind,
            "base": self.plan.base,
            "steps": {k: s.to_json() for k, s in self.steps.items()},
            "lr": None if self.lr is None else self.lr.to_json(),
            "warnings": list(self.warnings),
            "bytes_read": self.bytes_read,
            "seconds": round(self.seconds, 3),
        }


class _Norms:
    """||W||^2 of the frozen weights, each read once for the whole report."""

    def __init__(self) -> None:
        self.cache: dict[str, float] = {}

    def get(self, src: Source, name: str) -> float:
        if name not in self.cache:
            self.cache[name] = weight_sq(src, name)
        return self.cache[name]


def _moments(ckpt: DcpCheckpoint, infos) -> dict[str, dict[str, float]]:
    keys = ckpt.by_key()
    out: dict[str, dict[str, float]] = {}
    moments = [i for i in infos if i.group == "optimizer_state" and i.field in MOMENT_FIELDS]
    # every moment is read whole: a remote checkpoint fetches adjacent items in one request (io.remote)
    ckpt.hint_reads(
        (c.file, c.offset, c.length)
        for i in moments
        if isinstance(e := ckpt.entry(i.key), TensorEntry)
        for c in e.chunks
        if c.numel
    )
    for i in moments:
        g = out.setdefault(module_group(param_module(i.param)), {})
        g[i.field] = g.get(i.field, 0.0) + weight_sq(keys, i.key)
    return out


def _lora_step(ckpt, plan, norms: _Norms, weights: Source, num: StepNumbers) -> None:
    o = plan.options
    lora = ckpt.lora(alpha=o.alpha, run_config=as_input(o.run_config) if o.run_config else None)
    scales = {m.scale for m in lora.modules.values()}
    num.scale = scales.pop() if len(scales) == 1 else None
    for name, m in sorted(lora.modules.items()):
        a, b = lora.read_pair(name)
        if m.weight_name not in weights:
            raise FormatError(
                f"the LoRA's module {name} has no weight {m.weight_name} in {weights.path}",
                path=weights.path,
                key=m.weight_name,
                hint="is --base this run's base model?",
            )
        num.modules[name] = ModuleChange(
            name, lora_delta_sq(a, b, m.scale), norms.get(weights, m.weight_name)
        )


def _trained_step(
    masters: DcpBaseSource, base: Source | None, trained: set[str], num: StepNumbers, warnings: list[str]
) -> None:
    """||W - W0|| of every base weight the optimizer trains (a full fine-tune's, modules_to_save)."""
    names = [n for n in masters.names() if masters.dcp_key(n).removeprefix("app.model.") in trained]
    if not names:
        return
    if base is None:
        warnings.append(
            f"step {num.step}: {len(names)} trained weight(s) (full fine-tune / modules_to_save) need "
            "their base to measure a change: give --base"
        )
        return
    missing = [n for n in names if n not in base]
    if missing:
        warnings.append(
            f"step {num.step}: {len(missing)} trained weight(s) are not in the base (e.g. {missing[0]}): "
            "not measured"
        )
    for n in names:
        if n in base:
            num.modules[n.removesuffix(".weight")] = trained_delta(
                masters, base, n, n.removesuffix(".weight")
            )


def compute_report(plan: ReportPlan, progress=None) -> ReportResult:
    t0 = time.perf_counter()
    warnings: list[str] = []
    if plan.base_problem:
        warnings.append(f"the base ({plan.base_how}): {plan.base_problem}")
    base = open_weights(plan.base, trust_pickle=plan.options.trust_pickle) if plan.base else None
    steps: dict[str, StepNumbers] = {}
    curves = None
    read = 0
    try:
        if plan.kind == MERGED:
            assert base is not None  # a merged dir is planned with its --base
            steps["merged"] = _merged(plan, base)
        else:
            norms = _Norms()
            first_full = next((s for s in plan.steps if not s.slim), None)
            norm_src = (
                DcpCheckpoint.open(first_full.path, trust_pickle=plan.options.trust_pickle).base_weights(
                    str(first_full.path), owned=True
                )
                if first_full
                else base
            )
            if norm_src is None:
                raise UsageError(
                    "every step is slim (no base weights in them) and the base was not found: give --base",
                    path=plan.path,
                    hint=plan.base_problem or "e.g. --base Qwen/Qwen3-8B",
                )
            try:
                for s in plan.steps:
                    num, ckpt_lr = _step(plan, s, norms, norm_src, base, warnings)
                    steps[num.step] = num
                    curves = ckpt_lr
            finally:
                read += norm_src.bytes_read if norm_src is not base else 0
                if norm_src is not base:
                    norm_src.close()
    finally:
        if base is not None:
            read += base.bytes_read
            base.close()
    if curves is not None:
        warnings += list(curves.warnings)
    return ReportResult(plan, steps, curves, tuple(dict.fromkeys(warnings)), read, time.perf_counter() - t0)


def _step(plan, s, norms, norm_src, base, warnings):
    o = plan.options
    with DcpCheckpoint.open(s.path, trust_pickle=o.trust_pickle) as ckpt:
        summ = summarize(ckpt)
        step = s.step if s.step is not None else summ.step
        training = "full fine-tune" if summ.full_finetune else "LoRA" if summ.lora.modules else "none"
        num = StepNumbers(
            str(step),
            s.path,
            s.slim,
            training,
            lr=summ.lr,
            experts=summ.experts,
            bytes={
                "groups": {g: {"count": st.count, "bytes": st.bytes} for g, st in summ.groups.items()},
                "frozen_bytes": summ.frozen_bytes,
                "unique_bytes": summ.unique_bytes,
            },
        )
        if summ.lora.modules:
            _lora_step(ckpt, plan, norms, norm_src, num)
        trained = trained_params(ckpt) & {
            i.key.removeprefix("app.model.") for i in summ.infos if i.group == "base"
        }
        if trained:
            _trained_step(ckpt.base_weights(), base, trained, num, warnings)
        num.moments = _moments(ckpt, summ.infos)
        absent = optimizer_facts(summ.infos).absent
        if absent and not num.moments:
            warnings.append(f"{absent}: the page has no moments to draw")
        curves = (
            lr_curves(
                ckpt,
                progress_step=summ.step if isinstance(summ.step, int) else None,
                max_steps=plan.max_steps,
                max_steps_from=plan.max_steps_from,
                set_lr=o.set_lr,
                scale=o.scale,
            )
            if any(i.group == "scheduler" for i in summ.infos)
            else None
        )
    return num, curves


def _merged(plan: ReportPlan, base: Source) -> StepNumbers:
    weights = open_weights(plan.path, trust_pickle=plan.options.trust_pickle)
    try:
        num = StepNumbers("merged", plan.path, False, "merged")
        for n in sorted(set(weights.names()) & set(base.names())):
            if weights.facts(n).shape == base.facts(n).shape:
                num.modules[n.removesuffix(".weight")] = trained_delta(
                    weights, base, n, n.removesuffix(".weight")
                )
        return num
    finally:
        weights.close()
