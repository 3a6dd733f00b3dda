"""A tensor of a source, cast and hashed in row blocks (memory: one block): the sha256 the slim
manifest records for a frozen tensor is that of the base's tensor upcast to the checkpoint's dtype."""
from __future__ import annotations

import hashlib
import math

import torch

from ..core.crc import crc32
from ..core.dtypes import itemsize, torch_dtype
from ..core.keys import expert_names, is_stacked_pattern
from ..core.tensor_math import sha256_of_tensor, update_hash
from ..formats.slim.partition import map_to_base
from .base import Source
from ..formats.hf_dir.model_dir import HFModelDir

__all__ = ["BASE_BLOCK_BYTES", "read_rows_as", "read_rows_into", "read_as", "upcast_sha256", "base_hash_check", "upcast_sha256_crc32s",
           "base_crc_check"]

# Rows per block when a base tensor is streamed: bounded scratch whatever the tensor's size.
BASE_BLOCK_BYTES = 64 << 20


def _stacked(src: Source, pattern: str, start: int, count: int) -> torch.Tensor:
    """Rows [start, start + count) of a prime-format stacked expert tensor: those experts' HF weights."""
    names = expert_names(pattern, start, count)
    if not names:
        f = src.facts(expert_names(pattern, 0, 1)[0])
        return torch.empty((0,) + tuple(f.shape), dtype=torch_dtype(f.dtype))
    return torch.stack([src.read_tensor(n) for n in names])


def _experts_in(src: Source, pattern: str) -> int:
    n = 0
    while expert_names(pattern, n, 1)[0] in src:
        n += 1
    return n


def read_rows_as(src: Source, name: str, dtype, start: int, count: int) -> torch.Tensor:
    """Rows [start, start + count) of `name`, cast to `dtype` (an exact upcast of a bf16 base to fp32).
    A `stacked_hf_pattern` name reads experts start.. of the base's per-expert weights, stacked."""
    t = _stacked(src, name, start, count) if is_stacked_pattern(name) else src.read_rows(name, start, count)
    dt = torch_dtype(dtype)
    return t if t.dtype == dt else t.to(dt)


def read_rows_into(src: Source, name: str, start: int, count: int, out) -> None:
    """Rows [start, start + count) of `name` as stored, into the caller's buffer `out` (exactly their bytes;
    no allocation: what a pipeline of pooled buffers reads into). A `stacked_hf_pattern` name reads experts
    start.. of the base's per-expert weights, one after another."""
    view = memoryview(out).cast("B")
    if not is_stacked_pattern(name):
        src.read_into(name, view, rows=(start, count))
        return
    at = 0
    for expert in expert_names(name, start, count):
        n = src.facts(expert).nbytes
        src.read_into(expert, view[at:at + n])
        at += n


def read_as(src: Source, name: str, dtype) -> torch.Tensor:
    """The whole tensor `name`, cast to `dtype`."""
    t = _stacked(src, name, 0, _experts_in(src, name)) if is_stacked_pattern(name) else src.read_tensor(name)
    dt = torch_dtype(dtype)
    return t if t.dtype == dt else t.to(dt)


def upcast_sha256(src: Source, name: str, dtype) -> str:
    """sha256 of tensor `name` cast to `dtype`, streamed in row blocks (memory: one block)."""
    if is_stacked_pattern(name):   # row-major bytes of the stack = the experts' bytes in order
        h = hashlib.sha256()
        for e in range(_experts_in(src, name)):
            update_hash(h, read_rows_as(src, name, dtype, e, 1))
        return h.hexdigest()
    info = src.facts(name)
    if not info.shape or info.shape[0] == 0:
        return sha256_of_tensor(read_as(src, name, dtype))
    n = info.shape[0]
    row_out = max(1, (info.numel // n) * itemsize(dtype))
    step = max(1, BASE_BLOCK_BYTES // row_out)
    h = hashlib.sha256()
    for s in range(0, n, step):
        update_hash(h, read_rows_as(src, name, dtype, s, min(step, n - s)))
    return h.hexdigest()


def base_hash_check(base: HFModelDir, dropped):
    """What a slim's dropped tensors are proven against: for each, (its base tensor's name, the sha256 of
    that tensor upcast to its dtype). Names and shapes are checked for every tensor at once first: one
    error listing every problem, before a single tensor byte is read."""
    mapping = map_to_base(dropped, {n: base.facts(n).shape for n in base.names()}, base.config, base.path)

    def base_hash(d) -> tuple[str, str]:
        return mapping[d.key], upcast_sha256(base, mapping[d.key], d.dtype)
    return base_hash


def upcast_sha256_crc32s(src: Source, name: str, dtype, row_blocks, shape=None) -> tuple[str, list[int]]:
    """(sha256 of tensor `name` cast to `dtype`, the CRC-32 of each row block [start, start + count) of
    `row_blocks`, which tile its rows in order): one streamed pass over the base (memory: one block).
    `shape`: the tensor's (needed for a `stacked_hf_pattern` name, whose rows are experts)."""
    shape = tuple(shape) if shape is not None else tuple(src.facts(name).shape)
    row_out = max(1, (math.prod(shape[1:]) if shape else 1) * itemsize(dtype))
    step = max(1, BASE_BLOCK_BYTES // row_out)
    h, crcs = hashlib.sha256(), []
    for start, count in row_blocks:
        crc = 0
        for s in range(start, start + count, step):
            t = read_rows_as(src, name, dtype, s, min(step, start + count - s))
            if t.numel():
                b = memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
                h.update(b)
                crc = crc32(b, crc)
                del b
            del t   # before the next block is read: one block in memory, not two
        crcs.append(crc)
    return h.hexdigest(), crcs


def base_crc_check(base: HFModelDir, dropped):
    """As `base_hash_check`, for a checkpoint whose dropped tensors are not read (a remote one): for each,
    given the row blocks of its chunks, (its base tensor's name, the sha256 of the upcast, the CRC-32 of
    each block's upcast bytes), to compare with the CRC-32 the checkpoint's items store."""
    mapping = map_to_base(dropped, {n: base.facts(n).shape for n in base.names()}, base.config, base.path)

    def base_crcs(d, row_blocks) -> tuple[str, str, list[int]]:
        sha, crcs = upcast_sha256_crc32s(base, mapping[d.key], d.dtype, row_blocks, d.shape)
        return mapping[d.key], sha, crcs
    return base_crcs
