"""`ckpt average`: the weighted mean of a run's LoRA steps, exact in delta space, as a PEFT adapter.

    delta_avg = sum_i w_i * s_i * B_i @ A_i        (w: --weights normalized, --ema, or uniform)

is itself a LoRA of rank sum(r_i): A_i stacked, B_i * (w_i * s_i) side by side (`sources.delta`); no
base weight is read. `--rank K` / `--energy E` bring each module down to its Eckart-Young rank (the
same math as `ckpt resize-adapter`). Trained full tensors (modules_to_save) are averaged with the same
weights (fp64, written fp32). The inputs are DCP checkpoints (full or slim) and PEFT adapters of one run;
inputs that disagree in base model, LoRA targets or alpha are refused, naming the
difference, unless `allow` names what may differ (`--allow-mismatch`). `--merge BASE` (the merged
model instead of the adapter) is `workflows.average_merge`: this op's source into the merge op.

open -> plan -> run -> report: `open_average_sources(paths, options)` opens metadata and configs;
`plan_average(sources, options)` is the frozen plan (with --rank/--energy the factors are read to
decide the ranks: a dry run reads the LoRA factors, never a base weight); `run_average` writes OUT
through `formats.peft.writer.write_adapter`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..core.delta_math import ema_weights, normalize_weights
from ..core.errors import FormatError, UsageError
from ..core.keys import DEFAULT_LAYOUT, classify
from ..core.progress import Progress
from ..formats.dcp.layout import is_checkpoint_path
from ..formats.handle import LoraSource
from ..formats.peft.writer import AdapterDirReport, OutTensor, safetensors_file_bytes, write_adapter
from ..formats.primerl.optimizers import optimizer_facts
from ..io.inputs import as_input
from ..sources.delta import DeltaSource, Term, lora_base, lora_step, peft_outputs, shared_peft_targets
from ..sources.open import open_lora_source

__all__ = [
    "MISMATCH_KINDS",
    "AverageInput",
    "AverageOptions",
    "AveragePlan",
    "AverageReport",
    "AverageSources",
    "input_facts",
    "open_average_sources",
    "plan_average",
    "run_average",
]

MISMATCH_KINDS = ("base", "targets", "alpha")


@dataclass(frozen=True)
class AverageOptions:
    out: str | Path = ""
    weights: tuple[float, ...] | None = None  # one per input, in the order given; divided by their sum
    ema: float | None = None  # beta: weights from the recurrence, in step order
    rank: int | None = None
    energy: float | None = None
    allow: frozenset[str] = frozenset()  # of MISMATCH_KINDS: what may differ between the inputs
    alpha: float | None = None  # of the DCP inputs (over their run config's); adapters keep theirs
    trust_pickle: bool = False
    layout: str = DEFAULT_LAYOUT  # how MoE expert LoRA is written (core.keys.LAYOUTS)


@dataclass(frozen=True)
class AverageInput:
    path: str
    kind: str  # dcp | peft
    step: int | None  # from step_N in the path, else the checkpoint's progress.step
    alpha: float | None
    alpha_source: str
    scale: float | list[float]
    rank: int | list[int]
    modules: int
    base: str | None  # base_model_name_or_path / the run config's model name
    base_dir: str | None  # where that name resolves here (relative names against the run's launch dir)
    weight: float = 0.0

    def to_json(self) -> dict:
        return dict(self.__dict__)


@dataclass
class AverageSources:
    inputs: list[LoraSource]
    facts: list[AverageInput]
    delta: DeltaSource | None = None  # set by plan_average: the weighted sum the run (or a merge) reads

    def close(self) -> None:
        for s in self.inputs:
            s.close()

    def __enter__(self) -> AverageSources:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def input_facts(src: LoraSource) -> AverageInput:
    """What the plan records of one input (and compares across inputs)."""
    d = src.describe()
    name, where = lora_base(src)
    return AverageInput(
        str(src.path),
        src.kind,
        lora_step(src),
        src.alpha,
        src.alpha_source,
        d["scale"],
        d["rank"],
        len(src.modules),
        name,
        None if where is None else str(where),
    )


def open_average_sources(paths: list[str | Path], options: AverageOptions) -> AverageSources:
    """Each input opened as a LoRA source (metadata and configs only), all kept open."""
    if len(paths) < 2:
        raise UsageError(
            f"ckpt average needs at least 2 inputs, got {len(paths)}",
            hint="to change one adapter's rank use `ckpt resize-adapter`",
        )
    seen: dict[Path, str] = {}
    for p in paths:
        r = as_input(p).resolve()
        if r in seen:
            raise UsageError(
                f"input given twice: {p} (and {seen[r]})",
                path=p,
                hint="to count a step twice, give it a larger --weights entry",
            )
        seen[r] = str(p)
    srcs: list[LoraSource] = []
    try:
        for p in paths:
            # --alpha is for checkpoints (which do not store it); an adapter carries its own
            dcp = is_checkpoint_path(as_input(p))
            src = open_lora_source(p, alpha=options.alpha if dcp else None, trust_pickle=options.trust_pickle)
            srcs.append(src)
        return AverageSources(srcs, [input_facts(s) for s in srcs])
    except BaseException:
        for s in srcs:
            s.close()
        raise


# ------------------------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class AveragePlan:
    out: str
    method: str  # mean | weights | ema
    ema: float | None
    inputs: tuple[AverageInput, ...]  # in the order the weights apply (step order for --ema)
    rank_rule: dict | None  # {"rank": K} | {"energy": E} | None (the exact stacked LoRA)
    modules: int
    modules_to_save: tuple[str, ...]  # trained full tensors (HF names), averaged with the same weights
    ranks: dict[str, int]  # module -> rank written
    truncations: dict[str, dict]  # module -> kept energy / error (with a rank rule)
    allowed: tuple[str, ...]
    differences: tuple[str, ...]  # what differs between the inputs (allowed, or none)
    tensors: tuple[OutTensor, ...] = field(repr=False)
    config: dict = field(repr=False)
    out_file_bytes: int = 0
    warnings: tuple[str, ...] = ()
    adapter_warnings: tuple[str, ...] = ()  # about the adapter OUT's consumers (not a --merge's output)

    def to_json(self) -> dict:
        rank_values = sorted(set(self.ranks.values()))
        return {
            "out": self.out,
            "method": self.method,
            "ema": self.ema,
            "inputs": [i.to_json() for i in self.inputs],
            "weights": [i.weight for i in self.inputs],
            "rank_rule": self.rank_rule,
            "modules": self.modules,
            "modules_to_save": list(self.modules_to_save),
            "rank": rank_values[0] if len(rank_values) == 1 else rank_values,
            "ranks": dict(self.ranks),
            "truncations": dict(self.truncations),
            "allowed": list(self.allowed),
            "differences": list(self.differences),
            "tensors": [t.to_json() for t in self.tensors],
            "config": self.config,
            "out_file_bytes": self.out_file_bytes,
            "warnings": list(self.warnings + self.adapter_warnings),
        }


def _weights(facts: list[AverageInput], options: AverageOptions) -> tuple[str, list[int], list[float]]:
    """(method, the inputs' order, their weights in that order)."""
    n = len(facts)
    if options.weights is not None and options.ema is not None:
        raise UsageError("pass --weights or --ema, not both")
    if options.weights is not None:
        if len(options.weights) != n:
            raise UsageError(
                f"--weights has {len(options.weights)} values for {n} inputs",
                hint="one weight per input, in the order the inputs are given",
            )
        return "weights", list(range(n)), normalize_weights(options.weights)
    if options.ema is not None:
        unknown = [f.path for f in facts if f.step is None]
        if unknown:
            raise UsageError(
                f"--ema needs each input's step; none found for {unknown[0]}",
                path=unknown[0],
                hint="inputs under step_N/ (or a checkpoint with progress.step), or use --weights",
            )
        steps = [f.step for f in facts if f.step is not None]  # (every one, now)
        dup = sorted({s for s in steps if steps.count(s) > 1})
        if dup:
            raise UsageError(f"--ema: step {dup[0]} is given more than once", hint="one input per step")
        order = sorted(range(n), key=lambda i: steps[i])
        return "ema", order, ema_weights(n, options.ema)
    return "mean", list(range(n)), [1.0 / n] * n


def _differences(facts: list[AverageInput], srcs: list[LoraSource]) -> dict[str, str]:
    """kind -> what differs, naming the inputs."""
    out: dict[str, str] = {}
    first, f0 = srcs[0], facts[0]
    for f, s in zip(facts[1:], srcs[1:]):
        # the resolved dirs when both are found here, else the names as written
        same = f.base_dir == f0.base_dir if f.base_dir and f0.base_dir else f.base == f0.base
        if "base" not in out and f.base is not None and f0.base is not None and not same:
            where = f" = {f0.base_dir} vs {f.base_dir}" if f.base_dir and f0.base_dir else ""
            out["base"] = f"base model {f0.base!r} ({f0.path}) vs {f.base!r} ({f.path}){where}"
        if "targets" not in out and set(s.modules) != set(first.modules):
            only0 = sorted(set(first.modules) - set(s.modules))
            only1 = sorted(set(s.modules) - set(first.modules))
            what = "; ".join(
                x
                for x in (
                    f"only in {f0.path}: {', '.join(only0[:3])}" + (" ..." if len(only0) > 3 else "")
                    if only0
                    else "",
                    f"only in {f.path}: {', '.join(only1[:3])}" + (" ..." if len(only1) > 3 else "")
                    if only1
                    else "",
                )
                if x
            )
            out["targets"] = f"LoRA targets differ: {len(first.modules)} vs {len(s.modules)} modules ({what})"
        if "targets" not in out and set(s.full_tensors) != set(first.full_tensors):
            out["targets"] = (
                f"trained full tensors (modules_to_save) differ: {sorted(first.full_tensors)} ({f0.path}) "
                f"vs {sorted(s.full_tensors)} ({f.path})"
            )
        if "alpha" not in out and (f.alpha != f0.alpha or s.use_rslora != first.use_rslora):
            out["alpha"] = (
                f"lora alpha {f0.alpha:g} ({f0.path}) vs {f.alpha:g} ({f.path})"
                if f.alpha is not None and f0.alpha is not None
                else f"alpha differs: {f0.path}, {f.path}"
            )
    return out


def plan_average(sources: AverageSources, options: AverageOptions) -> AveragePlan:
    """The average as data: the inputs checked to be steps of one run (or the differences allowed), their
    weights, the weighted sum as a `DeltaSource` (brought to `--rank` / `--energy`; kept in `sources` for
    the run), laid out as a PEFT adapter dir."""
    srcs, facts = sources.inputs, sources.facts
    unknown = sorted(set(options.allow) - set(MISMATCH_KINDS))
    if unknown:
        raise UsageError(f"--allow-mismatch {unknown[0]!r}: choose from {', '.join(MISMATCH_KINDS)}")
    if options.rank is not None and options.energy is not None:
        raise UsageError("pass --rank K or --energy E, not both")
    diffs = _differences(facts, srcs)
    _refuse_differences(diffs, options, facts, srcs)
    method, order, weights = _weights(facts, options)
    facts = [replace(facts[i], weight=w) for i, w in zip(order, weights)]
    src = _weighted_sum(srcs, order, weights)
    warnings = [w for s in srcs for w in s.warnings]
    absent = {
        a
        for s in srcs
        if s.ckpt is not None
        if (a := optimizer_facts(classify(k, e.path) for k, e in s.ckpt.entries.items()).absent) is not None
    }
    warnings += [f"{a}: nothing of the optimizer is averaged (the LoRA factors are)" for a in sorted(absent)]
    rule: dict[str, int | float] | None = None
    if options.rank is not None:
        rule = {"rank": int(options.rank)}
    elif options.energy is not None:
        rule = {"energy": float(options.energy)}
    if rule is not None:
        src.truncate_to(rank=options.rank, energy=options.energy)
    sources.delta = src
    tensors, cfg, full_warnings = peft_outputs(
        src,
        base_model_name_or_path=facts[0].base,
        target_modules=shared_peft_targets(srcs),
        layout=options.layout,
    )
    return AveragePlan(
        out=str(options.out),
        method=method,
        ema=options.ema,
        inputs=tuple(facts),
        rank_rule=rule,
        modules=len(src.modules),
        modules_to_save=tuple(src.full_tensors),
        ranks={m: s.rank for m, s in src.modules.items()},
        truncations={m: t.to_json() for m, t in src.truncations.items()},
        allowed=tuple(sorted(options.allow)),
        differences=tuple(diffs[k] for k in MISMATCH_KINDS if k in diffs),
        tensors=tensors,
        config=cfg,
        out_file_bytes=safetensors_file_bytes(list(tensors)),
        warnings=tuple(dict.fromkeys(warnings)),
        adapter_warnings=tuple(full_warnings),
    )


def _refuse_differences(
    diffs: dict[str, str], options: AverageOptions, facts: list[AverageInput], srcs: list[LoraSource]
) -> None:
    """Inputs that are not steps of one run are refused, naming the difference, unless it is allowed;
    inputs that train different full tensors always (an adapter cannot hold the base's values)."""
    refused = [k for k in MISMATCH_KINDS if k in diffs and k not in options.allow]
    if refused:
        raise FormatError(
            "the inputs are not steps of one run: " + "; ".join(diffs[k] for k in refused),
            path=facts[0].path,
            hint="average steps of one run; if the difference is intended pass "
            + " ".join(f"--allow-mismatch {k}" for k in refused)
            + (
                " (a module missing from an input counts as a zero delta there)"
                if "targets" in refused
                else ""
            )
            + (" (each input's delta keeps its own scale)" if "alpha" in refused else ""),
        )
    fulls = {frozenset(x.full_tensors) for x in srcs}
    if len(fulls) > 1:  # an input without a trained tensor has the base's there, which an adapter cannot hold
        raise FormatError(
            "the inputs train different full tensors (modules_to_save): "
            + " vs ".join(str(sorted(x)) for x in sorted(fulls, key=sorted)),
            path=facts[0].path,
            hint="average steps of one run; --allow-mismatch targets covers LoRA modules only",
        )


def _weighted_sum(srcs: list[LoraSource], order: list[int], weights: list[float]) -> DeltaSource:
    """The inputs' weighted sum (each module's terms in the weights' order) as one LoRA."""
    terms: dict[str, list[Term]] = {}
    for i, w in zip(order, weights):
        for m in srcs[i].modules:
            terms.setdefault(m, []).append(Term(i, w))
    full = {n: tuple(Term(i, w) for i, w in zip(order, weights)) for n in srcs[0].full_tensors}
    return DeltaSource(
        srcs,
        {m: tuple(t) for m, t in terms.items()},
        path=srcs[0].path,
        describe_as="average",
        full_terms=full,
    )


@dataclass(frozen=True)
class AverageReport(AdapterDirReport):
    plan: AveragePlan


def run_average(
    plan: AveragePlan, sources: AverageSources, progress: Progress | None = None, *, overwrite: bool = False
) -> AverageReport:
    """Write OUT (PEFT adapter dir, fp32 factors) from the plan's delta source, one module in flight."""
    t0 = time.perf_counter()
    src = sources.delta
    if src is None:
        raise ValueError("run_average needs the sources plan_average planned")
    size = write_adapter(
        Path(plan.out),
        plan.tensors,
        lambda t: src.read_out(t.source),
        plan.config,
        inputs=[as_input(i.path) for i in plan.inputs],
        overwrite=overwrite,
        progress=progress,
        stage="average",
    )
    return AverageReport(plan, size, round(time.perf_counter() - t0, 3))
