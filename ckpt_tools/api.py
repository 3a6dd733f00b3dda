"""The Python API: every operation of the CLI as one function with a typed result (docs/api.md).

    import ckpt_tools
    report = ckpt_tools.merge("Qwen/Qwen3-8B", "outputs/checkpoints/step_95/trainer", "merged-95")
    print(report.result.merged_modules, report.to_json())

Each function opens its inputs, plans from metadata and, unless `dry_run`, runs: the same three calls
the command makes (`open_X_sources -> plan_X -> run_X`), so a script gets the CLI's checks, atomic
outputs and errors (`ckpt_tools.core.errors.CkptError`: `.message`, `.path`, `.key`, `.hint`). Every
result has `.to_json()`: the `plan` / `result` of the command's `--json` envelope. `progress`, where
taken, is called with `ckpt_tools.core.progress.ProgressEvent`s.
"""
from __future__ import annotations

from pathlib import Path

from .core.progress import Progress
from .formats.dcp.reader import DcpCheckpoint
from .formats.hf_dir.hub import resolve_model_dir
from .formats.hf_dir.model_dir import HFModelDir
from .formats.peft.adapter import PeftAdapter, open_peft_adapter
from .formats.sniff import DCP, HF, PEFT, sniff
from .ops.diff import DiffReport
from .ops.diff import diff_vs_base as _diff_vs_base
from .ops.extract_adapter import ExtractOptions, ExtractReport, plan_extract, run_extract
from .ops.inspect import InspectOptions, InspectReport, plan_inspect, run_inspect
from .ops.merge import MergeOptions, MergeReport, check_output, open_merge_sources, plan_merge, run_merge
from .ops.rehydrate import RehydrateReport
from .ops.report import ReportOptions, ReportReport, plan_report, run_report
from .ops.rehydrate import rehydrate as _rehydrate
from .ops.set_lr import PatchReport
from .ops.set_lr import set_lr as _set_lr
from .ops.slim import SlimReport
from .ops.slim import slim as _slim
from .ops.verify import VerifyReport, verify_path
from .sources.lora import DcpLoraSource

__all__ = ["open", "inspect", "extract_adapter", "merge", "diff_vs_base", "verify", "slim", "rehydrate", "set_lr",
           "report", "ReportReport", "InspectReport", "ExtractReport", "MergeReport", "DiffReport", "VerifyReport", "SlimReport",
           "RehydrateReport", "PatchReport"]


def open(path: str | Path, *, trust_pickle: bool = False) -> DcpCheckpoint | HFModelDir | PeftAdapter:  # noqa: A001
    """The lazy handle of what `path` is (metadata read, tensors on demand): a `DcpCheckpoint`
    (`.entries`, `.read_object(key)`, `.read_tensor(key)`), an `HFModelDir` (`.keys()`, `.info(name)`,
    `.read_tensor(name)`) or a `PeftAdapter` (`.modules`, `.read_pair(module)`). A hub id
    (`org/name[@revision]`) is looked up in the local HF cache. Use it as a context manager."""
    p = Path(path)
    if not p.exists():
        p = resolve_model_dir(str(path))
    kind = sniff(p)
    if kind == DCP:
        return DcpCheckpoint.open(p, trust_pickle=trust_pickle)
    if kind == HF:
        return HFModelDir.open(p)
    if kind == PEFT:
        return open_peft_adapter(p, strict=False)
    plan_inspect(p, InspectOptions())   # the one error for "not a checkpoint, model or adapter"
    raise ValueError(f"{p}: a checkpoints dir has no single handle; open one of its step_N/trainer dirs")


def inspect(path: str | Path, *, alpha: float | None = None, run_config: str | Path | None = None,
            keys: bool = False, trust_pickle: bool = False) -> InspectReport:
    """What `ckpt inspect` prints, from metadata alone: `.plan.kind` (dcp | checkpoints | hf | peft)
    and `.data` (the description, or with `keys` one row per DCP key)."""
    p = Path(path) if Path(path).exists() else resolve_model_dir(str(path))
    options = InspectOptions(alpha, None if run_config is None else str(run_config), keys, trust_pickle)
    return run_inspect(plan_inspect(p, options))


def extract_adapter(ckpt: str | Path, out: str | Path, *, alpha: float | None = None,
                    run_config: str | Path | None = None, base: str | None = None, slot: int = 0,
                    dtype: str = "fp32", dry_run: bool = False, overwrite: bool = False,
                    trust_pickle: bool = False, progress: Progress | None = None) -> ExtractReport:
    """A prime-rl DCP checkpoint's LoRA as a PEFT adapter dir at `out` (`ckpt extract-adapter`)."""
    with DcpLoraSource(Path(ckpt), alpha=alpha, run_config=None if run_config is None else Path(run_config),
                       slot=slot, trust_pickle=trust_pickle) as src:
        plan = plan_extract(src, ExtractOptions(out, base, dtype))
        return ExtractReport(plan) if dry_run else run_extract(plan, src, progress, overwrite=overwrite)


