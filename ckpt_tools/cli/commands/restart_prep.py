"""`ckpt restart-prep`: arguments -> `api.restart_prep` -> text or JSON."""

from __future__ import annotations

from pathlib import Path

import click

from ... import api
from ...core.units import human_bytes, human_number
from ..flow import finish, progress_line
from ..mistakes import check_roles
from ..options import (
    InputPath,
    OutputPath,
    alpha_options,
    download_option,
    dry_run_option,
    input_arg,
    json_option,
    output_beside,
    overwrite_option,
    trust_option,
)
from ..render import dry_run_label, warn, warn_trust

__all__ = ["command"]


@click.command("restart-prep")
@click.argument("run_or_ckpt", metavar="RUN_OR_CKPT", type=InputPath())
@click.argument("out", type=OutputPath())
@click.option(
    "--base",
    required=True,
    help="The HF base model the run trained on (dir or hub id in the local HF cache).",
)
@click.option("--lr", type=float, required=True, help="The learning rate of the restarted run.")
@click.option(
    "--config",
    type=InputPath(dir_okay=False),
    help="Your prime-rl TOML (rl or trainer config): a patched copy is written next to OUT.",
)
@click.option(
    "--config-out",
    type=OutputPath(),
    metavar="FILE",
    help="Where to write the patched config, a path or a URL (default: merge mode OUT.<config name> beside "
    "OUT, at OUT's URL too; adapter mode <config stem>.restart.toml beside a local config).",
)
@click.option(
    "--mode",
    type=click.Choice(("merge", "adapter")),
    default="merge",
    show_default=True,
    help="merge: merged bf16 model + config for a fresh LoRA run. adapter: resumable checkpoint with "
    "the adapter kept, fresh AdamW, lr X, step kept.",
)
@alpha_options
@click.option(
    "--world-size",
    type=click.IntRange(min=1),
    help="adapter mode: row chunks for W ranks (default: the checkpoint's).",
)
@click.option(
    "--scheduler-step",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="adapter mode: position of the restarted schedule (0 = warm up again).",
)
@overwrite_option
@dry_run_option
@download_option
@json_option
@trust_option
def command(
    run_or_ckpt: Path,
    out: Path,
    base,
    lr,
    config,
    config_out,
    mode: str,
    alpha,
    run_config,
    world_size,
    scheduler_step: int,
    overwrite: bool,
    dry_run: bool,
    as_json: bool,
    trust_pickle: bool,
) -> None:
    """Prepare a fresh-LR restart of a prime-rl LoRA run.

    RUN_OR_CKPT: a trainer checkpoint dir, or a run/outputs dir (its latest checkpoint is used).
    merge mode writes the merged bf16 model at OUT and, with --config, OUT.<config name> with the
    model name -> OUT, lr -> --lr and resume settings removed. adapter mode writes a resumable
    trainer checkpoint at OUT (the adapter kept, fresh AdamW, --lr, the step kept) and, with
    --config, <config>.restart.toml with lr -> --lr and ckpt.resume_step -> the step.

    \b
    Example:
      ckpt restart-prep outputs/checkpoints/step_95/trainer merged-95 --base Qwen/Qwen3-32B \\
        --lr 5e-6 --config rl.toml
    """
    base = input_arg(base)
    if (
        mode == "merge" and config is not None and config_out is None
    ):  # OUT at a URL: the config beside it there
        config_out = output_beside(out, f".{config.name}")
    check_roles("restart-prep", {"RUN_OR_CKPT": run_or_ckpt, "--base": base})
    warn_trust(trust_pickle)
    with progress_line() as bar:
        rep = api.restart_prep(
            run_or_ckpt,
            out,
            base=base,
            lr=lr,
            config=config,
            mode=mode,
            alpha=alpha,
            run_config=run_config,
            world_size=world_size,
            scheduler_step=scheduler_step,
            config_out=config_out,
            dry_run=dry_run,
            trust_pickle=trust_pickle,
            overwrite=overwrite,
            progress=bar,
        )
    finish(rep, as_json, lambda r: _render(r, dry_run))


def _render(rep: dict, dry_run: bool) -> None:
    dry = dry_run_label(dry_run)
    click.echo(f"restart-prep ({rep['mode']} mode) from {rep['checkpoint']} -> {rep['out']}{dry}")
    if rep["mode"] == "merge":
        mp = rep["merge_plan"]
        click.echo(
            f"  merge {mp['merged_modules']} LoRA modules (alpha {human_number(mp['alpha'])}, from "
            f"{mp['alpha_source']}) "
            f"into {mp['out_dtype']}: {human_bytes(mp['write_bytes'])}"
        )
        for w in mp["warnings"]:
            warn(w)
    else:
        a = rep["adapter"]
        click.echo(
            f"  adapter: {a['modules']} modules, rank {a['rank']}, scale {human_number(a['scale'])} (alpha "
            f"{human_number(a['alpha'])} "
            f"from {a['alpha_source']}); fresh AdamW, lr {human_number(rep['lr'])}, step {rep['step']}, "
            f"scheduler {rep['scheduler']} at position {rep['scheduler_step']}, world size "
            f"{rep['world_size']}"
        )
    cfg = rep.get("config")
    if cfg:
        click.echo(f"  config {cfg['out']}:")
        for c in cfg["changes"]:
            after = "(removed)" if c["after"] is None else repr(c["after"])
            click.echo(f"    {c['key']}: {c['before']!r} -> {after}")
    for n in rep.get("notes", []):
        click.echo(f"  note: {n}")
    for w in rep.get("warnings", []):
        warn(w)
    click.echo("next:")
    for line in rep["next"]:
        click.echo(f"  {line}")
