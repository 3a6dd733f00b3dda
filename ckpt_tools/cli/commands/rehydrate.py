"""`ckpt rehydrate`: arguments -> `api.rehydrate` -> text or JSON."""

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


@click.command("rehydrate")
@click.argument("slim_ckpt", metavar="SLIM", type=InputPath())
@click.argument("out", type=OutputPath())
@click.option(
    "--base",
    required=True,
    help="The bf16 HF base model the run trained on (dir or hub id in the local HF cache).",
)
@click.option(
    "--world-size",
    type=click.IntRange(min=1),
    help="Write base weights as row chunks for W ranks "
    "(default: the original checkpoint's exact chunk layout and rank files).",
)
@click.option(
    "--threads",
    type=click.IntRange(1, 64),
    default=None,
    help="Workers reading, casting, checking and writing blocks in parallel (default: the cores + 2). "
    "Memory does not grow with them: the blocks in flight share one budget (the plan's memory "
    "bound).",
)
@overwrite_option
@dry_run_option
@download_option
@json_option
@trust_option
def command(
    slim_ckpt: Path,
    out: Path,
    base: str,
    world_size,
    threads,
    overwrite: bool,
    dry_run: bool,
    as_json: bool,
    trust_pickle: bool,
) -> None:
    """Rebuild the full checkpoint prime-rl resumes from, from a slim one and the base model.

    Slim items are copied verbatim; each dropped tensor is rebuilt as the exact fp32 upcast of the
    base weight and checked against the slim manifest (each original chunk's CRC-32, the tensor's
    sha256 where recorded). Any mismatch (a different base revision) aborts and OUT is not created.

    \b
    Example:
      ckpt rehydrate step_95-slim step_95-full --base Qwen/Qwen3-32B
    """
    base = input_arg(base)
    check_roles("rehydrate", {"SLIM": slim_ckpt, "OUT": out, "--base": base})
    warn_trust(trust_pickle)
    with progress_line(not dry_run) as bar:
        report = api.rehydrate(
            slim_ckpt,
            out,
            base=base,
            world_size=world_size,
            dry_run=dry_run,
            overwrite=overwrite,
            trust_pickle=trust_pickle,
            threads=threads,
            progress=bar,
        )
    finish(report, as_json, lambda r: _render(r, dry_run))


def _render(report: dict, dry_run: bool) -> None:
    p = report["plan"]
    click.echo(f"rehydrate {p['slim']} + {p['base']} -> {p['out']}{dry_run_label(dry_run)}")
    click.echo(
        f"  copy {p['copied_items']} items ({human_bytes(p['copied_bytes'])}) verbatim; rebuild "
        f"{p['rebuilt_tensors']} tensors ({human_bytes(p['rebuilt_bytes'])}), layout {p['layout']}"
    )
    for w in p["warnings"]:
        warn(w)
    r = report.get("result")
    if r:
        click.echo(
            f"  {r['verified_tensors']}/{r['rebuilt_tensors']} rebuilt tensors match the manifest (sha256 / "
            f"chunk CRC-32); "
            f"wrote {human_bytes(r['out_bytes'])} in {r['seconds']['total']:.2f}s"
        )
        click.echo(f"  resumable: point prime-rl at {r['out']}")
