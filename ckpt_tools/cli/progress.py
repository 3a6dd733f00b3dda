"""The one progress renderer: every op's `ProgressEvent` drawn as one line on stderr, only on a
terminal, never under -q or --json.

    progress = ProgressLine.for_terminal()   # None when stderr is not a terminal, or -q / --json
    run_x(plan, sources, progress)
    progress.close()                          # ends the line

What the line shows follows from what the event carries: work with bytes (merge, diff-vs-base, slim,
rehydrate, verify --deep, gc) shows the bytes done and total, the rate and an ETA; anything else its
count and the item's name. Redrawn at most every 0.2 s (and at the ends). A message printed meanwhile
(`render.warn`, the error edge) clears the line first (`render.clear_progress`).
"""

from __future__ import annotations

import time

import click

from ..core.progress import ProgressEvent
from ..core.units import human_bytes
from ..dist import env_part
from ..io import remote
from ..io.remote_url import redact
from .render import STATE, is_tty

__all__ = ["ProgressLine"]


class ProgressLine:
    def __init__(self, min_interval_s: float = 0.2):
        self._last = 0.0
        self._t0 = time.monotonic()
        self.min_interval_s = min_interval_s

    @classmethod
    def for_terminal(cls, enabled: bool = True) -> ProgressLine | None:
        return (
            cls()
            if enabled and not STATE.quiet and not STATE.as_json and is_tty() and env_part().leader
            else None
        )  # one bar, rank 0's

    def __call__(self, ev: ProgressEvent) -> None:
        now = time.monotonic()
        if ev.done not in (0, ev.total) and now - self._last < self.min_interval_s:
            return
        self._last = now
        click.echo("\r\033[K" + self.line(ev, now - self._t0), err=True, nl=False)
        STATE.progress_shown = True

    @staticmethod
    def line(ev: ProgressEvent, wall_s: float | None = None) -> str:
        name = (ev.name or "")[-40:]
        elapsed = ev.elapsed_s or wall_s or 0.0
        if ev.bytes_total is not None:
            done, total, count = ev.bytes_done or 0, ev.bytes_total, f"[{ev.done:>5}/{ev.total}] "
        elif ev.unit == "bytes":
            done, total, count = ev.done, ev.total, ""
        else:
            return redact(f"  {ev.phase} {ev.done}/{ev.total} {name}")
        frac = done / total if total else 1.0
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (total - done) / rate if rate > 0 else 0.0
        fetched = f"  fetched {human_bytes(remote.bytes_fetched())}" if remote.active() else ""
        return redact(
            f"  {ev.phase} {count}{human_bytes(done):>10} / {human_bytes(total)} ({100 * frac:.0f}%)  "
            f"{human_bytes(rate)}/s  ETA {int(eta) // 60}:{int(eta) % 60:02d}{fetched}  {name:<40}"
        )

    def close(self) -> None:
        if STATE.progress_shown:
            click.echo("\r\033[K", err=True, nl=False)
            STATE.progress_shown = False
