"""`ckpt export`: arguments -> `api.export` (merge's contract) -> text or JSON."""

from __future__ import annotations

import click

from ... import api
from ...core.units import human_bytes
from ..flow import progress_line
from ..mistakes import check_roles
from ..options import (
    OutputPath,
    alpha_options,
    download_option,
    dry_run_option,
    input_arg,
    json_option,
    overwrite_option,
    trust_option,
)
from ..render import warn_trust
from .merge import render_merge

__all__ = ["command"]


@click.command("export")
@click.argument("ckpt", type=click.Path(path_type=str))
@click.argument("out", type=OutputPath(str))
@click.option(
    "--config-from",
    metavar="DIR",
    help="HF model dir or hub id (local HF cache) giving config.json, tokenizer and the other "
    "non-weight files: the checkpoint holds none (default: the run config's base model, when "
    "found locally).",
)
@alpha_options
@click.option(
    "--slot",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Adapter slot of a multi-run DCP checkpoint (lora_A.<slot>).",
)
@click.option(
    "--dtype",
    "dtype",
    type=click.Choice(["bf16", "fp16", "fp32", "fp8"]),
    default=None,
    help="Output dtype (default bf16): one rounding from the fp32 masters. fp8: block FP8 as `ckpt merge "
    "--dtype fp8` writes it.",
)
@click.option(
    "--allow-zero-delta",
    is_flag=True,
    help="LoRA runs: write the output even when every merged weight rounds back to the base.",
)
@click.option(
    "--max-shard-size",
    default="5GB",
    show_default=True,
    help="Largest output shard (bytes of tensor data; GB = 10**9, GiB = 2**30).",
)
@click.option(
    "--threads",
    type=click.IntRange(1, 64),
    default=None,
    help="Tensors read and computed in parallel ahead of the writer (default: 2, or 4 with 4+ cores).",
)
@overwrite_option
@dry_run_option
@download_option
@json_option
@trust_option
def command(
    ckpt,
    out,
    config_from,
    alpha,
    run_config,
    slot,
    dtype,
    allow_zero_delta,
    max_shard_size,
    threads,
    overwrite,
    dry_run,
    as_json,
    trust_pickle,
) -> None:
    """Export a prime-rl DCP checkpoint as an HF model directory: the trained weights of a full
    fine-tune, or the merged model of a LoRA run (= merge --base-from-checkpoint).

    Weights come from the checkpoint's fp32 masters, rounded once to --dtype; prime-format MoE
    weights (mlp.experts.w1/w2/w3, mlp.router.gate) are written under the HF per-expert names.
    OUT appears only when complete.

    \b
    Example:
      ckpt export outputs/checkpoints/step_95/trainer exported-95 --config-from Qwen/Qwen3-8B
    """
    ckpt, config_from = input_arg(ckpt), input_arg(config_from)
    check_roles("export", {"CKPT": ckpt, "OUT": out, "--config-from": config_from})
    warn_trust(trust_pickle)
    with progress_line(not dry_run) as bar:
        report = api.export(
            ckpt,
            out,
            config_from=config_from,
            alpha=alpha,
            run_config=run_config,
            slot=slot,
            dtype=dtype,
            max_shard_size=max_shard_size,
            threads=threads,
            trust_pickle=trust_pickle,
            allow_zero_delta=allow_zero_delta,
            dry_run=dry_run,
            overwrite=overwrite,
            progress=bar,
        )
    render_merge(report, out, _render_result, dry_run=dry_run, as_json=as_json)


def _render_result(plan, result, out) -> None:
    c = result.counts
    what = f"{result.merged_modules} modules merged" if result.merged_modules else "trained weights"
    click.echo(
        f"wrote {out}: {what}, {c['cast']} tensors cast to {plan.cast_to()}, {c['copy']} copied; "
        f"{human_bytes(result.bytes_written)} in {result.seconds:.1f}s"
    )
