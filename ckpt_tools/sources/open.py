"""Open the right `Source` for a path: an HF model dir (single file or sharded), a hub id from the
local HF cache (offline), or a DCP checkpoint (trainer dir or step dir: its base weights)."""

from __future__ import annotations

import os
from pathlib import Path

from ..core.errors import UsageError
from ..formats.dcp.reader import DcpCheckpoint
from ..formats.hf_dir.model_dir import HFModelDir
from ..formats.sniff import DCP, PEFT, has_hf_weights, sniff
from ..formats.trainers import open_trainer
from .base import Source

__all__ = ["open_weights"]


def open_weights(spec: str | os.PathLike, *, trust_pickle: bool = False) -> Source:
    label = str(spec)
    p = Path(spec).expanduser()
    if p.exists():
        trainer = open_trainer(p, trust_pickle=trust_pickle)  # verl, torchtitan: their weights under HF names
        if trainer is not None:
            return trainer.base_weights(label, owned=True)
        kind = sniff(p)
        if kind == DCP:
            return DcpCheckpoint.open(p, trust_pickle=trust_pickle).base_weights(label, owned=True)
        if kind == PEFT and not has_hf_weights(p):
            raise UsageError(
                "is a PEFT adapter, not model weights",
                path=p,
                hint="pass it as --adapter, and the model directories as WEIGHTS and BASE",
            )
        if not p.is_dir():
            raise UsageError("expected a model directory, a hub id or a DCP checkpoint, got a file", path=p)
        return HFModelDir.open(p, label)
    return HFModelDir.open_ref(label, label)
