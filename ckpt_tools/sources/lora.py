"""One view of "a LoRA" for every command: from a PEFT adapter dir or straight from a prime-rl DCP
checkpoint (which stores A/B but not alpha: resolved by `formats.primerl.alpha`, never guessed).

`LoraSource.modules` maps HF module FQNs (`model.layers.0.self_attn.q_proj`) to a `LoraModule`
(rank, scale, the keys and shapes of A and B); `read_pair(module)` returns fp32 (A, B) for one module
at a time; `full_tensors` are `modules_to_save` replacements (HF name -> key), read by `read_full`.
A layout is data here (the keys each module's factors live under), so a new layout (MoE experts
stacked [E, r, in]) is a new way to fill `modules`, not a new code path in every command.

The protocol lives in `formats.handle`; each format's handle offers its LoRA view (`DcpCheckpoint.lora`,
`PeftAdapter.lora`); `open_lora_source` picks the format of a path; `NoLoraSource` is a full fine-tune's.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..core.errors import FormatError, UsageError
from ..formats.dcp.layout import METADATA_NAME, is_checkpoint_path
from ..formats.dcp.lora import DcpLoraSource, trained_full_tensors
from ..formats.dcp.reader import DcpCheckpoint
from ..formats.handle import LoraModule, LoraSource
from ..formats.peft.adapter import open_peft_adapter
from ..formats.peft.config import ADAPTER_CONFIG
from ..formats.peft.lora import PeftLoraSource
from ..formats.trainers import open_trainer

if TYPE_CHECKING:  # annotations only: torch is imported where tensors are built
    import torch

__all__ = [
    "DcpLoraSource",
    "LoraModule",
    "LoraSource",
    "NoLoraSource",
    "PeftLoraSource",
    "open_checkpoint_lora",
    "open_lora_source",
    "trained_full_tensors",
]


class NoLoraSource(LoraSource):
    """The "adapter" of a full fine-tune's export: no LoRA at all, the checkpoint's weights are the model."""

    kind = "none"

    def __init__(self, path: Path, *, tied_aliases: tuple[str, ...] = ()):
        self.path = Path(path)
        self.config_path = self.weights_path = self.path / METADATA_NAME
        self.tied_aliases = tied_aliases  # output embeddings trained as the input embedding (tied)
        self.modules, self.full_tensors = {}, {}
        self.alpha, self.alpha_source = None, "none (a full fine-tune: the trained weights are exported)"

    def read_key(self, key: str) -> torch.Tensor:
        raise FormatError("a full fine-tune has no adapter tensors", path=self.path, key=key)


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
    p = Path(path)
    trainer = open_trainer(p, trust_pickle=trust_pickle)
    if trainer is not None:  # verl, torchtitan
        return _trainer_lora(trainer, alpha, slot)
    if is_checkpoint_path(p) and p.name != METADATA_NAME:
        return DcpCheckpoint.open(p, trust_pickle=trust_pickle).lora(
            alpha=alpha, run_config=Path(run_config) if run_config else None, slot=slot
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
    return DcpCheckpoint.open(Path(path), trust_pickle=trust_pickle).lora(
        alpha=alpha, run_config=None if run_config is None else Path(run_config), slot=slot
    )
