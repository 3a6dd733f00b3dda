"""`ckpt restart-prep`: the "fresh-LR restart" of a prime-rl LoRA run in one command.

prime-rl's resume restores the checkpoint's optimizer and scheduler, so a new lr in the config is
ignored. Two ways to restart with lr X (docs/surgery.md says when to prefer which):

- `merge` (default): merge the LoRA into the base (the `ckpt merge` op, bf16 HF model dir at OUT) and
  write a copy of the user's prime-rl TOML next to OUT with the model name -> OUT, lr -> X and
  the resume settings removed (`formats.primerl.toml_patch`: comments and order survive). The next
  run trains a fresh LoRA on the merged weights from step 0.
- `adapter`: keep the adapter. A resumable trainer checkpoint built straight from the checkpoint's own
  LoRA (the `ckpt adapter-to-dcp` op over a `DcpLoraSource`: no PEFT round trip, the checkpoint opened
  once): the adapter's A/B, a fresh AdamW, lr X, the step kept and the scheduler the run's config
  describes. The next run resumes at that step.

A workflow, not an op: it composes two ops through their public contracts (plan_X / run_X), which
no op does (ops never import each other).
"""

from __future__ import annotations

import functools
import math
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import FormatError, MissingPathError, OutputExistsError, UsageError
from ..core.keys import PROGRESS_STEP_KEY, classify, step_of, world_size_from_chunks
from ..core.primerl_state import SchedulerSpec
from ..core.progress import Progress
from ..formats.dcp.layout import METADATA_NAME, resolve_checkpoint_dir
from ..formats.dcp.lora import DcpLoraSource
from ..formats.dcp.reader import DcpCheckpoint
from ..formats.hf_dir.model_dir import HFModelDir
from ..formats.primerl.files import GEN_16E747C, GEN_HEAD
from ..formats.primerl.kinds import toml_kind
from ..formats.primerl.optimizers import optimizer_facts
from ..formats.primerl.resume import generation_of, resume_instruction, run_name_of
from ..formats.primerl.toml_patch import config_kind, patch_config_text, scheduler_from_config, unified_diff
from ..io.files import atomic_write_text, make_dirs
from ..io.inputs import as_input, is_url, read_toml
from ..io.remote_display import display
from ..io.remote_url import parse_url
from ..io.staging import OVERWRITE_HINT, check_output_file, describe_output
from ..ops.adapter_to_dcp import ToDcpOptions, ToDcpSources, plan_adapter_to_dcp, run_adapter_to_dcp
from ..ops.extract_adapter import ExtractOptions, plan_extract
from ..ops.merge import DEFAULT_MAX_SHARD, MergeOptions, MergeSources, check_output, plan_merge, run_merge

__all__ = ["MODES", "RestartPrepReport", "default_config_out", "find_checkpoint", "restart_prep"]

MODES = ("merge", "adapter")


# ============================================================================ locating the checkpoint


def find_checkpoint(path: str | Path) -> Path:
    """A trainer dir, a step dir, an outputs/checkpoints dir, an outputs dir or a run root: the
    latest complete checkpoint under it."""
    p = as_input(path)
    if not p.exists():
        raise MissingPathError(p)
    if (p / METADATA_NAME).is_file() or (p / "trainer" / METADATA_NAME).is_file():
        return resolve_checkpoint_dir(p)
    for root in (p, p / "checkpoints", p / "outputs" / "checkpoints"):
        if not root.is_dir():
            continue
        steps = sorted(
            (n, c)
            for c in root.iterdir()
            if (n := step_of(c.name)) is not None and (c / "trainer" / METADATA_NAME).is_file()
        )
        if steps:
            return steps[-1][1] / "trainer"
    raise UsageError(
        "no prime-rl checkpoint found (looked for .metadata, trainer/.metadata, and "
        "step_N/trainer/.metadata under checkpoints/ and outputs/checkpoints/)",
        path=p,
        hint="pass outputs/checkpoints/step_N/trainer",
    )


