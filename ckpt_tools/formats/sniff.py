"""What is this path? The one answer every command starts from: a DCP checkpoint, a PEFT adapter dir,
an HF model dir, a prime-rl `checkpoints` dir (step_N/ subdirs), a verl checkpoint (`formats.verl.layout`)
or a torchtitan one (a `step-N` DCP dir, `formats.torchtitan.layout`). From names on disk only."""

from __future__ import annotations

from pathlib import Path

from ..core.keys import step_of
from ..io.inputs import as_input
from .dcp.layout import is_checkpoint_path
from .hf_dir.names import INDEX_NAME, WEIGHTS_NAME
from .peft.config import ADAPTER_CONFIG
from .torchtitan.layout import is_torchtitan_path
from .verl.layout import is_verl_path

__all__ = ["CHECKPOINTS", "DCP", "HF", "PEFT", "TORCHTITAN", "VERL", "has_hf_weights", "sniff", "step_number"]

DCP, PEFT, HF, CHECKPOINTS = "dcp", "peft", "hf", "checkpoints"
VERL, TORCHTITAN = "verl", "torchtitan"


def step_number(p: Path) -> int | None:
    """N for a `step_N` directory, else None."""
    n = step_of(p.name)
    return n if n is not None and p.is_dir() else None


def has_hf_weights(p: Path) -> bool:
    return (p / WEIGHTS_NAME).is_file() or (p / INDEX_NAME).is_file()


def sniff(path) -> str | None:
    """TORCHTITAN, DCP, PEFT, HF, VERL or CHECKPOINTS (in that order of precedence), None when it is none."""
    p = as_input(path)
    if is_torchtitan_path(p):
        return TORCHTITAN
    if is_checkpoint_path(p):
        return DCP
    if (p / ADAPTER_CONFIG).is_file():
        return PEFT
    if has_hf_weights(p):
        return HF
    if is_verl_path(p):
        return VERL
    if p.is_dir() and (
        any(step_number(c) is not None for c in p.iterdir())
        or (p / "checkpoints").is_dir()  # an outputs dir
        or (p / "outputs" / "checkpoints").is_dir()  # a run dir (its launch dir: configs/, outputs/)
    ):
        return CHECKPOINTS
    return None
