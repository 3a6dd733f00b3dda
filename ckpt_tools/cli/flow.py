"""The one shape of a writing command, from the CLI's side: open the sources, plan, then either the
dry-run report or the run with the one progress line; then the envelope (--json) or the text.

    report = plan_and_run(lambda: open_slim_sources(ckpt, options), lambda s: plan_slim(s, options),
                          lambda plan, s, progress: run_slim(plan, s, progress, overwrite=overwrite),
                          SlimReport, dry_run=dry_run)
    finish(report, as_json, render)
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import click

from ..core.units import human_bytes
from ..io.signals import signals_deferred
from .progress import ProgressLine
from .render import STATE, emit

__all__ = ["plan_and_run", "finish", "op_imports", "DryRunReport", "dry_run_output"]


@contextlib.contextmanager
def op_imports():
    """Where a command imports its op, and torch with it. The import sits inside the command
    function, so that `ckpt <cmd> --help` stays torch-free (tests/test_startup.py); SIGINT/SIGTERM
    are held until the imports are done and delivered right after, as `entry.py` holds them while
    the CLI itself is imported. A signal raised inside numpy's initialization (under torch) leaves it
    half-loaded, and the error path's next import of it fails ("cannot load module more than once
    per process") instead of the one line a Ctrl-C should give (tests/test_hostile_files.py, signals
    during start-up)."""
    with signals_deferred():
        yield


@dataclass
class DryRunReport:
    """A dry run's report with what writing OUT would do (`io.staging.describe_output`): its JSON
    plan gains `output` = {"out", "exists", "replaces"}."""
    report: object
    output: dict | None

    def to_json(self) -> dict:
        d = self.report.to_json() if hasattr(self.report, "to_json") else dict(self.report)
        if self.output is None:
            return d
        if isinstance(d.get("plan"), dict):
            return {**d, "plan": {**d["plan"], "output": self.output}}
        return {**d, "output": self.output}


def dry_run_output(out, overwrite: bool) -> dict | None:
    """What the real run would do at OUT, refusing what it would refuse (None: no OUT)."""
    if out is None:
        return None
    from ..io.staging import describe_output
    return describe_output(out, overwrite=overwrite)


def plan_and_run(open_sources: Callable, plan: Callable, run: Callable, dry_report: Callable, *, dry_run: bool,
                 out=None, overwrite: bool = False):
    """`open_sources()` (a context manager) -> `plan(sources)` -> `dry_report(plan)` in a dry run (with
    OUT checked as the real run checks it: `dry_run_output`), else `run(plan, sources, progress)` with
    the progress line drawn (on a terminal, not under -q/--json)."""
    with open_sources() as sources:
        planned = plan(sources)
        if dry_run:
            return DryRunReport(dry_report(planned), dry_run_output(out, overwrite))
        progress = ProgressLine.for_terminal()
        try:
            return run(planned, sources, progress)
        finally:
            if progress is not None:
                progress.close()


def finish(report, as_json: bool, render: Callable[[dict], None], *, exit_code: int = 0) -> None:
    """The envelope under --json, else `render(report.to_json())`. An OUT bound for a URL is uploaded
    and committed first (io.upload): the report is only printed once the output is there."""
    from ..io import remote, upload
    if upload.pending():
        ctx = click.get_current_context(silent=True)
        params = ctx.params if ctx is not None else {}
        STATE.uploaded = upload.commit_pending(overwrite=bool(params.get("overwrite")))
    if as_json:
        emit(report, exit_code=exit_code)
        return
    payload = report.to_json() if hasattr(report, "to_json") else report
    render(remote.display(payload))
    rep = getattr(report, "output", None) if isinstance(report, DryRunReport) else None
    if rep and rep.get("replaces") is not None:
        r = rep["replaces"]
        what = f"an earlier output of `ckpt {r['command']}`" if r.get("command") else "an empty directory"
        click.echo(f"  --overwrite would remove {rep['out']}: {what}, {r['entries']} entries, "
                   f"{human_bytes(r['bytes'])}")
    for u in STATE.uploaded:
        click.echo(f"uploaded {u.files} file(s), {human_bytes(u.bytes)}, to {u.url} ({u.method})")
    if remote.active():
        click.echo(f"fetched {human_bytes(remote.bytes_fetched())} of {human_bytes(remote.mounted_bytes())} "
                   "held remotely")
