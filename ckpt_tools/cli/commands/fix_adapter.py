"""`ckpt fix-adapter`: arguments -> `api.fix_adapter` -> text or JSON."""

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
    overwrite_option,
)
from ..render import dry_run_label, warn

__all__ = ["command"]


@click.command("fix-adapter")
@click.argument("src", type=InputPath(file_okay=False))
@click.argument("out", type=OutputPath())
@click.option(
    "--base",
    metavar="DIR",
    help="Base model to check every LoRA module against (default: the export's "
    "base_model_name_or_path, looked up next to the run).",
)
@click.option(
    "--slot", type=int, default=None, help="Adapter slot to keep from a multi-slot export (default 0)."
)
@click.option(
    "--checkpoint",
    "checkpoint",
    type=InputPath(),
    default=None,
    metavar="CKPT",
    help="The run's DCP checkpoint of the same step: fills the modules_to_save tensors prime-rl's "
    "broadcast lists but does not hold (HEAD lora.modules_to_save).",
)
@alpha_options
@click.option(
    "--layout",
    type=click.Choice(["peft", "vllm", "prime-rl"]),
    default="peft",
    metavar="LAYOUT",
    help="peft (default), vllm or prime-rl: how MoE expert LoRA is written (as extract-adapter "
    "--layout; any layout is read). A dense adapter is the same file in every layout.",
)
@overwrite_option
@dry_run_option
@download_option
@json_option
def command(
    src: Path,
    out: Path,
    base,
    slot,
    checkpoint,
    alpha,
    run_config,
    layout: str,
    overwrite: bool,
    dry_run: bool,
    as_json: bool,
) -> None:
    """Repair a prime-rl adapter export into a PEFT adapter that really applies.

    SRC is a broadcast dir (outputs/<run>/broadcasts/step_N: keys lack `base_model.model.`) or a
    weight export (outputs/weights/step_N/lora_adapters: adapter_model.bin with `lora_A.<slot>`).
    PEFT loads both without an error and applies NOTHING. OUT gets the renamed tensors (values
    unchanged) as safetensors and a config with the training lora_alpha (the run's orch.toml, or
    --alpha / --run-config) and only the modules_to_save that are really there, under their exact
    module names; with --checkpoint, the trained ones the export lacks are filled from it.

    \b
    Example:
      ckpt fix-adapter outputs/run_default/broadcasts/step_95 adapter-step95
      ckpt fix-adapter outputs/broadcasts/step_9 ad9 --checkpoint outputs/checkpoints/step_9
    """
    base = input_arg(base)
    check_roles("fix-adapter", {"SRC": src, "OUT": out, "--base": base, "--checkpoint": checkpoint})
    with progress_line(not dry_run) as bar:
        report = api.fix_adapter(
            src,
            out,
            base=base,
            slot=slot,
            alpha=alpha,
            run_config=run_config,
            checkpoint=checkpoint,
            layout=layout,
            dry_run=dry_run,
            overwrite=overwrite,
            progress=bar,
        )
    finish(report, as_json, lambda rep: _render(rep, dry_run))


def _render(rep: dict, dry_run: bool) -> None:
    verb = "would write" if dry_run else "wrote"
    click.echo(
        f"{verb} {rep['out']}: {rep['modules']} LoRA modules, rank {rep['rank']}"
        + (f", slot {rep['slot']}" if rep["slot"] is not None else "")
        + (f", modules_to_save {', '.join(rep['modules_to_save'])}" if rep["modules_to_save"] else "")
        + dry_run_label(dry_run)
    )
    click.echo(
        f"  lora_alpha {human_number(rep['lora_alpha'])} (scale {human_number(rep['scale'])}) from "
        f"{rep['alpha_source']}"
    )
    click.echo(f"  checked against base: {rep['base_checked'] or 'NO'}")
    for f in rep["fixes"] or ["nothing needed fixing (normalized copy)"]:
        click.echo(f"  fixed: {f}")
    click.echo(
        f"  adapter_model.safetensors {human_bytes(rep.get('written_file_bytes', rep['out_file_bytes']))}"
    )
    for w in rep["warnings"]:
        warn(w)
