"""`ckpt resize-adapter`: each module of an adapter brought to its best rank-K delta (or the smallest
rank keeping E of its squared Frobenius norm), written as a PEFT adapter.

Per module, D = s * B @ A is factored through thin QRs (A^T = Qa Ra, B = Qb Rb) and the SVD of the
r x r core Rb Ra^T (`core.delta_math.truncate`, fp64, the d x d product never formed); the leading
k singular triplets are the Eckart-Young optimum, written in fp32 with scale 1. The report gives each
module's kept energy and error ||D - D_k||_F = sqrt(sum of the discarded s_i^2). Grouped-expert
(MoE) LoRA is resized per expert. The input is a PEFT adapter dir or a prime-rl DCP checkpoint.

open -> plan -> run -> report: the plan reads the factors (they decide the ranks), never a base weight.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import UsageError
from ..core.keys import DEFAULT_LAYOUT
from ..core.progress import Progress
from ..formats.peft.writer import AdapterDirReport, OutTensor, safetensors_file_bytes, write_adapter
from ..io.inputs import as_input
from ..sources.delta import DeltaSource, Term, lora_base_name, peft_outputs, shared_peft_targets
from ..sources.open import open_lora_source

__all__ = ["ResizeOptions", "ResizePlan", "ResizeReport", "open_resize_sources", "plan_resize", "run_resize"]


@dataclass(frozen=True)
class ResizeOptions:
    out: str | Path = ""
    rank: int | None = None
    energy: float | None = None
    alpha: float | None = None  # a DCP input without a run config
    trust_pickle: bool = False
    layout: str = DEFAULT_LAYOUT  # how MoE expert LoRA is written (core.keys.LAYOUTS)


def open_resize_sources(path: str | Path, options: ResizeOptions) -> DeltaSource:
    """The adapter (PEFT dir or DCP checkpoint) as a one-term delta source (metadata only)."""
    src = open_lora_source(path, alpha=options.alpha, trust_pickle=options.trust_pickle)
    try:
        # trained full tensors (modules_to_save) are carried over unchanged (fp32)
        return DeltaSource(
            [src],
            {m: (Term(0, 1.0),) for m in src.modules},
            path=as_input(src.path),
            describe_as="resize",
            full_terms={n: (Term(0, 1.0),) for n in src.full_tensors},
        )
    except BaseException:
        src.close()
        raise


@dataclass(frozen=True)
class ResizePlan:
    adapter: str
    kind: str
    out: str
    rank_rule: dict
    rank_in: int | list[int]
    modules: int
    ranks: dict[str, int]
    truncations: dict[str, dict]  # module -> rank_in, rank, energy_kept, error, ...
    modules_to_save: tuple[str, ...]  # trained full tensors, carried over unchanged
    energy_kept: float  # over the whole adapter: sum of kept s^2 / sum of s^2
    error: float  # sqrt(sum over modules of error^2)
    tensors: tuple[OutTensor, ...] = field(repr=False)
    config: dict = field(repr=False)
    out_file_bytes: int = 0
    warnings: tuple[str, ...] = ()

    def to_json(self) -> dict:
        rank_values = sorted(set(self.ranks.values()))
        return {
            "adapter": self.adapter,
            "kind": self.kind,
            "out": self.out,
            "rank_rule": self.rank_rule,
            "rank_in": self.rank_in,
            "rank": rank_values[0] if len(rank_values) == 1 else rank_values,
            "modules": self.modules,
            "modules_to_save": list(self.modules_to_save),
            "ranks": dict(self.ranks),
            "truncations": dict(self.truncations),
            "energy_kept": self.energy_kept,
            "error": self.error,
            "tensors": [t.to_json() for t in self.tensors],
            "config": self.config,
            "out_file_bytes": self.out_file_bytes,
            "warnings": list(self.warnings),
        }


def plan_resize(src: DeltaSource, options: ResizeOptions) -> ResizePlan:
    rank_rule: dict[str, int | float]
    if options.rank is not None and options.energy is None:
        rank_rule = {"rank": int(options.rank)}
    elif options.energy is not None and options.rank is None:
        rank_rule = {"energy": float(options.energy)}
    else:
        raise UsageError("pass exactly one of --rank K or --energy E", hint="e.g. --rank 8 or --energy 0.99")
    inner = src.inputs[0]
    truncs = src.truncate_to(rank=options.rank, energy=options.energy)
    tensors, cfg, full_warnings = peft_outputs(
        src,
        base_model_name_or_path=lora_base_name(inner),
        target_modules=shared_peft_targets([inner]),
        layout=options.layout,
    )
    total = sum(t.energy_total for t in truncs.values())
    kept = sum(t.energy_kept for t in truncs.values())
    warnings = list(inner.warnings) + list(full_warnings)
    grown = sorted(m for m, t in truncs.items() if options.rank is not None and t.rank < options.rank)
    if grown:
        warnings.append(
            f"{len(grown)} module(s) have rank below --rank {options.rank} (e.g. {grown[0]}: "
            f"{truncs[grown[0]].rank}); they are written at their own rank, exactly"
        )
    return ResizePlan(
        adapter=str(inner.path),
        kind=inner.kind,
        out=str(options.out),
        rank_rule=rank_rule,
        rank_in=inner.describe()["rank"],
        modules=len(src.modules),
        ranks={m: t.rank for m, t in truncs.items()},
        truncations={m: t.to_json() for m, t in truncs.items()},
        modules_to_save=tuple(src.full_tensors),
        energy_kept=kept / total if total > 0 else 1.0,
        error=sum(t.error**2 for t in truncs.values()) ** 0.5,
        tensors=tensors,
        config=cfg,
        out_file_bytes=safetensors_file_bytes(list(tensors)),
        warnings=tuple(warnings),
    )


@dataclass(frozen=True)
class ResizeReport(AdapterDirReport):
    plan: ResizePlan


def run_resize(
    plan: ResizePlan, src: DeltaSource, progress: Progress | None = None, *, overwrite: bool = False
) -> ResizeReport:
    """Write OUT (PEFT adapter dir, fp32 factors), one module in flight."""
    t0 = time.perf_counter()
    size = write_adapter(
        Path(plan.out),
        plan.tensors,
        lambda t: src.read_out(t.source),
        plan.config,
        inputs=[as_input(plan.adapter)],
        overwrite=overwrite,
        progress=progress,
        stage="resize",
    )
    return ResizeReport(plan, size, round(time.perf_counter() - t0, 3))
