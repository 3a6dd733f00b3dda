"""`ckpt merge`: arguments -> `api.merge` -> text or JSON."""

from __future__ import annotations

from collections import Counter

import click

from ... import api
from ...core.errors import UsageError
from ...core.units import human_bytes, human_bytes_si, human_number
from ..flow import finish, progress_line
from ..mistakes import check_roles
from ..options import (
    ModelPath,
    OutputPath,
    alpha_options,
    download_option,
    dry_run_option,
    input_arg,
    json_option,
    overwrite_option,
    trust_option,
)
from ..render import dry_run_label, warn, warn_trust

__all__ = ["command", "render_merge", "render_plan"]


@click.command("merge")
@click.argument("paths", nargs=-1, required=True, metavar="[BASE] ADAPTER OUT")
@click.option(
    "--base-from-checkpoint",
    is_flag=True,
    help="Use the DCP checkpoint's own fp32 master weights as the base (no base download). BASE is "
    "then that checkpoint, or omitted when ADAPTER is the checkpoint.",
)
@click.option(
    "--config-from",
    metavar="DIR",
    help="With --base-from-checkpoint: model dir or hub id giving config.json, tokenizer and other "
    "non-weight files (e.g. the run's outputs/weights/step_N).",
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
    help="Output dtype (default: fp16 for an fp16 base, else bf16). Merged weights are computed in "
    "fp32 and rounded once to it. fp8: block FP8 (e4m3, 128x128 scales, what vLLM serves): the attention and "
    "MLP projections quantized from the exact fp32 value, the rest bf16 (docs/merge.md).",
)
@click.option(
    "--allow-zero-delta",
    is_flag=True,
    help="Write the output even when every merged weight rounds back to the base (an all-zero "
    "lora_B, a tiny alpha): refused by default, since it is usually the wrong adapter or alpha.",
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
    help="Tensors read and computed in parallel ahead of the writer (default: 2, or 4 with 4+ cores). Memory "
    "grows "
    "with it: see the plan's memory bound.",
)
@overwrite_option
@dry_run_option
@download_option
@json_option
@trust_option
def command(
    paths,
    base_from_checkpoint,
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
    """Merge a LoRA into base weights; write an HF model directory (sharded safetensors).

    BASE: an HF model dir or a hub id from the local HF cache (offline). ADAPTER: a PEFT adapter
    dir, or a prime-rl DCP checkpoint (alpha from --alpha, --run-config or the run's orch.toml).
    With --base-from-checkpoint, BASE is the checkpoint itself (omit it when ADAPTER is that
    checkpoint) and config/tokenizer come from --config-from.

    W' = round(W32 + s * B32 @ A32), fp32 compute, one rounding. OUT appears only when complete.

    \b
    Example:
      ckpt merge Qwen/Qwen3-8B outputs/checkpoints/step_95/trainer merged-step95
    """
    warn_trust(trust_pickle)
    if len(paths) == 3:
        base, adapter, out = paths
    elif len(paths) == 2 and base_from_checkpoint:
        base, (adapter, out) = None, paths
    else:
        need = "ADAPTER OUT (or BASE ADAPTER OUT)" if base_from_checkpoint else "BASE ADAPTER OUT"
        raise UsageError(f"expected {need}, got {len(paths)} path(s)", hint="see `ckpt merge --help`")
    # a missing path is "no such file or directory: P" (exit 2), whichever argument it is; a hub id is
    # looked up in the local HF cache
    adapter = ModelPath().convert(adapter, None, None)
    base, config_from, out = input_arg(base), input_arg(config_from), OutputPath(str).convert(out, None, None)
    if base_from_checkpoint:
        check_roles(
            "merge --base-from-checkpoint",
            {"BASE": base, "ADAPTER": adapter, "OUT": out, "--config-from": config_from},
        )
    else:
        check_roles("merge", {"BASE": base, "ADAPTER": adapter, "OUT": out})
    with progress_line(not dry_run) as bar:
        report = api.merge(
            base,
            adapter,
            out,
            base_from_checkpoint=base_from_checkpoint,
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


def render_merge(report, out, render_result, *, dry_run: bool, as_json: bool) -> None:
    """A merge-contract command (merge, export) after its api call: a dry run rendered as the plan (with
    what the real run would refuse among its warnings), else `render_result(plan, result, out)`; then the
    plan's warnings, as every command prints its report's."""
    plan = report.plan
    if dry_run:
        finish(report, as_json, lambda _: render_plan(plan, out, dry_run=True))
    else:
        finish(report, as_json, lambda _: render_result(plan, report.result, out))
    for w in () if as_json else plan.warnings:
        warn(w)


def _render_result(plan, result, out) -> None:
    c = result.counts
    a = plan.adapter
    click.echo(
        f"wrote {out}: {result.merged_modules} modules merged (rank {a.get('rank')}, scale "
        f"{human_number(a.get('scale'))}, alpha from {a.get('alpha_source')}), {c['copy']} tensors copied, "
        f"{c['cast']} cast, {c['replace']} replaced; {human_bytes(result.bytes_written)} in "
        f"{result.seconds:.1f}s"
    )
    if result.fp8 is not None:
        f = result.fp8
        click.echo(
            f"  fp8: {f['quantized']} weights quantized (block 128x128 e4m3), {len(f['kept'])} kept bf16; "
            f"quantization error ||deq(q) - W32|| / ||W32||: max {f['rel_error_max']:.4f}, mean "
            f"{f['rel_error_mean']:.4f}"
        )
        for w in f["warnings"]:
            warn(w)
    if plan.masters_checked:
        mc = plan.masters_checked
        click.echo(
            f"  base checked: {mc['values']} values of {len(mc['tensors'])} fp32 masters equal the base's"
        )


def _targets_summary(plan) -> str:
    kinds = Counter(j.module.rsplit(".", 1)[-1] for j in plan.jobs if j.action == "merge")
    return ", ".join(f"{k} x{n}" for k, n in sorted(kinds.items()))


def render_plan(plan, out, brief: bool = False, dry_run: bool = False) -> None:
    a = plan.adapter
    scale = a.get("scale")
    click.echo(f"merge {plan.adapter_kind} adapter {plan.adapter_path}{dry_run_label(dry_run)}")
    click.echo(
        f"   into {plan.base_kind} base {plan.base_path}"
        + (" (fp32 masters)" if plan.base_kind == "dcp" else "")
    )
    click.echo(
        f"   -> {out}  ({plan.out_dtype}"
        + (f", {plan.out_dtype_reason}" if plan.out_dtype_reason else "")
        + ")"
    )
    click.echo(
        f"  LoRA      {a.get('modules')} modules, rank {a.get('rank')}, alpha "
        f"{human_number(a.get('alpha'))}, "
        f"scale {human_number(scale)} (alpha from {a.get('alpha_source')})"
    )
    click.echo(f"  merged    {plan.merged_modules}: {_targets_summary(plan)}")
    click.echo(
        f"  tensors   {len(plan.jobs)}: {plan.count('merge')} merged, {plan.count('copy')} copied verbatim, "
        f"{plan.count('cast')} cast to {plan.cast_to()}, {plan.count('replace')} replaced (modules_to_save)"
    )
    if plan.out_dtype == "float8_e4m3fn":
        q = sum(1 for j in plan.jobs if j.scale_name)
        click.echo(
            f"  fp8       {q} weights quantized (e4m3, 128x128 blocks), {len(plan.jobs) - q} kept bf16"
        )
    if plan.masters_checked:
        mc = plan.masters_checked
        click.echo(
            f"  base      checked: {mc['values']} values of {len(mc['tensors'])} fp32 masters equal the "
            f"base's"
        )
    for name, why in plan.omitted:
        click.echo(f"  omitted   {name}: {why}")
    largest = max((sh.file_bytes for sh in plan.shards), default=0)
    click.echo(
        f"  shards    {len(plan.shards)} file(s), largest {human_bytes(largest)} (limit "
        f"{human_bytes_si(plan.max_shard_bytes)})"
        + ("" if plan.index is None else " + model.safetensors.index.json")
    )
    if not brief:
        for s in plan.shards:
            click.echo(f"            {s.file_name}  {human_bytes(s.file_bytes)}  ({len(s.tensors)} tensors)")
    changes = [c for f in plan.files for c in f.changes]
    click.echo(f"  files     {', '.join(f.name for f in plan.files) or 'none'}")
    if changes:
        click.echo("  config    " + "; ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in changes))
    click.echo(f"  I/O       read {human_bytes(plan.read_bytes)}, write {human_bytes(plan.write_bytes)}")
    click.echo(
        f"  memory    tensors in flight <= {human_bytes(plan.memory_bound_bytes)} "
        f"({plan.threads} thread(s) ahead of the writer)"
    )
