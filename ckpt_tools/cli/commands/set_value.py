"""`ckpt set`: arguments -> `api.set_values` -> text or JSON."""

from __future__ import annotations

from pathlib import Path

import click

from ... import api
from ..flow import finish
from ..options import InputPath, OutputPath, dry_run_option, json_option, overwrite_option, trust_option
from ..render import dry_run_label, warn, warn_trust
from .set_lr import render_changes, render_result

__all__ = ["command"]


@click.command("set")
@click.argument("ckpt", type=InputPath())
@click.argument("out", type=OutputPath())
@click.argument("assignments", metavar="KEY=VALUE...", nargs=-1, required=True)
@overwrite_option
@dry_run_option
@json_option
@trust_option
def command(
    ckpt: Path, out: Path, assignments, overwrite: bool, dry_run: bool, as_json: bool, trust_pickle: bool
) -> None:
    """Set scalar byte items (progress, scheduler fields, ...) of a checkpoint by surgery.

    KEY is a DCP key with or without the leading `app.` (`progress.step`). The new VALUE must have
    the current value's type: int stays int, float stays float, bool is true/false, a list is a
    JSON array of the same length. Tensors cannot be set. OUT hard-links the data files.

    A verl checkpoint's KEY is a field of its optimizer's param groups or its scheduler
    (`param_groups.0.weight_decay`, `lr_scheduler.last_epoch`), set on every rank, in place in the
    rank files' pickles (a value must fit the old one's bytes). torchtitan checkpoints are refused.

    \b
    Example:
      ckpt set outputs/checkpoints/step_95/trainer step_95-fixed progress.step=100
    """
    warn_trust(trust_pickle)
    result = api.set_values(
        ckpt, out, list(assignments), dry_run=dry_run, overwrite=overwrite, trust_pickle=trust_pickle
    )
    finish(result, as_json, lambda r: _render(r, dry_run))


def _render(report: dict, dry_run: bool) -> None:
    p = report["plan"]
    click.echo(f"set {p['source']}{dry_run_label(dry_run)}")
    render_changes(p["changes"])
    for w in p["warnings"]:
        warn(w)
    if report.get("result"):
        render_result(report["result"])
