"""Where a torchtitan checkpoint lies, from names on disk (pure of reads).

torchtitan's `CheckpointManager` (torchtitan/components/checkpointer/dcp.py, 0.3.0) saves step N with
`dcp.save(..., checkpoint_id=<dump_folder>/<checkpoint.folder>/step-N)` (`_create_checkpoint_id`; the folder
defaults to "checkpoint"), and resumes from the highest `step-N` holding a `.metadata` (`_find_load_step`).
"""

from __future__ import annotations

import re
from pathlib import Path

from ...core.errors import UsageError
from ...io.inputs import as_input, lexists
from ..dcp.layout import METADATA_NAME

__all__ = ["DEFAULT_FOLDER", "is_step_dir", "is_torchtitan_path", "resolve_step_dir", "step_dirs"]

DEFAULT_FOLDER = "checkpoint"
_STEP = re.compile(r"step-(\d+)")


def is_step_dir(p: Path) -> bool:
    return _STEP.fullmatch(p.name) is not None and lexists(p / METADATA_NAME)


def step_dirs(folder: Path) -> list[tuple[int, Path]]:
    """(N, dir) of every `step-N` with a `.metadata` in a checkpoint folder, by N."""
    if not folder.is_dir():
        return []
    found = []
    for c in folder.iterdir():
        m = _STEP.fullmatch(c.name)
        if m and lexists(c / METADATA_NAME):
            found.append((int(m.group(1)), c))
    return sorted(found)


def is_torchtitan_path(p: Path) -> bool:
    """A `step-N` DCP dir, a checkpoint folder of them, or a dump folder holding `checkpoint/`."""
    p = as_input(p)
    return is_step_dir(p) or bool(step_dirs(p)) or bool(step_dirs(p / DEFAULT_FOLDER))


def resolve_step_dir(path: str | Path) -> Path:
    """The step dir of a torchtitan path: itself, or the highest `step-N` of a checkpoint or dump folder (the
    one
    torchtitan resumes from)."""
    p = as_input(path)
    if lexists(p / METADATA_NAME):
        return p
    steps = step_dirs(p) or step_dirs(p / DEFAULT_FOLDER)
    if not steps:
        raise UsageError(
            "not a torchtitan checkpoint: no step-N/.metadata here or in checkpoint/",
            path=p,
            hint="pass the step dir (<dump_folder>/checkpoint/step-N), its checkpoint folder or the "
            "dump folder",
        )
    return steps[-1][1]