def default_config_out(mode: str, out: Path, config: Path, step: int | None = None) -> Path:
    """merge: beside OUT (`OUT.<config name>`); adapter: beside the source config
    (`<stem>.restart<suffix>`), because OUT is a checkpoint dir prime-rl scans by name."""
    if mode == "merge":
        return out.parent / f"{out.name}.{config.name}"
    return config.parent / f"{config.stem}.restart{config.suffix}"


# ============================================================================ the report
_KEYS = {  # each mode's report keys, in the order its JSON has them
    "merge": (
        "mode",
        "checkpoint",
        "out",
        "lr",
        "dry_run",
        "generation",
        "config",
        "merge_plan",
        "merge",
        "next",
        "notes",
    ),
    "adapter": (
        "mode",
        "checkpoint",
        "out",
        "lr",
        "step",
        "world_size",
        "scheduler",
        "scheduler_step",
        "dry_run",
        "generation",
        "run_name",
        "warnings",
        "config",
        "adapter",
        "output",
        "checkpoint_out",
        "next",
    ),
}


@dataclass
class RestartPrepReport:
    """`ckpt restart-prep`'s report; a field that is None is not part of the mode's (or run's) report.
    merge mode: `merge_plan` (what the merge does), `merge` (what it did, unless a dry run). adapter mode:
    `step`, `world_size`, `scheduler`, `scheduler_step`, `adapter` (its alpha, rank, scale), `output` (a dry
    run's OUT: what --overwrite would remove), `checkpoint_out` (what was written). Both: `config` (the
    patched --config and its diff), `next` (what to run next), `notes`, `warnings`."""

    mode: str
    checkpoint: str
    out: str
    lr: float
    dry_run: bool
    step: int | None = None
    world_size: int | None = None
    scheduler: str | None = None
    scheduler_step: int | None = None
    warnings: list[str] | None = None
    config: dict | None = None
    merge_plan: dict | None = None
    merge: dict | None = None
    adapter: dict | None = None
    output: dict | None = None
    checkpoint_out: dict | None = None
    next: list[str] | None = None
    notes: list[str] | None = None
    generation: str | None = None  # the run's prime-rl generation: the form of the resume instructions
    run_name: str | None = None  # HEAD: the run.name a resume relaunches under (its launch's rl.json)

    def to_json(self) -> dict:
        return {k: getattr(self, k) for k in _KEYS[self.mode] if getattr(self, k) is not None}


@dataclass(frozen=True)
class _ConfigEdit:
    """--config, read and checked: its text and where the patched copy goes."""

    source: Path
    text: str
    out: Path

    def patched(self, **changes) -> tuple[str, dict]:
        """The patched text, and the report's `config` (the changes and the diff)."""
        new_text, edits = patch_config_text(
            self.text, rebase_from=_rebase(self.source, self.out), where=self.source, **changes
        )
        doc = {
            "source": str(self.source),
            "out": str(self.out),
            "changes": [c.to_json() for c in edits],
            "diff": unified_diff(self.text, new_text, self.source.name),
        }
        return new_text, doc

    def run_command(self) -> str:
        """What prime-rl runs the patched config with."""
        return f"uv run {'rl' if config_kind(self.text) == 'rl' else 'trainer'} @ {self.out}"


def _generation(ckpt: DcpCheckpoint, edit: _ConfigEdit | None) -> str:
    """HEAD when the run's files (`resume.generation_of`) or the --config (a launch attempt's, or with
    HEAD-only keys: `kinds.toml_kind`) say so, else 16e747c."""
    gen, _why = generation_of(ckpt)
    if gen != GEN_HEAD and edit is not None:
        try:
            kind = toml_kind(tomllib.loads(edit.text), edit.source)
        except tomllib.TOMLDecodeError:
            return gen
        return kind.generation or gen
    return gen


