"""The one progress event every long operation reports (pure): ops call `progress(ProgressEvent(...))`,
the CLI draws it (`cli.progress`), tests collect it.

`done` / `total` count the operation's unit (`unit`: "bytes", "tensors", ...); a per-tensor operation
also says which tensor (`name`, `action`) and, when bytes are what takes the time, `bytes_done` /
`bytes_total`. `finished` carries a work unit's own report when one completes (a gc step, say).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Progress", "ProgressEvent", "report"]


@dataclass(frozen=True)
class ProgressEvent:
    phase: str  # "merge", "copy", "hash", "rebuild", "crc32", "read", "compare", "gc" ...
    done: int
    total: int
    unit: str = "bytes"  # what done/total count
    name: str | None = None  # the tensor (or step) just done
    action: str | None = None  # what was done to it (merge: copy | cast | merge | replace)
    bytes_done: int | None = None
    bytes_total: int | None = None
    elapsed_s: float = 0.0
    finished: object | None = None  # a completed work unit's report (gc: its StepResult)


Progress = Callable[[ProgressEvent], None]


def report(progress: Progress | None, phase: str, done: int, total: int, **kw) -> None:
    """Call `progress` (when given) with one event."""
    if progress is not None:
        progress(ProgressEvent(phase, done, total, **kw))
