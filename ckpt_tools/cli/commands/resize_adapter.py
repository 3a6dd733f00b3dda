"""`ckpt resize-adapter`: arguments -> `api.resize_adapter` -> text or JSON."""

from __future__ import annotations

from pathlib import Path

import click

from ... import api
from ...core.units import human_bytes
from ..flow import finish, progress_line
from ..mistakes import check_roles
from ..options import InputPath, OutputPath, dry_run_option, json_option, overwrite_option, trust_option
from ..render import dry_run_label, warn, warn_trust
from .average import render_truncations, rule_text

__all__ = ["command"]


@click.command("resize-adapter")
@click.argument("adapter", type=InputPath(file_okay=False))
@click.argument("out", type=OutputPath())
@click.option("--rank", type=click.IntRange(min=1), help="Each module's best rank-K delta (Eckart-Young).")
@click.option(
    "--energy",
    type=float,
    metavar="E",
    help="Each module at the smallest rank keeping E (e.g. 0.99) of its squared Frobenius norm.",
)
@click.option(
    "--layout",
    type=click.Choice(["peft", "vllm", "prime-rl"]),
    default="peft",
    metavar="LAYOUT",
    help="peft (default), vllm or prime-rl: how MoE expert LoRA is written (as extract-adapter --layout); "
    "a dense LoRA is the same file in every layout.",
)
@click.option("--alpha", type=float, help="LoRA alpha of a DCP checkpoint whose run config cannot be found.")
@overwrite_option
@dry_run_option
@json_option
@trust_option
def command(
    adapter: Path,
    out: Path,
    rank,
    energy,
    layout,
    alpha,
    overwrite: bool,
    dry_run: bool,
    as_json: bool,
    trust_pickle: bool,
) -> None:
    """Bring each LoRA module of an adapter to its best lower rank; write a PEFT adapter.

    ADAPTER: a PEFT adapter dir or a prime-rl DCP checkpoint. Per module (per expert for MoE) the
    delta s * B @ A is factored by QR of A^T and B and the SVD of the small r x r core, in fp64 (the
    d x d product is never formed); its leading K singular directions are the best rank-K delta
    (Eckart-Young), written in fp32 with scale 1. The report gives each module's kept energy and its
    error ||delta - delta_K||_F, the norm of the discarded singular values. Trained full tensors
    (modules_to_save) are carried over unchanged.

    \b
    Example:
      ckpt resize-adapter adapter-step95 adapter-step95-r8 --rank 8
    """
    check_roles("resize-adapter", {"ADAPTER": adapter, "OUT": out})
    warn_trust(trust_pickle)
    with progress_line(not dry_run) as bar:
        report = api.resize_adapter(
            adapter,
            out,
            rank=rank,
            energy=energy,
            alpha=alpha,
            layout=layout,
            dry_run=dry_run,
            overwrite=overwrite,
            trust_pickle=trust_pickle,
            progress=bar,
        )
    finish(report, as_json, _render)


def _render(r: dict) -> None:
    dry = bool(r.get("dry_run"))
    rk = r["rank"]
    click.echo(
        f"{'would write' if dry else 'wrote'} {r['out']}: {r['modules']} LoRA modules of {r['adapter']} "
        f"({r['kind']}, rank {r['rank_in']}) -> "
        f"{'rank ' + str(rk) if isinstance(rk, int) else 'ranks ' + str(rk)} "
        f"({rule_text(r['rank_rule'])}){dry_run_label(dry)}"
    )
    click.echo(
        f"  kept {100 * r['energy_kept']:.4f}% of the energy overall, error {r['error']:.4g} (Frobenius)"
    )
    render_truncations(r["truncations"])
    if r["modules_to_save"]:
        click.echo(f"  trained full tensors carried over unchanged: {', '.join(r['modules_to_save'])}")
    size = r.get("written_file_bytes", r["out_file_bytes"])
    click.echo(f"  adapter_model.safetensors {human_bytes(size)} (fp32, scale 1)")
    for w in r["warnings"]:
        warn(w)
