"""The Python API: every operation of the CLI as one function with a typed result (docs/api.md).

    import ckpt_tools
    report = ckpt_tools.merge("Qwen/Qwen3-8B", "outputs/checkpoints/step_95/trainer", "merged-95")
    print(report.result.merged_modules, report.to_json())

Each function opens its inputs, plans from metadata and, unless `dry_run`, runs: the same three calls
the command makes (`open_X_sources -> plan_X -> run_X`), so a script gets the CLI's checks, atomic
outputs and errors (`ckpt_tools.core.errors.CkptError`: `.message`, `.path`, `.key`, `.hint`). Every
result has `.to_json()`: the `plan` / `result` of the command's `--json` envelope. Every function
taking a hub id takes `download=True` (the commands' `--download`). `progress`, where
taken, is called with `ckpt_tools.core.progress.ProgressEvent`s.
"""
from __future__ import annotations

import functools
from pathlib import Path

from .core.primerl_state import SchedulerSpec
from .core.progress import Progress
from .formats.dcp.reader import DcpCheckpoint
from .formats.hf_dir.hub import resolve_model_dir
from .formats.hf_dir.model_dir import HFModelDir
from .formats.peft.adapter import PeftAdapter, open_peft_adapter
from .formats.sniff import DCP, HF, PEFT, sniff
from .io import hub_fetch
from .io.owned import command_scope
from .ops.adapter_to_dcp import ToDcpOptions, ToDcpReport, open_to_dcp_sources, plan_adapter_to_dcp, \
    run_adapter_to_dcp
from .ops.average import AverageOptions, AverageReport, open_average_sources, plan_average, run_average
from .ops.diff import DiffReport
from .ops.diff import diff_vs_base as _diff_vs_base
from .ops.doctor import DoctorReport
from .ops.doctor import doctor as _doctor
from .ops.extract_adapter import ExtractOptions, ExtractReport, plan_extract, run_extract
from .ops.fix_adapter import FixOptions, FixReport, open_fix_source, plan_fix, run_fix
from .ops.gc import gc as _gc
from .ops.inspect import InspectOptions, InspectReport, plan_inspect, run_inspect
from .ops.merge import ExportOptions, MergeOptions, MergeReport, check_output, open_export_sources, open_merge_sources, \
    plan_export, plan_merge, run_export, run_merge
from .ops.rehydrate import RehydrateReport
from .ops.report import ReportOptions, ReportReport, plan_report, run_report
from .ops.rehydrate import rehydrate as _rehydrate
from .ops.resize_adapter import ResizeOptions, ResizeReport, open_resize_sources, plan_resize, run_resize
from .ops.set_lr import PatchReport
from .ops.set_lr import set_lr as _set_lr
from .ops.set_lr import set_values as _set_values
from .ops.slim import SlimReport
from .ops.slim import slim as _slim
from .ops.verify import VerifyReport, verify_path
from .workflows.average_merge import AverageMergeReport, average_merge
from .workflows.restart_prep import restart_prep as _restart_prep

__all__ = ["open", "inspect", "extract_adapter", "merge", "export", "diff_vs_base", "verify", "slim", "rehydrate",
           "set_lr", "set_values", "adapter_to_dcp", "fix_adapter", "restart_prep", "gc", "doctor", "average",
           "resize_adapter", "report", "ReportReport", "InspectReport", "ExtractReport", "MergeReport", "DiffReport", "VerifyReport", "SlimReport",
           "RehydrateReport", "PatchReport", "ToDcpReport", "FixReport", "DoctorReport", "SchedulerSpec", "AverageReport",
           "AverageMergeReport", "ResizeReport"]


def open(path: str | Path, *, trust_pickle: bool = False) -> DcpCheckpoint | HFModelDir | PeftAdapter:  # noqa: A001
    """The format's one lazy handle of what `path` is (metadata read, tensors on demand): a `DcpCheckpoint`
    (`.entries`, `.read_object(key)`, `.read_tensor(key)`; its tensors as `Source`s: `.base_weights()`,
    `.by_key()`; its LoRA: `.lora(alpha=...)`), an `HFModelDir`, itself a `Source` (`.names()`, `.facts(name)`,
    `.read_tensor(name)`, `.read_rows(name, start, count)`, `.info(name)`) or a `PeftAdapter` (`.modules`,
    `.read_pair(module)`; `.lora()`). A hub id (`org/name[@revision]`) is looked up in the local HF cache.
    Use it as a context manager: leaving the block closes its files."""
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
                    trust_pickle: bool = False, progress: Progress | None = None,
                    layout: str = "peft") -> ExtractReport:
    """A prime-rl DCP checkpoint's LoRA as a PEFT adapter dir at `out` (`ckpt extract-adapter`; `layout`:
    peft | vllm | prime-rl, how MoE expert LoRA is written, docs/adapters.md)."""
    with DcpCheckpoint.open(Path(ckpt), trust_pickle=trust_pickle).lora(
            alpha=alpha, run_config=None if run_config is None else Path(run_config), slot=slot) as src:
        plan = plan_extract(src, ExtractOptions(out, base, dtype, layout))
        return ExtractReport(plan) if dry_run else run_extract(plan, src, progress, overwrite=overwrite)


