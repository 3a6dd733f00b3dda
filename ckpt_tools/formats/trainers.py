"""Checkpoints of trainers other than prime-rl, by the kind `sniff` names: verl (`formats.verl`) and
torchtitan
(`formats.torchtitan`). `open_trainer` returns the format's handle (`VerlCheckpoint`, `TorchtitanCheckpoint`),
each offering what a DCP checkpoint's does to the ops: `.base_weights()` (a `Source` of fp32 masters under HF
names), `.lora(...)`, `.dir`, `.stats`, `.close()`."""

from __future__ import annotations

from pathlib import Path

from ..io.inputs import as_input
from .sniff import TORCHTITAN, VERL, sniff

__all__ = ["TRAINERS", "open_trainer", "open_trainer_for_export", "trainer_dir", "trainer_kind"]

TRAINERS = (VERL, TORCHTITAN)


def trainer_kind(path) -> str | None:
    """VERL or TORCHTITAN for a path of theirs, else None."""
    p = as_input(path)
    kind = sniff(p) if p.exists() else None
    return kind if kind in TRAINERS else None


def open_trainer(path, *, trust_pickle: bool = False):
    """The handle of a verl or torchtitan checkpoint path, None for any other path."""
    kind = trainer_kind(path)
    if kind == VERL:
        from .verl.reader import VerlCheckpoint

        return VerlCheckpoint.open(path)
    if kind == TORCHTITAN:
        from .torchtitan.reader import TorchtitanCheckpoint

        return TorchtitanCheckpoint.open(path, trust_pickle=trust_pickle)
    return None


def trainer_dir(path) -> Path:
    """The dir a trainer handle of `path` reads (verl's role dir, torchtitan's step dir), without opening
    it."""
    kind = trainer_kind(path)
    if kind == VERL:
        from .verl.layout import resolve_actor_dir

        return resolve_actor_dir(path)
    from .torchtitan.layout import resolve_step_dir

    return resolve_step_dir(path)


def open_trainer_for_export(path, *, config_dir=None, trust_pickle: bool = False):
    """(handle, its weights as a `Source` of masters): torchtitan's llama3 rows need the HF config's head
    counts
    (`config_dir`: a dir holding config.json); verl's checkpoint carries its config (`huggingface/`)."""
    trainer = open_trainer(path, trust_pickle=trust_pickle)
    if trainer is None:
        return None, None
    try:
        config = None
        if config_dir is not None and trainer.kind == TORCHTITAN:
            from .hf_dir.config import load_config
            from .hf_dir.hub import resolve_model_dir

            config, _p = load_config(resolve_model_dir(config_dir, need="config"), required=True)
        return trainer, trainer.base_weights(str(path), config=config)
    except BaseException:
        trainer.close()
        raise
