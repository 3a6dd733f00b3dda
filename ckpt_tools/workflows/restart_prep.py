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

import math
import re
import time
from pathlib import Path

from ..core.errors import FormatError, MissingPathError, OutputExistsError, UsageError
from ..core.keys import PROGRESS_STEP_KEY, world_size_from_chunks
from ..core.primerl_state import SchedulerSpec
from ..formats.dcp.layout import METADATA_NAME, resolve_checkpoint_dir
from ..formats.dcp.reader import DcpCheckpoint
from ..formats.hf_dir.model_dir import HFModelDir
from ..formats.primerl.toml_patch import config_kind, patch_config_text, scheduler_from_config, unified_diff
from ..io.files import atomic_write_text, make_dirs
from ..io.inputs import read_toml
from ..io.remote import display, is_remote_path, parse_url
from ..io.staging import OVERWRITE_HINT, check_output_file, describe_output
from ..ops.adapter_to_dcp import ToDcpOptions, ToDcpSources, plan_adapter_to_dcp, run_adapter_to_dcp
from ..ops.extract_adapter import ExtractOptions, plan_extract
from ..ops.merge import MergeOptions, MergeSources, check_output, plan_merge, run_merge
from ..sources.lora import DcpLoraSource

__all__ = ["MODES", "default_config_out", "find_checkpoint", "restart_prep"]

MODES = ("merge", "adapter")


# ============================================================================ locating the checkpoint
_STEP = re.compile(r"^step_(\d+)$")


def find_checkpoint(path: str | Path) -> Path:
    """A trainer dir, a step dir, an outputs/checkpoints dir, an outputs dir or a run root: the
    latest complete checkpoint under it."""
    p = Path(path)
    if not p.exists():
        raise MissingPathError(p)
    if (p / METADATA_NAME).is_file() or (p / "trainer" / METADATA_NAME).is_file():
        return resolve_checkpoint_dir(p)
    for root in (p, p / "checkpoints", p / "outputs" / "checkpoints"):
        if not root.is_dir():
            continue
        steps = sorted(
            (int(m.group(1)), c)
            for c in root.iterdir()
            if (m := _STEP.match(c.name)) and (c / "trainer" / METADATA_NAME).is_file()
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
    max_shard_size: str = "5GB",
    world_size: int | None = None,
    scheduler_step: int = 0,
    config_out: str | Path | None = None,
    dry_run: bool = False,
    trust_pickle: bool = False,
    progress=None,
    overwrite: bool = False,
) -> dict:
    """Library entry point. Returns a JSON-able report with "next" (what to run next)."""
    if mode not in MODES:
        raise UsageError(f"--mode {mode!r}: choose one of {', '.join(MODES)}")
    out = Path(out)
    ckpt_dir = find_checkpoint(run_or_ckpt)
    with DcpCheckpoint.open(
        ckpt_dir, trust_pickle=trust_pickle
    ) as ckpt:  # the input is checked first, opened once
        if base is None:
            raise UsageError("--base is required: the HF base model the run trained on")
        if lr is None or not (lr > 0 and math.isfinite(lr)):
            raise UsageError(f"--lr must be a positive finite number (got {lr})")
        cfg_text = cfg_out = None
        if config is not None:
            config = Path(config)
            _doc, cfg_text = read_toml(config, what="prime-rl config")
            cfg_out = Path(config_out) if config_out is not None else default_config_out(mode, out, config)
            if config_out is None and is_remote_path(config):
                raise UsageError(
                    "the patched config goes beside --config by default, and that is at a URL",
                    path=cfg_out,
                    hint="pass --config-out (a local path, or a URL to upload it to)",
                )
            if cfg_out.resolve() == config.resolve():
                raise UsageError(
                    "the patched config would overwrite the source config",
                    path=cfg_out,
                    hint="pass another --config-out",
                )
            # checked now, before anything is written: its dir exists, nothing is there, and it is not
            # (inside) an input (the checkpoint, the config, the base dir, the run config) or inside OUT
            local_base = [base] if base is not None and Path(base).is_dir() else []
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
        if mode == "merge":
            return _merge_mode(
                ckpt,
                out,
                base=base,
                lr=lr,
                cfg_text=cfg_text,
                config=config,
                cfg_out=cfg_out,
                alpha=alpha,
                run_config=run_config,
                dtype=dtype,
                max_shard_size=max_shard_size,
                dry_run=dry_run,
                trust_pickle=trust_pickle,
                progress=progress,
                overwrite=overwrite,
            )
        return _adapter_mode(
            ckpt,
            out,
            base=base,
            lr=lr,
            cfg_text=cfg_text,
            config=config,
            cfg_out=cfg_out,
            alpha=alpha,
            run_config=run_config,
            world_size=world_size,
            scheduler_step=scheduler_step,
            dry_run=dry_run,
            trust_pickle=trust_pickle,
            progress=progress,
            overwrite=overwrite,
        )