# ============================================================================ the command
def restart_prep(
    run_or_ckpt: str | Path,
    out: str | Path,
    *,
    base: str | None,
    lr: float | None,
    config: str | Path | None = None,
    mode: str = "merge",
    alpha: float | None = None,
    run_config: str | Path | None = None,
    dtype: str | None = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD,
    world_size: int | None = None,
    scheduler_step: int = 0,
    config_out: str | Path | None = None,
    dry_run: bool = False,
    trust_pickle: bool = False,
    progress: Progress | None = None,
    overwrite: bool = False,
) -> RestartPrepReport:
    """Library entry point: the report, with `next` (what to run next)."""
    if mode not in MODES:
        raise UsageError(f"--mode {mode!r}: choose one of {', '.join(MODES)}")
    out = Path(out)
    ckpt_dir = find_checkpoint(run_or_ckpt)
    # the input is checked first, opened once
    with DcpCheckpoint.open(ckpt_dir, trust_pickle=trust_pickle) as ckpt:
        if base is None:
            raise UsageError("--base is required: the HF base model the run trained on")
        if lr is None or not (lr > 0 and math.isfinite(lr)):
            raise UsageError(f"--lr must be a positive finite number (got {lr})")
        edit = None
        if config is not None:
            edit = _config_edit(as_input(config), config_out, mode, out, [ckpt_dir, base, run_config])
        # the LoRA view, opened once the config is checked (an alpha that cannot be resolved comes second)
        lora = functools.partial(
            ckpt.lora, alpha=alpha, run_config=as_input(run_config) if run_config else None
        )
        report = RestartPrepReport(mode, str(ckpt.dir), str(out), lr, dry_run)
        report.generation = _generation(ckpt, edit)
        report.run_name = run_name_of(ckpt.dir) if report.generation == GEN_HEAD else None
        if mode == "merge":
            options = MergeOptions(
                out=str(out),
                alpha=alpha,
                run_config=None if run_config is None else str(run_config),
                dtype=dtype,
                max_shard_size=max_shard_size,
                trust_pickle=trust_pickle,
            )
            _merge_mode(report, lora, base, edit, options, progress=progress, overwrite=overwrite)
        else:
            _adapter_mode(
                report,
                ckpt,
                lora,
                base,
                edit,
                world_size,
                scheduler_step,
                trust_pickle,
                progress,
                overwrite=overwrite,
            )
        return report


def _config_edit(
    config: Path, config_out: str | Path | None, mode: str, out: Path, inputs: list
) -> _ConfigEdit:
    """--config read, and where its patched copy goes checked now, before anything is written: its dir
    exists, nothing is there, and it is not (inside) an input (the checkpoint, the config, the base dir,
    the run config) or inside OUT."""
    _doc, text = read_toml(config, what="prime-rl config")
    if config_out is None and is_url(config):
        raise UsageError(
            "the patched config goes beside --config by default, and that is at a URL",
            path=config,
            hint="pass --config-out (a local path, or a URL to upload it to)",
        )
    cfg_out = Path(config_out) if config_out is not None else default_config_out(mode, out, config)
    if cfg_out.resolve() == config.resolve():
        raise UsageError(
            "the patched config would overwrite the source config",
            path=cfg_out,
            hint="pass another --config-out",
        )
    ckpt_dir, base, run_config = inputs
    local_base = [base] if base is not None and as_input(base).is_dir() else []
    cfg_out = check_output_file(
        cfg_out,
        [ckpt_dir, config, *local_base, *([run_config] if run_config else [])],
        what="patched config (--config-out)",
    )
    if cfg_out.parent.resolve() == out.resolve() or out.resolve() in cfg_out.parents:
        raise UsageError(
            "the patched config would be written inside OUT",
            path=cfg_out,
            hint="pass a --config-out outside OUT",
        )
    return _ConfigEdit(config, text, cfg_out)


def _rebase(config: Path, cfg_out: Path) -> Path | None:
    """The dir relative `toml_files` of the copy are made absolute from; None: left as written (the copy
    beside its source, or a source at a URL: its local stand-in is gone once the command ends)."""
    src, dst = config.resolve().parent, cfg_out.resolve().parent
    return None if is_url(config) or src == dst else src


def _write_config(cfg_out: Path, text: str) -> None:
    if cfg_out.exists():
        raise OutputExistsError("appeared while we worked", path=cfg_out)
    atomic_write_text(cfg_out, text)


