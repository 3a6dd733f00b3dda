"""Open a path of any format as what an op reads: `open_weights`, the `Source` of model weights (an HF
model dir, single file or sharded; a hub id from the local HF cache, offline; a DCP checkpoint's base
weights, trainer dir or step dir), and `open_lora_source`, the `LoraSource` of a PEFT adapter dir or a
prime-rl DCP checkpoint. Each format's handle offers these views; this module picks the format."""

from __future__ import annotations

import os
from pathlib import Path

from ..core.errors import UsageError
from ..formats.dcp.layout import METADATA_NAME, is_checkpoint_path
from ..formats.dcp.reader import DcpCheckpoint
from ..formats.handle import LoraSource, Source
from ..formats.hf_dir.model_dir import HFModelDir
from ..formats.peft.adapter import open_peft_adapter
from ..formats.peft.config import ADAPTER_CONFIG
from ..formats.sniff import DCP, PEFT, has_hf_weights, sniff
from ..formats.trainers import open_trainer
from ..io.inputs import as_input

__all__ = ["open_checkpoint_lora", "open_lora_source", "open_weights"]


def open_weights(spec: str | os.PathLike, *, trust_pickle: bool = False) -> Source:
    label = str(spec)
    p = as_input(spec).expanduser()
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


def open_lora_source(
    path: str | Path,
    *,
    alpha: float | None = None,
    run_config: str | Path | None = None,
    slot: int = 0,
    trust_pickle: bool = False,
) -> LoraSource:
    """A PEFT adapter dir or a prime-rl DCP checkpoint. For PEFT, alpha comes from its config
    (an explicit --alpha overrides it, with the adapter's own rank)."""
    p = as_input(path)
    trainer = open_trainer(p, trust_pickle=trust_pickle)
    if trainer is not None:  # verl, torchtitan
        return _trainer_lora(trainer, alpha, slot)
    if is_checkpoint_path(p) and p.name != METADATA_NAME:
        return DcpCheckpoint.open(p, trust_pickle=trust_pickle).lora(
            alpha=alpha, run_config=as_input(run_config) if run_config else None, slot=slot
        )
    if (p / ADAPTER_CONFIG).is_file():
        src = open_peft_adapter(p, strict=True).lora()
        if alpha is not None:
            src.with_alpha(alpha)
        return src
    raise UsageError(
        "not a LoRA source: expected a PEFT adapter dir (adapter_config.json) or a prime-rl "
        "DCP checkpoint (.metadata)",
        path=p,
    )


def _trainer_lora(trainer, alpha: float | None, slot: int) -> LoraSource:
    try:
        return trainer.lora(alpha=alpha, slot=slot)
    except BaseException:
        trainer.close()
        raise


def open_checkpoint_lora(
    path: str | Path,
    *,
    alpha: float | None = None,
    run_config: str | Path | None = None,
    slot: int = 0,
    trust_pickle: bool = False,
) -> LoraSource:
    """The LoRA of a training checkpoint: a prime-rl DCP checkpoint's (alpha resolved from its run) or a verl
    one's (alpha from its lora_train_meta.json): what `extract-adapter` reads."""
    trainer = open_trainer(path, trust_pickle=trust_pickle)
    if trainer is not None:
        return _trainer_lora(trainer, alpha, slot)
    return DcpCheckpoint.open(as_input(path), trust_pickle=trust_pickle).lora(
        alpha=alpha, run_config=None if run_config is None else as_input(run_config), slot=slot
    )
