"""`ckpt merge`: a LoRA merged into base weights, written as an HF model directory, streamed.

Plan, then execute, one contract: `open_merge_sources(base, adapter, options)` opens headers only;
`plan_merge(sources, options) -> MergePlan` (frozen, `to_json()`) decides every output tensor's source,
action, shard and bytes from facts (`plan.plan_from_facts`, pure); `run_merge(plan, sources, progress)
-> MergeReport` writes OUT through the bounded pipeline (`pipeline`); `finish_merge(plan, sources, out,
dry_run=...)` is the end of merge and export (OUT checked, then the dry run's report or the run). The one
entry point that does all three is `ckpt_tools.api.merge` (and `api.export`), which `ckpt merge` / `ckpt
export` call. `--dry-run` / `--json` print the plan. Modules: `facts` (what the planner sees), `plan`
(the pure planner), `guards` (merges that would be wrong), `prepare` (sources and options), `pipeline`
(execution), `export` (`ckpt export`: a checkpoint's own model as an HF dir, the same plan and pipeline).
"""

from __future__ import annotations

from ...core.progress import ProgressEvent
from .export import ExportOptions, open_export_sources, plan_export
from .facts import AdapterFacts, BaseFacts, FullFact, LoraFact, SourceTensor
from .pipeline import MergeReport, MergeResult, finish_merge, run_merge
from .plan import (
    DEFAULT_MAX_SHARD,
    DEFAULT_THREADS,
    FileJob,
    MergePlan,
    ShardOut,
    TensorJob,
    memory_bound,
    plan_from_facts,
    window_budget,
)
from .prepare import MergeOptions, MergeSources, check_output, open_merge_sources, plan_merge

__all__ = [
    "DEFAULT_MAX_SHARD",
    "DEFAULT_THREADS",
    "AdapterFacts",
    "BaseFacts",
    "ExportOptions",
    "FileJob",
    "FullFact",
    "LoraFact",
    "MergeOptions",
    "MergePlan",
    "MergeReport",
    "MergeResult",
    "MergeSources",
    "ProgressEvent",
    "ShardOut",
    "SourceTensor",
    "TensorJob",
    "check_output",
    "finish_merge",
    "memory_bound",
    "open_export_sources",
    "open_merge_sources",
    "plan_export",
    "plan_from_facts",
    "plan_merge",
    "run_merge",
    "window_budget",
]