# ============================================================================ merge mode
def _merge_mode(
    report: RestartPrepReport,
    lora: Callable[[], DcpLoraSource],
    base: str,
    edit: _ConfigEdit | None,
    options: MergeOptions,
    *,
    progress: Progress | None,
    overwrite: bool,
) -> None:
    out = Path(options.out)
    new_text = None
    if edit is not None:  # validate the config before the (long) merge
        # OUT at a URL (its local staging dir, uploaded once written: io.upload): the config names the URL
        new_text, report.config = edit.patched(
            model_name=display(str(out.resolve())), lr=report.lr, remove_resume=True
        )
    with MergeSources(HFModelDir.open_ref(base), lora()) as sources:
        plan = plan_merge(sources, options)
        ad = plan.adapter or {}
        report.merge_plan = {
            "merged_modules": plan.merged_modules,
            "alpha": ad.get("alpha"),
            "alpha_source": ad.get("alpha_source"),
            "scale": ad.get("scale"),
            "out_dtype": plan.out_dtype,
            "write_bytes": plan.write_bytes,
            "warnings": list(plan.warnings),
        }
        if report.dry_run:
            check_output(plan, out, overwrite=overwrite)
        else:
            res = run_merge(plan, sources, progress, overwrite=overwrite).result
            assert res is not None  # a run's report has its result
            report.merge = {
                "seconds": res.seconds,
                "tensors": res.tensors,
                "merged_modules": res.merged_modules,
                "bytes_written": res.bytes_written,
                "files": list(res.files),
            }
            if edit is not None and new_text is not None:
                _write_config(edit.out, new_text)
    report.next, report.notes = _merge_next(edit, out, report.lr, report.generation)


def _merge_next(
    edit: _ConfigEdit | None, out: Path, lr: float, gen: str | None
) -> tuple[list[str], list[str]]:
    """merge mode's `next` and `notes`."""
    shown = display(str(out.resolve()))
    if edit is not None:
        steps = [edit.run_command()]
        notes = [
            "the restart trains a NEW LoRA on the merged weights from step 0, with the config's "
            "scheduler (warmup included); use a fresh output_dir so old checkpoints are not mixed in"
        ]
    else:
        fresh = (
            "drop --resume and the [resume] block, then start a new run (a new --run.name: the old run dir "
            "keeps the old checkpoints)"
            if gen == GEN_HEAD
            else "remove ckpt.resume_step, then start the run as before"
        )
        steps = [
            f'set [model] name = "{shown}" and [trainer.optim] lr = {lr!r} (or [optim] lr for a trainer '
            f"config), {fresh}"
        ]
        notes = ["pass --config YOUR.toml to have these edits written for you"]
    if parse_url(shown):
        notes.append(
            "OUT is at a URL, and prime-rl loads [model] name from a local dir or a Hub repo id: download "
            "OUT where the run starts and set [model] name to that dir"
        )
    return steps, notes


# ============================================================================ adapter mode
def _resume_step(ckpt: DcpCheckpoint) -> int:
    step = ckpt.read_object(PROGRESS_STEP_KEY) if PROGRESS_STEP_KEY in ckpt.entries else None
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise FormatError(f"progress.step is {step!r}, not an int >= 0", path=ckpt.dir, key=PROGRESS_STEP_KEY)
    return step


def _adapter_mode(
    report: RestartPrepReport,
    ckpt: DcpCheckpoint,
    lora_of: Callable[[], DcpLoraSource],
    base: str,
    edit: _ConfigEdit | None,
    world_size: int | None,
    scheduler_step: int,
    trust_pickle: bool,
    progress: Progress | None,
    *,
    overwrite: bool,
) -> None:
    out = Path(report.out)
    sharded = [len(e.chunks) for e in ckpt.tensor_entries() if e.shape and e.shape[0] > 1]
    orig_world = world_size_from_chunks(sharded) or 1
    step = _resume_step(ckpt)
    spec = scheduler_from_config(edit.text, edit.source) if edit is not None else SchedulerSpec("constant")
    report.step, report.world_size = step, world_size or orig_world
    report.scheduler, report.scheduler_step, report.warnings = spec.describe(), scheduler_step, []
    new_text = _adapter_config(report, edit, step)
    lora = lora_of()
    # the adapter as `ckpt extract-adapter` would export it: its alpha, rank and scale, checked against
    # the base, and every warning the export would give; it is then streamed into the new checkpoint
    xplan = plan_extract(lora, ExtractOptions(out, base=str(base)))
    report.adapter = {
        "modules": xplan.modules,
        "rank": xplan.rank,
        "alpha": xplan.alpha,
        "alpha_source": xplan.alpha_source,
        "scale": xplan.scale,
    }
    report.warnings += list(xplan.warnings)
    report.warnings += _absent(ckpt)
    if report.dry_run:  # OUT checked as the real run checks it; what --overwrite would remove
        report.output = describe_output(out, overwrite=overwrite)
        return
    options = ToDcpOptions(
        out,
        lr=report.lr,
        step=step,
        world_size=report.world_size,
        scheduler=spec,
        scheduler_step=scheduler_step,
        trust_pickle=trust_pickle,
    )
    _write_adapter_checkpoint(report, lora, base, options, progress, overwrite=overwrite)
    if edit is not None and new_text is not None:
        _write_config(edit.out, new_text)
    _adapter_next(report, edit, out, step)


