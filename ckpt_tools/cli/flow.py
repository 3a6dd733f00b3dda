"""The one shape of a command, from the CLI's side: arguments -> one `ckpt_tools.api` call (with the
progress line) -> the envelope (--json) or the text.

    with progress_line(not dry_run) as bar:
        report = api.slim(ckpt, out, base=base, dry_run=dry_run, overwrite=overwrite, progress=bar)
    finish(report, as_json, render)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import click

from ..api import DryRunReport
from ..core.units import human_bytes
from .progress import ProgressLine
from .render import STATE, emit, warn

__all__ = ["DryRunReport", "finish", "progress_line", "shown"]


@contextlib.contextmanager
def progress_line(enabled: bool = True):
    """The one progress line for an api call's `progress=` (None when stderr is not a terminal, under
    -q / --json, or not `enabled`), ended when the call returns or raises."""
    bar = ProgressLine.for_terminal(enabled)
    try:
        yield bar
    finally:
        if bar is not None:
            bar.close()


def shown(payload):
    """`payload` with each staged output's local path shown as its URL (`io.remote_display`) and no
    credentials of any URL (`io.remote_url.redact`)."""
    from ..io.remote_display import display
    from ..io.remote_url import redact

    return redact(display(payload))


def finish(report, as_json: bool, render: Callable[[dict], None], *, exit_code: int = 0) -> None:
    """The envelope under --json, else `render(report.to_json())`, with the OUTs the api call put at URLs
    (`io.upload.take_uploaded`)."""
    from ..io import remote, upload

    STATE.uploaded = upload.take_uploaded()  # the OUTs the api call put at URLs
    for u in STATE.uploaded:
        for x in u.left_behind:
            warn(f"{u.url} is in place, complete, but the cleanup could not remove {x}: delete it yourself")
    if as_json:
        emit(report, exit_code=exit_code)
        return
    payload = report.to_json() if hasattr(report, "to_json") else report
    render(shown(payload))
    rep = getattr(report, "output", None) if isinstance(report, DryRunReport) else None
    if rep and rep.get("replaces") is not None:
        r = rep["replaces"]
        what = f"an earlier output of `ckpt {r['command']}`" if r.get("command") else "an empty directory"
        click.echo(
            f"  --overwrite would remove {rep['out']}: {what}, {r['entries']} entries, "
            f"{human_bytes(r['bytes'])}"
        )
    for u in STATE.uploaded:
        click.echo(f"uploaded {u.files} file(s), {human_bytes(u.bytes)}, to {u.url} ({u.method})")
    if remote.active():
        click.echo(
            f"fetched {human_bytes(remote.bytes_fetched())} of the {human_bytes(remote.input_bytes())} "
            "of remote files it read"
        )
