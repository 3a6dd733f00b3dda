"""`ckpt inspect`: arguments -> `api.inspect` -> text or JSON."""

from __future__ import annotations

from pathlib import Path

import click

from ... import api
from ...core.units import human_bytes, human_number
from ..flow import shown
from ..options import ModelPath, alpha_options, download_option, json_option, trust_option
from ..render import emit, one_line, warn, warn_trust

__all__ = ["command"]


@click.command("inspect")
@click.argument("path", type=ModelPath())
@alpha_options
@click.option(
    "--keys", "list_keys", is_flag=True, help="List every key with its group, dtype, shape and chunks."
)
@download_option
@json_option
@trust_option
def command(path: Path, alpha, run_config, list_keys: bool, as_json: bool, trust_pickle: bool) -> None:
    """Describe a checkpoint, HF model dir or PEFT adapter from metadata alone.

    PATH: a prime-rl trainer dir (.../step_N/trainer), a step dir, an outputs/checkpoints dir (or the run
    dir above it: its steps and run config), an HF model dir, a PEFT adapter dir, a verl checkpoint (its
    run dir, global_step_N or global_step_N/actor) or a torchtitan one (its dump folder, checkpoint/ or
    checkpoint/step-N). Reads no tensor data.

    \b
    Example:
      ckpt inspect outputs/checkpoints/step_95/trainer
    """
    warn_trust(trust_pickle)
    result = api.inspect(path, alpha=alpha, run_config=run_config, keys=list_keys, trust_pickle=trust_pickle)
    if as_json:
        emit(result)
        return
    report = result.to_json()
    if result.plan.kind in ("verl", "torchtitan") and list_keys:
        for row in report:
            shape = "bytes" if row["dtype"] is None else f"{row['dtype']} {row['shape']}"
            click.echo(f"{row['key']}  | {row['group']} | {row.get('hf_name') or '-'} | {shape}")
        return
    if result.plan.kind == "dcp" and list_keys:
        for row in report:
            shape = "bytes" if row["dtype"] is None else f"{row['dtype']} {row['shape']}"
            click.echo(f"{one_line(row['key'])}  | {row['group']} | {shape} | {row['chunks']} chunk(s)")
        return
    render(shown(report))  # a URL shown as itself, not its local stand-in (io.remote)
    for w in report.get("warnings", []):
        warn(w)


def render(r: dict) -> None:
    fmt = r["format"]
    if fmt == "dcp":
        _render_dcp(r)
    elif fmt == "checkpoints":
        click.echo(f"{r['path']}: {len(r['steps'])} checkpoint(s)")
        for s in r["steps"]:
            if s.get("slim"):
                click.echo(
                    f"  step_{s['step']:<8} {human_bytes(s['bytes']):>10}  slim (not resumable as it is: "
                    f"`ckpt rehydrate` it first)"
                )
            elif s["complete"]:
                click.echo(
                    f"  step_{s['step']:<8} {human_bytes(s['bytes']):>10}  complete  -> resumes at step "
                    f"{s['step']}"
                )
            else:
                click.echo(f"  step_{s['step']:<8} {human_bytes(s['bytes']):>10}  INCOMPLETE (no .metadata)")
        click.echo(f"run config: {', '.join(r['run_config']) or r.get('run_config_problem') or 'none found'}")
        click.echo(r["note"])
    elif fmt in ("verl", "torchtitan"):
        _render_trainer(r)
    elif fmt == "hf":
        _render_hf(r)
    else:
        _render_peft(r)


def _render_trainer(r: dict) -> None:
    """A verl or torchtitan checkpoint: what wrote it, what it holds, what the ops read from it."""
    click.echo(f"{r['trainer']} checkpoint {r['path']}")
    if r.get("steps"):
        click.echo(f"  steps: {', '.join(str(s['step']) for s in r['steps'])} (the latest is described)")
    facts = {
        k: r.get(k)
        for k in ("step", "world_size", "fsdp_version", "model_family", "keys")
        if r.get(k) is not None
    }
    click.echo("  " + "   ".join(f"{k.replace('_', ' ')} {v}" for k, v in facts.items()))
    click.echo(f"  {r['training']}   model {human_bytes(r['model_bytes'])}   groups: {_counts(r['groups'])}")
    lora = r.get("lora")
    if lora:
        alpha = lora.get("alpha")
        why = lora.get("alpha_source") if alpha is not None else lora.get("alpha_unresolved")
        click.echo(f"  LoRA: {lora['modules']} modules, rank {lora['rank']}, alpha {alpha} ({why})")
    opt = r.get("optimizer")
    if isinstance(opt, dict) and opt.get("file"):
        click.echo(
            f"  optimizer: lr {opt.get('lr')} (initial {opt.get('initial_lr')}), "
            f"{opt.get('params_with_state')} params with state"
        )
    if r.get("lr") is not None:
        click.echo(f"  lr {r['lr']}   scheduler last_epoch {r.get('lr_scheduler_last_epoch')}")


