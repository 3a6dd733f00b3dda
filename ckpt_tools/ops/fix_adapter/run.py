"""fix-adapter executed: the planned adapter dir written, each tensor read from SRC as the plan says (as
stored, a per-expert view of SRC's fused LoRA, a fused LoRA built from per-expert factors, or from
--checkpoint)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ...core.progress import Progress
from ...formats.peft.experts import build_fused, read_view
from ...formats.peft.writer import AdapterDirReport, OutTensor, write_adapter
from .plan import FixPlan
from .sources import FixSources

__all__ = ["FixReport", "run_fix"]


@dataclass(frozen=True)
class FixReport(AdapterDirReport):
    plan: FixPlan


def run_fix(
    plan: FixPlan, weights: FixSources, progress: Progress | None = None, *, overwrite: bool = False
) -> FixReport:
    t0 = time.perf_counter()
    inputs = (
        [plan.src]
        + ([plan.base_checked] if plan.base_checked else [])
        + ([weights.ckpt.path] if weights.ckpt is not None else [])
    )  # --base and --checkpoint are read too
    reads = plan.reads
    # the fused tensors the last views were cut from: one block's A and B of gate_up and down
    cache: dict = {}

    def factor(m: str, ab: str) -> torch.Tensor:
        key = reads.factor_keys[m][0 if ab == "A" else 1]
        if m not in reads.views:
            return weights.read_tensor(key)
        if key not in cache:
            if len(cache) >= 4:
                cache.pop(next(iter(cache)))
            cache[key] = weights.read_tensor(key)
        return read_view(reads.views[m], ab, cache[key], key=key, path=weights.path)

    def read(t: OutTensor):
        if t.source in reads.view_sources:
            return factor(*reads.view_sources[t.source])
        if t.source in reads.fused_sources:
            return build_fused(*reads.fused_sources[t.source], factor)
        return weights.read_tensor(t.source)

    size = write_adapter(
        plan.out,
        plan.tensors,
        read,
        plan.config,
        inputs=inputs,
        overwrite=overwrite,
        progress=progress,
        stage="fix",
    )
    return FixReport(plan, size, round(time.perf_counter() - t0, 3))
