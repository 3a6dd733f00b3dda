"""A checkpoint summarized from its metadata and a handful of tiny byte items (step, lr, scheduler
fields): key groups and their bytes, frozen vs unique bytes, the LoRA's rank and targets, the world
size, the schedule. Never a byte of tensor data. `ckpt inspect` prints it; `ckpt doctor` reads a
run's checkpoints through it."""

from __future__ import annotations

from dataclasses import dataclass

from ...core.keys import (
    FROZEN_GROUPS,
    KeyInfo,
    LoraStats,
    classify,
    summarize_groups,
    summarize_lora,
    world_size_from_chunks,
)
from ...core.primerl_state import scheduler_class
from ...io.inputs import as_input
from ..primerl.optimizers import trained_params
from .layout import METADATA_NAME
from .model import TensorEntry
from .reader import DcpCheckpoint

__all__ = ["CheckpointSummary", "summarize"]


@dataclass(frozen=True)
class CheckpointSummary:
    path: str
    keys: int
    infos: tuple  # core.keys.KeyInfo per key
    groups: dict  # group -> GroupStats
    lora: LoraStats
    world_size: int | None
    step: object
    lr: object
    initial_lr: object
    scheduler: dict
    progress: dict
    frozen_bytes: int
    unique_bytes: int
    metadata_bytes: int
    data_files: tuple[str, ...]
    experts: dict | None = (
        None  # MoE (prime-format grouped experts): layers, experts per layer, expert blocks
    )
    full_finetune: bool = False  # optimizer state for base weights: every parameter trained, no LoRA

    @property
    def frozen_fraction(self) -> float:
        total = self.frozen_bytes + self.unique_bytes
        return self.frozen_bytes / total if total else 0.0


def summarize(ckpt: DcpCheckpoint) -> CheckpointSummary:
    infos = [classify(k, e.path) for k, e in ckpt.entries.items()]
    stored = {k: e.stored_bytes for k, e in ckpt.entries.items()}
    payload = {k: e.nbytes for k, e in ckpt.entries.items()}
    tensors = {k: e for k, e in ckpt.entries.items() if isinstance(e, TensorEntry)}
    shapes = {k: e.shape for k, e in tensors.items()}
    groups = summarize_groups(infos, stored, payload)
    lora = summarize_lora(infos, shapes, payload)
    sharded = [len(e.chunks) for e in ckpt.tensor_entries() if e.shape and e.shape[0] > 1]
    sched = _schedule(ckpt, infos)
    progress = {i.field: ckpt.read_object(i.key) for i in infos if i.group == "progress"}
    base_params = {i.key.removeprefix("app.model.") for i in infos if i.group == "base"}
    trained = trained_params(ckpt)  # state, or a stateless optimizer's param groups
    # frozen: base weights without optimizer state (a full fine-tune's base weights are trained, not frozen)
    frozen = sum(
        stored[i.key]
        for i in infos
        if i.group in FROZEN_GROUPS and i.key.removeprefix("app.model.") not in trained
    )
    return CheckpointSummary(
        path=str(ckpt.dir),
        keys=len(infos),
        infos=tuple(infos),
        groups=groups,
        lora=lora,
        world_size=world_size_from_chunks(sharded),
        step=progress.get("step"),
        lr=_value(ckpt, infos, "param_groups", "lr", 0),
        initial_lr=_value(ckpt, infos, "param_groups", "initial_lr", 0),
        scheduler=sched,
        progress=progress,
        frozen_bytes=frozen,
        unique_bytes=sum(st.bytes for st in groups.values()) - frozen,
        metadata_bytes=(as_input(ckpt.dir) / METADATA_NAME).stat().st_size,
        data_files=tuple(ckpt.data_files()),
        experts=_experts(infos, tensors, lora),
        full_finetune=bool(base_params & trained) and lora.modules == 0,
    )


def _value(
    ckpt: DcpCheckpoint,
    infos: list[KeyInfo],
    group: str,
    field: str,
    idx: int | None = None,
    sub: int | None = None,
) -> object:
    """The byte item of the first key of `group` with this field (group index, sub-scheduler), read; None
    where there is none."""
    for i in infos:
        if (
            i.group == group
            and i.field == field
            and (idx is None or i.group_index == idx)
            and i.sub_scheduler == sub
        ):
            return ckpt.read_object(i.key)
    return None


def _schedule(ckpt: DcpCheckpoint, infos: list[KeyInfo]) -> dict:
    """The lr scheduler: its class (each of a SequentialLR's, and its milestones) and its state's fields."""
    sched_fields = {i.field for i in infos if i.group == "scheduler" and i.sub_scheduler is None and i.field}
    subs = sorted({i.sub_scheduler for i in infos if i.group == "scheduler" and i.sub_scheduler is not None})
    sched: dict[str, object] = {"type": scheduler_class(sched_fields)}
    if subs:
        sched["schedulers"] = [
            scheduler_class(
                {i.field for i in infos if i.group == "scheduler" and i.sub_scheduler == j and i.field}
            )
            for j in subs
        ]
        sched["milestones"] = _value(ckpt, infos, "scheduler", "_milestones")
    for f in ("last_epoch", "_last_lr", "base_lrs"):
        if f in sched_fields:
            sched[f] = _value(ckpt, infos, "scheduler", f)
    return sched


def _experts(infos: list[KeyInfo], tensors: dict[str, TensorEntry], lora: LoraStats) -> dict | None:
    """A MoE's grouped experts (prime's format): layers, experts per layer, expert blocks; None without."""
    stacked = [i for i in infos if i.group == "base" and i.stacked]
    if not stacked:
        return None
    per_layer = sorted({tensors[i.key].shape[0] for i in stacked})
    blocks = sorted({len([c for c in tensors[i.key].chunks if c.numel]) for i in stacked})
    return {
        "layers": len({i.module for i in stacked}),
        "experts": per_layer[0] if len(per_layer) == 1 else per_layer,
        "expert_blocks": blocks[0] if len(blocks) == 1 else blocks,
        "lora_expert_modules": lora.expert_modules,
    }