def merge(base: str | Path | None, adapter: str | Path, out: str | Path, *, dry_run: bool = False,
          overwrite: bool = False, progress: Progress | None = None, **options) -> MergeReport:
    """The LoRA of `adapter` (PEFT dir or DCP checkpoint) merged into `base` (HF dir or hub id), written
    to `out` (`ckpt merge`). `options`: the fields of `ops.merge.MergeOptions` (alpha, run_config,
    dtype, max_shard_size, base_from_checkpoint, config_from, slot, threads, allow_zero_delta, ...).
    `.result` is None in a dry run."""
    opts = MergeOptions(out=str(out), **{k: str(v) if k in ("config_from", "run_config") and v is not None else v
                                         for k, v in options.items()})
    with open_merge_sources(None if base is None else str(base), str(adapter), opts) as sources:
        plan = plan_merge(sources, opts)
        check_output(plan, out, overwrite=overwrite)
        if dry_run:
            return MergeReport(plan)
        return run_merge(plan, sources, progress, overwrite=overwrite)


def export(ckpt: str | Path, out: str | Path, *, config_from: str | Path | None = None, dry_run: bool = False,
           overwrite: bool = False, progress: Progress | None = None, **options) -> MergeReport:
    """A DCP checkpoint as an HF model dir (`ckpt export`): a full fine-tune's trained weights, or a LoRA
    run's merged model, from the checkpoint's fp32 masters. `options`: the fields of
    `ops.merge.ExportOptions` (alpha, run_config, slot, dtype, max_shard_size, threads, allow_zero_delta,
    trust_pickle). `.result` is None in a dry run."""
    opts = ExportOptions(out=str(out), config_from=None if config_from is None else str(config_from), **options)
    with open_export_sources(ckpt, opts) as sources:
        plan = plan_export(sources, opts)
        check_output(plan, out, overwrite=overwrite)
        if dry_run:
            return MergeReport(plan)
        return run_export(plan, sources, progress, overwrite=overwrite)


def adapter_to_dcp(adapter: str | Path, out: str | Path, *, base: str | Path, lr: float | None = None,
                   step: int | None = None, world_size: int = 4, optimizer_from: str | Path | None = None,
                   scheduler: SchedulerSpec | None = None, scheduler_step: int | None = None, dry_run: bool = False,
                   overwrite: bool = False, trust_pickle: bool = False,
                   progress: Progress | None = None) -> ToDcpReport:
    """A prime-rl trainer checkpoint that resumes from a PEFT adapter and the HF base (`ckpt adapter-to-dcp`);
    `scheduler`: a `SchedulerSpec` (constant | linear | cosine, with prime-rl's own validation)."""
    options = ToDcpOptions(out, lr=lr, step=step, world_size=world_size, scheduler=scheduler,
                           scheduler_step=scheduler_step, trust_pickle=trust_pickle)
    with open_to_dcp_sources(adapter, str(base), optimizer_from=optimizer_from, trust_pickle=trust_pickle) as sources:
        plan = plan_adapter_to_dcp(sources, options)
        if dry_run:
            return ToDcpReport(plan, full=True)
        return run_adapter_to_dcp(plan, sources, progress, overwrite=overwrite)


def fix_adapter(src: str | Path, out: str | Path, *, base: str | Path | None = None, slot: int | None = None,
                alpha: float | None = None, run_config: str | Path | None = None, dry_run: bool = False,
                overwrite: bool = False, progress: Progress | None = None) -> FixReport:
    """prime-rl's own adapter export (a broadcast dir or a weights export) as a PEFT dir that applies
    (`ckpt fix-adapter`)."""
    options = FixOptions(out, None if base is None else str(base), slot, alpha,
                         None if run_config is None else str(run_config))
    with open_fix_source(src) as weights:
        plan = plan_fix(weights, src, options)
        return FixReport(plan) if dry_run else run_fix(plan, weights, progress, overwrite=overwrite)


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


def set_values(ckpt: str | Path, out: str | Path | None, assignments: list[str], *, in_place: bool = False,
               dry_run: bool = False, overwrite: bool = False, trust_pickle: bool = False) -> PatchReport:
    """Scalar byte items of a checkpoint set by surgery, `KEY=VALUE` each (`ckpt set`)."""
    return _set_values(ckpt, out, list(assignments), in_place=in_place, dry_run=dry_run, overwrite=overwrite,
                       trust_pickle=trust_pickle)