def _rebase(config: Path, cfg_out: Path) -> Path | None:
    """The dir relative `toml_files` of the copy are made absolute from; None: left as written (the copy
    beside its source, or a source at a URL: its local stand-in is gone once the command ends)."""
    src, dst = config.resolve().parent, cfg_out.resolve().parent
    return None if src == dst or is_remote_path(config) else src


def _write_config(cfg_out: Path, text: str) -> None:
    if cfg_out.exists():
        raise OutputExistsError("appeared while we worked", path=cfg_out)
    atomic_write_text(cfg_out, text)


def _lora(ckpt: DcpCheckpoint, alpha, run_config) -> DcpLoraSource:
    return ckpt.lora(alpha=alpha, run_config=Path(run_config) if run_config else None)


def _merge_mode(
    ckpt: DcpCheckpoint,
    out,
    *,
    base,
    lr,
    cfg_text,
    config,
    cfg_out,
    alpha,
    run_config,
    dtype,
    max_shard_size,
    dry_run,
    trust_pickle,
    progress,
    overwrite=False,
) -> dict:
    report: dict = {
        "mode": "merge",
        "checkpoint": str(ckpt.dir),
        "out": str(out),
        "lr": lr,
        "dry_run": dry_run,
    }
    new_text = None
    if cfg_text is not None:  # validate the config before the (long) merge
        # OUT at a URL (its local staging dir, uploaded once written: io.upload): the config names the URL
        new_text, changes = patch_config_text(
            cfg_text,
            model_name=display(str(out.resolve())),
            lr=lr,
            remove_resume=True,
            rebase_from=_rebase(config, cfg_out),
            where=config,
        )
        report["config"] = {
            "source": str(config),
            "out": str(cfg_out),
            "changes": [c.to_json() for c in changes],
            "diff": unified_diff(cfg_text, new_text, config.name),
        }
    options = MergeOptions(
        out=str(out),
        alpha=alpha,
        run_config=None if run_config is None else str(run_config),
        dtype=dtype,
        max_shard_size=max_shard_size,
        trust_pickle=trust_pickle,
    )
    lora = _lora(ckpt, alpha, run_config)
    with MergeSources(HFModelDir.open_ref(base), lora) as sources:
        plan = plan_merge(sources, options)
        ad = plan.adapter or {}
        report["merge_plan"] = {
            "merged_modules": plan.merged_modules,
            "alpha": ad.get("alpha"),
            "alpha_source": ad.get("alpha_source"),
            "scale": ad.get("scale"),
            "out_dtype": plan.out_dtype,
            "write_bytes": plan.write_bytes,
            "warnings": list(plan.warnings),
        }
        if dry_run:
            check_output(plan, out, overwrite=overwrite)
        else:
            res = run_merge(plan, sources, progress, overwrite=overwrite).result
            report["merge"] = {
                "seconds": res.seconds,
                "tensors": res.tensors,
                "merged_modules": res.merged_modules,
                "bytes_written": res.bytes_written,
                "files": list(res.files),
            }
            if new_text is not None:
                _write_config(cfg_out, new_text)
    if cfg_text is not None:
        cmd = "rl" if config_kind(cfg_text) == "rl" else "trainer"
        report["next"] = [f"uv run {cmd} @ {cfg_out}"]
        report["notes"] = [
            "the restart trains a NEW LoRA on the merged weights from step 0, with the config's "
            "scheduler (warmup included); use a fresh output_dir so old checkpoints are not mixed in"
        ]
    else:
        report["next"] = [
            f'set [model] name = "{display(str(out.resolve()))}" and [trainer.optim] lr = {lr!r} (or [optim] '
            f"lr for a "
            "trainer config), remove ckpt.resume_step, then start the run as before"
        ]
        report["notes"] = ["pass --config YOUR.toml to have these edits written for you"]
    if parse_url(display(str(out.resolve()))):
        report.setdefault("notes", []).append(
            "OUT is at a URL, and prime-rl loads [model] name from a local dir or a Hub repo id: download "
            "OUT "
            "where the run starts and set [model] name to that dir"
        )
    return report


