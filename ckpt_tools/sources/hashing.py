"""A tensor of a source, cast and hashed in row blocks (memory: one block): the sha256 the slim
manifest records for a frozen tensor is that of the base's tensor upcast to the checkpoint's dtype.

The base check (`base_crc_check`, `base_hash_check`) reads the base's raw bytes by range and casts them
with numpy (`core.casts`: a bf16 -> fp32 upcast is exact), in pieces small enough that each is hashed and
CRC'd while still in cache; no torch (a pair of dtypes numpy does not cast exactly goes through torch).
Every step releases the GIL (preadv, numpy, hashlib, zlib/ISA-L), so tensors are checked on parallel
threads; a tensor too big for one thread's share also splits its CRC-32s over row ranges, joined with
`core.crc.crc32_combine`, while its sha256 (serial by nature) runs in order on the calling thread.
"""

from __future__ import annotations

import hashlib
import math
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from ..core.casts import cast_into, exact_cast
from ..core.crc import crc32, crc32_combine
from ..core.dtypes import dtype_name, itemsize, torch_dtype
from ..core.errors import FormatError
from ..core.keys import expert_names, is_stacked_pattern
from ..formats.handle import Source
from ..formats.slim.partition import map_to_base

if TYPE_CHECKING:  # annotations only: torch is imported where tensors are built
    import torch

    from ..formats.hf_dir.model_dir import HFModelDir

__all__ = [
    "BASE_BLOCK_BYTES",
    "PIECE_VALUES",
    "READ_BLOCK_BYTES",
    "base_crc_check",
    "base_hash_check",
    "read_as",
    "read_rows_as",
    "read_rows_into",
    "upcast_sha256",
    "upcast_sha256_crc32s",
]

# Rows per block when a base tensor is streamed: bounded scratch whatever the tensor's size.
BASE_BLOCK_BYTES = 64 << 20
# The base check's reads (bytes of the base's dtype per pread) and its cast pieces (values cast, then hashed
# and CRC'd while in cache): one thread holds READ_BLOCK_BYTES + 4 * PIECE_VALUES bytes.
READ_BLOCK_BYTES = 16 << 20
PIECE_VALUES = 1 << 18


def _stacked(src: Source, pattern: str, start: int, count: int) -> torch.Tensor:
    """Rows [start, start + count) of a prime-format stacked expert tensor: those experts' HF weights."""
    import torch  # lazy: the base check below needs none

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
    dt = torch_dtype(dtype)  # (imports torch)
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
        src.read_into(expert, view[at : at + n])
        at += n


def read_as(src: Source, name: str, dtype) -> torch.Tensor:
    """The whole tensor `name`, cast to `dtype`."""
    t = _stacked(src, name, 0, _experts_in(src, name)) if is_stacked_pattern(name) else src.read_tensor(name)
    dt = torch_dtype(dtype)
    return t if t.dtype == dt else t.to(dt)


class _BaseRows:
    """Rows of a base tensor as the raw bytes of its own dtype, read by range (no decoding): a tensor's rows,
    or a `stacked_hf_pattern` name's experts (one expert's weight per row), each read whole."""

    def __init__(self, src: Source, name: str, rows: int | None = None):
        self.src, self.name = src, name
        self.stacked = is_stacked_pattern(name)
        if self.stacked:
            self.rows = _experts_in(src, name) if rows is None else rows
            first = src.facts(expert_names(name, 0, 1)[0]) if self.rows else None
            self.dtype = first.dtype if first is not None else "float32"
            self.row_values = first.numel if first is not None else 0
            for n in expert_names(name, 0, self.rows):
                f = src.facts(n)
                if first is not None and (f.dtype != self.dtype or f.numel != self.row_values):
                    raise FormatError(
                        f"expert weight {n} is {f.dtype} {list(f.shape)}, expert 0's "
                        f"{first.dtype} {list(first.shape)}: they do not stack",
                        path=src.path,
                        key=n,
                    )
        else:
            f = src.facts(name)
            self.rows = (f.shape[0] if f.shape else 1) if rows is None else rows
            self.dtype = f.dtype
            self.row_values = math.prod(f.shape[1:]) if f.shape else 1
        self.row_bytes = self.row_values * itemsize(self.dtype)

    def read(self, start: int, count: int, out: memoryview) -> None:
        """The bytes of rows [start, start + count) into `out` (exactly that long)."""
        if not self.stacked:
            self.src.read_span(self.name, start * self.row_bytes, out)
            return
        for j, n in enumerate(expert_names(self.name, start, count)):
            self.src.read_span(n, 0, out[j * self.row_bytes : (j + 1) * self.row_bytes])


