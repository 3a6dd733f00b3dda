"""`ckpt slim`: arguments -> `api.slim` -> text or JSON."""

from __future__ import annotations

from pathlib import Path

import click

from ... import api
from ...core.units import human_bytes
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


@click.command("slim")
@click.argument("ckpt", type=InputPath())
@click.argument("out", type=OutputPath())
@click.option(
    "--base",
    help="The bf16 HF base model (dir or hub id in the local cache). Recorded in the "
    "manifest and checked now: every dropped tensor must equal its upcast.",
)
@overwrite_option
@dry_run_option
@download_option
@json_option
@trust_option
def command(
    ckpt: Path, out: Path, base, overwrite: bool, dry_run: bool, as_json: bool, trust_pickle: bool
) -> None:
    """Drop the frozen base weights of a checkpoint, keeping everything unique.

    LoRA, optimizer state, param_groups, scheduler and progress items are copied verbatim by byte
    range into OUT; every dropped tensor is listed in OUT/ckpt-slim-manifest.json with its shape,
    dtype, chunk layout and sha256. A slim checkpoint is NOT loadable by prime-rl's strict loader:
    run `ckpt rehydrate` before resuming from it.

    \b
    Example:
      ckpt slim outputs/checkpoints/step_95/trainer step_95-slim --base Qwen/Qwen3-32B
    """
    check_roles("slim", {"CKPT": ckpt, "OUT": out, "--base": base})
    warn_trust(trust_pickle)
    with progress_line(not dry_run) as bar:
        report = api.slim(
            ckpt,
            out,
            base=input_arg(base),
            dry_run=dry_run,
            overwrite=overwrite,
            trust_pickle=trust_pickle,
            progress=bar,
        )
    finish(report, as_json, lambda r: _render(r, dry_run))


def _render(report: dict, dry_run: bool) -> None:
    p = report["plan"]
    click.echo(f"slim {p['source']} -> {p['out']}{dry_run_label(dry_run)}")
    click.echo(
        f"  keep {p['kept_keys']} keys ({p['kept_items']} items, {human_bytes(p['kept_bytes'])}) verbatim"
    )
    click.echo(
        f"  drop {p['dropped_keys']} frozen base tensors ({human_bytes(p['dropped_bytes'])}), "
        f"identified in the manifest by their items' stored CRC-32s"
    )
    base_info = p.get("base")
    if base_info:
        how = " (checked)" if p["verify_base"] else " (from the run config, unchecked)"
        click.echo(f"  base: {base_info.get('name')}{how}")
    r = report.get("result")
    if r:
        click.echo(
            f"  wrote {human_bytes(r['out_bytes'])} ({r['size_ratio']:.1f}x smaller) in "
            f"{r['seconds']['total']:.2f}s; read {human_bytes(r['bytes_read'])}"
        )
    for w in p.get("warnings") or []:
        warn(w)
    if not p.get("base"):
        warn("no base model recorded: pass --base to rehydrate (and --base here to check it now)")
    warn("a slim checkpoint is not loadable by prime-rl's strict loader; `ckpt rehydrate` it before resuming")
