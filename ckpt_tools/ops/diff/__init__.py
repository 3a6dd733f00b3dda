"""`ckpt diff-vs-base`: does WEIGHTS differ from BASE, tensor by tensor, and (with an adapter) is it
exactly BASE + the LoRA? `plan` pairs the tensors (`open_diff_sources`, `plan_diff(sources, options)`),
`run` compares them (`run_diff(plan, sources, progress) -> DiffReport`)."""

from .plan import (
    EXIT_ADAPTER_MISMATCH,
    EXIT_DIFFERS,
    EXIT_IDENTICAL,
    SAME,
    SKIPPED,
    DiffOptions,
    DiffPlan,
    DiffSources,
    open_diff_sources,
    plan_diff,
)
from .run import DiffReport, TensorDiff, diff_vs_base, run_diff

__all__ = [
    "EXIT_ADAPTER_MISMATCH",
    "EXIT_DIFFERS",
    "EXIT_IDENTICAL",
    "SAME",
    "SKIPPED",
    "DiffOptions",
    "DiffPlan",
    "DiffReport",
    "DiffSources",
    "TensorDiff",
    "diff_vs_base",
    "open_diff_sources",
    "plan_diff",
    "run_diff",
]