def _adapter_config(report: RestartPrepReport, edit: _ConfigEdit | None, step: int) -> str | None:
    """The --config patched to resume at `step` in the run generation's form (None without --config)."""
    assert report.warnings is not None  # adapter mode's list
    if edit is None:
        report.warnings.append(
            "no --config: the checkpoint gets prime-rl's constant scheduler; the resuming run "
            'must use [scheduler] type = "constant" (pass --config to take the run\'s)'
        )
        return None
    new_text, report.config = edit.patched(
        model_name=None,
        lr=report.lr,
        resume_step=step,
        resume_form=report.generation or GEN_16E747C,
        run_name=report.run_name,
    )
    return new_text


def _absent(ckpt: DcpCheckpoint) -> list[str]:
    """What the checkpoint does not hold that a resume from OUT would: SignSGD's missing moments (prime-rl's
    SignSGD then reads only the param group's lr and weight_decay from OUT)."""
    absent = optimizer_facts(classify(k, e.path) for k, e in ckpt.entries.items()).absent
    if not absent:
        return []
    return [
        f"{absent}: OUT gets a fresh AdamW state (zero moments); resumed with optim.type "
        '"sign_sgd" prime-rl reads only its param group (lr, weight_decay) from it'
    ]


def _adapter_next(report: RestartPrepReport, edit: _ConfigEdit | None, out: Path, step: int) -> None:
    assert report.warnings is not None
    if out.name != "trainer" or out.parent.name != f"step_{step}":
        report.warnings.append(
            f"prime-rl looks for the checkpoint at <output_dir>/checkpoints/step_{step}/trainer: move OUT "
            "there (a fresh output_dir keeps the old checkpoints apart)"
        )
    gen = report.generation or GEN_16E747C
    report.next = (
        [edit.run_command()]
        if edit is not None
        else [resume_instruction(gen, step, run_name=report.run_name, lr=report.lr)]
    )


def _write_adapter_checkpoint(
    report: RestartPrepReport,
    lora: DcpLoraSource,
    base: str,
    options: ToDcpOptions,
    progress: Progress | None,
    *,
    overwrite: bool,
) -> None:
    """The resumable checkpoint at OUT (the adapter-to-dcp op over the checkpoint's own LoRA)."""
    out = Path(options.out)
    make_dirs(out.parent)
    if out.exists() and not overwrite:
        raise OutputExistsError("already exists", path=out, hint=OVERWRITE_HINT)
    with ToDcpSources(lora, HFModelDir.open_ref(base)) as sources:
        plan = plan_adapter_to_dcp(sources, options)
        t0 = time.perf_counter()
        rep = run_adapter_to_dcp(plan, sources, progress, overwrite=overwrite).to_json()
        report.checkpoint_out = {
            "keys": rep["keys"],
            "bytes_written": rep["bytes_written"],
            "seconds": round(time.perf_counter() - t0, 3),
            "lr_now": rep["lr_now"],
            "lr_next": rep["lr_next"],
            "notes": rep["notes"],
        }
        assert report.warnings is not None  # adapter mode's list
        report.warnings += list(rep["warnings"])