def restart_prep(run_or_ckpt: str | Path, out: str | Path, *, base: str | None, lr: float | None,
                 progress: Progress | None = None, **options) -> dict:
    """The fresh-LR restart in one call (`ckpt restart-prep`): merge mode (a merged bf16 model) or adapter
    mode (a resumable checkpoint with fresh AdamW). `options`: config, mode, alpha, run_config, dtype,
    max_shard_size, world_size, scheduler_step, config_out, dry_run, overwrite, trust_pickle. Returns the
    command's JSON report, with "next" (what to run next)."""
    return _restart_prep(run_or_ckpt, out, base=base, lr=lr, progress=progress, **options)


def gc(checkpoints_dir: str | Path, *, keep_full: int, base: str | Path | None = None, dry_run: bool = False,
       trust_pickle: bool = False, progress: Progress | None = None, **options) -> dict:
    """A run's checkpoints kept: the newest `keep_full` whole, older ones slim in place (`ckpt gc`).
    `options`: min_age_s. Returns the command's JSON report (`plan`, and `steps` unless `dry_run`)."""
    return _gc(checkpoints_dir, keep_full=keep_full, base=base, dry_run=dry_run, trust_pickle=trust_pickle,
               progress=progress, **options)


def doctor(target: str | Path | None = None, **options) -> DoctorReport:
    """A prime-rl run's config and disk traps (`ckpt doctor`): `.exit_code` (0 none, 3 found), `.findings`.
    `target`: a run dir, outputs dir or checkpoint; or None with `files=[...]` (config files in `rl @`
    order) and `sections`. `options`: files, sections, outputs, base, decode_rate, compare_weights,
    trust_pickle."""
    return _doctor(target, **options)


def average(inputs: list[str | Path], out: str | Path, *, weights: list[float] | None = None, ema: float | None = None,
            rank: int | None = None, energy: float | None = None, merge: str | Path | None = None,
            dtype: str | None = None, allow_mismatch: tuple[str, ...] = (), alpha: float | None = None,
            layout: str = "peft", dry_run: bool = False, overwrite: bool = False, trust_pickle: bool = False,
            progress: Progress | None = None) -> AverageReport | AverageMergeReport:
    """The weighted mean of LoRA steps (DCP checkpoints, PEFT adapters) in delta space, as a PEFT adapter
    at `out` (`ckpt average`), exact at rank sum(r_i) or brought down by `rank` / `energy`; with `merge`
    (an HF base), the merged model instead (`.result` None in a dry run). docs/delta-space.md."""
    options = AverageOptions(out=str(out), weights=None if weights is None else tuple(float(w) for w in weights),
                             ema=ema, rank=rank, energy=energy, allow=frozenset(allow_mismatch), alpha=alpha,
                             trust_pickle=trust_pickle, layout=layout)
    if merge is not None:
        return average_merge(list(inputs), merge, out, options=options,
                             merge_options=MergeOptions(dtype=dtype, trust_pickle=trust_pickle), dry_run=dry_run,
                             overwrite=overwrite, progress=progress)
    with open_average_sources(list(inputs), options) as sources:
        plan = plan_average(sources, options)
        return AverageReport(plan) if dry_run else run_average(plan, sources, progress, overwrite=overwrite)


def resize_adapter(adapter: str | Path, out: str | Path, *, rank: int | None = None, energy: float | None = None,
                   alpha: float | None = None, layout: str = "peft", dry_run: bool = False, overwrite: bool = False,
                   trust_pickle: bool = False, progress: Progress | None = None) -> ResizeReport:
    """Each module of `adapter` (PEFT dir or DCP checkpoint) at its best rank `rank` (or the smallest rank
    keeping `energy` of its squared norm), written as a PEFT adapter at `out` (`ckpt resize-adapter`);
    `.plan.truncations` has each module's kept energy and error."""
    options = ResizeOptions(out=str(out), rank=rank, energy=energy, alpha=alpha, trust_pickle=trust_pickle, layout=layout)
    with open_resize_sources(adapter, options) as src:
        plan = plan_resize(src, options)
        return ResizeReport(plan) if dry_run else run_resize(plan, src, progress, overwrite=overwrite)


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


def _as_command(fn, command: str):
    """`fn` recording `command` in the outputs it writes (their `.ckpt-tools-output` marker), as the CLI does;
    `download=True` is the command's `--download` (a hub id missing from the HF cache is fetched into it,
    only the files the command needs: `io.hub_fetch`)."""
    @functools.wraps(fn)
    def run_as_command(*args, download: bool = False, **kwargs):
        with command_scope(command), hub_fetch.allowing(download):
            return fn(*args, **kwargs)
    return run_as_command


# each function is its command (`set_values` is `ckpt set`: `set` is Python's builtin)
for _name in [n for n in __all__ if n[0].islower() and n != "open"]:
    globals()[_name] = _as_command(globals()[_name], "set" if _name == "set_values" else _name.replace("_", "-"))
del _name
