"""`ckpt average`: arguments -> `api.average` (with --merge: the averaged LoRA merged) -> text or JSON."""

from __future__ import annotations

import click

from ... import api
from ...core.errors import UsageError
from ...core.units import human_bytes
from ..flow import finish, progress_line
from ..mistakes import check_roles
from ..options import (
    InputPath,
    ModelPath,
    OutputPath,
    download_option,
    dry_run_option,
    json_option,
    overwrite_option,
    trust_option,
)
from ..render import dry_run_label, warn, warn_trust

__all__ = ["command", "parse_weights", "render_truncations", "rule_text"]

MISMATCH_CHOICES = ("base", "targets", "alpha")  # ops.average.MISMATCH_KINDS (a test checks they agree)


def parse_weights(text: str | None) -> list[float] | None:
    if text is None:
        return None
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise UsageError(
            f"--weights {text!r}: expected comma-separated numbers", hint="e.g. --weights 1,1,2"
        ) from None


@click.command("average")
@click.argument("paths", nargs=-1, required=True, metavar="CKPT_OR_ADAPTER ... OUT")
@click.option(
    "--weights",
    metavar="W1,W2,...",
    help="One weight per input, in the order given (divided by their sum). Default: the plain mean.",
)
@click.option(
    "--ema",
    type=float,
    metavar="BETA",
    help="Exponential moving average in step order: ema_1 = x_1, "
    "ema_t = BETA * ema_(t-1) + (1 - BETA) * x_t; OUT is ema_n.",
)
@click.option("--rank", type=click.IntRange(min=1), help="Bring each module down to its best rank-K delta.")
@click.option(
    "--energy",
    type=float,
    metavar="E",
    help="Bring each module down to the smallest rank keeping E (e.g. 0.99) of its squared Frobenius norm.",
)
@click.option(
    "--merge",
    "merge_base",
    type=ModelPath(),
    metavar="BASE",
    help="Write the averaged LoRA merged "
    "into BASE (HF model dir or hub id) as an HF model dir, instead of the adapter.",
)
@click.option(
    "--dtype",
    type=click.Choice(["bf16", "fp16", "fp32", "fp8"]),
    default=None,
    help="With --merge: the output dtype (default as `ckpt merge`; fp8: block FP8 as merge writes it).",
)
@click.option(
    "--allow-mismatch",
    "allow",
    multiple=True,
    type=click.Choice(MISMATCH_CHOICES),
    help="Average inputs that differ in this (repeatable): base (base model name), targets (a module "
    "missing from an input is a zero delta there), alpha (each input keeps its own scale).",
)
@click.option(
    "--layout",
    type=click.Choice(["peft", "vllm", "prime-rl"]),
    default="peft",
    metavar="LAYOUT",
    help="peft (default), vllm or prime-rl: how MoE expert LoRA is written (as extract-adapter --layout); "
    "a dense LoRA is the same file in every layout.",
)
@click.option(
    "--alpha",
    type=float,
    help="LoRA alpha the DCP inputs trained with (default: each run's config); PEFT adapters keep their own.",
)
@overwrite_option
@dry_run_option
@download_option
@json_option
@trust_option
def command(
    paths,
    weights,
    ema,
    rank,
    energy,
    merge_base,
    dtype,
    allow,
    layout,
    alpha,
    overwrite,
    dry_run,
    as_json,
    trust_pickle,
) -> None:
    """Average LoRA steps of one run in delta space; write a PEFT adapter (or, with --merge, the merged
    model).

    Inputs: prime-rl DCP checkpoints (full or slim) and PEFT adapters. The weighted mean of the
    deltas, sum_i w_i * s_i * B_i @ A_i, is written exactly as one LoRA of rank sum(r_i) (A stacked,
    B concatenated with the weights and scales folded in, fp32, scale 1); --rank / --energy bring each
    module down optimally (Eckart-Young, as `ckpt resize-adapter`). Trained full tensors
    (modules_to_save) are averaged with the same weights. Inputs of different base models,
    targets or alphas are refused unless --allow-mismatch says so. docs/delta-space.md has the math.

    \b
    Example:
      ckpt average outputs/checkpoints/step_{80,90,100}/trainer avg-80-100 --ema 0.9 --rank 32
    """
    if len(paths) < 3:
        raise UsageError(
            f"expected at least 2 inputs and OUT, got {len(paths)} path(s)", hint="see `ckpt average --help`"
        )
    *inputs, out = paths
    inputs = [InputPath().convert(p, None, None) for p in inputs]
    out = OutputPath().convert(out, None, None)
    check_roles(
        "average --merge" if merge_base is not None else "average",
        {
            "CKPT_OR_ADAPTER": inputs[-1],
            "OUT": out,
            **({"--merge": merge_base} if merge_base is not None else {}),
        },
    )
    if dtype is not None and merge_base is None:
        raise UsageError("--dtype applies only with --merge (the adapter is written in fp32)")
    warn_trust(trust_pickle)
    with progress_line(not dry_run) as bar:
        report = api.average(
            inputs,
            out,
            weights=parse_weights(weights),
            ema=ema,
            rank=rank,
            energy=energy,
            merge=merge_base,
            dtype=dtype,
            allow_mismatch=tuple(allow),
            alpha=alpha,
            layout=layout,
            dry_run=dry_run,
            overwrite=overwrite,
            trust_pickle=trust_pickle,
            progress=bar,
        )
    finish(report, as_json, _render if merge_base is None else _render_merge)