def _adapter_mode(
    ckpt: DcpCheckpoint,
    out,
    *,
    base,
    lr,
    cfg_text,
    config,
    cfg_out,
    alpha,
    run_config,
    world_size,
    scheduler_step,
    dry_run,
    trust_pickle,
    progress,
    overwrite=False,
) -> dict:
    step = ckpt.read_object(PROGRESS_STEP_KEY) if PROGRESS_STEP_KEY in ckpt.entries else None
    sharded = [len(e.chunks) for e in ckpt.tensor_entries() if e.shape and e.shape[0] > 1]
    orig_world = world_size_from_chunks(sharded) or 1
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise FormatError(f"progress.step is {step!r}, not an int >= 0", path=ckpt.dir, key=PROGRESS_STEP_KEY)
    world_size = world_size or orig_world
    spec = scheduler_from_config(cfg_text, config) if cfg_text is not None else SchedulerSpec("constant")
    report: dict = {
        "mode": "adapter",
        "checkpoint": str(ckpt.dir),
        "out": str(out),
        "lr": lr,
        "step": step,
        "world_size": world_size,
        "scheduler": spec.describe(),
        "scheduler_step": scheduler_step,
        "dry_run": dry_run,
        "warnings": [],
    }
    if cfg_text is None:
        report["warnings"].append(
            "no --config: the checkpoint gets prime-rl's constant scheduler; the resuming run "
            'must use [scheduler] type = "constant" (pass --config to take the run\'s)'
        )
    new_text = None
    if cfg_text is not None:
        new_text, changes = patch_config_text(
            cfg_text,
            model_name=None,
            lr=lr,
            resume_step=step,
            rebase_from=_rebase(config, cfg_out),
            where=config,
        )
        report["config"] = {
            "source": str(config),
            "out": str(cfg_out),
            "changes": [c.to_json() for c in changes],
            "diff": unified_diff(cfg_text, new_text, config.name),
        }
    lora = _lora(ckpt, alpha, run_config)
    # the adapter as `ckpt extract-adapter` would export it: its alpha, rank and scale, checked against
    # the base, and every warning the export would give; it is then streamed into the new checkpoint
    xplan = plan_extract(lora, ExtractOptions(out, base=str(base)))
    report["adapter"] = {
        "modules": xplan.modules,
        "rank": xplan.rank,
        "alpha": xplan.alpha,
        "alpha_source": xplan.alpha_source,
        "scale": xplan.scale,
    }
    report["warnings"] += list(xplan.warnings)
    if dry_run:  # OUT checked as the real run checks it; what --overwrite would remove
        report["output"] = describe_output(out, overwrite=overwrite)
        return report
    make_dirs(out.parent)
    if out.exists() and not overwrite:
        raise OutputExistsError("already exists", path=out, hint=OVERWRITE_HINT)
    with ToDcpSources(lora, HFModelDir.open_ref(base)) as sources:
        plan = plan_adapter_to_dcp(
            sources,
            ToDcpOptions(
                out,
                lr=lr,
                step=step,
                world_size=world_size,
                scheduler=spec,
                scheduler_step=scheduler_step,
                trust_pickle=trust_pickle,
            ),
        )
        t0 = time.perf_counter()
        rep = run_adapter_to_dcp(plan, sources, progress, overwrite=overwrite).to_json()
        report["checkpoint_out"] = {
            "keys": rep["keys"],
            "bytes_written": rep["bytes_written"],
            "seconds": round(time.perf_counter() - t0, 3),
            "lr_now": rep["lr_now"],
            "lr_next": rep["lr_next"],
            "notes": rep["notes"],
        }
        report["warnings"] += list(rep["warnings"])
    if new_text is not None:
        _write_config(cfg_out, new_text)
    where = f"<output_dir>/checkpoints/step_{step}/trainer"
    if out.name != "trainer" or out.parent.name != f"step_{step}":
        report["warnings"].append(
            f"prime-rl looks for the checkpoint at {where}: move OUT there (a fresh "
            "output_dir keeps the old checkpoints apart)"
        )
    run_cmd = "rl" if cfg_text is not None and config_kind(cfg_text) == "rl" else "trainer"
    report["next"] = (
        [f"uv run {run_cmd} @ {cfg_out}"]
        if cfg_out is not None
        else [f"resume with ckpt.resume_step = {step} and lr {lr!r} in your config"]
    )
    return report
