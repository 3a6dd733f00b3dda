"""Where a verl FSDP checkpoint lies, from names on disk (pure of reads).

verl's `FSDPCheckpointManager.save_checkpoint` (verl/utils/checkpoint/fsdp_checkpoint_manager.py, 0.9.1)
writes,
into the role's dir (`<default_local_dir>/global_step_N/actor`, `ray_trainer._save_checkpoint`):
`model_world_size_{W}_rank_{R}.pt`, `optim_world_size_{W}_rank_{R}.pt`,
`extra_state_world_size_{W}_rank_{R}.pt`
(each rank's `torch.save`), and on rank 0 `fsdp_config.json` (`FSDP_version`, `world_size`), `huggingface/`
(the
model's config; the tokenizer where the run has one) and, for a LoRA run, `lora_train_meta.json` (`r`,
`lora_alpha`, `task_type`). The trainer writes `latest_checkpointed_iteration.txt` beside the global_step
dirs.
"""

from __future__ import annotations

import re
from pathlib import Path

from ...core.errors import UsageError
from ...io.inputs import as_input

__all__ = [
    "FSDP_CONFIG",
    "HF_DIR",
    "LORA_META",
    "TRACKER",
    "actor_dirs",
    "is_actor_dir",
    "is_verl_path",
    "rank_file",
    "resolve_actor_dir",
    "step_of",
]

FSDP_CONFIG = "fsdp_config.json"
LORA_META = "lora_train_meta.json"
HF_DIR = "huggingface"
TRACKER = "latest_checkpointed_iteration.txt"
ROLES = ("actor", "critic")
_STEP = re.compile(r"global_step_(\d+)")
_RANK = re.compile(r"model_world_size_(\d+)_rank_(\d+)\.pt")


def rank_file(kind: str, world: int, rank: int) -> str:
    """`model`, `optim` or `extra_state` file of `rank`."""
    return f"{kind}_world_size_{world}_rank_{rank}.pt"


def is_actor_dir(p: Path) -> bool:
    """A role dir verl's manager wrote: its fsdp_config.json, or a rank file."""
    if not p.is_dir():
        return False
    return (p / FSDP_CONFIG).is_file() or any(_RANK.fullmatch(c.name) for c in p.iterdir())


def step_of(p: Path) -> int | None:
    m = _STEP.fullmatch(p.name)
    return int(m.group(1)) if m and p.is_dir() else None


def actor_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, actor dir) of every `global_step_N/actor` under a run dir, by step."""
    found = [(step_of(c), c / "actor") for c in root.iterdir() if step_of(c) is not None]
    return sorted((s, d) for s, d in found if s is not None and is_actor_dir(d))


def is_verl_path(p: Path) -> bool:
    """A verl role dir, a `global_step_N` dir holding one, or a run dir of `global_step_N` dirs."""
    p = as_input(p)
    if not p.is_dir():
        return False
    if is_actor_dir(p) or (step_of(p) is not None and any(is_actor_dir(p / r) for r in ROLES)):
        return True
    return (p / TRACKER).is_file() or bool(actor_dirs(p))


def resolve_actor_dir(path: str | Path) -> Path:
    """The role dir of a verl path: itself, `global_step_N/actor`, or a run dir's latest step's actor (the one
    its tracker names, else the highest)."""
    p = as_input(path)
    if is_actor_dir(p):
        return p
    if step_of(p) is not None:
        for role in ROLES:
            if is_actor_dir(p / role):
                return p / role
    steps = actor_dirs(p) if p.is_dir() else []
    if not steps:
        raise UsageError(
            "not a verl checkpoint: no fsdp_config.json or model_world_size_W_rank_R.pt here, and no "
            "global_step_N/actor below",
            path=p,
            hint="pass the run dir (trainer.default_local_dir), a global_step_N dir or its actor dir",
        )
    return steps[-1][1]
