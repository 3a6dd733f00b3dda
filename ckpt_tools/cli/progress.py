"""The one progress renderer: every op's `ProgressEvent` drawn as one line on stderr, only on a terminal.

    progress = ProgressLine.for_terminal()   # None when stderr is not a terminal (or under --json)
    run_x(plan, sources, progress)
    progress.close()                          # ends the line

What the line shows follows from what the event carries: per-tensor work with bytes (merge) shows
tensors, bytes and an ETA; byte-counted phases (slim, rehydrate, verify, gc) the bytes and percent;
anything else its count and the tensor's name. Redrawn at most every 0.2 s (and at the ends).
"""
from __future__ import annotations

import time

import click

from ..core.progress import ProgressEvent
from ..dist import env_part
from ..core.units import human_bytes
from .render import is_tty

__all__ = ["ProgressLine"]


class ProgressLine:
    def __init__(self, min_interval_s: float = 0.2):
        self._last = 0.0
        self._shown = False
        self.min_interval_s = min_interval_s

    @classmethod
    def for_terminal(cls, enabled: bool = True) -> "ProgressLine | None":
        return cls() if enabled and is_tty() and env_part().leader else None   # one bar, rank 0's

    def __call__(self, ev: ProgressEvent) -> None:
        now = time.monotonic()
        if ev.done not in (0, ev.total) and now - self._last < self.min_interval_s:
            return
        self._last = now
        click.echo("\r\033[K" + self.line(ev), err=True, nl=False)
        self._shown = True

    @staticmethod
    def line(ev: ProgressEvent) -> str:
        name = (ev.name or "")[-40:]
        if ev.bytes_total is not None:
            frac = ev.bytes_done / ev.bytes_total if ev.bytes_total else 1.0
            eta = (ev.elapsed_s / frac - ev.elapsed_s) if frac > 0 else 0.0
            return (f"  [{ev.done:>5}/{ev.total}] {human_bytes(ev.bytes_done):>10} / {human_bytes(ev.bytes_total)}"
                    f"  ETA {int(eta) // 60}:{int(eta) % 60:02d}  {name:<40}")
        if ev.unit == "bytes":
            pct = 100 * ev.done / ev.total if ev.total else 100
            return f"  {ev.phase}: {human_bytes(ev.done)} / {human_bytes(ev.total)} ({pct:.0f}%)"
        return f"  {ev.phase} {ev.done}/{ev.total} {name}"

    def close(self) -> None:
        if self._shown:
            click.echo("", err=True)
            self._shown = False
