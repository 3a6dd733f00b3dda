"""`ckpt set-lr`: arguments -> `api.set_lr` -> text or JSON (and the change/result renderers `ckpt set`
shares)."""

from __future__ import annotations

from pathlib import Path

import click

from ... import api
from ...core.units import human_bytes, human_number
from ..flow import finish
from ..options import InputPath, OutputPath, dry_run_option, json_option, overwrite_option, trust_option
from ..render import dry_run_label, warn, warn_trust

__all__ = ["command", "render_changes", "render_result"]


def render_changes(changes) -> None:
    width = max((len(c["key"]) for c in changes), default=10)
    for c in changes:
        click.echo(f"  {c['key']:<{width}}  {_value(c['before']):>24} -> {_value(c['after'])}")


def _value(v) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return human_number(v)


def _render_verl(r: dict) -> None:
    """A verl role dir's rank files rewritten (optim_/extra_state_: data.pkl patched), the rest linked."""
    how = ", ".join(f"{n} {m}" for m, n in sorted(r["rewritten"].items()))
    kept = ", ".join(f"{n} {m}" for m, n in sorted(r["linked"].items())) or "none"
    if r["in_place"]:
        click.echo(
            f"  patched in place: {len(r['files'])} rank files rewritten ({how}, "
            f"{human_bytes(r['bytes_written'])}), the dir switched atomically; the old one kept as "
            f"{r['backup']} (hard links: remove it once resumed)"
        )
    else:
        click.echo(
            f"  wrote {r['out']}: {len(r['files'])} rank files rewritten ({how}, "
            f"{human_bytes(r['bytes_written'])}); other files: {kept}; {r['seconds']:.3f}s"
        )


def render_result(r: dict) -> None:
    if r.get("format") == "verl":
        _render_verl(r)
    elif r["in_place"]:
        click.echo(
            f"  patched in place: {r['patch_file']} + new .metadata ({human_bytes(r['bytes_written'])}); "
            f"old metadata kept as {r['backup']}"
        )
    else:
        links = ", ".join(f"{n} {m}" for m, n in sorted(r["linked"].items())) or "none"
        click.echo(
            f"  wrote {r['out']}: {r['patch_file']} + .metadata ({human_bytes(r['bytes_written'])}); "
            f"data files: {links}; {r['seconds']:.3f}s"
        )
    for w in r.get("warnings", []):
        warn(w)


@click.command("set-lr")
@click.argument("ckpt", type=InputPath())
@click.argument("out", type=OutputPath(), required=False)
@click.option(
    "--lr",
    type=float,
    help="New current lr; every lr value of the optimizer and scheduler is scaled by lr / current lr.",
)
@click.option("--scale", type=float, help="Multiply every lr value of the optimizer and scheduler by F.")
@click.option(
    "--min-lr",
    type=float,
    help="Also retarget the end of the decay (cosine eta_min, or the "
    "decaying LinearLR's end_factor) to this absolute lr.",
)
@click.option(
    "--in-place",
    is_flag=True,
    help="Patch CKPT itself: a new small data file and an atomic swap of "
    ".metadata (the old one kept as .metadata.bak-<time>); verl: the role dir "
    "rebuilt beside and swapped in atomically (the old one kept as actor.bak-<time>).",
)
@overwrite_option
@dry_run_option
@json_option
@trust_option
def command(
    ckpt: Path,
    out,
    lr,
    scale,
    min_lr,
    in_place: bool,
    overwrite: bool,
    dry_run: bool,
    as_json: bool,
    trust_pickle: bool,
) -> None:
    """Change the learning rate of a checkpoint, keeping the Adam moments.

    prime-rl's resume restores the checkpoint's lr and ignores the config's. This patches
    param_groups lr/initial_lr and the scheduler's base_lrs/_last_lr/eta_min (SequentialLR's
    sub-schedulers too), so the remaining schedule scales consistently. OUT hard-links the data
    files and adds one small patch file and a new .metadata: O(KB) written (an s3:// CKPT to an
    s3:// OUT: the data files are copied server-side, O(KB) fetched and sent).

    A verl checkpoint (run dir, global_step_N or its actor dir) is changed the same way in every
    rank's optim_ and extra_state_ file (the same bytes rewritten, the model files hard-linked).
    A torchtitan checkpoint is refused: it resumes its lr from the config.

    \b
    Example:
      ckpt set-lr outputs/checkpoints/step_95/trainer step_95-lr5e-6 --lr 5e-6 --dry-run
    """
    warn_trust(trust_pickle)
    result = api.set_lr(
        ckpt,
        out,
        lr=lr,
        scale=scale,
        min_lr=min_lr,
        in_place=in_place,
        dry_run=dry_run,
        overwrite=overwrite,
        trust_pickle=trust_pickle,
    )
    finish(result, as_json, lambda r: _render(r, dry_run))


def _render(report: dict, dry_run: bool) -> None:
    p = report["plan"]
    click.echo(
        f"set-lr {p['source']}: lr {human_number(p['lr_before'])} -> {human_number(p['lr_after'])} "
        f"(x{human_number(p['factor'])}), scheduler {p['scheduler']}{dry_run_label(dry_run)}"
    )
    render_changes(p["changes"])
    pv = p.get("preview")
    if pv:
        b, a = pv["before"], pv["after"]
        click.echo(
            f"  next {a['steps']} scheduler steps: peak {human_number(b['peak'])} -> "
            f"{human_number(a['peak'])}, "
            f"end {human_number(b['end'])} -> {human_number(a['end'])}"
        )
    for w in p["warnings"]:
        warn(w)
    if report.get("result"):
        render_result(report["result"])
