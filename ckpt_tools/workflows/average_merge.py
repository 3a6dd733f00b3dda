"""`ckpt average --merge BASE`: the averaged LoRA merged into BASE, written as an HF model dir.

A workflow, not an op: it composes the average op (its plan's `DeltaSource`, the weighted sum as one
LoRA of rank sum(r_i), or its Eckart-Young truncation) with the merge op through their public
contracts. The merge pipeline reads the average like any adapter (`LoraSource`): each module's stacked
factors are computed when the pipeline asks for them, W' = round(W + B_cat @ A_cat) in fp32 with one
rounding, so the merged average equals the average of the merged steps to that one rounding. No
temporary adapter is written.

Before the merge is planned, each DCP input is planned as a merge into BASE on its own (the merge op's
checks that the run trained on this base: names, shapes and a few rows of its fp32 masters); that
reads no more than `ckpt merge BASE CKPT OUT --dry-run` would.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ..core.progress import Progress
from ..formats.hf_dir.model_dir import HFModelDir
from ..io.inputs import as_input
from ..io.staging import AtomicOutputDir
from ..ops.average import AverageOptions, AveragePlan, AverageSources, open_average_sources, plan_average
from ..ops.merge import MergeOptions, MergePlan, MergeResult, MergeSources, plan_merge, run_merge

__all__ = ["AverageMergeReport", "average_merge"]


@dataclass(frozen=True)
class AverageMergeReport:
    average: AveragePlan
    merge: MergePlan
    result: MergeResult | None = None  # None: a dry run

    @property
    def plan(self) -> dict:
        avg = dataclasses.replace(self.average, adapter_warnings=())  # no adapter is written
        return {"average": avg.to_json(), "merge": self.merge.to_json(jobs=self.result is None)}

    @property
    def warnings(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(self.average.warnings + tuple(self.merge.warnings)))

    def to_json(self) -> dict:
        """The merge's report shape: the plan (the average's and the merge's), the merge's result."""
        d = {
            "dry_run": self.result is None,
            "out": self.merge.out,
            "plan": self.plan,
            "warnings": list(self.warnings),
        }
        if self.result is not None:
            d["result"] = dataclasses.asdict(self.result)
        return d


def _check_trained_on(base: HFModelDir, src: AverageSources) -> None:
    for s in src.inputs:
        if s.ckpt is not None:  # a checkpoint's LoRA records the base it trained on
            plan_merge(MergeSources(base, s), MergeOptions())


def average_merge(
    paths: list[str | Path],
    base: str | Path,
    out: str | Path,
    *,
    options: AverageOptions,
    merge_options: MergeOptions | None = None,
    dry_run: bool = False,
    overwrite: bool = False,
    progress: Progress | None = None,
) -> AverageMergeReport:
    """Average `paths` (the average op's plan with `options`) and merge the result into `base`."""
    mopts = dataclasses.replace(merge_options or MergeOptions(), out=str(out))
    with open_average_sources(paths, options) as sources:
        avg = plan_average(sources, options)
        delta = sources.delta
        assert delta is not None  # the weighted sum plan_average made
        hf = HFModelDir.open_ref(base)
        try:
            _check_trained_on(hf, sources)
            mplan = plan_merge(MergeSources(hf, delta), mopts)
            inputs = sorted(set(mplan.inputs) | {str(as_input(i.path)) for i in avg.inputs})
            mplan = dataclasses.replace(mplan, inputs=tuple(inputs))
            AtomicOutputDir(
                out, inputs=mplan.inputs, need_bytes=mplan.write_bytes, overwrite=overwrite
            ).preflight()
            if dry_run:
                return AverageMergeReport(avg, mplan)
            report = run_merge(mplan, MergeSources(hf, delta), progress, overwrite=overwrite)
            return AverageMergeReport(avg, mplan, report.result)
        finally:
            hf.close()
