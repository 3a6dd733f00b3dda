"""`ckpt verify`: integrity of a DCP checkpoint, an HF model dir or a PEFT adapter dir, before you
trust or ship it. Every problem found is one `Problem(file, key, message)`; warnings are facts worth
knowing that do not make it unusable. One contract: `plan_verify(path, options) -> VerifyPlan` (what
is checked, from the path's kind), `run_verify(plan, progress) -> VerifyReport`. Verify opens what it
checks itself, problem-tolerant (a source would refuse a malformed input at open: verify lists why).
Per kind: `formats.dcp.checks` (shared with `ckpt gc`), `hf`, `peft`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...core.errors import MissingPathError, UsageError
from ...core.problems import Problem, VerifyReport
from ...core.progress import Progress
from ...dist import Group
from ...formats.dcp.checks import verify_dcp
from ...formats.primerl.step_dir import step_extras
from ...formats.sniff import CHECKPOINTS, DCP, TORCHTITAN, VERL, sniff
from ...io.inputs import as_input
from .hf import verify_hf
from .peft import verify_peft

__all__ = ["Problem", "VerifyOptions", "VerifyPlan", "VerifyReport", "plan_verify", "run_verify"]


@dataclass(frozen=True)
class VerifyOptions:
    deep: bool = False
    base: str | None = None  # PEFT adapters only: the base every target module must fit
    trust_pickle: bool = False


@dataclass(frozen=True)
class VerifyPlan:
    path: str
    kind: str  # dcp | hf | peft
    options: VerifyOptions

    def to_json(self) -> dict:
        return {"path": self.path, "format": self.kind, "deep": self.options.deep}


def plan_verify(path: str | Path, options: VerifyOptions) -> VerifyPlan:
    p = as_input(path)
    if not p.exists():
        raise MissingPathError(p)
    kind = sniff(p)
    if kind in (None, CHECKPOINTS) or (kind != DCP and not p.is_dir()):
        raise UsageError(
            "cannot tell what to verify: not a DCP checkpoint (.metadata), an HF model dir "
            "(model.safetensors or model.safetensors.index.json), a PEFT adapter dir "
            "(adapter_config.json), a verl or a torchtitan checkpoint",
            path=p,
        )
    if options.base is not None and kind != "peft":
        raise UsageError(
            f"--base applies to PEFT adapter dirs; {p} is a {kind} directory",
            hint="use `ckpt diff-vs-base` to compare model weights with a base",
        )
    return VerifyPlan(str(p), kind, options)


def _verify_beside(step_dir: Path, report: VerifyReport, *, deep: bool, progress, group) -> None:
    """Each `weights*/` dir of a step dir checked as the HF model dir it is (`formats.primerl.step_dir`): an
    incomplete one (a converter killed mid-way) and every problem of it are problems of the step."""
    seen = []
    for extra in step_extras(step_dir):
        if not extra.is_weights:
            continue
        sub = VerifyReport(str(extra.path), "hf", deep)
        if extra.complete:
            verify_hf(extra.path, sub, deep=deep, progress=progress, group=group)
        else:
            sub.problem(extra.path, None, f"incomplete {extra.kind}: {extra.problem}")
        report.problems += sub.problems
        report.warnings += sub.warnings
        seen.append(
            {
                "name": extra.name,
                "kind": extra.kind,
                "bytes": extra.bytes,
                "ok": sub.ok,
                "problems": len(sub.problems),
            }
        )
    if seen:
        report.checked["beside"] = seen


def run_verify(
    plan: VerifyPlan, progress: Progress | None = None, *, group: Group | None = None
) -> VerifyReport:
    """Check `plan.path`. Under torchrun (`group`), the data checks of `--deep` (every tensor / item)
    are split over the ranks and rank 0's report holds every rank's problems."""
    p, o = as_input(plan.path), plan.options
    report = VerifyReport(str(p), plan.kind, o.deep)
    if plan.kind == VERL:
        from ...formats.verl.summary import verify_verl

        verify_verl(p, report, deep=o.deep)
    elif plan.kind == TORCHTITAN:
        from ...formats.torchtitan.summary import verify_torchtitan

        verify_torchtitan(p, report, deep=o.deep, progress=progress, group=group)
    elif plan.kind == "dcp":
        verify_dcp(p, report, deep=o.deep, trust_pickle=o.trust_pickle, progress=progress, group=group)
        if (p / "trainer").is_dir():  # a step dir: the HF weights prime-rl's converters write beside trainer/
            _verify_beside(p, report, deep=o.deep, progress=progress, group=group)
    elif plan.kind == "hf":
        verify_hf(p, report, deep=o.deep, progress=progress, group=group)
    else:
        verify_peft(p, report, deep=o.deep, base=o.base, trust_pickle=o.trust_pickle)
    return report
