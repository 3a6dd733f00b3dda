"""`ckpt report`: arguments -> `api.report` -> the page (and PNGs), a text summary or JSON."""

from __future__ import annotations

from pathlib import Path

import click

from ... import api
from ..flow import finish
from ..mistakes import check_roles
from ..options import (
    InputPath,
    ModelPath,
    OutputPath,
    alpha_options,
    download_option,
    dry_run_option,
    json_option,
    overwrite_option,
    trust_option,
)
from ..render import warn, warn_trust

__all__ = ["command"]

DEFAULT_PAGE = "report.html"


@click.command("report")
@click.argument("path", type=InputPath())
@click.option(
    "--base",
    type=ModelPath(),
    help="The bf16 HF base (dir or hub id in the local HF cache): W0 of "
    "trained weights (full fine-tune, modules_to_save, a merged dir) and ||W|| for slim steps "
    "(default: the run config's model.name, when found).",
)
@click.option(
    "-o",
    "--out",
    type=OutputPath(),
    metavar="FILE",
    help=f"The HTML page to write (default {DEFAULT_PAGE}; none under --json unless given); a URL "
    "(s3://, hf://, gs://) is uploaded to.",
)
@click.option(
    "--png",
    "png_dir",
    type=OutputPath(),
    metavar="DIR",
    help="Also write each plot as a PNG into this new directory (or URL).",
)
@click.option("--set-lr", "set_lr", type=float, help="Overlay the lr curve `ckpt set-lr --lr X` would give.")
@click.option("--scale", type=float, help="Overlay the lr curve `ckpt set-lr --scale F` would give.")
@alpha_options
@overwrite_option
@dry_run_option
@download_option
@json_option
@trust_option
def command(
    path: Path,
    base,
    out,
    png_dir,
    set_lr,
    scale,
    alpha,
    run_config,
    overwrite: bool,
    dry_run: bool,
    as_json: bool,
    trust_pickle: bool,
) -> None:
    """See what a run changed, and its learning rate, as a picture.

    PATH: a checkpoint (step_N/trainer, full or slim), a run's outputs/checkpoints dir (every step), or
    a merged / HF model dir (with --base). From metadata and the LoRA bytes only: ||s*B@A||_F from
    the r x r Gram matrices (B@A is never formed), ||W||_F streamed once from the frozen base weights.
    One self-contained HTML page (plots inline as SVG, nothing fetched): per layer and module the
    relative change ||dW||_F / ||W||_F (experts per layer for MoE), each module group's change and
    Adam moments step by step, every past step's lr and the plan to max_steps, bytes by group.

    \b
    Example:
      ckpt report outputs/checkpoints -o report.html --scale 0.5
    """
    check_roles("report", {"PATH": path, "--base": base})
    warn_trust(trust_pickle)
    if out is None and not as_json:
        out = Path(DEFAULT_PAGE)
    result = api.report(
        path,
        base=None if base is None else str(base),
        out=None if out is None else str(out),
        png_dir=None if png_dir is None else str(png_dir),
        set_lr=set_lr,
        scale=scale,
        alpha=alpha,
        run_config=None if run_config is None else str(run_config),
        dry_run=dry_run,
        overwrite=overwrite,
        trust_pickle=trust_pickle,
    )
    finish(result, as_json, _render)


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def _render(report: dict) -> None:
    p, r = report["plan"], report["result"]
    if r is None:
        click.echo(
            f"report {p['path']} ({p['kind']}): {len(p['steps'])} step(s) "
            f"{', '.join(str(s['step'] if s['step'] is not None else '?') for s in p['steps'])}; base "
            f"{p['base'] or '-'}; max_steps {p['max_steps'] or '-'} (from {p['max_steps_from']}); "
            f"would write {p['out'] or 'no page'}{', ' + p['png_dir'] if p['png_dir'] else ''} (dry run)"
        )
        return
    click.echo(f"report {r['path']} ({r['kind']}, {len(r['steps'])} step(s): {', '.join(r['steps'])})")
    for step, s in r["steps"].items():
        groups = ", ".join(
            f"{g} {_fmt(v['rel_delta'])}" for g, v in s["groups"].items() if v["rel_delta"] is not None
        )
        click.echo(
            f"  step {step}: {s['training']}, {len(s['modules'])} module(s); relative change by group: "
            f"{groups or '-'}"
        )
    last = r["steps"][list(r["steps"])[-1]] if r["steps"] else None
    if last and last["largest"]:
        click.echo(
            "  largest: "
            + ", ".join(f"{n} {_fmt(last['modules'][n]['rel_delta'])}" for n in last["largest"][:5])
        )
    lr = r.get("lr")
    if lr:
        past = list(lr["past"].values())
        planned = list(lr["planned"].values())
        plan = (
            f"planned to step {lr['max_steps']}: {_fmt(planned[0])} -> {_fmt(planned[-1])}"
            if planned
            else f"nothing planned past step {lr['step']}"
        )
        click.echo(
            f"  lr ({lr['scheduler']}): steps 1..{lr['step']} ran at {_fmt(min(past)) if past else '-'}.."
            f"{_fmt(max(past)) if past else '-'}; {plan}: max_steps is {lr['max_steps_from']}"
        )
        if lr.get("set_lr"):
            sl = lr["set_lr"]
            click.echo(
                f"  with set-lr (x{_fmt(sl['factor'])}): lr {_fmt(sl['lr_before'])} -> {_fmt(sl['lr_after'])}"
            )
    if r.get("page"):
        click.echo(f"  wrote {r['page']}")
    for p in r.get("pngs", []):
        click.echo(f"  wrote {p}")
    for w in r.get("warnings", []):
        warn(w)