def merge(base: str | Path | None, adapter: str | Path, out: str | Path, *, dry_run: bool = False,
          overwrite: bool = False, progress: Progress | None = None, **options) -> MergeReport:
    """The LoRA of `adapter` (PEFT dir or DCP checkpoint) merged into `base` (HF dir or hub id), written
    to `out` (`ckpt merge`). `options`: the fields of `ops.merge.MergeOptions` (alpha, run_config,
    dtype, max_shard_size, base_from_checkpoint, config_from, slot, threads, allow_zero_delta, ...).
    `.result` is None in a dry run."""
    opts = MergeOptions(out=str(out), **options)
    with open_merge_sources(None if base is None else str(base), str(adapter), opts) as sources:
        plan = plan_merge(sources, opts)
        check_output(plan, out, overwrite=overwrite)
        if dry_run:
            return MergeReport(plan)
        return run_merge(plan, sources, progress, overwrite=overwrite)


def diff_vs_base(weights: str | Path, base: str | Path, *, adapter: str | Path | None = None,
                 alpha: float | None = None, run_config: str | Path | None = None, targeted_only: bool = False,
                 trust_pickle: bool = False, progress: Progress | None = None) -> DiffReport:
    """Whether `weights` differ from `base`, tensor by tensor (`ckpt diff-vs-base`): `.verdict`,
    `.exit_code` (0 differ, 3 identical, 4 adapter check failed), `.tensors`."""
    return _diff_vs_base(weights, base, adapter=adapter, alpha=alpha, run_config=run_config,
                         targeted_only=targeted_only, trust_pickle=trust_pickle, progress=progress)


def verify(path: str | Path, *, deep: bool = False, base: str | Path | None = None, trust_pickle: bool = False,
           progress: Progress | None = None) -> VerifyReport:
    """Integrity of a DCP checkpoint, HF dir or PEFT adapter (`ckpt verify`): `.ok`, `.problems`."""
    return verify_path(path, deep=deep, base=base, trust_pickle=trust_pickle, progress=progress)


def slim(ckpt: str | Path, out: str | Path, *, base: str | Path | None = None, dry_run: bool = False,
         overwrite: bool = False, trust_pickle: bool = False, progress: Progress | None = None) -> SlimReport:
    """The checkpoint without its frozen base weights (`ckpt slim`)."""
    return _slim(ckpt, out, base=base, dry_run=dry_run, overwrite=overwrite, trust_pickle=trust_pickle,
                 progress=progress)


def rehydrate(slim_ckpt: str | Path, out: str | Path, *, base: str | Path, world_size: int | None = None,
              dry_run: bool = False, overwrite: bool = False, trust_pickle: bool = False,
              progress: Progress | None = None) -> RehydrateReport:
    """The full checkpoint rebuilt bit-exactly from a slim one and the base (`ckpt rehydrate`)."""
    return _rehydrate(slim_ckpt, out, base=base, world_size=world_size, dry_run=dry_run, overwrite=overwrite,
                      trust_pickle=trust_pickle, progress=progress)


def set_lr(ckpt: str | Path, out: str | Path | None, *, lr: float | None = None, scale: float | None = None,
           min_lr: float | None = None, in_place: bool = False, dry_run: bool = False, overwrite: bool = False,
           trust_pickle: bool = False) -> PatchReport:
    """A checkpoint with a new learning rate, Adam moments kept (`ckpt set-lr`)."""
    return _set_lr(ckpt, out, lr=lr, scale=scale, min_lr=min_lr, in_place=in_place, dry_run=dry_run,
                   overwrite=overwrite, trust_pickle=trust_pickle)


def report(path: str | Path, *, base: str | Path | None = None, out: str | Path | None = None,
           png_dir: str | Path | None = None, set_lr: float | None = None, scale: float | None = None,
           alpha: float | None = None, run_config: str | Path | None = None, dry_run: bool = False,
           overwrite: bool = False, trust_pickle: bool = False, progress: Progress | None = None) -> ReportReport:
    """What a run changed and its learning rate (`ckpt report`): `.result.steps[step].modules[name]`
    (delta_fro, weight_fro, rel_delta), `.result.lr` (past, planned, set_lr); the page written to `out`
    and one PNG per plot into `png_dir` when given (nothing is written otherwise). `dry_run`: the plan only
    (what PATH is, its steps, the base, max_steps), `.result` None."""
    options = ReportOptions(base=None if base is None else str(base), out=None if out is None else str(out),
                            png_dir=None if png_dir is None else str(png_dir), set_lr=set_lr, scale=scale,
                            alpha=alpha, run_config=None if run_config is None else str(run_config),
                            overwrite=overwrite, trust_pickle=trust_pickle)
    plan = plan_report(path, options)
    return ReportReport(plan) if dry_run else run_report(plan, progress)
