"""`ckpt merge`: a LoRA merged into base weights, written as an HF model directory, streamed.

Plan, then execute, one contract: `open_merge_sources(base, adapter, options)` opens headers only;
`plan_merge(sources, options) -> MergePlan` (frozen, `to_json()`) decides every output tensor's source,
action, shard and bytes from facts (`plan.plan_from_facts`, pure); `run_merge(plan, sources, progress)
-> MergeReport` writes OUT through the bounded pipeline (`pipeline`). `--dry-run` / `--json` print the
plan. Modules: `facts` (what the planner sees), `plan` (the pure planner), `guards` (merges that would
be wrong), `prepare` (sources and options), `pipeline` (execution), `export` (`ckpt export`: a
checkpoint's own model as an HF dir, the same plan and pipeline).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from ...core.progress import Progress, ProgressEvent
from ...sources.dcp import DcpBaseSource
from ...sources.hf import HFSource
from ...sources.lora import DcpLoraSource, NoLoraSource, PeftLoraSource
from .export import ExportOptions, open_export_sources, plan_export, run_export
from .facts import AdapterFacts, BaseFacts, FullFact, LoraFact, SourceTensor
from .pipeline import MergeReport, MergeResult, run_merge
from .plan import DEFAULT_THREADS, FileJob, MergePlan, ShardOut, TensorJob, memory_bound, plan_from_facts, window_budget
from .prepare import MergeOptions, MergeSources, check_output, open_merge_sources, plan_merge, prepare_merge

__all__ = ["MergeOptions", "MergeSources", "open_merge_sources", "plan_merge", "run_merge", "MergePlan", "MergeReport",
           "MergeResult", "TensorJob", "FileJob", "ShardOut", "BaseFacts", "AdapterFacts", "SourceTensor", "LoraFact",
           "FullFact", "plan_from_facts", "memory_bound", "window_budget", "DEFAULT_THREADS", "prepare_merge",
           "execute_merge", "merge", "check_output", "ProgressEvent", "ExportOptions", "open_export_sources",
           "plan_export", "run_export"]


def reopen_sources(plan: MergePlan) -> MergeSources:
    """The sources a plan names, opened again (the adapter's alpha as the plan resolved it)."""
    base = HFSource(plan.base_path) if plan.base_kind == "hf" else \
        DcpBaseSource(plan.base_path, trust_pickle=plan.trust_pickle)
    try:
        if plan.adapter_kind == "dcp":
            same = isinstance(base, DcpBaseSource) and Path(plan.adapter_path).resolve() == base.path.resolve()
            adapter = DcpLoraSource(Path(plan.adapter_path), alpha=plan.adapter.get("alpha"), run_config=None,
                                    slot=plan.slot or 0, trust_pickle=plan.trust_pickle,
                                    ckpt=base.ckpt if same else None)
        elif plan.adapter_kind == "none":
            adapter = NoLoraSource(Path(plan.adapter_path))
        else:
            adapter = PeftLoraSource(Path(plan.adapter_path))
    except BaseException:
        base.close()
        raise
    return MergeSources(base, adapter)


def execute_merge(plan: MergePlan, out: str | Path, *, progress: Progress | None = None,
                  overwrite: bool = False) -> MergeResult:
    """Re-open the plan's sources (checked unchanged) and write the merged model to `out`."""
    plan = dataclasses.replace(plan, out=str(out))
    with reopen_sources(plan) as sources:
        return run_merge(plan, sources, progress, overwrite=overwrite).result


def merge(base, adapter, out, *, progress: Progress | None = None, **options) -> tuple[MergePlan, MergeResult]:
    """Open, plan and execute a merge (the library entry point scripts use)."""
    opts = MergeOptions(out=str(out), **options)
    with open_merge_sources(base, adapter, opts) as sources:
        plan = plan_merge(sources, opts)
        return plan, run_merge(plan, sources, progress).result