def _rank_text(r: dict) -> str:
    rk = r["rank"]
    return f"rank {rk}" if isinstance(rk, int) else f"ranks {min(rk)}-{max(rk)}"


def rule_text(rule: dict) -> str:
    return (
        f"rank {rule['rank']}"
        if "rank" in rule
        else f"the smallest rank keeping {rule['energy']:g} of the energy"
    )


def render_truncations(truncations: dict) -> None:
    """The per-module kept energy and error lines (shared with resize-adapter)."""
    for m, t in truncations.items():
        click.echo(
            f"    {m}: rank {t['rank_in']} -> {t['rank']}, kept {100 * t['energy_kept']:.4f}% of the energy, "
            f"error {t['error']:.4g} ({100 * t['relative_error']:.3g}% of |delta|)"
        )


def _render(r: dict) -> None:
    dry = bool(r.get("dry_run"))
    click.echo(
        f"{'would write' if dry else 'wrote'} {r['out']}: the {r['method']} of {len(r['inputs'])} inputs, "
        f"{r['modules']} LoRA modules, {_rank_text(r)}{dry_run_label(dry)}"
    )
    for i in r["inputs"]:
        step = f"step {i['step']}" if i["step"] is not None else "step ?"
        click.echo(
            f"  {i['weight']:<10.6g} {step:<9} {i['kind']:<5} {i['path']}  (rank {i['rank']}, alpha "
            f"{i['alpha']:g})"
        )
    if r["rank_rule"]:
        click.echo(f"  each module brought down to {rule_text(r['rank_rule'])} (Eckart-Young):")
        render_truncations(r["truncations"])
    for d in r["differences"]:
        click.echo(f"  allowed difference: {d}")
    if r["modules_to_save"]:
        click.echo(f"  trained full tensors averaged: {', '.join(r['modules_to_save'])}")
    size = r.get("written_file_bytes", r["out_file_bytes"])
    click.echo(f"  adapter_model.safetensors {human_bytes(size)} (fp32, scale 1)")
    for w in r["warnings"]:
        warn(w)


def _render_merge(r: dict) -> None:
    dry = bool(r.get("dry_run"))
    avg, mp = r["plan"]["average"], r["plan"]["merge"]
    click.echo(
        f"{'would merge' if dry else 'merged'} the {avg['method']} of {len(avg['inputs'])} inputs "
        f"({avg['modules']} modules, {_rank_text(avg)}) into {mp['base_path']} -> {r['out']} "
        f"({mp['out_dtype']}){dry_run_label(dry)}"
    )
    for i in avg["inputs"]:
        click.echo(f"  {i['weight']:<10.6g} step {i['step']!s:<4} {i['path']}")
    if avg["rank_rule"]:
        render_truncations(avg["truncations"])
    res = r.get("result")
    if res:
        click.echo(
            f"  {res['merged_modules']} modules merged, {human_bytes(res['bytes_written'])} in "
            f"{res['seconds']:.1f}s"
        )
    for w in r.get("warnings") or ():
        warn(w)
