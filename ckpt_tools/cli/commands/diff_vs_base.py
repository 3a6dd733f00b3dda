"""`ckpt diff-vs-base`: arguments -> `api.diff_vs_base` -> text or JSON; the verdict is the exit status."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from ... import api
from ...core.units import human_bytes
from ..flow import progress_line
from ..mistakes import check_roles
from ..options import InputPath, alpha_options, download_option, input_arg, json_option, trust_option
from ..render import emit, warn, warn_trust

if TYPE_CHECKING:
    from ...api import DiffReport

__all__ = ["command", "render"]


@click.command("diff-vs-base")
@click.argument("weights")
@click.argument("base")
@click.option(
    "--adapter",
    type=InputPath(),
    help="PEFT adapter dir or prime-rl DCP checkpoint: also check every targeted tensor equals "
    "round(W0 + s*B@A) exactly and every other tensor is unchanged.",
)
@alpha_options
@click.option(
    "--targeted-only", is_flag=True, help="Read only the tensors the adapter targets (needs --adapter)."
)
@click.option(
    "--top",
    type=click.IntRange(min=0),
    default=20,
    show_default=True,
    help="How many changed tensors to list (largest relative change first); --json lists all.",
)
@click.option(
    "--report",
    "report_file",
    type=click.Path(path_type=Path),
    help="Also write the comparison as a self-contained HTML page (changed fraction and max |delta| "
    "per tensor; the page of `ckpt report`). A new file.",
)
@click.option(
    "--device",
    metavar="cpu|cuda[:N]",
    help="Where --adapter's value check runs: the CPU's cores (the default), or a CUDA GPU (the expected "
    "values computed there; the same verdicts and counts).",
)
@download_option
@json_option
@trust_option
@click.pass_context
def command(
    ctx: click.Context,
    weights: str,
    base: str,
    adapter: Path | None,
    alpha,
    run_config,
    targeted_only: bool,
    top: int,
    report_file: Path | None,
    device: str | None,
    as_json: bool,
    trust_pickle: bool,
) -> None:
    """Tell whether WEIGHTS differ from BASE, tensor by tensor; with --adapter, whether WEIGHTS is
    exactly BASE + the LoRA.

    WEIGHTS, BASE: HF model dirs (single file or sharded), hub ids in the local HF cache, or DCP
    checkpoints (their base weights; an fp32 side is compared with a bf16 side by upcasting the
    bf16 side exactly). Identical tensors are found by comparing raw bytes, streamed.

    Exit status: 0 WEIGHTS differ from BASE (and the adapter check passed); 3 every compared tensor
    is bitwise identical to BASE (a LoRA meant to be in WEIGHTS was not merged); 4 the adapter
    check failed; 1 errors.

    \b
    Example:
      ckpt diff-vs-base outputs/weights/step_100 Qwen/Qwen3-8B
    """
    weights, base = input_arg(weights), input_arg(base)
    check_roles("diff-vs-base", {"WEIGHTS": weights, "BASE": base, "--adapter": adapter})
    warn_trust(trust_pickle)
    with progress_line(not as_json) as bar:
        report = api.diff_vs_base(
            weights,
            base,
            adapter=adapter,
            alpha=alpha,
            run_config=run_config,
            targeted_only=targeted_only,
            trust_pickle=trust_pickle,
            progress=bar,
            page=report_file,
            device=device,
        )
    if report_file is not None and not as_json:
        click.echo(f"wrote {report.page}")
    if as_json:
        emit(report, exit_code=report.exit_code)  # warnings are in it
    else:
        render(report, top)
        for w in report.warnings:
            warn(w)
    if report.exit_code != 0:  # 0: WEIGHTS differ from BASE (the adapter check passed)
        ctx.exit(report.exit_code)


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def render(r: DiffReport, top: int) -> None:
    from ...api import DIFF_SAME as SAME
    from ...api import DIFF_SKIPPED as SKIPPED

    p = r.plan
    _render_inputs(p)
    same = [t for t in r.tensors if t.status in SAME]
    skipped = [t for t in r.tensors if t.status == SKIPPED]
    changed = [t for t in r.tensors if t.status not in SAME and t.status != SKIPPED]
    changed.sort(key=lambda t: (-(t.rel_fro if t.rel_fro is not None else float("inf")), t.name))
    if changed:
        click.echo(f"{len(changed)} changed tensor(s)" + (f", top {top}:" if len(changed) > top else ":"))
        click.echo(f"  {'name':<48} {'changed':>8} {'max|d|':>9} {'rel fro':>9}  note")
        for t in changed[:top]:
            frac = "-" if t.changed_fraction is None else f"{100 * t.changed_fraction:.1f}%"
            click.echo(
                f"  {t.name:<48} {frac:>8} {_fmt(t.max_abs_delta):>9} {_fmt(t.rel_fro):>9}  {_note(t)}"
            )
    upcast = sum(1 for t in same if t.status == "identical_upcast")
    click.echo(
        f"{len(same)} identical tensor(s)"
        + (f" ({upcast} after exact upcast)" if upcast else "")
        + (f", {len(skipped)} not read (--targeted-only)" if skipped else "")
    )
    for label, names in (("only in WEIGHTS", p.only_in_weights), ("only in BASE", p.only_in_base)):
        if names:
            shown = ", ".join(names[:10]) + (f", ... ({len(names) - 10} more)" if len(names) > 10 else "")
            click.echo(f"{len(names)} tensor(s) {label}: {shown}")
    summary = r.adapter_summary
    if summary is not None:
        for o in summary["off"]:
            click.echo(
                f"  adapter check: {o['name']}: "
                + (o["problem"] or f"{o['elements_off']} element(s) off, up to {o['max_ulps']} ulps")
            )
        for n in summary["untargeted_changed"]:
            click.echo(f"  adapter check: {n}: not targeted by the adapter but changed")
        for n in summary["missing_in_weights"]:
            click.echo(f"  adapter check: {n}: targeted by the adapter but missing from WEIGHTS")
    click.echo(f"read {human_bytes(r.bytes_read)} in {r.seconds:.2f}s")
    click.echo(r.summary)


def _render_inputs(p) -> None:
    """WEIGHTS, BASE and the adapter, one line each."""
    click.echo(
        f"WEIGHTS {p.weights['label']} ({p.weights['kind']}, {p.weights['tensors']} tensors, "
        f"{'/'.join(p.weights['dtypes'])})"
    )
    click.echo(
        f"BASE    {p.base['label']} ({p.base['kind']}, {p.base['tensors']} tensors, "
        f"{'/'.join(p.base['dtypes'])})"
    )
    if p.adapter:
        a = p.adapter
        click.echo(
            f"ADAPTER {a['path']} ({a['kind']}, {a['modules']} modules, rank {a['rank']}, scale "
            f"{a['scale']}, "
            f"alpha from {a['alpha_source']})"
        )


def _note(t) -> str:
    """A changed tensor's note: shape and dtype changes, its adapter check, non-finite values."""
    note = []
    if t.status == "shape_changed":
        note.append(f"shape {t.base_shape} -> {t.weights_shape}")
    if t.weights_dtype != t.base_dtype:
        note.append(f"dtype {t.base_dtype} -> {t.weights_dtype}")
    if t.adapter_check is not None:
        ac = t.adapter_check
        if ac.get("ok"):
            note.append("adapter exact (0 ulps)")
        else:
            why = ac.get("problem") or f"{ac.get('elements_off')} elements, up to {ac.get('max_ulps')} ulps"
            note.append(f"ADAPTER OFF: {why}")
    elif t.role == "untargeted":
        note.append("UNTARGETED BUT CHANGED")
    if t.nonfinite:
        note.append(f"{t.nonfinite} non-finite")
    return "; ".join(note)
