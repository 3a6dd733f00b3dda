"""`ckpt gc`: arguments -> `api.gc` -> text or JSON."""

from __future__ import annotations

from pathlib import Path

import click

from ... import api
from ...core.progress import ProgressEvent
from ...core.units import human_bytes
from ...io.signals import Terminated
from ..mistakes import check_roles
from ..options import InputPath, download_option, dry_run_option, json_option, trust_option
from ..progress import ProgressLine
from ..render import emit, json_errors, warn, warn_trust

__all__ = ["command"]


@click.command("gc")
@click.argument("checkpoints", metavar="CHECKPOINTS_DIR", type=InputPath(file_okay=False))
@click.option(
    "--keep-full",
    type=click.IntRange(min=1),
    required=True,
    help="How many of the newest complete checkpoints to keep whole (resumable as they are).",
)
@click.option(
    "--base",
    help="The bf16 HF base model the run trained on (dir or hub id in the local HF cache). "
    "Default: the run config's model name. Every slim is checked against it.",
)
@click.option(
    "--min-age",
    "min_age",
    type=click.FloatRange(min=0),
    default=600,
    show_default=True,
    help="Seconds since a checkpoint's last write before gc touches it (younger ones may be being written).",
)
@click.option(
    "--slim-to",
    "slim_to",
    metavar="URL",
    help="Also upload each slim to URL/step_N/trainer (s3://, hf://org/repo/DIR, gs://), committed before "
    "the step's full copy is deleted; a failed upload leaves the step full (docs/remote.md).",
)
@dry_run_option
@download_option
@json_option
@trust_option
def command(
    checkpoints: Path,
    keep_full: int,
    base,
    min_age: float,
    slim_to,
    dry_run: bool,
    as_json: bool,
    trust_pickle: bool,
) -> None:
    """Keep every checkpoint of a run: the newest N whole, every older one slim, in place.

    CHECKPOINTS_DIR: prime-rl's outputs/checkpoints (or the outputs dir). Each older step_N/trainer
    is slimmed next to itself, verified against the original (sha256 of every kept item; every dropped
    tensor checked against the base), swapped in atomically and the full copy deleted. A kill at any
    moment leaves each step full or slim; rerun to finish. Left alone: the newest N, checkpoints being
    written (no .metadata, recent writes, a lock) and slim ones. `ckpt rehydrate` restores any of them
    bit-exactly.

    \b
    Example:
      ckpt gc outputs/checkpoints --keep-full 2 --base Qwen/Qwen3-32B --dry-run
    """
    check_roles("gc", {"CHECKPOINTS_DIR": checkpoints, "--base": base})
    warn_trust(trust_pickle)
    bar = ProgressLine.for_terminal(not as_json)
    done: list = []  # the steps finished so far, for the interrupt message

    def progress(ev: ProgressEvent) -> None:
        if ev.finished is not None:  # a step done: its line, whatever the terminal
            done.append(ev.finished)
            if bar is not None:
                bar.close()
            if not as_json:
                _echo_step(ev.finished)
        elif bar is not None:
            bar(ev)

    try:
        with json_errors(as_json):
            report = api.gc(
                checkpoints,
                keep_full=keep_full,
                base=base,
                dry_run=dry_run,
                min_age_s=min_age,
                trust_pickle=trust_pickle,
                progress=progress,
                slim_to=slim_to,
            )
    except (KeyboardInterrupt, Terminated) as exc:
        if bar is not None:
            bar.close()
        changed = [
            f"step_{r.step} {r.result}" for r in done if r.result in ("slimmed", "finished", "restored")
        ]
        line = (
            f"gc stopped after {', '.join(changed)} (done, kept); "
            if changed
            else "gc stopped before any step was changed; "
        ) + "every step is full or slim; rerun to finish"
        # what the CLI's interrupt line says instead of "nothing was written"
        exc.summary = line  # type: ignore[union-attr]
        raise
    finally:
        if bar is not None:
            bar.close()
    failed = report.result.failed if report.result is not None else []
    if as_json:
        emit(report, exit_code=1 if failed else 0)
    else:
        _render(report.to_json())
    if failed:
        raise click.exceptions.Exit(1)


def _echo_step(r) -> None:
    if r.result in ("slimmed", "finished", "restored"):
        click.echo(
            f"  step_{r.step}: {r.result}, {human_bytes(r.bytes_before)} -> {human_bytes(r.bytes_after)} "
            f"(freed {human_bytes(r.freed_bytes)}, {r.seconds:.1f}s)"
            + (f"; uploaded to {r.uploaded['url']}" if r.uploaded else ""),
            err=True,
        )
    elif r.result == "skipped" and r.action in ("slim", "finish", "restore"):  # the plan said yes, the run no
        click.echo(f"  step_{r.step}: skipped: {r.reason}", err=True)


def _render(report: dict) -> None:
    p = report["plan"]
    click.echo(
        f"gc {p['checkpoints']}: keep the newest {p['keep_full']} whole"
        f"{'  (dry run: nothing written)' if report['dry_run'] else ''}"
    )
    if p["base"]:
        b = p["base"]
        click.echo(
            f"  base: {b['dir'] or b['name']} ({b['how']})" + (f": {b['problem']}" if b["problem"] else "")
        )
    for s in p["steps"]:
        what = {
            "slim": f"slim: frees ~{human_bytes(s['bytes_to_free'])} ({human_bytes(s['bytes'])} -> "
            f"~{human_bytes(s['slim_bytes'] or 0)})",
            "finish": f"finish an interrupted gc: frees ~{human_bytes(s['bytes_to_free'])}",
            "restore": "restore the full checkpoint an interrupted gc set aside",
        }.get(s["action"], s["action"])
        click.echo(f"  step_{s['step']}: {what}; {s['reason']}")
    if p.get("kept_beside"):
        names = ", ".join(sorted({b["name"] for b in p["kept_beside"]}))
        click.echo(
            f"  kept as they are beside trainer/ (never slimmed or deleted): {len(p['kept_beside'])} dir(s), "
            f"{human_bytes(p['kept_beside_bytes'])} ({names})"
        )
    r = report.get("result")
    if r is None:
        click.echo(
            f"would free ~{human_bytes(p['bytes_to_free'])}; needs {human_bytes(p['need_bytes'])} free, "
            f"{human_bytes(p['free_bytes'])} free"
        )
        return
    for s in r["steps"]:
        for n in s["notes"]:
            warn(f"step_{s['step']}: {n}")
    click.echo(
        f"slimmed {len(r['slimmed'])} step(s): {human_bytes(r['bytes_before'])} -> "
        f"{human_bytes(r['bytes_after'])}, freed {human_bytes(r['freed_bytes'])}"
    )
    if r["slimmed"]:
        click.echo(
            f"  to resume from a slimmed step: ckpt rehydrate {p['checkpoints']}/step_N/trainer "
            f"restored/step_N/trainer --base {(p['base'] or {}).get('dir') or 'BASE'}"
        )
