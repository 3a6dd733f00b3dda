"""How a checkpoint splits into what a slim keeps and what it drops (from metadata alone), and the base
model a slim's dropped tensors are rebuilt from."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from ...core.errors import FormatError, UsageError
from ...core.keys import (
    FROZEN_GROUPS,
    KeyInfo,
    classify,
    expert_names,
    is_stacked_pattern,
    stacked_hf_pattern,
    world_size_from_chunks,
)
from ...core.tied import tied_source, ties_by_default
from ...io.inputs import MAX_JSON_BYTES, as_input, lexists, read_input
from ..dcp.layout import METADATA_NAME, extra_entries
from ..dcp.model import TensorEntry
from ..dcp.reader import DcpCheckpoint
from ..primerl.optimizers import trained_params
from ..safetensors.header import LEN_BYTES
from .manifest import SLIM_MANIFEST, ChunkLayout, DroppedTensor

__all__ = ["KeptItem", "SlimLayout", "base_identity", "map_to_base", "partition"]


@dataclass(frozen=True)
class KeptItem:
    key: str
    path: tuple
    kind: str  # "tensor" | "bytes"
    file: str
    offset: int
    length: int
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    chunk_offsets: tuple[int, ...] | None = None
    chunk_sizes: tuple[int, ...] | None = None


@dataclass(frozen=True)
class SlimLayout:
    source: str
    world_size: int | None
    data_files: tuple[str, ...]  # the source's data files (output file i <- source file i)
    kept: tuple[KeptItem, ...]  # in source (file, offset) order: sequential reads
    dropped: tuple[DroppedTensor, ...]  # sorted by key
    extra_files: tuple[str, ...]  # other entries of the checkpoint dir, copied (dataloader/)
    kept_bytes: int  # stored bytes of the kept items (what is written)
    dropped_bytes: int  # stored bytes of the dropped items
    dropped_tensor_bytes: int  # payload bytes hashed
    source_bytes: int


def partition(ckpt: DcpCheckpoint) -> SlimLayout:
    """What a slim of `ckpt` keeps and drops, from metadata alone. Dropped = the `base` group (frozen fp32
    masters, HF names) minus any param that has optimizer state."""
    if (ckpt.dir / SLIM_MANIFEST).exists():
        raise UsageError(
            "is already a slim checkpoint",
            path=ckpt.dir / SLIM_MANIFEST,
            hint="nothing left to drop; `ckpt rehydrate` it to get the full checkpoint back",
        )
    trainable = trained_params(ckpt)  # state, or a stateless optimizer's param groups (SignSGD)
    kept: list[KeptItem] = []
    dropped: list[DroppedTensor] = []
    for key, e in ckpt.entries.items():
        info = classify(key, e.path)
        if not isinstance(e, TensorEntry):
            kept.append(KeptItem(key, tuple(e.path), "bytes", e.file, e.offset, e.length))
        elif info.group in FROZEN_GROUPS and e.path[2] not in trainable:
            dropped.append(_dropped_tensor(key, e, info))
        else:
            kept.extend(
                KeptItem(
                    key,
                    tuple(e.path),
                    "tensor",
                    c.file,
                    c.offset,
                    c.length,
                    e.dtype,
                    tuple(e.shape),
                    c.offsets,
                    c.sizes,
                )
                for c in e.chunks
            )
    if not dropped:
        raise UsageError(
            "has no frozen base weights to drop (every app.model.* tensor was trained: it has optimizer "
            "state or its optimizer's param groups list it)",
            path=ckpt.dir,
            hint="is this already a slim or adapter-only checkpoint? `ckpt inspect` shows its groups",
        )
    kept.sort(key=lambda k: (k.file, k.offset))
    dropped.sort(key=lambda d: d.key)
    files = ckpt.data_files()
    sharded = [len(e.chunks) for e in ckpt.tensor_entries() if e.shape and e.shape[0] > 1]
    source_bytes = sum(ckpt.file_size(f) for f in files) + (ckpt.dir / METADATA_NAME).stat().st_size
    return SlimLayout(
        source=str(ckpt.dir),
        world_size=world_size_from_chunks(sharded),
        data_files=tuple(files),
        kept=tuple(kept),
        dropped=tuple(dropped),
        extra_files=tuple(extra_entries(ckpt.dir, set(files), exclude={SLIM_MANIFEST})),
        kept_bytes=sum(k.length for k in kept),
        dropped_bytes=sum(ckpt.entries[d.key].stored_bytes for d in dropped),
        dropped_tensor_bytes=sum(d.nbytes for d in dropped),
        source_bytes=source_bytes,
    )


def _dropped_tensor(key: str, e: TensorEntry, info: KeyInfo) -> DroppedTensor:
    """A frozen base tensor as the manifest records it (its HF name, or its experts' pattern)."""
    hf_name = stacked_hf_pattern(info) if info.stacked else info.hf_name
    assert hf_name is not None  # classify names every base key
    return DroppedTensor(
        key=key,
        path=tuple(e.path),
        hf_name=hf_name,
        shape=tuple(e.shape),
        dtype=e.dtype,
        chunks=tuple(ChunkLayout(c.offsets, c.sizes, c.file) for c in e.chunks),
        nbytes=e.nbytes,
    )


def map_to_base(
    dropped, base_shapes: dict[str, tuple], base_config: dict | None, where: Path
) -> dict[str, str]:
    """Map every dropped key to the base tensor it is an upcast of (its own HF name, or the input
    embedding for a tied model's `lm_head.weight`), checking names and shapes. Raises one error listing
    every problem (before a single tensor byte is read)."""
    tied = ties_by_default(base_config)
    keys = set(base_shapes)
    mapping, problems = {}, []
    for d in dropped:
        if is_stacked_pattern(
            d.hf_name
        ):  # prime-format stacked experts: the base's per-expert weights, stacked
            names = expert_names(d.hf_name, 0, d.shape[0] if d.shape else 0)
            bad = [n for n in names if tuple(base_shapes.get(n, ())) != tuple(d.shape[1:])]
            if not names or bad:
                problems.append(
                    f"{d.hf_name}: the base lacks per-expert weight(s) of shape {list(d.shape[1:])}: "
                    + ", ".join(bad[:3])
                )
                continue
            mapping[d.key] = d.hf_name
            continue
        src = tied_source(d.hf_name, keys, tied)
        if src is None:
            problems.append(f"{d.hf_name}: not in the base model")
            continue
        shape = tuple(base_shapes[src])
        if shape != tuple(d.shape):
            problems.append(f"{d.hf_name}: base has shape {list(shape)}, checkpoint {list(d.shape)}")
            continue
        mapping[d.key] = src
    if problems:
        shown = "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise FormatError(
            f"the base model does not match the checkpoint's frozen weights "
            f"({len(problems)} of {len(dropped)} tensors): {shown}",
            path=where,
            hint="pass the exact base model the run trained on (same architecture and size)",
        )
    return mapping


def base_identity(hf, name: str) -> dict:
    """Who the base model is: the name given, its path, sha256 of config.json and of every weight
    file's raw safetensors header (cheap: headers only, yet it changes with any re-export)."""
    cfg = hf.path / "config.json"
    h = hashlib.sha256()
    for fname, header in sorted(hf.headers.items()):
        h.update(fname.encode() + b"\0")
        # the raw header read_header validated
        h.update(hf.files.read(fname, LEN_BYTES, header.header_bytes))
    cfg_bytes = (
        read_input(cfg, root=hf.path, what="config.json", max_bytes=MAX_JSON_BYTES) if lexists(cfg) else None
    )
    return {
        "name": name,
        "path": str(as_input(hf.path).resolve()),
        "config_sha256": hashlib.sha256(cfg_bytes).hexdigest() if cfg_bytes is not None else None,
        "headers_sha256": h.hexdigest(),
        "tensors": len(hf.keys()),
        "tie_word_embeddings": ties_by_default(hf.config),
    }
