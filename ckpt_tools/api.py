"""The Python API: every operation of the CLI as one function with a typed result (docs/api.md).

    import ckpt_tools
    report = ckpt_tools.merge("Qwen/Qwen3-8B", "outputs/checkpoints/step_95/trainer", "merged-95")
    print(report.result.merged_modules, report.to_json())

Each function is its command: it opens the inputs, plans from metadata and, unless `dry_run`, runs
(`open_X_sources -> plan_X -> run_X`, the op's one path), so a script gets the CLI's checks, atomic
outputs and errors (`ckpt_tools.core.errors.CkptError`: `.message`, `.path`, `.key`, `.hint`). The CLI
is a thin client of these functions: each `ckpt` command parses its arguments, makes one call here and
renders the report. Every result is a typed report with `.to_json()`: the `plan` / `result` of the
command's `--json` envelope; a dry run that would write OUT returns a `DryRunReport` (the report, plus what
writing OUT would do). Every option is a keyword argument, named as the command's flag. `progress`,
where taken, is called with `ckpt_tools.core.progress.ProgressEvent`s; `group`
(the commands that split their work over torchrun's ranks) is a `ckpt_tools.dist.Group`, by default
`dist.current()` (solo outside torchrun). Every command's function takes `download=True` (the commands'
`--download`: a hub id missing from the HF cache is fetched into it, only the files the command needs) and
records its command in the outputs it writes (their `.ckpt-tools-output` marker), as the CLI does.

This module imports no op until one is called (`import ckpt_tools.api` is torch-free, so `ckpt
--help` and the metadata commands stay fast): each function imports its op with SIGINT/SIGTERM held
(`io.signals.signals_deferred`: a signal inside numpy's initialization leaves it half-loaded). The
report classes named in `__all__` are loaded on first access.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

from .core.dry_run import DryRunReport
from .core.progress import Progress
from .io import hub_fetch
from .io.inputs import as_input
from .io.owned import command_scope
from .io.remote_url import parse_url
from .io.signals import signals_deferred as _loading

if TYPE_CHECKING:  # loaded on first use (see `__getattr__`)
    from .core.primerl_state import SchedulerSpec
    from .dist import Group
    from .formats.dcp.reader import DcpCheckpoint
    from .formats.hf_dir.model_dir import HFModelDir
    from .formats.peft.adapter import PeftAdapter
    from .ops.adapter_to_dcp import ToDcpReport
    from .ops.average import AverageReport
    from .ops.diff import SAME as DIFF_SAME
    from .ops.diff import SKIPPED as DIFF_SKIPPED
    from .ops.diff import DiffReport
    from .ops.doctor import DoctorReport
    from .ops.doctor.traps import DEFAULT_DECODE_RATE as DOCTOR_DEFAULT_DECODE_RATE
    from .ops.doctor.traps import ERROR as DOCTOR_ERROR
    from .ops.doctor.traps import INFO as DOCTOR_INFO
    from .ops.doctor.traps import WARNING as DOCTOR_WARNING
    from .ops.doctor.traps import toml_value as doctor_toml_value
    from .ops.extract_adapter import ExtractReport
    from .ops.fix_adapter import FixReport
    from .ops.gc import GcReport
    from .ops.inspect import InspectReport
    from .ops.merge import MergeReport
    from .ops.rehydrate import RehydrateReport
    from .ops.report import ReportReport
    from .ops.resize_adapter import ResizeReport
    from .ops.set_lr import PatchReport
    from .ops.slim import SlimReport
    from .ops.verify import VerifyReport
    from .workflows.average_merge import AverageMergeReport
    from .workflows.restart_prep import RestartPrepReport

__all__ = [
    "DIFF_SAME",
    "DIFF_SKIPPED",
    "DOCTOR_DEFAULT_DECODE_RATE",
    "DOCTOR_ERROR",
    "DOCTOR_INFO",
    "DOCTOR_WARNING",
    "AverageMergeReport",
    "AverageReport",
    "DiffReport",
    "DoctorReport",
    "DryRunReport",
    "ExtractReport",
    "FixReport",
    "GcReport",
    "InspectReport",
    "MergeReport",
    "PatchReport",
    "RehydrateReport",
    "ReportReport",
    "ResizeReport",
    "RestartPrepReport",
    "SchedulerSpec",
    "SlimReport",
    "ToDcpReport",
    "VerifyReport",
    "adapter_to_dcp",
    "average",
    "diff_vs_base",
    "doctor",
    "doctor_toml_value",
    "export",
    "extract_adapter",
    "fix_adapter",
    "gc",
    "inspect",
    "merge",
    "open",
    "rehydrate",
    "report",
    "resize_adapter",
    "restart_prep",
    "set_lr",
    "set_values",
    "slim",
    "verify",
]

# name -> "module:attribute" it is loaded from on first access (`from ckpt_tools.api import MergeReport`);
# the doctor's severities, --decode-rate default and TOML value rendering, and the statuses of a
# diff's tensors, are what `ckpt doctor` and `ckpt diff-vs-base` render with
_LAZY = {
    "SchedulerSpec": "core.primerl_state",
    "ReportReport": "ops.report",
    "InspectReport": "ops.inspect",
    "ExtractReport": "ops.extract_adapter",
    "MergeReport": "ops.merge",
    "DiffReport": "ops.diff",
    "VerifyReport": "ops.verify",
    "SlimReport": "ops.slim",
    "RehydrateReport": "ops.rehydrate",
    "PatchReport": "ops.set_lr",
    "ToDcpReport": "ops.adapter_to_dcp",
    "FixReport": "ops.fix_adapter",
    "DoctorReport": "ops.doctor",
    "AverageReport": "ops.average",
    "AverageMergeReport": "workflows.average_merge",
    "ResizeReport": "ops.resize_adapter",
    "GcReport": "ops.gc",
    "RestartPrepReport": "workflows.restart_prep",
    "DOCTOR_DEFAULT_DECODE_RATE": "ops.doctor.traps:DEFAULT_DECODE_RATE",
    "DOCTOR_ERROR": "ops.doctor.traps:ERROR",
    "DOCTOR_WARNING": "ops.doctor.traps:WARNING",
    "DOCTOR_INFO": "ops.doctor.traps:INFO",
    "doctor_toml_value": "ops.doctor.traps:toml_value",
    "DIFF_SAME": "ops.diff:SAME",
    "DIFF_SKIPPED": "ops.diff:SKIPPED",
}


def __getattr__(name: str):
    if name in _LAZY:
        module, _, attr = _LAZY[name].partition(":")
        with _loading():
            return getattr(importlib.import_module(f"{__package__}.{module}"), attr or name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _dry(report: Any, out: str | Path | None, overwrite: bool) -> DryRunReport:
    """`report` (a dry run's) with OUT checked as the real run checks it, and described."""
    from .io.staging import describe_output

    return DryRunReport(report, None if out is None else describe_output(out, overwrite=overwrite))


@contextlib.contextmanager
def _out_at(
    out: Any, overwrite: bool, dry_run: bool, *, single: bool = False, inputs: Sequence[Any] = ()
) -> Iterator[tuple[Any, Callable[[Any], Any]]]:
    """(what the op writes to, how its report names it): for OUT at a URL the local staging OUT of
    `io.upload.output_at` (the URL checked now, the output put there when the call returns) and the report
    renamed to name the URL, as the CLI's does; anything else as it is. `inputs`: what the call reads."""
    if out is None or parse_url(out) is None:
        yield out, lambda report: report
        return
    from .io.upload import describe_at, output_at

    shown = parse_url(out).shown  # type: ignore[union-attr]

    def named(report: Any) -> Any:
        if isinstance(report, DryRunReport):  # what writing OUT would do: at the URL
            report = DryRunReport(report.report, describe_at(out, overwrite=overwrite, single=single))
        return _renamed(report, str(local), shown)

    with output_at(
        out, overwrite=overwrite, dry_run=dry_run, single=single, inputs=[str(i) for i in inputs]
    ) as local:
        yield local, named


def _renamed(obj: Any, local: str, url: str, depth: int = 0) -> Any:
    """`obj` (a report: dataclasses, dicts and lists of them) with every path naming the local staging OUT
    `local` naming `url` instead."""
    if isinstance(obj, (str, PurePath)):
        text = str(obj)
        return text.replace(local, url) if local in text else obj
    if depth > 16:
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changed = {}
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            new = _renamed(value, local, url, depth + 1)
            if new is not value:
                changed[f.name] = new
        if not changed:
            return obj
        copy = dataclasses.replace(obj, **{k: v for k, v in changed.items() if _init_field(obj, k)})
        for k, v in changed.items():
            if not _init_field(obj, k):
                object.__setattr__(copy, k, v)
        return copy
    if isinstance(obj, dict):
        return {k: _renamed(v, local, url, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_renamed(v, local, url, depth + 1) for v in obj)
    return obj


def _init_field(obj: Any, name: str) -> bool:
    return next(f.init for f in dataclasses.fields(obj) if f.name == name)


def _group(group: Group | None) -> Group:
    """The group the run's work units are split over: `group`, else this process's (`dist.current()`:
    asked for once the inputs are open and planned, since the ranks then compare them)."""
    from . import dist

    return dist.current() if group is None else group


def _str(p: str | Path | None) -> str | None:
    return None if p is None else str(p)


@contextlib.contextmanager
def _command(name: str, download: bool | None, *inputs: Any) -> Iterator[None]:
    """The command `name` recorded in the outputs written meanwhile (their marker), as the CLI does;
    `download` None leaves hub fetching as the caller set it (the CLI's --download turns it on around the
    whole command). One remote session for the call (`io.remote`: one listing and one pinned version of
    each object, what was fetched); a URL among `inputs` with nothing at it is the command's own error."""
    from .io import remote
    from .io.inputs import existing_urls

    with (
        command_scope(name),
        contextlib.nullcontext() if download is None else hub_fetch.allowing(download),
        remote.session(),
    ):
        existing_urls(*inputs)
        yield


def open(path: str | Path, *, trust_pickle: bool = False) -> DcpCheckpoint | HFModelDir | PeftAdapter:
    """The format's one lazy handle of what `path` is (metadata read, tensors on demand): a `DcpCheckpoint`
    (`.entries`, `.read_object(key)`, `.read_tensor(key)`; its tensors as `Source`s: `.base_weights()`,
    `.by_key()`; its LoRA: `.lora(alpha=...)`), an `HFModelDir`, itself a `Source` (`.names()`,
    `.facts(name)`,
    `.read_tensor(name)`, `.read_rows(name, start, count)`, `.info(name)`) or a `PeftAdapter` (`.modules`,
    `.read_pair(module)`; `.lora()`). A hub id (`org/name[@revision]`) is looked up in the local HF cache.
    Use it as a context manager: leaving the block closes its files."""
    with _loading():
        from .formats.dcp.reader import DcpCheckpoint
        from .formats.hf_dir.hub import resolve_model_dir
        from .formats.hf_dir.model_dir import HFModelDir
        from .formats.peft.adapter import open_peft_adapter
        from .formats.sniff import DCP, HF, PEFT, sniff
        from .ops.inspect import InspectOptions, plan_inspect
    p = as_input(path)
    if not p.exists():
        p = resolve_model_dir(str(path))
    kind = sniff(p)
    if kind == DCP:
        return DcpCheckpoint.open(p, trust_pickle=trust_pickle)
    if kind == HF:
        return HFModelDir.open(p)
    if kind == PEFT:
        return open_peft_adapter(p, strict=False)
    plan_inspect(p, InspectOptions())  # the one error for "not a checkpoint, model or adapter"
    raise ValueError(f"{p}: a checkpoints dir has no single handle; open one of its step_N/trainer dirs")


def inspect(
    path: str | Path,
    *,
    alpha: float | None = None,
    run_config: str | Path | None = None,
    keys: bool = False,
    trust_pickle: bool = False,
    download: bool | None = None,
) -> InspectReport:
    """What `ckpt inspect` prints, from metadata alone: `.plan.kind` (dcp | checkpoints | hf | peft)
    and `.data` (the description, or with `keys` one row per DCP key)."""
    with _command("inspect", download, path, run_config):
        with _loading():
            from .formats.hf_dir.hub import resolve_model_dir
            from .ops.inspect import InspectOptions, plan_inspect, run_inspect
        p = as_input(path) if as_input(path).exists() else resolve_model_dir(str(path))
        return run_inspect(plan_inspect(p, InspectOptions(alpha, _str(run_config), keys, trust_pickle)))


def extract_adapter(
    ckpt: str | Path,
    out: str | Path,
    *,
    alpha: float | None = None,
    run_config: str | Path | None = None,
    base: str | None = None,
    slot: int = 0,
    dtype: str = "fp32",
    dry_run: bool = False,
    overwrite: bool = False,
    trust_pickle: bool = False,
    progress: Progress | None = None,
    layout: str = "peft",
    download: bool | None = None,
) -> ExtractReport | DryRunReport:
    """A prime-rl DCP (or verl) checkpoint's LoRA as a PEFT adapter dir at `out` (`ckpt extract-adapter`;
    `layout`: peft | vllm | prime-rl, how MoE expert LoRA is written, docs/adapters.md)."""
    with (
        _command("extract-adapter", download, ckpt, run_config, base),
        _out_at(out, overwrite, dry_run, inputs=(ckpt,)) as (out, shown),
    ):
        with _loading():
            from .ops.extract_adapter import ExtractOptions, ExtractReport, plan_extract, run_extract
            from .sources.open import open_checkpoint_lora
        with open_checkpoint_lora(
            ckpt, alpha=alpha, run_config=run_config, slot=slot, trust_pickle=trust_pickle
        ) as src:
            plan = plan_extract(src, ExtractOptions(out, base, dtype, layout))
            if dry_run:
                return shown(_dry(ExtractReport(plan), out, overwrite))
            return shown(run_extract(plan, src, progress, overwrite=overwrite))


def merge(
    base: str | Path | None,
    adapter: str | Path,
    out: str | Path,
    *,
    base_from_checkpoint: bool = False,
    config_from: str | Path | None = None,
    alpha: float | None = None,
    run_config: str | Path | None = None,
    slot: int = 0,
    dtype: str | None = None,
    max_shard_size: str | int | None = None,
    threads: int | None = None,
    allow_zero_delta: bool = False,
    trust_pickle: bool = False,
    dry_run: bool = False,
    overwrite: bool = False,
    progress: Progress | None = None,
    group: Group | None = None,
    download: bool | None = None,
) -> MergeReport | DryRunReport:
    """The LoRA of `adapter` (PEFT dir or DCP checkpoint) merged into `base` (HF dir or hub id), written
    to `out` (`ckpt merge`; the options are its flags: `ops.merge.MergeOptions`). `base_from_checkpoint`:
    the checkpoint's fp32 masters are the base (`base` that checkpoint, or None when `adapter` is it),
    config and tokenizer from `config_from`. `max_shard_size` None: 5GB. `.result` is None in a dry run,
    whose plan warns of what the real run would refuse (too little disk); `.plan.warnings` are the
    plan's warnings either way."""
    with (
        _command("merge", download, base, adapter, config_from, run_config),
        _out_at(out, overwrite, dry_run, inputs=(base, adapter)) as (out, shown),
    ):
        with _loading():
            from .ops.merge import (
                DEFAULT_MAX_SHARD,
                MergeOptions,
                finish_merge,
                open_merge_sources,
                plan_merge,
            )
        opts = MergeOptions(
            out=str(out),
            base_from_checkpoint=base_from_checkpoint,
            config_from=_str(config_from),
            alpha=alpha,
            run_config=_str(run_config),
            slot=slot,
            dtype=dtype,
            max_shard_size=DEFAULT_MAX_SHARD if max_shard_size is None else max_shard_size,
            threads=threads,
            trust_pickle=trust_pickle,
            allow_zero_delta=allow_zero_delta,
        )
        with open_merge_sources(_str(base), str(adapter), opts) as sources:
            return shown(
                finish_merge(
                    plan_merge(sources, opts),
                    sources,
                    out,
                    dry_run=dry_run,
                    overwrite=overwrite,
                    progress=progress,
                    group=group,
                )
            )


def export(
    ckpt: str | Path,
    out: str | Path,
    *,
    config_from: str | Path | None = None,
    alpha: float | None = None,
    run_config: str | Path | None = None,
    slot: int = 0,
    dtype: str | None = None,
    max_shard_size: str | int | None = None,
    threads: int | None = None,
    allow_zero_delta: bool = False,
    trust_pickle: bool = False,
    dry_run: bool = False,
    overwrite: bool = False,
    progress: Progress | None = None,
    group: Group | None = None,
    download: bool | None = None,
) -> MergeReport | DryRunReport:
    """A DCP checkpoint as an HF model dir (`ckpt export`): a full fine-tune's trained weights, or a LoRA
    run's merged model, from the checkpoint's fp32 masters (the options are its flags:
    `ops.merge.ExportOptions`). `.result` is None in a dry run, as `merge`'s."""
    with (
        _command("export", download, ckpt, config_from, run_config),
        _out_at(out, overwrite, dry_run, inputs=(ckpt,)) as (out, shown),
    ):
        with _loading():
            from .ops.merge import (
                DEFAULT_MAX_SHARD,
                ExportOptions,
                finish_merge,
                open_export_sources,
                plan_export,
            )
        opts = ExportOptions(
            out=str(out),
            config_from=_str(config_from),
            alpha=alpha,
            run_config=_str(run_config),
            slot=slot,
            dtype=dtype,
            max_shard_size=DEFAULT_MAX_SHARD if max_shard_size is None else max_shard_size,
            threads=threads,
            trust_pickle=trust_pickle,
            allow_zero_delta=allow_zero_delta,
        )
        with open_export_sources(ckpt, opts) as sources:
            return shown(
                finish_merge(
                    plan_export(sources, opts),
                    sources,
                    out,
                    dry_run=dry_run,
                    overwrite=overwrite,
                    progress=progress,
                    group=group,
                )
            )


def adapter_to_dcp(
    adapter: str | Path,
    out: str | Path,
    *,
    base: str | Path,
    lr: float | None = None,
    step: int | None = None,
    world_size: int = 4,
    optimizer_from: str | Path | None = None,
    scheduler: SchedulerSpec | None = None,
    scheduler_step: int | None = None,
    dry_run: bool = False,
    overwrite: bool = False,
    trust_pickle: bool = False,
    progress: Progress | None = None,
    group: Group | None = None,
    download: bool | None = None,
) -> ToDcpReport | DryRunReport:
    """A prime-rl trainer checkpoint that resumes from a PEFT adapter and the HF base (`ckpt adapter-to-dcp`);
    `scheduler`: a `SchedulerSpec` (constant | linear | cosine, with prime-rl's own validation)."""
    with (
        _command("adapter-to-dcp", download, adapter, base, optimizer_from),
        _out_at(out, overwrite, dry_run, inputs=(adapter, base, optimizer_from)) as (out, shown),
    ):
        with _loading():
            from .ops.adapter_to_dcp import (
                ToDcpOptions,
                ToDcpReport,
                open_to_dcp_sources,
                plan_adapter_to_dcp,
                run_adapter_to_dcp,
            )
        options = ToDcpOptions(
            out,
            lr=lr,
            step=step,
            world_size=world_size,
            scheduler=scheduler,
            scheduler_step=scheduler_step,
            trust_pickle=trust_pickle,
        )
        with open_to_dcp_sources(
            adapter, str(base), optimizer_from=optimizer_from, trust_pickle=trust_pickle
        ) as sources:
            plan = plan_adapter_to_dcp(sources, options)
            if dry_run:
                return shown(_dry(ToDcpReport(plan, full=True), out, overwrite))
            return shown(
                run_adapter_to_dcp(plan, sources, progress, overwrite=overwrite, group=_group(group))
            )


def fix_adapter(
    src: str | Path,
    out: str | Path,
    *,
    base: str | Path | None = None,
    slot: int | None = None,
    alpha: float | None = None,
    run_config: str | Path | None = None,
    checkpoint: str | Path | None = None,
    layout: str = "peft",
    dry_run: bool = False,
    overwrite: bool = False,
    progress: Progress | None = None,
    download: bool | None = None,
) -> FixReport | DryRunReport:
    """prime-rl's own adapter export (a broadcast dir or a weights export) as a PEFT dir that applies
    (`ckpt fix-adapter`); `checkpoint`: the run's DCP checkpoint of that step, filling the trained full
    tensors (modules_to_save) the export lacks; `layout` as `extract_adapter`'s."""
    with (
        _command("fix-adapter", download, src, base, run_config, checkpoint),
        _out_at(out, overwrite, dry_run, inputs=(src, base, checkpoint)) as (out, shown),
    ):
        with _loading():
            from .ops.fix_adapter import FixOptions, FixReport, open_fix_source, plan_fix, run_fix
        options = FixOptions(
            out, _str(base), slot, alpha, _str(run_config), checkpoint=_str(checkpoint), layout=layout
        )
        with open_fix_source(src, checkpoint) as weights:
            plan = plan_fix(weights, src, options)
            if dry_run:
                return shown(_dry(FixReport(plan), out, overwrite))
            return shown(run_fix(plan, weights, progress, overwrite=overwrite))


def diff_vs_base(
    weights: str | Path,
    base: str | Path,
    *,
    adapter: str | Path | None = None,
    alpha: float | None = None,
    run_config: str | Path | None = None,
    targeted_only: bool = False,
    trust_pickle: bool = False,
    progress: Progress | None = None,
    group: Group | None = None,
    page: str | Path | None = None,
    device: str | None = None,
    download: bool | None = None,
) -> DiffReport:
    """Whether `weights` differ from `base`, tensor by tensor (`ckpt diff-vs-base`): `.verdict`,
    `.exit_code` (0 differ, 3 identical, 4 adapter check failed), `.tensors`. `page`: also write the
    comparison as an HTML page there (a new file; `--report`), its path then in `.page`. `device`: "cuda" (or
    "cuda:N") runs the adapter check's value check on that GPU, with the same verdicts and counts as the CPU
    (the default); a `UsageError` where there is none."""
    with _command("diff-vs-base", download, weights, base, adapter, run_config):
        with _loading():
            from .ops.diff import DiffOptions, open_diff_sources, plan_diff, run_diff
        options = DiffOptions(_str(adapter), alpha, _str(run_config), targeted_only, trust_pickle, device)
        with open_diff_sources(weights, base, options) as sources:
            report = run_diff(
                plan_diff(sources, options), sources, progress, group=_group(group), device=device
            )
        if page is not None:
            with _loading():
                from .ops.report import write_diff_page
            report.page = write_diff_page(
                report.to_json(),
                page,
                inputs=[p for p in (weights, base, adapter) if p is not None and as_input(p).exists()],
            )
        return report


def verify(
    path: str | Path,
    *,
    deep: bool = False,
    base: str | Path | None = None,
    trust_pickle: bool = False,
    progress: Progress | None = None,
    group: Group | None = None,
    download: bool | None = None,
) -> VerifyReport:
    """Integrity of a DCP checkpoint, HF dir or PEFT adapter (`ckpt verify`): `.ok`, `.problems`."""
    with _command("verify", download, path, base):
        with _loading():
            from .ops.verify import VerifyOptions, plan_verify, run_verify
        return run_verify(
            plan_verify(path, VerifyOptions(deep, _str(base), trust_pickle)), progress, group=_group(group)
        )


def slim(
    ckpt: str | Path,
    out: str | Path,
    *,
    base: str | Path | None = None,
    dry_run: bool = False,
    overwrite: bool = False,
    trust_pickle: bool = False,
    progress: Progress | None = None,
    group: Group | None = None,
    download: bool | None = None,
) -> SlimReport | DryRunReport:
    """The checkpoint without its frozen base weights (`ckpt slim`)."""
    with (
        _command("slim", download, ckpt, base),
        _out_at(out, overwrite, dry_run, inputs=(ckpt, base)) as (out, shown),
    ):
        with _loading():
            from .ops.slim import SlimOptions, SlimReport, open_slim_sources, plan_slim, run_slim
        options = SlimOptions(out, _str(base), overwrite, trust_pickle)
        with open_slim_sources(ckpt, options) as sources:
            plan = plan_slim(sources, options)
            if dry_run:
                return shown(_dry(SlimReport(plan), out, overwrite))
            return shown(run_slim(plan, sources, progress, overwrite=overwrite, group=_group(group)))


def rehydrate(
    slim_ckpt: str | Path,
    out: str | Path,
    *,
    base: str | Path,
    world_size: int | None = None,
    dry_run: bool = False,
    overwrite: bool = False,
    trust_pickle: bool = False,
    threads: int | None = None,
    progress: Progress | None = None,
    group: Group | None = None,
    download: bool | None = None,
) -> RehydrateReport | DryRunReport:
    """The full checkpoint rebuilt bit-exactly from a slim one and the base (`ckpt rehydrate`). `threads`:
    the workers (default: this rank's cores + 2); memory does not grow with them
    (`plan.memory_bound_bytes`)."""
    with (
        _command("rehydrate", download, slim_ckpt, base),
        _out_at(out, overwrite, dry_run, inputs=(slim_ckpt, base)) as (out, shown),
    ):
        with _loading():
            from .ops.rehydrate import (
                RehydrateOptions,
                RehydrateReport,
                open_rehydrate_sources,
                plan_rehydrate,
                run_rehydrate,
            )
        options = RehydrateOptions(out, str(base), world_size, overwrite, trust_pickle, threads)
        with open_rehydrate_sources(slim_ckpt, options) as sources:
            plan = plan_rehydrate(sources, options)
            if dry_run:
                return shown(_dry(RehydrateReport(plan), out, overwrite))
            return shown(run_rehydrate(plan, sources, progress, overwrite=overwrite, group=_group(group)))


def set_lr(
    ckpt: str | Path,
    out: str | Path | None,
    *,
    lr: float | None = None,
    scale: float | None = None,
    min_lr: float | None = None,
    in_place: bool = False,
    dry_run: bool = False,
    overwrite: bool = False,
    trust_pickle: bool = False,
    download: bool | None = None,
) -> PatchReport | DryRunReport:
    """A checkpoint with a new learning rate, Adam moments kept (`ckpt set-lr`)."""
    with _command("set-lr", download, ckpt), _out_at(out, overwrite, dry_run, inputs=(ckpt,)) as (out, shown):
        with _loading():
            from .ops.set_lr import set_lr as run
        report = run(
            ckpt,
            out,
            lr=lr,
            scale=scale,
            min_lr=min_lr,
            in_place=in_place,
            dry_run=dry_run,
            overwrite=overwrite,
            trust_pickle=trust_pickle,
        )
        return shown(_dry(report, out, overwrite) if dry_run and out is not None else report)


def set_values(
    ckpt: str | Path,
    out: str | Path | None,
    assignments: list[str],
    *,
    in_place: bool = False,
    dry_run: bool = False,
    overwrite: bool = False,
    trust_pickle: bool = False,
    download: bool | None = None,
) -> PatchReport | DryRunReport:
    """Scalar byte items of a checkpoint set by surgery, `KEY=VALUE` each (`ckpt set`)."""
    with _command("set", download, ckpt), _out_at(out, overwrite, dry_run, inputs=(ckpt,)) as (out, shown):
        with _loading():
            from .ops.set_lr import set_values as run
        report = run(
            ckpt,
            out,
            list(assignments),
            in_place=in_place,
            dry_run=dry_run,
            overwrite=overwrite,
            trust_pickle=trust_pickle,
        )
        return shown(_dry(report, out, overwrite) if dry_run and out is not None else report)


def restart_prep(
    run_or_ckpt: str | Path,
    out: str | Path,
    *,
    base: str | None,
    lr: float | None,
    mode: str = "merge",
    config: str | Path | None = None,
    config_out: str | Path | None = None,
    alpha: float | None = None,
    run_config: str | Path | None = None,
    dtype: str | None = None,
    max_shard_size: str | int | None = None,
    world_size: int | None = None,
    scheduler_step: int = 0,
    dry_run: bool = False,
    overwrite: bool = False,
    trust_pickle: bool = False,
    progress: Progress | None = None,
    download: bool | None = None,
) -> RestartPrepReport:
    """The fresh-LR restart in one call (`ckpt restart-prep`): `mode` "merge" (a merged bf16 model) or
    "adapter" (a resumable checkpoint with fresh AdamW); with `config`, the run's TOML patched beside OUT
    (merge) or beside itself (adapter), or at `config_out`. `max_shard_size` None: 5GB (merge mode). Its
    `.next` says what to run next."""
    if mode == "merge" and config is not None and config_out is None and parse_url(out) is not None:
        config_out = (
            f"{parse_url(out)}.{Path(config).name}"  # OUT at a URL: the patched config beside it there
        )
    with (
        _command("restart-prep", download, run_or_ckpt, base, config, run_config),
        _out_at(out, overwrite, dry_run, inputs=(run_or_ckpt, base, config)) as (out, shown),
        _out_at(config_out, overwrite, dry_run, single=True, inputs=(run_or_ckpt, config)) as (
            config_out,
            shown_config,
        ),
    ):
        with _loading():
            from .ops.merge import DEFAULT_MAX_SHARD
            from .workflows.restart_prep import restart_prep as run
        return shown_config(
            shown(
                run(
                    run_or_ckpt,
                    out,
                    base=base,
                    lr=lr,
                    config=config,
                    mode=mode,
                    alpha=alpha,
                    run_config=run_config,
                    dtype=dtype,
                    max_shard_size=DEFAULT_MAX_SHARD if max_shard_size is None else max_shard_size,
                    world_size=world_size,
                    scheduler_step=scheduler_step,
                    config_out=config_out,
                    dry_run=dry_run,
                    trust_pickle=trust_pickle,
                    progress=progress,
                    overwrite=overwrite,
                )
            )
        )


def gc(
    checkpoints_dir: str | Path,
    *,
    keep_full: int,
    base: str | Path | None = None,
    min_age_s: float | None = None,
    slim_to: str | None = None,
    dry_run: bool = False,
    trust_pickle: bool = False,
    progress: Progress | None = None,
    download: bool | None = None,
) -> GcReport:
    """A run's checkpoints kept: the newest `keep_full` whole, older ones slim in place (`ckpt gc`).
    `min_age_s` None: gc's default (`ops.gc.DEFAULT_MIN_AGE_S`); `slim_to`: a URL each slimmed step is
    uploaded to first (docs/remote.md). `.plan`, and `.result` (each step's outcome) unless `dry_run`;
    `progress` is also given each step's outcome as it finishes (`ProgressEvent.finished`)."""
    with _command("gc", download, checkpoints_dir, base):
        with _loading():
            from .ops.gc import DEFAULT_MIN_AGE_S
            from .ops.gc import gc as run
        return run(
            checkpoints_dir,
            keep_full=keep_full,
            base=base,
            dry_run=dry_run,
            min_age_s=DEFAULT_MIN_AGE_S if min_age_s is None else min_age_s,
            trust_pickle=trust_pickle,
            progress=progress,
            slim_to=slim_to,
        )


def doctor(
    target: str | Path | None = None,
    *,
    files: Sequence[str | Path] = (),
    sections: dict[str, str | Path] | None = None,
    outputs: str | Path | None = None,
    base: str | Path | None = None,
    decode_rate: float | None = None,
    compare_weights: bool = True,
    trust_pickle: bool = False,
    download: bool | None = None,
) -> DoctorReport:
    """A prime-rl run's config and disk traps (`ckpt doctor`): `.exit_code` (0 none, 3 found), `.findings`.
    `target`: a run dir, outputs dir or checkpoint; or None with `files` (config files in `rl @` order) and
    `sections` ({"trainer" | "orchestrator" | "inference": FILE}). `decode_rate` None: the default
    (`DOCTOR_DEFAULT_DECODE_RATE`); `compare_weights` False: the base is not read."""
    with _command("doctor", download, target, files, outputs, base):
        with _loading():
            from .ops.doctor import doctor as run
            from .ops.doctor.traps import DEFAULT_DECODE_RATE
        return run(
            target,
            files=files,
            sections=sections,
            outputs=outputs,
            base=base,
            decode_rate=DEFAULT_DECODE_RATE if decode_rate is None else decode_rate,
            compare_weights=compare_weights,
            trust_pickle=trust_pickle,
        )


def average(
    inputs: list[str | Path],
    out: str | Path,
    *,
    weights: list[float] | None = None,
    ema: float | None = None,
    rank: int | None = None,
    energy: float | None = None,
    merge: str | Path | None = None,
    dtype: str | None = None,
    allow_mismatch: tuple[str, ...] = (),
    alpha: float | None = None,
    layout: str = "peft",
    dry_run: bool = False,
    overwrite: bool = False,
    trust_pickle: bool = False,
    progress: Progress | None = None,
    download: bool | None = None,
) -> AverageReport | AverageMergeReport:
    """The weighted mean of LoRA steps (DCP checkpoints, PEFT adapters) in delta space, as a PEFT adapter
    at `out` (`ckpt average`), exact at rank sum(r_i) or brought down by `rank` / `energy`; with `merge`
    (an HF base), the merged model instead (`.result` None in a dry run). docs/delta-space.md."""
    with (
        _command("average", download, inputs, merge),
        _out_at(out, overwrite, dry_run, inputs=(*inputs, merge)) as (out, shown),
    ):
        with _loading():
            from .ops.average import (
                AverageOptions,
                AverageReport,
                open_average_sources,
                plan_average,
                run_average,
            )
        options = AverageOptions(
            out=str(out),
            weights=None if weights is None else tuple(float(w) for w in weights),
            ema=ema,
            rank=rank,
            energy=energy,
            allow=frozenset(allow_mismatch),
            alpha=alpha,
            trust_pickle=trust_pickle,
            layout=layout,
        )
        if merge is not None:
            with _loading():
                from .ops.merge import MergeOptions
                from .workflows.average_merge import average_merge
            # the merge stage reads no pickle (an HF base and the averaged LoRA): the inputs' trust is the
            # average stage's
            return shown(
                average_merge(
                    list(inputs),
                    merge,
                    out,
                    options=options,
                    merge_options=MergeOptions(dtype=dtype),
                    dry_run=dry_run,
                    overwrite=overwrite,
                    progress=progress,
                )
            )
        with open_average_sources(list(inputs), options) as sources:
            plan = plan_average(sources, options)
            return shown(
                AverageReport(plan) if dry_run else run_average(plan, sources, progress, overwrite=overwrite)
            )


def resize_adapter(
    adapter: str | Path,
    out: str | Path,
    *,
    rank: int | None = None,
    energy: float | None = None,
    alpha: float | None = None,
    layout: str = "peft",
    dry_run: bool = False,
    overwrite: bool = False,
    trust_pickle: bool = False,
    progress: Progress | None = None,
    download: bool | None = None,
) -> ResizeReport:
    """Each module of `adapter` (PEFT dir or DCP checkpoint) at its best rank `rank` (or the smallest rank
    keeping `energy` of its squared norm), written as a PEFT adapter at `out` (`ckpt resize-adapter`);
    `.plan.truncations` has each module's kept energy and error."""
    with (
        _command("resize-adapter", download, adapter),
        _out_at(out, overwrite, dry_run, inputs=(adapter,)) as (out, shown),
    ):
        with _loading():
            from .ops.resize_adapter import (
                ResizeOptions,
                ResizeReport,
                open_resize_sources,
                plan_resize,
                run_resize,
            )
        options = ResizeOptions(
            out=str(out), rank=rank, energy=energy, alpha=alpha, trust_pickle=trust_pickle, layout=layout
        )
        with open_resize_sources(adapter, options) as src:
            plan = plan_resize(src, options)
            return shown(
                ResizeReport(plan) if dry_run else run_resize(plan, src, progress, overwrite=overwrite)
            )


def report(
    path: str | Path,
    *,
    base: str | Path | None = None,
    out: str | Path | None = None,
    png_dir: str | Path | None = None,
    set_lr: float | None = None,
    scale: float | None = None,
    alpha: float | None = None,
    run_config: str | Path | None = None,
    dry_run: bool = False,
    overwrite: bool = False,
    trust_pickle: bool = False,
    progress: Progress | None = None,
    download: bool | None = None,
) -> ReportReport:
    """What a run changed and its learning rate (`ckpt report`): `.result.steps[step].modules[name]`
    (delta_fro, weight_fro, rel_delta), `.result.lr` (past, planned, set_lr); the page written to `out`
    and one PNG per plot into `png_dir` when given (nothing is written otherwise). `dry_run`: the plan only
    (what PATH is, its steps, the base, max_steps), `.result` None."""
    with (
        _command("report", download, path, base, run_config),
        _out_at(out, overwrite, dry_run, single=True, inputs=(path, base)) as (out, shown),
        _out_at(png_dir, overwrite, dry_run, inputs=(path, base)) as (png_dir, shown_pngs),
    ):
        with _loading():
            from .ops.report import ReportOptions, ReportReport, plan_report, run_report
        options = ReportOptions(
            base=_str(base),
            out=_str(out),
            png_dir=_str(png_dir),
            set_lr=set_lr,
            scale=scale,
            alpha=alpha,
            run_config=_str(run_config),
            overwrite=overwrite,
            trust_pickle=trust_pickle,
        )
        plan = plan_report(path, options)
        return shown_pngs(shown(ReportReport(plan) if dry_run else run_report(plan, progress)))
