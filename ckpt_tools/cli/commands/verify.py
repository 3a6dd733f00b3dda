"""`ckpt verify`: arguments -> `api.verify` -> one line per problem (or JSON), exit 1 on any."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from ... import api
from ...core.problems import group_problems
from ...core.units import human_bytes
from ..flow import progress_line
from ..mistakes import check_roles
from ..options import ModelPath, download_option, json_option, trust_option
from ..render import emit, one_line, warn, warn_trust

if TYPE_CHECKING:
    from ...api import VerifyReport

__all__ = ["command", "render"]


@click.command("verify")
@click.argument("path", type=ModelPath())
@click.option(
    "--deep",
    is_flag=True,
    help="Also read every payload byte: DCP recomputes each zip record's CRC32 (torch never "
    "checks it); HF and PEFT check every float for inf/nan and every file against its "
    "SHA256SUMS or Hub cache blob name (without one, only structure and finite values "
    "are proven).",
)
@click.option(
    "--base",
    help="PEFT adapters only: a base model (dir, hub id or DCP checkpoint) that every "
    "target module must exist in, with matching shapes.",
)
@download_option
@json_option
@trust_option
@click.pass_context
def command(
    ctx: click.Context, path: Path, deep: bool, base: str | None, as_json: bool, trust_pickle: bool
) -> None:
    """Check a checkpoint's integrity before you trust or ship it.

    PATH: a DCP checkpoint (.../step_N/trainer or step dir), an HF model dir (single or sharded)
    or a PEFT adapter dir. Prints one line per problem, naming the file and key, and exits 1 if
    there is any; exits 0 when clean. Reads metadata and zip headers only, unless --deep.

    \b
    Example:
      ckpt verify outputs/checkpoints/step_95/trainer --deep
    """
    if base is not None:
        check_roles("verify --base", {"PATH": path, "--base": base})
    warn_trust(trust_pickle)
    with progress_line(not as_json) as bar:
        report = api.verify(path, deep=deep, base=base, trust_pickle=trust_pickle, progress=bar)
    if as_json:
        emit(report, exit_code=0 if report.ok else 1)
    else:
        render(report)
    if not report.ok:
        ctx.exit(1)


def render(r: VerifyReport) -> None:
    for line in group_problems(r.problems):
        click.echo(f"problem: {one_line(line)}")
    for line in group_problems(r.warnings):
        warn(line)
    c = r.checked
    if r.format == "verl":
        what = f"{c.get('tensors', 0)} tensors assembled from {c.get('ranks', 0)} ranks' shards"
        if r.deep:
            what += f", CRC32 of {c.get('records', 0)} zip records recomputed"
    elif r.format in ("dcp", "torchtitan"):
        what = (
            f"{c.get('keys', 0)} keys, {c.get('storage_items', 0)} items in {c.get('files', 0)} files "
            f"({human_bytes(c.get('file_bytes', 0))})"
        )
        if r.deep:
            what += f", CRC32 of {c.get('records_crc_checked', 0)} zip records recomputed"
        if c.get("superseded_bytes"):
            what += (
                f"; {human_bytes(c['superseded_bytes'])} of old values superseded by a `ckpt set-lr`/`ckpt "
                f"set` "
                "patch (expected)"
            )
    elif r.format == "hf":
        what = (
            f"{c.get('tensors', 0)} tensors in {c.get('files', 0)} file(s) "
            f"({human_bytes(c.get('tensor_bytes', 0))})"
        )
        if r.deep:
            what += ", every value read"
    else:
        what = f"{c.get('modules', 0)} LoRA modules, {c.get('keys', 0)} keys"
        if "base" in c:
            what += f", fits base {c['base']['label']}"
    kind = {
        "dcp": "DCP checkpoint",
        "hf": "HF model dir",
        "peft": "PEFT adapter",
        "verl": "verl checkpoint",
        "torchtitan": "torchtitan checkpoint",
    }[r.format]
    if c.get("beside"):  # a step dir: the weights dirs beside trainer/, checked as HF model dirs
        kind += " and " + ", ".join(
            f"{b['name']}/ ({b['kind']}: {'ok' if b['ok'] else 'FAILED'})" for b in c["beside"]
        )
    integrity = r.integrity
    if r.ok and (integrity is None or integrity.get("proven")):
        tail = f"; {integrity['statement']}" if integrity else ""
        click.echo(f"OK: {r.path}: {kind}, {what}{tail}")
    elif r.ok and integrity is not None:
        # well formed (and finite, with --deep), but nothing proves the bytes are the ones written
        click.echo(f"STRUCTURE OK, INTEGRITY NOT PROVEN: {r.path}: {kind}, {what}; {integrity['statement']}")
    else:
        click.echo(f"FAILED: {r.path}: {len(r.problems)} problem(s) in this {kind} ({what})")
