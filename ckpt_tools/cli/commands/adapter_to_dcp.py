"""`ckpt adapter-to-dcp`: arguments -> `api.adapter_to_dcp` -> text or JSON."""

from __future__ import annotations

from pathlib import Path

import click

from ... import api
from ...core.errors import UsageError
from ...core.primerl_state import SCHEDULER_TYPES, SchedulerSpec
from ...core.units import human_bytes, human_number
from ..flow import finish, progress_line
from ..mistakes import check_roles
from ..options import (
    InputPath,
    OutputPath,
    download_option,
    dry_run_option,
    input_arg,
    json_option,
    overwrite_option,
    trust_option,
)
from ..render import dry_run_label, warn, warn_trust

__all__ = ["command"]


@click.command("adapter-to-dcp")
@click.argument("adapter", type=InputPath(file_okay=False))
@click.argument("out", type=OutputPath())
@click.option(
    "--base",
    required=True,
    metavar="NAME_OR_DIR",
    help="The HF base model the adapter was trained on (a dir, or a hub id in the local HF cache).",
)
@click.option(
    "--lr",
    type=float,
    help="Base learning rate of the resumed run (default with --optimizer-from: its initial_lr).",
)
@click.option("--step", type=int, help="progress.step of the checkpoint (default 0, or --optimizer-from's).")
@click.option(
    "--world-size",
    type=int,
    default=4,
    show_default=True,
    help="FSDP world size of the resuming run: tensors are written as its row chunks.",
)
@click.option(
    "--optimizer-from",
    type=InputPath(file_okay=False),
    metavar="CKPT",
    help="Carry AdamW moments and step from this prime-rl checkpoint (same LoRA) instead of a fresh "
    "optimizer.",
)
@click.option(
    "--scheduler",
    type=click.Choice(SCHEDULER_TYPES),
    default="constant",
    show_default=True,
    help="prime-rl [scheduler] type of the resuming run (its state must match the run's config).",
)
@click.option("--warmup-steps", type=int, default=0, show_default=True, help="[scheduler] warmup_steps.")
@click.option(
    "--decay-steps", type=int, default=0, show_default=True, help="[scheduler] decay_steps (linear)."
)
@click.option("--max-steps", type=int, help="The run's max_steps (cosine, linear decay).")
@click.option("--min-lr", type=float, default=0.0, show_default=True, help="[scheduler] min_lr.")
@click.option(
    "--scheduler-step",
    type=int,
    help="Steps the schedule has advanced (default: --step). 0 restarts the warmup at the resume.",
)
@overwrite_option
@dry_run_option
@download_option
@json_option
@trust_option
def command(
    adapter: Path,
    out: Path,
    base: str,
    lr,
    step,
    world_size: int,
    optimizer_from,
    scheduler: str,
    warmup_steps: int,
    decay_steps: int,
    max_steps,
    min_lr: float,
    scheduler_step,
    overwrite: bool,
    dry_run: bool,
    as_json: bool,
    trust_pickle: bool,
) -> None:
    """Build a prime-rl trainer checkpoint from a PEFT adapter and the HF base.

    OUT becomes a DCP checkpoint (put it at outputs/checkpoints/step_N/trainer) that prime-rl's
    strict loader resumes from: fp32 master copies of the base weights, the adapter's A/B as
    lora_A.0/lora_B.0, AdamW state (fresh, or --optimizer-from another checkpoint), param_groups
    with --lr and prime-rl's AdamW defaults, the --scheduler state and progress.step. Memory: one
    row chunk of one base tensor at a time.

    \b
    Example:
      ckpt adapter-to-dcp adapter-step95 outputs/checkpoints/step_95/trainer \\
        --base Qwen/Qwen3-32B --lr 5e-6 --step 95 \\
        --scheduler linear --warmup-steps 10 --scheduler-step 0
    """
    base = input_arg(base)
    check_roles(
        "adapter-to-dcp", {"ADAPTER": adapter, "OUT": out, "--base": base, "--optimizer-from": optimizer_from}
    )
    warn_trust(trust_pickle)
    try:
        spec = SchedulerSpec(
            scheduler, warmup_steps=warmup_steps, decay_steps=decay_steps, max_steps=max_steps, min_lr=min_lr
        )
    except ValueError as exc:
        raise UsageError(f"--scheduler {scheduler}: {exc}") from None
    with progress_line(not dry_run) as bar:
        report = api.adapter_to_dcp(
            adapter,
            out,
            base=base,
            lr=lr,
            step=step,
            world_size=world_size,
            optimizer_from=optimizer_from,
            scheduler=spec,
            scheduler_step=scheduler_step,
            dry_run=dry_run,
            overwrite=overwrite,
            trust_pickle=trust_pickle,
            progress=bar,
        )
    finish(report, as_json, lambda rep: _render(rep, dry_run))


def _render(rep: dict, dry_run: bool) -> None:
    verb = "would write" if dry_run else "wrote"
    k = rep["tensor_keys"]
    click.echo(
        f"{verb} {rep['out']}: {rep['keys']} keys ({k.get('base', 0)} base fp32, {k.get('lora', 0)} LoRA, "
        f"{k.get('optimizer_state', 0)} optimizer state, {len(rep['byte_items']) + 1} byte items), "
        f"row chunks for world size {rep['world_size']}{dry_run_label(dry_run)}"
    )
    opt = f"carried from {rep['optimizer_from']}" if rep["optimizer_from"] else "fresh (zero moments, step 0)"
    click.echo(
        f"  LoRA: {rep['modules']} modules, rank {rep['rank']}, scale {human_number(rep['scale'])}; AdamW "
        f"{opt}"
    )
    nxt = ", ".join(f"{x:.3g}" for x in rep["lr_next"])
    click.echo(
        f"  progress.step {rep['step']}; lr {human_number(rep['lr'])}; scheduler "
        f"{rep['scheduler']['describe']} at step "
        f"{rep['scheduler_step']}: lr now {rep['lr_now']:.3g}, next steps {nxt}"
    )
    size = rep.get("bytes_written", rep["need_bytes"])
    click.echo(
        f"  {'data' if 'bytes_written' in rep else 'needs up to'} {human_bytes(size)}"
        + (f" in {rep['seconds']:.1f} s" if "seconds" in rep else "")
    )
    for n in rep["notes"]:
        click.echo(f"  note: {n}")
    for w in rep["warnings"]:
        warn(w)