def _counts(d: dict) -> str:
    return ", ".join(f"{n} {k}" for k, n in sorted(d.items(), key=lambda kv: (-kv[1], kv[0])))


def _render_hf(r: dict) -> None:
    click.echo(f"HF model dir {r['path']}")
    shards = r["shards"]
    click.echo(
        f"  {r['architecture'] or 'architecture unknown (no config.json architectures)'}: {r['tensors']} "
        f"tensors ({_counts(r['dtypes'])}), {human_bytes(r['total_bytes'])} in {len(shards)} shard(s)"
        + (f": {', '.join(shards)}" if len(shards) <= 3 else f": {shards[0]} ... {shards[-1]}")
    )
    tied = {True: "yes", False: "no", None: "not set"}[r["tie_word_embeddings"]]
    click.echo(f"  config dtype {r['config_dtype'] or 'not set'}; tied embeddings {tied}")
    if r["lora_keys"]:
        click.echo(
            f"  {r['lora_keys']} tensor name(s) contain lora_: an adapter or an unmerged export, not a "
            "plain model"
        )
    if "fp8" in r:
        f = r["fp8"]
        click.echo(
            f"  block FP8 ({f['fmt']}, {f['weight_block_size'][0]}x{f['weight_block_size'][1]} blocks, "
            f"{f['activation_scheme']} activations): {f['quantized']} weights quantized (weight + "
            f"weight_scale_inv), {f['kept']} tensors kept ({', '.join(f['kept_dtypes'])}), "
            f"{len(f['modules_to_not_convert'])} modules_to_not_convert"
        )
        for p in f["problems"][:5]:
            click.echo(f"  problem: {p}")


def _render_peft(r: dict) -> None:
    click.echo(f"PEFT adapter {r['path']} ({r['weights']})")
    if r["modules"]:
        rank = r["rank"] if not isinstance(r["rank"], list) else f"varies ({', '.join(map(str, r['rank']))})"
        scale = (
            human_number(r["scale"])
            if not isinstance(r["scale"], list)
            else f"varies ({', '.join(human_number(s) for s in r['scale'])})"
        )
        click.echo(
            f"  LoRA: {r['modules']} modules, rank {rank}, lora_alpha {human_number(r['lora_alpha'])} -> "
            f"scale "
            f"{scale}{' (rsLoRA)' if r['use_rslora'] else ''}; targets {', '.join(r['targets'])}"
        )
    else:
        click.echo(f"  LoRA: NO module matches (lora_alpha {human_number(r['lora_alpha'])})")
    click.echo(
        f"  weights {', '.join(r['dtypes']) or 'none'}, {human_bytes(r['bytes'])}; modules_to_save "
        f"{', '.join(r['modules_to_save']) or 'none'}"
    )
    click.echo(f"  base_model_name_or_path: {r['base_model_name_or_path'] or 'not set'}")
    if r["layout"] == "dense":
        click.echo(
            "  layout: dense (no expert LoRA: every --layout writes this file; PEFT, vLLM and prime-rl load "
            "it)"
        )
    else:
        names = {
            "peft": "peft (fused MoE expert LoRA through target_parameters)",
            "per-expert": "vllm / prime-rl (per-expert MoE modules experts.<e>.<proj>)",
        }
        click.echo(f"  layout: {names.get(r['layout'], r['layout'])}")
        for consumer, how in r["consumers"].items():
            click.echo(f"    {consumer}: {how}")
    if r["unrecognized_keys"]:
        click.echo(f"  {r['unrecognized_keys']} key(s) PEFT would ignore (see the warning below)")
    for p in r["problems"]:
        click.echo(f"  problem: {p}")


