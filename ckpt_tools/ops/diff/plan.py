"""`ckpt diff-vs-base`'s sources and plan: WEIGHTS and BASE (any `Source`: HF dirs, hub ids, DCP
checkpoints' base weights) and an optional LoRA, paired by name from headers alone, each pair's role
marked (targeted / replaced / untargeted); an adapter that does not fit BASE is refused before any
tensor byte is read."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...core.errors import FormatError, UsageError
from ...formats.handle import LoraSource, Source, TensorFacts
from ...sources.compare import shared_names
from ...sources.open import open_lora_source, open_weights
from .device import resolve_device

__all__ = [
    "DIFFERS",
    "EXIT_ADAPTER_MISMATCH",
    "EXIT_DIFFERS",
    "EXIT_IDENTICAL",
    "IDENTICAL",
    "IDENTICAL_UPCAST",
    "REPLACED",
    "ROUNDED",
    "SAME",
    "SHAPE_CHANGED",
    "SKIPPED",
    "TARGETED",
    "UNTARGETED",
    "DiffOptions",
    "DiffPlan",
    "DiffSources",
    "PairPlan",
    "open_diff_sources",
    "plan_diff",
]

EXIT_DIFFERS = 0
EXIT_IDENTICAL = 3
EXIT_ADAPTER_MISMATCH = 4

# per-tensor status
IDENTICAL = "identical"  # same dtype and shape, same bytes
IDENTICAL_UPCAST = "identical_upcast"  # dtypes differ; bitwise equal after exact upcast
DIFFERS = "differs"
# dtypes differ; the narrower side is the wider one rounded to its dtype (round to nearest even): the same
# weights, exported (a checkpoint's fp32 trained weights and its step_N/weights, as `ckpt export` and
# prime-rl's converter write them)
ROUNDED = "rounded"
SHAPE_CHANGED = "shape_changed"
SKIPPED = "skipped"  # --targeted-only: not read
SAME = (IDENTICAL, IDENTICAL_UPCAST)

# role of a pair when an adapter is given
TARGETED = "targeted"  # W = W0 + s*B@A expected
REPLACED = "replaced"  # modules_to_save: W = the adapter's full tensor expected
UNTARGETED = "untargeted"  # W = W0 expected


@dataclass(frozen=True)
class DiffOptions:
    adapter: str | None = None
    alpha: float | None = None
    run_config: str | None = None
    targeted_only: bool = False
    trust_pickle: bool = False
    device: str | None = None  # where the adapter check's value check runs: None / "cpu", or "cuda[:N]"


@dataclass
class DiffSources:
    weights: Source
    base: Source
    lora: LoraSource | None = None

    def close(self) -> None:
        for s in (self.lora, self.base, self.weights):
            if s is not None:
                s.close()

    def __enter__(self) -> DiffSources:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_diff_sources(weights: str | Path, base: str | Path, options: DiffOptions) -> DiffSources:
    if options.adapter is None and (options.alpha is not None or options.run_config is not None):
        raise UsageError("--alpha/--run-config only apply with --adapter")
    if options.device not in (None, "cpu"):
        if options.adapter is None:
            raise UsageError(
                f"--device {options.device} only applies with --adapter (it runs the adapter check's "
                "value check; the plain comparison reads and compares bytes on the CPU)"
            )
        resolve_device(options.device)  # no such device: refused before anything is opened
    opened = []
    try:
        w = open_weights(weights, trust_pickle=options.trust_pickle)
        opened.append(w)
        b = open_weights(base, trust_pickle=options.trust_pickle)
        opened.append(b)
        lora = None
        if options.adapter is not None:
            lora = open_lora_source(
                options.adapter,
                alpha=options.alpha,
                run_config=options.run_config,
                trust_pickle=options.trust_pickle,
            )
    except BaseException:
        for s in reversed(opened):
            s.close()
        raise
    return DiffSources(w, b, lora)


@dataclass(frozen=True)
class PairPlan:
    name: str
    weights: TensorFacts
    base: TensorFacts
    role: str | None  # TARGETED / REPLACED / UNTARGETED, None without an adapter
    module: str | None  # the LoRA module for TARGETED
    read: bool  # False: skipped by --targeted-only

    @property
    def mode(self) -> str:
        if self.weights.shape != self.base.shape:
            return "shape"
        return "raw" if self.weights.dtype == self.base.dtype else "upcast"


@dataclass(frozen=True)
class DiffPlan:
    weights: dict
    base: dict
    adapter: dict | None
    pairs: tuple[PairPlan, ...]
    only_in_weights: tuple[str, ...]
    only_in_base: tuple[str, ...]
    targets_missing_in_weights: tuple[str, ...]  # tensors the adapter changes that WEIGHTS lacks
    targeted_only: bool

    @property
    def bytes_to_read(self) -> int:
        return sum(p.weights.nbytes + p.base.nbytes for p in self.pairs if p.read)

    @property
    def units(self) -> tuple[PairPlan, ...]:
        """The independent work units: one tensor pair each."""
        return tuple(p for p in self.pairs if p.read)


def plan_diff(sources: DiffSources, options: DiffOptions) -> DiffPlan:
    """Pair tensors by name (metadata only). With a LoRA source, mark roles and refuse an adapter
    that does not fit BASE (all problems in one error)."""
    weights, base, lora = sources.weights, sources.base, sources.lora
    targeted_only = options.targeted_only
    if targeted_only and lora is None:
        raise UsageError("--targeted-only needs --adapter (it reads only the tensors the adapter targets)")
    wk, bk = set(weights.names()), set(base.names())
    shared = shared_names(weights, base)
    roles: dict[str, tuple[str, str | None]] = {}
    missing_in_weights: list[str] = []
    if lora is not None:
        problems = []
        for module, spec in sorted(lora.modules.items()):
            name = spec.weight_name
            if name not in bk:
                problems.append(f"targets {name}, which BASE does not have")
                continue
            roles[name] = (TARGETED, module)
        for name in sorted(lora.full_tensors):
            if name not in bk:
                problems.append(f"replaces {name} (modules_to_save), which BASE does not have")
                continue
            roles[name] = (REPLACED, None)
        if problems:
            shown = "; ".join(problems[:10]) + (
                f"; and {len(problems) - 10} more" if len(problems) > 10 else ""
            )
            raise FormatError(
                f"the adapter does not fit BASE: {shown}",
                path=lora.path,
                hint="the adapter was trained on a different base model, or BASE is not the base",
            )
        if not roles:
            raise FormatError(
                "the adapter targets no tensor",
                path=lora.path,
                hint="an adapter that matches nothing would merge to the base unchanged",
            )
        missing_in_weights = sorted(n for n in roles if n not in wk)
    pairs = []
    for name in shared:
        role, target = roles.get(name, (UNTARGETED if lora is not None else None, None))
        read = not targeted_only or role in (TARGETED, REPLACED)
        pairs.append(PairPlan(name, weights.facts(name), base.facts(name), role, target, read))
    return DiffPlan(
        weights=weights.describe(),
        base=base.describe(),
        adapter=lora.describe() if lora is not None else None,
        pairs=tuple(pairs),
        only_in_weights=tuple(sorted(wk - bk)),
        only_in_base=tuple(sorted(bk - wk)),
        targets_missing_in_weights=tuple(missing_in_weights),
        targeted_only=targeted_only,
    )