class _CastReader:
    """Rows of a base tensor cast to `dtype`, yielded piece by piece into this reader's own buffers (one read
    block of the base's bytes, one piece of the cast): a piece is valid until the next is asked for."""

    def __init__(self, rows: _BaseRows, dtype):
        self.rows, self.dtype = rows, dtype_name(dtype)
        self.out_row_bytes = rows.row_values * itemsize(self.dtype)
        self.read_rows = max(1, READ_BLOCK_BYTES // max(1, rows.row_bytes))
        self.raw = bytearray(min(self.read_rows, max(1, rows.rows)) * rows.row_bytes)
        self.same = rows.dtype == self.dtype
        self.exact = exact_cast(rows.dtype, self.dtype)
        self.out = bytearray(PIECE_VALUES * itemsize(self.dtype)) if not self.same and self.exact else None

    def pieces(self, start: int, count: int):
        raw = memoryview(self.raw)
        src_size, dst_size = itemsize(self.rows.dtype), itemsize(self.dtype)
        for s in range(start, start + count, self.read_rows):
            n = min(self.read_rows, start + count - s)
            block = raw[: n * self.rows.row_bytes]
            if not len(block):
                continue
            self.rows.read(s, n, block)
            if self.same:
                yield block
            elif self.out is not None:  # an exact cast (numpy's): made for it
                out = memoryview(self.out)
                values = len(block) // src_size
                for v in range(0, values, PIECE_VALUES):
                    m = min(PIECE_VALUES, values - v)
                    cast_into(
                        self.rows.dtype,
                        self.dtype,
                        block[v * src_size : (v + m) * src_size],
                        out[: m * dst_size],
                    )
                    yield out[: m * dst_size]
            else:  # a pair numpy does not cast exactly: torch's cast (imports torch)
                import torch

                t = torch.frombuffer(block, dtype=torch_dtype(self.rows.dtype)).to(torch_dtype(self.dtype))
                yield t.view(torch.uint8).numpy().data
                del t


def upcast_sha256(src: Source, name: str, dtype) -> str:
    """sha256 of tensor `name` cast to `dtype`, streamed by row blocks (memory: one block and one piece). A
    `stacked_hf_pattern` name: the experts the base holds, stacked (row-major bytes = the experts' in
    order)."""
    rows = _BaseRows(src, name)
    h = hashlib.sha256()
    for piece in _CastReader(rows, dtype).pieces(0, rows.rows):
        h.update(piece)
    return h.hexdigest()


def base_hash_check(base: HFModelDir, dropped):
    """What a slim's dropped tensors are proven against: for each, (its base tensor's name, the sha256 of
    that tensor upcast to its dtype). Names and shapes are checked for every tensor at once first: one
    error listing every problem, before a single tensor byte is read."""
    mapping = map_to_base(dropped, {n: base.facts(n).shape for n in base.names()}, base.config, base.path)

    def base_hash(d) -> tuple[str, str]:
        return mapping[d.key], upcast_sha256(base, mapping[d.key], d.dtype)

    return base_hash


def _crc_of_rows(rows: _BaseRows, dtype, start: int, count: int) -> int:
    crc = 0
    for piece in _CastReader(rows, dtype).pieces(start, count):
        crc = crc32(piece, crc)
    return crc


def upcast_sha256_crc32s(
    src: Source, name: str, dtype, row_blocks, shape=None, *, threads: int = 1
) -> tuple[str, list[int]]:
    """(sha256 of tensor `name` cast to `dtype`, the CRC-32 of each row block [start, start + count) of
    `row_blocks`, which tile its rows in order): one streamed pass over the base (memory: one read block and
    one cast piece). `shape`: the tensor's (needed for a `stacked_hf_pattern` name, whose rows are experts).
    `threads` > 1: the CRC-32s are computed by `threads - 1` more threads over row ranges of about
    READ_BLOCK_BYTES (each read and cast again: the page cache serves the second read), joined per block by
    `crc32_combine`, while this thread hashes the rows in order."""
    shape = tuple(shape) if shape is not None else None
    rows = _BaseRows(src, name, shape[0] if shape else (1 if shape == () else None))
    reader = _CastReader(rows, dtype)
    h, crcs = hashlib.sha256(), []
    if threads <= 1:
        for start, count in row_blocks:
            crc = 0
            for piece in reader.pieces(start, count):
                h.update(piece)
                crc = crc32(piece, crc)
            crcs.append(crc)
        return h.hexdigest(), crcs
    step = reader.read_rows
    ranges = [
        (i, s, min(step, start + count - s))
        for i, (start, count) in enumerate(row_blocks)
        for s in range(start, start + count, step)
    ]
    pool = ThreadPoolExecutor(max_workers=threads - 1, thread_name_prefix="ckpt-crc")
    try:
        futures = [pool.submit(_crc_of_rows, rows, dtype, s, n) for _i, s, n in ranges]
        for start, count in row_blocks:
            for piece in reader.pieces(start, count):
                h.update(piece)
        crcs = [0] * len(row_blocks)
        for (i, _s, n), fut in zip(ranges, futures):
            crcs[i] = crc32_combine(crcs[i], fut.result(), n * reader.out_row_bytes)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    return h.hexdigest(), crcs


def base_crc_check(base: HFModelDir, dropped):
    """As `base_hash_check`, for a checkpoint whose dropped tensors are not read (a remote one): for each,
    given the row blocks of its chunks, (its base tensor's name, the sha256 of the upcast, the CRC-32 of
    each block's upcast bytes), to compare with the CRC-32 the checkpoint's items store. `threads`: see
    `upcast_sha256_crc32s`."""
    mapping = map_to_base(dropped, {n: base.facts(n).shape for n in base.names()}, base.config, base.path)

    def base_crcs(d, row_blocks, threads: int = 1) -> tuple[str, str, list[int]]:
        sha, crcs = upcast_sha256_crc32s(base, mapping[d.key], d.dtype, row_blocks, d.shape, threads=threads)
        return mapping[d.key], sha, crcs

    return base_crcs
