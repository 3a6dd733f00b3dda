"""`ckpt extract-adapter`: arguments -> `api.extract_adapter` -> text or JSON."""

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
    alpha_options,
    download_option,
    dry_run_option,
    json_option,
    overwrite_option,
    trust_option,
)
from ..render import dry_run_label, warn, warn_trust

__all__ = ["command"]


@click.command("extract-adapter")
@click.argument("ckpt", type=InputPath(file_okay=False))
@click.argument("out", type=OutputPath())
@alpha_options
@click.option(
    "--base",
    "base",
    metavar="NAME_OR_DIR",
    help="Base model for base_model_name_or_path (default: the run's orch.toml [model] name); "
    "when found locally, LoRA shapes are checked against it.",
)
@click.option("--slot", type=int, default=0, show_default=True, help="Adapter slot (`lora_A.<slot>`).")
@click.option(
    "--dtype",
    type=click.Choice(["fp32", "bf16"]),
    default="fp32",
    show_default=True,
    help="fp32 keeps the exact trained values.",
)
@click.option(
    "--layout",
    type=click.Choice(["peft", "vllm", "prime-rl"]),
    default="peft",
    metavar="LAYOUT",
    help="peft (default), vllm or prime-rl: how MoE expert LoRA is written. peft = fused expert "
    "parameters through target_parameters (PEFT with transformers 5); vllm / prime-rl = per-expert "
    "modules (stock vLLM's Qwen3-MoE, prime-rl). A dense LoRA is the same file in every layout "
    "(docs/adapters.md).",
)
@overwrite_option
@dry_run_option
@download_option
@json_option
@trust_option
def command(
    ckpt: Path,
    out: Path,
    alpha,
    run_config,
    base,
    slot: int,
    dtype: str,
    layout: str,
    overwrite: bool,
    dry_run: bool,
    as_json: bool,
    trust_pickle: bool,
) -> None:
    """Export a prime-rl DCP checkpoint's LoRA as a PEFT adapter dir.

    Writes OUT/adapter_model.safetensors (keys base_model.model.<module>.lora_A/B.weight) and
    OUT/adapter_config.json, loadable as-is by PEFT's PeftModel.from_pretrained and by vLLM (a MoE
    adapter: by the consumer its --layout is for, see docs/adapters.md). Reads
    only the LoRA items of the slot. Alpha is not stored in the checkpoint: --alpha, else
    --run-config, else the run's outputs/run_*/configs/orch.toml; lora_alpha is written so that
    lora_alpha / r is the scale training used.

    \b
    Example:
      ckpt extract-adapter outputs/checkpoints/step_95/trainer adapter-step95
    """
    check_roles("extract-adapter", {"CKPT": ckpt, "OUT": out, "--base": base})
    warn_trust(trust_pickle)
    with progress_line(not dry_run) as bar:
        report = api.extract_adapter(
            ckpt,
            out,
            alpha=alpha,
            run_config=run_config,
            base=base,
            slot=slot,
            dtype=dtype,
            layout=layout,
            dry_run=dry_run,
            overwrite=overwrite,
            trust_pickle=trust_pickle,
            progress=bar,
        )
    finish(report, as_json, _render)


def _render(r: dict) -> None:
    dry = bool(r.get("dry_run"))
    click.echo(
        f"{'would write' if dry else 'wrote'} {r['out']}: {r['modules']} LoRA modules, {len(r['tensors'])} "
        f"tensors ({r['dtype']}), rank {r['rank']}, slot {r['slot']}{dry_run_label(dry)}"
    )
    click.echo(
        f"  alpha {r['alpha']:g} from {r['alpha_source']} -> lora_alpha {r['lora_alpha']:g}, "
        f"scale {r['scale']:g}"
    )
    click.echo(
        f"  base_model_name_or_path: {r['base_model_name_or_path']}"
        + (f" (shapes checked against {r['base_checked']})" if r["base_checked"] else " (not checked)")
    )
    click.echo(f"  target_modules: {', '.join(r['config']['target_modules'])}")
    if r["fused"]:
        f0 = r["fused"][0]
        click.echo(
            f"  layout {r['layout']}: {len(r['fused'])} fused expert LoRA(s) over {f0['experts']} experts "
            f"(target_parameters {', '.join(r['config']['target_parameters'])}; gate and up as one block "
            f"LoRA "
            f"of rank {2 * f0['projection_rank']}, rank_pattern {r['config']['rank_pattern']})"
        )
    elif r["layout"] != "peft" or any(".experts." in t["name"] for t in r["tensors"]):
        click.echo(f"  layout {r['layout']}: per-expert modules")
    size = r.get("written_file_bytes", r["out_file_bytes"])
    click.echo(
        f"  adapter_model.safetensors {human_bytes(size)}; LoRA items in the checkpoint "
        f"{human_bytes(r['lora_item_bytes'])}"
    )
    if "bytes_read" in r:
        click.echo(
            f"  read {human_bytes(r['bytes_read'])} of checkpoint data ({r['read_ratio']}x the LoRA items) "
            f"in {r['seconds']:.2f} s"
        )
    for w in r["warnings"]:
        warn(w)