def _render_notes(r: dict) -> None:
    """The interval checkpoint's lag, the launches of the run, what the optimizer does not hold."""
    if r.get("interval_checkpoint"):
        click.echo(f"  note: {r['interval_checkpoint']}")
    _render_attempts(r)
    _render_beside(r)
    if (r.get("optimizer_state") or {}).get("absent"):
        click.echo(f"  note: {r['optimizer_state']['absent']}")


def _render_beside(r: dict) -> None:
    for b in r.get("beside") or []:
        state = "complete" if b["complete"] else "INCOMPLETE"
        click.echo(f"  beside trainer/: {b['name']}/  {b['kind']}, {human_bytes(b['bytes'])}, {state}")
        if b.get("check"):
            click.echo(f"    is it this step's? {b['check']}")


def _render_attempts(r: dict) -> None:
    if not r.get("attempts"):
        return
    click.echo(f"  launched {len(r['attempts'])} times (one config dir per attempt):")
    for a in r["attempts"]:
        how = (
            f"resumed from step {a['resume_step']}"
            if a["resume_step"] is not None
            else ("resumed from the latest step" if a["resumed"] else "fresh")
        )
        click.echo(
            f"    {a['attempt']:<30} {how:<28} alpha {human_number(a['alpha'])}  lr {human_number(a['lr'])}"
            f"  {a['optimizer'] or ''}"
        )
    w = r.get("written_by") or {}
    click.echo(f"  this checkpoint: {w.get('attempt') or 'undecided'} ({w.get('how')})")


def _render_dcp(r: dict) -> None:
    click.echo(f"DCP checkpoint {r['path']}")
    sched = r["scheduler"]
    stype = sched["type"] + (f"({', '.join(sched['schedulers'])})" if sched.get("schedulers") else "")
    click.echo(
        f"  step {r['step']}   lr {human_number(r['lr'])}   scheduler {stype}   world size {r['world_size']} "
        f"  "
        f"keys {r['keys']}"
    )
    click.echo(
        f"  prime-rl {r['generation']} layout (from {r['generation_from']})"
        + (f"   training: {r['training']}" if r.get("training") else "")
        + (f"   optimizer: {r['optimizer']}" if r.get("optimizer") else "")
    )
    ex = r.get("experts")
    if ex:
        click.echo(
            f"  MoE: {ex['layers']} layer(s) x {ex['experts']} experts (prime-format stacked w1/w2/w3), "
            f"stored in {ex['expert_blocks']} expert block(s) by expert index"
            + (f", EP {r['ep']} (run config)" if r.get("ep") is not None else "")
            + (f"; LoRA on {ex['lora_expert_modules']} expert modules" if ex["lora_expert_modules"] else "")
        )
    _render_notes(r)
    total = r["frozen_bytes"] + r["unique_bytes"]
    click.echo(f"  {'group':<16}{'keys':>7}{'size':>12}{'share':>8}")
    for g, s in r["groups"].items():
        if s["count"]:
            share = 100 * s["bytes"] / total if total else 0
            click.echo(f"  {g:<16}{s['count']:>7}{human_bytes(s['bytes']):>12}{share:>7.1f}%")
    click.echo(
        f"  frozen (base, recoverable from the public model): {human_bytes(r['frozen_bytes'])} "
        f"({100 * r['frozen_fraction']:.1f}%)"
    )
    click.echo(f"  unique (LoRA + optimizer + scalars):              {human_bytes(r['unique_bytes'])}")
    lo = r["lora"]
    if lo["modules"]:
        rank = lo["rank"] if lo["rank"] is not None else "varies"
        click.echo(
            f"  LoRA: {lo['modules']} modules, rank {rank}, slots {lo['slots']}, targets "
            f"{', '.join(lo['targets'])}"
        )
        a = r.get("alpha")
        if a:
            click.echo(
                f"  alpha {human_number(a['alpha'])} -> training scale {human_number(a['training_scale'])} "
                f"(from {a['source']})"
            )
            click.echo(f"  rule: {a['rule']}")
        else:
            click.echo(f"  alpha: unknown ({r.get('alpha_unresolved', '')})")
            click.echo(f"  rule: {r['scale_rule']}")
    if r.get("modules_to_save"):
        click.echo(
            f"  trained full tensors (modules_to_save, from their optimizer state): "
            f"{', '.join(r['modules_to_save'])}"
        )
    if r["slim"]:
        click.echo("  SLIM checkpoint: base weights removed; `ckpt rehydrate` before resuming")
