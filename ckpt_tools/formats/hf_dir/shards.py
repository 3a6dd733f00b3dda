"""New shards of an HF model, planned (pure) and indexed: `plan_shards` reproduces huggingface_hub's
greedy split, so a model we write is sharded, named and indexed the way `save_pretrained` would."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ...core.errors import UsageError
from ...io.files import atomic_write_text
from ...io.inputs import as_input
from .names import INDEX_NAME, WEIGHTS_NAME

__all__ = ["ShardPlan", "ShardSpec", "index_json", "plan_shards", "shard_file_name", "write_index"]


@dataclass(frozen=True)
class ShardSpec:
    file_name: str
    tensor_names: tuple[str, ...]  # in plan (input) order
    nbytes: int  # tensor data bytes, header excluded


@dataclass(frozen=True)
class ShardPlan:
    shards: tuple[ShardSpec, ...]
    weight_map: dict[str, str]  # tensor name -> shard file name, in shard order
    total_size_bytes: int
    max_shard_bytes: int

    @property
    def is_sharded(self) -> bool:
        return len(self.shards) > 1

    def metadata(self) -> dict[str, int]:
        return {"total_size": self.total_size_bytes}


def shard_file_name(index: int, count: int) -> str:
    """`model-00001-of-00003.safetensors` (1-based), or `model.safetensors` when count == 1."""
    if count == 1:
        return WEIGHTS_NAME
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def plan_shards(entries: Iterable[tuple[str, int]], max_shard_bytes: int) -> ShardPlan:
    """Split (name, nbytes) entries into shards of at most `max_shard_bytes` of tensor data,
    exactly as huggingface_hub's `split_state_dict_into_shards_factory` does (what
    `save_pretrained` uses): walk in order; a tensor larger than the limit gets a shard of its
    own, appended when met; otherwise a tensor that would overflow the current shard closes it.
    No tensor is split, so a shard exceeds the limit only when one tensor does."""
    if not isinstance(max_shard_bytes, int) or isinstance(max_shard_bytes, bool) or max_shard_bytes <= 0:
        raise UsageError(f"max shard size must be a positive number of bytes, got {max_shard_bytes!r}")
    groups: list[list[tuple[str, int]]] = []
    current: list[tuple[str, int]] = []
    current_bytes = 0
    seen: set[str] = set()
    for name, nbytes in entries:
        if name in seen:
            raise UsageError(f"tensor {name!r} appears twice in the shard plan")
        if not isinstance(nbytes, int) or nbytes < 0:
            raise UsageError(f"tensor {name!r} has invalid size {nbytes!r}")
        seen.add(name)
        if nbytes > max_shard_bytes:
            groups.append([(name, nbytes)])
            continue
        if current_bytes + nbytes > max_shard_bytes:
            groups.append(current)
            current, current_bytes = [], 0
        current.append((name, nbytes))
        current_bytes += nbytes
    if current:
        groups.append(current)
    if not groups:
        raise UsageError("no tensors to write")
    shards = tuple(
        ShardSpec(shard_file_name(i + 1, len(groups)), tuple(n for n, _ in g), sum(b for _, b in g))
        for i, g in enumerate(groups)
    )
    weight_map = {n: s.file_name for s in shards for n in s.tensor_names}
    return ShardPlan(
        shards=shards,
        weight_map=weight_map,
        total_size_bytes=sum(s.nbytes for s in shards),
        max_shard_bytes=max_shard_bytes,
    )


def write_index(
    directory: str | os.PathLike, plan: ShardPlan, *, total_parameters: int | None = None
) -> Path | None:
    """Write `model.safetensors.index.json` for a sharded plan the way transformers does
    (indent 2, sorted keys, trailing newline; `total_parameters` included when given, as
    transformers >= 4.56 writes it). Returns its path; for a one-shard plan writes nothing and
    returns None (transformers writes no index then)."""
    if not plan.is_sharded:
        return None
    metadata: dict[str, int] = dict(plan.metadata())
    if total_parameters is not None:
        metadata["total_parameters"] = total_parameters
    path = as_input(directory) / INDEX_NAME
    atomic_write_text(path, index_json({"metadata": metadata, "weight_map": plan.weight_map}))
    return path


def index_json(index: dict) -> str:
    """`model.safetensors.index.json` text as transformers writes it: indent 2, sorted keys, a newline."""
    return json.dumps(index, indent=2, sort_keys=True) + "\n"
