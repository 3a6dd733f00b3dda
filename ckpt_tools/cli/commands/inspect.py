"""`ckpt inspect`: arguments -> `ops.inspect` -> text or JSON."""
from __future__ import annotations

from pathlib import Path

import click

from ...core.units import human_bytes
from ...ops.inspect import InspectOptions, plan_inspect, run_inspect
from ..options import alpha_options, json_option, trust_option
from ..render import emit, warn, warn_trust

__all__ = ["command"]


@click.command("inspect")
@click.argument("path", type=click.Path(exists=True, path_type=Path))
@alpha_options
@click.option("--keys", "list_keys", is_flag=True, help="List every key with its group, dtype, shape and chunks.")
@json_option
@trust_option
def command(path: Path, alpha, run_config, list_keys: bool, as_json: bool, trust_pickle: bool) -> None:
    """Describe a checkpoint, HF model dir or PEFT adapter from metadata alone.

    PATH: a prime-rl trainer dir (.../step_N/trainer), a step dir, an outputs/checkpoints dir, an HF
    model dir or a PEFT adapter dir. Reads no tensor data.

    Example: ckpt inspect outputs/checkpoints/step_95/trainer
    """
    warn_trust(trust_pickle)
    plan = plan_inspect(path, InspectOptions(alpha, None if run_config is None else str(run_config), list_keys,
                                             trust_pickle))
    result = run_inspect(plan)
    if as_json:
        emit(result)
        return
    report = result.to_json()
    if plan.kind == "dcp" and list_keys:
        for row in report:
            shape = "bytes" if row["dtype"] is None else f"{row['dtype']} {row['shape']}"
            click.echo(f"{row['key']}  | {row['group']} | {shape} | {row['chunks']} chunk(s)")
        return
    render(report)
    for w in report.get("warnings", []):
        warn(w)


def render(r: dict) -> None:
    fmt = r["format"]
    if fmt == "dcp":
        _render_dcp(r)
    elif fmt == "checkpoints":
        click.echo(f"{r['path']}: {len(r['steps'])} checkpoint(s)")
        for s in r["steps"]:
            state = "complete" if s["complete"] else "INCOMPLETE (no .metadata)"
            click.echo(f"  step_{s['step']:<8} {human_bytes(s['bytes']):>10}  {state}  -> resumes at step {s['step']}")
        click.echo(r["note"])
    else:
        width = max(len(k) for k in r)
        for k, v in r.items():
            if k != "warnings":
                click.echo(f"{k:>{width}}: {v}")


def _render_dcp(r: dict) -> None:
    click.echo(f"DCP checkpoint {r['path']}")
    sched = r["scheduler"]
    stype = sched["type"] + (f"({', '.join(sched['schedulers'])})" if sched.get("schedulers") else "")
    click.echo(f"  step {r['step']}   lr {r['lr']}   scheduler {stype}   world size {r['world_size']}   "
               f"keys {r['keys']}")
    click.echo(f"  prime-rl {r['generation']} layout (from {r['generation_from']})"
               + (f"   training: {r['training']}" if r.get("training") else "")
               + (f"   optimizer: {r['optimizer']}" if r.get("optimizer") else ""))
    ex = r.get("experts")
    if ex:
        click.echo(f"  MoE: {ex['layers']} layer(s) x {ex['experts']} experts (prime-format stacked w1/w2/w3), "
                   f"stored in {ex['expert_blocks']} expert block(s) by expert index"
                   + (f", EP {r['ep']} (run config)" if r.get("ep") is not None else "")
                   + (f"; LoRA on {ex['lora_expert_modules']} expert modules" if ex["lora_expert_modules"] else ""))
    if r.get("interval_checkpoint"):
        click.echo(f"  note: {r['interval_checkpoint']}")
    total = r["frozen_bytes"] + r["unique_bytes"]
    click.echo(f"  {'group':<16}{'keys':>7}{'size':>12}{'share':>8}")
    for g, s in r["groups"].items():
        if s["count"]:
            share = 100 * s["bytes"] / total if total else 0
            click.echo(f"  {g:<16}{s['count']:>7}{human_bytes(s['bytes']):>12}{share:>7.1f}%")
    click.echo(f"  frozen (base, recoverable from the public model): {human_bytes(r['frozen_bytes'])} "
               f"({100 * r['frozen_fraction']:.1f}%)")
    click.echo(f"  unique (LoRA + optimizer + scalars):              {human_bytes(r['unique_bytes'])}")
    lo = r["lora"]
    if lo["modules"]:
        rank = lo["rank"] if lo["rank"] is not None else "varies"
        click.echo(f"  LoRA: {lo['modules']} modules, rank {rank}, slots {lo['slots']}, targets "
                   f"{', '.join(lo['targets'])}")
        a = r.get("alpha")
        if a:
            click.echo(f"  alpha {a['alpha']:g} -> training scale {a['training_scale']:g} (from {a['source']})")
            click.echo(f"  rule: {a['rule']}")
        else:
            click.echo(f"  alpha: unknown ({r.get('alpha_unresolved', '')})")
            click.echo(f"  rule: {r['scale_rule']}")
    if r["slim"]:
        click.echo("  SLIM checkpoint: base weights removed; `ckpt rehydrate` before resuming")
