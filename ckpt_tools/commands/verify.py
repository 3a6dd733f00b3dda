from __future__ import annotations

from pathlib import Path

import click

from ..ops.verify import VerifyReport, verify_path
from ..units import human_bytes
from ._common import emit_json, is_tty, json_option, trust_option, warn_trust


@click.command("verify")
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@click.option("--deep", is_flag=True,
              help="Also read every payload byte: DCP recomputes each zip record's CRC32 (torch never "
                   "checks it); HF and PEFT check every float for inf/nan.")
@click.option("--base", help="PEFT adapters only: a base model (dir, hub id or DCP checkpoint) that every "
                             "target module must exist in, with matching shapes.")
@json_option
@trust_option
@click.pass_context
def command(ctx: click.Context, path: Path, deep: bool, base: str | None, as_json: bool, trust_pickle: bool) -> None:
    """Check a checkpoint's integrity before you trust or ship it.

    PATH: a DCP checkpoint (.../step_N/trainer or step dir), an HF model dir (single or sharded)
    or a PEFT adapter dir. Prints one line per problem, naming the file and key, and exits 1 if
    there is any; exits 0 when clean. Reads metadata and zip headers only, unless --deep.

    Example: ckpt verify outputs/checkpoints/step_95/trainer --deep
    """
    warn_trust(trust_pickle)
    progress = _progress if (is_tty() and not as_json) else None
    report = verify_path(path, deep=deep, base=base, trust_pickle=trust_pickle, progress=progress)
    if progress is not None:
        click.echo("\r\033[K", nl=False, err=True)
    if as_json:
        emit_json(report.to_json())
    else:
        render(report)
    if not report.ok:
        ctx.exit(1)


def _progress(phase: str, done: int, total: int) -> None:
    click.echo(f"\r\033[K{phase}: {human_bytes(done)} / {human_bytes(total)}", nl=False, err=True)


def render(r: VerifyReport) -> None:
    for p in r.problems:
        click.echo(f"problem: {p.render()}")
    for w in r.warnings:
        click.secho(f"WARNING: {w.render()}", fg="yellow", err=True)
    c = r.checked
    if r.format == "dcp":
        what = (f"{c.get('keys', 0)} keys, {c.get('storage_items', 0)} items in {c.get('files', 0)} files "
                f"({human_bytes(c.get('file_bytes', 0))})")
        if r.deep:
            what += f", CRC32 of {c.get('records_crc_checked', 0)} zip records recomputed"
    elif r.format == "hf":
        what = f"{c.get('tensors', 0)} tensors in {c.get('files', 0)} file(s) ({human_bytes(c.get('tensor_bytes', 0))})"
        if r.deep:
            what += ", every value read"
    else:
        what = f"{c.get('modules', 0)} LoRA modules, {c.get('keys', 0)} keys"
        if "base" in c:
            what += f", fits base {c['base']['label']}"
    kind = {"dcp": "DCP checkpoint", "hf": "HF model dir", "peft": "PEFT adapter"}[r.format]
    if r.ok:
        click.echo(f"OK: {r.path}: {kind}, {what}")
    else:
        click.echo(f"FAILED: {r.path}: {len(r.problems)} problem(s) in this {kind} ({what})")
