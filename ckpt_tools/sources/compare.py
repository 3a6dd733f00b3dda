"""Two sources' tensors compared bitwise, chunk by chunk (memory: a few chunks per thread).

Every tensor pair is walked in the chunks the statistics fold: blocks of `block_bytes`, each cut into
STATS_BLOCK_ELEMS elements (`block_chunks`; each a dot product: other boundaries change the sums' low bits).
Each block of each side is read in one piece straight into this thread's reused buffers (`Scratch`: no
allocation, so no page faults, per block), then walked chunk by chunk (slices of it: no copy). Same dtype:
raw byte comparison first (memcmp, no decoding); a chunk that differs gets its statistics from the bytes
just read. An identical tensor is read once and costs no arithmetic; in a tensor where only some blocks
differ, the identical ones are read again from BASE alone for what they add (||W0||^2), which a LoRA merge
never causes (its delta reaches every row of a targeted tensor).
Different dtypes: both sides upcast exactly to a common dtype (bf16/fp16/fp32 -> fp32, anything
with fp64 -> fp64) and compared bitwise there, with the statistics of W - W0 (`DeltaStats`, fp64
accumulation). `ckpt diff-vs-base` reports these per tensor (its worker threads compare tensors in
parallel); `ckpt doctor` asks `identical` of a weights export and its base.

A chunk's statistics (bf16/fp16/fp32/fp64) are one pass of `delta_stats_c` (delta_stats_c.c, built
at install where a C compiler is at hand) with the GIL released; `reference_chunk_stats` is their
definition in torch and runs for any other dtype or without the extension (same counts and max |d|;
sums equal but for their last bits). The sums are order-sensitive in their low bits: the chunk
boundaries and the kernel's fixed order inside a chunk are part of the result, so 1 worker and N
give the same report.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, TypeVar, overload

import torch

from ..core.accel import load_accelerator
from ..core.dtypes import torch_dtype
from ..core.errors import FormatError
from ..core.tensor_math import LoraFactors64, MergeCheck, check_merged_values_bounded
from ..formats.handle import Source, TensorFacts

# Not built (no C compiler at install) or CKPT_TOOLS_PURE_PYTHON=1: the torch statistics alone.
accelerator = load_accelerator("ckpt_tools.sources.delta_stats_c")

__all__ = [
    "BLOCK_BYTES",
    "STATS_BLOCK_ELEMS",
    "ChunkStats",
    "DeltaStats",
    "FactorBuffers",
    "Scratch",
    "accelerator",
    "bits",
    "block_chunks",
    "block_ranges",
    "block_stats",
    "chunk_map",
    "chunk_scratch_bytes",
    "chunk_stats",
    "common_dtype",
    "factor_buffers",
    "identical",
    "identical_chunk_stats",
    "read_block",
    "read_chunk",
    "reference_chunk_stats",
    "shared_names",
    "stream_stats",
    "tensors_identical",
    "value_check_chunk",
]

# Elements per block of a tensor's statistics (`block_bytes` of the wider side), each folded in
# STATS_BLOCK_ELEMS pieces: 2 MB of fp64 per temporary, which stays in the CPU's cache.
BLOCK_BYTES = 4 * 2**20
STATS_BLOCK_ELEMS = 2**18


def common_dtype(a, b) -> torch.dtype:
    """The dtype both sides upcast to exactly (every fp8/fp16/bf16 value is an fp32 value)."""
    a, b = torch_dtype(a), torch_dtype(b)
    if a == b:
        return a
    if a.is_floating_point and b.is_floating_point:
        return torch.float64 if torch.float64 in (a, b) else torch.float32
    return torch.float64


def bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view of the same bytes (bitwise comparison: -0.0 != 0.0, NaN payloads count)."""
    size = t.element_size()
    if t.dtype in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
        return t
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size])


class Scratch(threading.local):
    """This thread's reusable buffers, by role: grown to the largest chunk asked for, then reused, so
    a chunk costs no allocation (a fresh 2 MB tensor per chunk was page faults and most of the time:
    profiled 5x slower). Each thread of a worker pool has its own; they go when the thread ends."""

    def __init__(self) -> None:
        self._tensors: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self._bytes: dict[str, tuple[memoryview, torch.Tensor]] = {}

    def tensor(self, role: str, n: int, dtype: torch.dtype) -> torch.Tensor:
        """The first `n` elements of this thread's `role` buffer (starting at its aligned start)."""
        t = self._tensors.get((role, dtype))
        if t is None or t.numel() < n:
            t = self._tensors[(role, dtype)] = torch.empty(max(n, 1), dtype=dtype)
        return t[:n]

    def bytes(self, role: str, n: int) -> tuple[memoryview, torch.Tensor]:
        """The first `n` bytes of this thread's `role` buffer, as a memoryview and a uint8 tensor over them:
        one
        buffer per role, grown to the largest block asked for (so what a worker holds is counted by
        `chunk_scratch_bytes`, whatever the mix of block sizes it is handed)."""
        got = self._bytes.get(role)
        if got is None or len(got[0]) < n:
            buf = bytearray(max(n, 1))
            got = self._bytes[role] = (memoryview(buf), torch.frombuffer(buf, dtype=torch.uint8))
        return got[0][:n], got[1][:n]


_SCRATCH = Scratch()
T = TypeVar("T")
R = TypeVar("R")


@dataclass
class ChunkStats:
    """One chunk's share of the statistics (computed on any thread; folded in chunk order)."""

    numel: int
    changed: int = 0
    base_sq: float = 0.0
    delta_sq: float = 0.0
    nonfinite: int = 0
    max_abs: float = 0.0
    finite: bool = True  # W and W0 hold no inf/nan in this chunk


# The one-pass C kernels (`delta_stats_c.c`, built at install where a C compiler is at hand) for
# these dtypes; any other dtype, and every chunk where the extension is absent, takes the torch path
# (`reference_chunk_stats`), which defines the statistics.
_DTYPE_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2, torch.float64: 3}


def _c_code(*ts: torch.Tensor) -> int | None:
    """The C kernels' dtype code for these chunks (one dtype, contiguous), or None: the torch path."""
    if accelerator is None:
        return None
    code = _DTYPE_CODES.get(ts[0].dtype)
    if code is None or any(t.dtype != ts[0].dtype or not t.is_contiguous() for t in ts):
        return None
    return code


def _raw(t: torch.Tensor):
    return t.view(torch.uint8).numpy()  # (a buffer over the tensor's bytes: no copy)


def _base_sq(w0: torch.Tensor) -> float:
    code = _c_code(w0)
    if code is not None and accelerator is not None:
        got = accelerator.base_sq(_raw(w0), code)
        if got is not None:
            return got
    return _reference_base_sq(w0)


def _reference_base_sq(w0: torch.Tensor) -> float:
    b64 = _SCRATCH.tensor("b64", w0.numel(), torch.float64)
    b64.copy_(w0)
    return float(torch.dot(b64, b64)) if b64.numel() else 0.0


def identical_chunk_stats(w0: torch.Tensor) -> ChunkStats:
    """A chunk known to be bitwise equal on both sides: all it adds is ||W0||^2 (BASE alone)."""
    base_sq = _base_sq(w0)
    return ChunkStats(w0.numel(), base_sq=base_sq, finite=math.isfinite(base_sq))


def chunk_stats(w: torch.Tensor, w0: torch.Tensor) -> ChunkStats:
    """One chunk pair (same dtype, 1-D, at most STATS_BLOCK_ELEMS), in one pass of the C kernel where
    it covers the dtype, else `reference_chunk_stats` (same counts and max_abs; the sums in their
    own fixed order, equal to torch.dot's but for the last bits)."""
    code = _c_code(w, w0)
    if code is not None and accelerator is not None:
        got = accelerator.chunk_stats(_raw(w), _raw(w0), code)
        if got is not None:
            return ChunkStats(w.numel(), *got)
    return reference_chunk_stats(w, w0)


def _chunk_stats_read(xw, xb, w: torch.Tensor, w0: torch.Tensor) -> ChunkStats:
    """`chunk_stats` of two chunks `read_chunk` / `read_block` read, their bytes (a bytearray, or a slice
    of a block's memoryview) handed to the C kernel as they are (a view of each tensor as a buffer is 2 us
    with the GIL held: a third of the kernel's own
    time at 16 threads)."""
    code = _DTYPE_CODES.get(w.dtype) if accelerator is not None else None
    if code is not None and accelerator is not None:
        got = accelerator.chunk_stats(xw, xb, code)
        if got is not None:
            return ChunkStats(w.numel(), *got)
    return chunk_stats(w, w0)


def _identical_chunk_stats_read(xb, w0: torch.Tensor) -> ChunkStats:
    """`identical_chunk_stats` of a chunk `read_chunk` read (its bytearray as it is)."""
    code = _DTYPE_CODES.get(w0.dtype) if accelerator is not None else None
    base_sq = accelerator.base_sq(xb, code) if code is not None and accelerator is not None else None
    if base_sq is None:
        return identical_chunk_stats(w0)
    return ChunkStats(w0.numel(), base_sq=base_sq, finite=math.isfinite(base_sq))


def reference_chunk_stats(w: torch.Tensor, w0: torch.Tensor) -> ChunkStats:
    """The definition, in torch (one dot product per sum): `changed` counts the elements whose bits
    differ; d = fp64(w) - fp64(w0); where inf/nan appear, `nonfinite` counts the non-finite d and the
    sums and max |d| are over the finite values only (`finite` False)."""
    n = w.numel()
    xor = _SCRATCH.tensor("xor", n, bits(w).dtype)
    torch.bitwise_xor(bits(w), bits(w0), out=xor)  # (10x faster than != and a bool count)
    n_changed = int(torch.count_nonzero(xor))
    base_sq = _reference_base_sq(w0)
    if not n_changed:
        return ChunkStats(n, base_sq=base_sq, finite=math.isfinite(base_sq))
    b64 = _SCRATCH.tensor("b64", n, torch.float64)  # W0 in fp64, as _reference_base_sq left it
    d = _SCRATCH.tensor("d64", n, torch.float64)
    d.copy_(w)
    d.sub_(b64)
    delta_sq = float(torch.dot(d, d))
    nonfinite, finite = 0, math.isfinite(delta_sq) and math.isfinite(base_sq)
    if not finite:
        # rare: inf/nan somewhere; count them and keep the statistics over the finite part
        isfin = torch.isfinite(d)
        nonfinite = int(d.numel() - torch.count_nonzero(isfin))
        d = torch.where(isfin, d, torch.zeros((), dtype=torch.float64))
        delta_sq = float(torch.dot(d, d))
        b64 = w0.to(torch.float64)
        b64 = torch.where(torch.isfinite(b64), b64, torch.zeros((), dtype=torch.float64))
        base_sq = float(torch.dot(b64, b64))
    lo, hi = torch.aminmax(d)
    return ChunkStats(n, n_changed, base_sq, delta_sq, nonfinite, max(abs(float(lo)), abs(float(hi))), finite)


@dataclass
class DeltaStats:
    """Streaming statistics of W - W0 (fp64 accumulation)."""

    numel: int = 0
    changed: int = 0  # elements whose bits differ (in the common dtype)
    max_abs: float = 0.0
    sum_sq_delta: float = 0.0
    sum_sq_base: float = 0.0
    nonfinite: int = 0  # elements where W or W0 is inf/nan

    def add(self, w: torch.Tensor, w0: torch.Tensor) -> None:
        """Fold in one block pair (same dtype, 1-D), STATS_BLOCK_ELEMS at a time: the fp64 temporaries
        then stay in the CPU's cache (profiled at 0.6B: 87% of diff-vs-base was these passes over 4 MB
        blocks, memory-bound; 2-3x faster in cache-sized pieces)."""
        for s in range(0, w.numel(), STATS_BLOCK_ELEMS):
            self.fold(chunk_stats(w[s : s + STATS_BLOCK_ELEMS], w0[s : s + STATS_BLOCK_ELEMS]))
        if not w.numel():
            self.fold(chunk_stats(w, w0))

    def fold(self, c: ChunkStats) -> None:
        """Add the next chunk's share (in chunk order: the float sums' low bits depend on it)."""
        self.numel += c.numel
        if not c.changed:
            self.sum_sq_base += c.base_sq
            return
        self.changed += c.changed
        self.nonfinite += c.nonfinite
        self.max_abs = max(self.max_abs, c.max_abs)
        self.sum_sq_base += c.base_sq
        self.sum_sq_delta += c.delta_sq

    @property
    def rel_fro(self) -> float:
        """||W - W0||_F / ||W0||_F (inf when W0 is all zero and W is not)."""
        if self.sum_sq_delta == 0.0:
            return 0.0
        if self.sum_sq_base == 0.0:
            return math.inf
        return math.sqrt(self.sum_sq_delta) / math.sqrt(self.sum_sq_base)


def block_ranges(total: int, block: int) -> list[tuple[int, int]]:
    return [(s, min(block, total - s)) for s in range(0, total, block)]


def chunk_scratch_bytes(*itemsizes: int, block_bytes: int = BLOCK_BYTES) -> int:
    """What one thread's `Scratch` holds at most for chunked comparisons of sides with these item sizes: a
    block of each side's bytes (`read_block`); for sides of two dtypes, a chunk of each upcast; without the C
    kernels, the torch statistics' temporaries too (the xors, two fp64 chunks)."""
    widest = max(itemsizes, default=8)
    held = (block_bytes // widest) * sum(itemsizes)
    if len(set(itemsizes)) > 1:
        held += STATS_BLOCK_ELEMS * 2 * 8
    if accelerator is None:
        held += STATS_BLOCK_ELEMS * (3 * sum(itemsizes) + 2 * widest + 16)
    return held


def read_chunk(
    src: Source, facts: TensorFacts, start: int, n: int, role: str
) -> tuple[memoryview, torch.Tensor]:
    """Elements [start, start + n) of `facts.name` into this thread's `role` buffer: (its bytes, a tensor of
    the tensor's dtype over them)."""
    nbytes = n * facts.itemsize
    raw, u8 = _SCRATCH.bytes(role, nbytes)
    if nbytes:
        src.read_span(facts.name, start * facts.itemsize, raw)
    return raw, u8.view(torch_dtype(facts.dtype))


class FactorBuffers(NamedTuple):
    """A tensor's factors and norms as byte buffers for the C kernel (made once per tensor: a view of a tensor
    as a buffer costs microseconds with the GIL held)."""

    left: Any
    right: Any
    left_norms: Any
    right_norms: Any
    rank: int


def factor_buffers(f: LoraFactors64) -> FactorBuffers:
    return FactorBuffers(
        _raw(f.left.reshape(-1)), _raw(f.right.reshape(-1)), _raw(f.left_norms), _raw(f.right_norms), f.rank
    )


def value_check_chunk(
    w: torch.Tensor,
    w0: torch.Tensor,
    prod: torch.Tensor,
    factors: LoraFactors64,
    r0: int,
    first: int,
    scale: float,
    *,
    w_raw=None,
    w0_raw=None,
    factors_raw: FactorBuffers | None = None,
) -> MergeCheck:
    """`core.tensor_math.check_merged_values`' counts for one chunk: elements [first, first + n) of the row
    block
    that starts at row `r0` (`prod`: the chunk's fp64 P, by any kernel), in one pass of the C kernel with the
    GIL
    released (the bound and margin computed per element, never stored) where it covers W's dtype (bf16, fp32),
    else `check_merged_values_bounded` in torch. `w_raw`/`w0_raw`: the chunks' bytes as `read_block` read them
    (a view of a tensor as a buffer costs microseconds with the GIL held)."""
    n, cols = w.numel(), int(factors.right_norms.numel())
    code_w = _DTYPE_CODES.get(w.dtype) if accelerator is not None else None
    code_w0 = _DTYPE_CODES.get(w0.dtype)
    if (
        code_w in (0, 2)
        and code_w0 is not None
        and accelerator is not None
        and prod.dtype == torch.float64
        and prod.is_contiguous()
    ):
        lo, hi = (r0 + first // cols, r0 + (first + n + cols - 1) // cols) if n else (r0, r0)
        fb = factors_raw or factor_buffers(factors)
        got = accelerator.value_check(
            w_raw if w_raw is not None else _raw(w),
            code_w,
            w0_raw if w0_raw is not None else _raw(w0),
            code_w0,
            _raw(prod),
            fb.left_norms[8 * lo : 8 * hi],
            fb.right_norms,
            fb.left[8 * fb.rank * lo : 8 * fb.rank * hi],
            fb.right,
            first % cols,
            cols,
            float(scale),
            factors.gamma,
        )
        if got is not None:
            return MergeCheck(*got)
    found = MergeCheck()  # (the torch path over statistics chunks: its fp64 temporaries stay a few MiB)
    for s, k in block_chunks(n) or [(0, 0)]:
        found.fold(
            check_merged_values_bounded(
                w[s : s + k], w0[s : s + k], prod[s : s + k], factors, r0, first + s, scale
            )
        )
    return found


@overload
def block_stats(
    xw, xb, w: torch.Tensor, w0: torch.Tensor, ct: torch.dtype, *, skip_identical: Literal[False] = ...
) -> list[ChunkStats]: ...


@overload
def block_stats(
    xw, xb, w: torch.Tensor, w0: torch.Tensor, ct: torch.dtype, *, skip_identical: bool
) -> list[ChunkStats] | None: ...


def block_stats(
    xw, xb, w: torch.Tensor, w0: torch.Tensor, ct: torch.dtype, *, skip_identical: bool = False
) -> list[ChunkStats] | None:
    """The statistics chunks of one block (`block_chunks`) as `read_block` read both sides (bytes and
    tensors),
    in one C call where both sides share a dtype it covers (the Python around each call holds the GIL: one per
    block, not two or three per chunk), else chunk by chunk in the common dtype `ct`. `skip_identical` (same
    dtypes): each chunk's bytes compared first; an identical chunk adds only ||W0||^2, and a block whose
    chunks are all identical gives None."""
    code = _DTYPE_CODES.get(w.dtype) if accelerator is not None and w.dtype == w0.dtype else None
    if code is not None and accelerator is not None:
        got = accelerator.block_stats(xw, xb, code, STATS_BLOCK_ELEMS, skip_identical)
        if got is True:
            return None
        if got is not None:
            return [
                ChunkStats(min(STATS_BLOCK_ELEMS, w.numel() - i * STATS_BLOCK_ELEMS), *c)
                for i, c in enumerate(got)
            ]
    chunks = block_chunks(w.numel())
    if skip_identical and w.dtype == w0.dtype:
        size = w.element_size()
        same = [_same_bytes(xw[s * size : (s + k) * size], xb[s * size : (s + k) * size]) for s, k in chunks]
        if all(same):
            return None
        return [
            _identical_chunk_stats_read(xb[s * size : (s + k) * size], w0[s : s + k])
            if eq
            else _chunk_stats_read(
                xw[s * size : (s + k) * size], xb[s * size : (s + k) * size], w[s : s + k], w0[s : s + k]
            )
            for (s, k), eq in zip(chunks, same)
        ]
    return [chunk_stats(_as(w[s : s + k], ct, "w_ct"), _as(w0[s : s + k], ct, "w0_ct")) for s, k in chunks]


def _same_bytes(a: memoryview, b: memoryview) -> bool:
    # the C one is a memcmp with the GIL released; without it, bytes == bytes is one memcmp (memoryview ==
    # compares item by item: 60x slower) after a copy of each side
    return accelerator.same_bytes(a, b) if accelerator is not None else a.tobytes() == b.tobytes()


def _as(t: torch.Tensor, dtype: torch.dtype, role: str) -> torch.Tensor:
    if t.dtype == dtype:
        return t
    out = _SCRATCH.tensor(role, t.numel(), dtype)
    out.copy_(t)  # exact upcast
    return out


def chunk_map(pool: Executor | None, fn: Callable[[T], R], items: Sequence[T]) -> list[R]:
    """[fn(x) for x in items], on `pool`'s threads when given (in order; chunks are independent). With
    a pool, every chunk runs there, so only the pool's threads hold chunk buffers."""
    if pool is None:
        return [fn(x) for x in items]
    return list(pool.map(fn, items))


def read_block(
    src: Source, facts: TensorFacts, start: int, n: int, role: str
) -> tuple[memoryview, torch.Tensor]:
    """`read_chunk` of a whole block (one read per side, however many statistics chunks it holds: the
    Python around each read holds the GIL, and at 16 threads reads of 512 KB serialized on it), as a
    memoryview (sliced per chunk at no cost) and a tensor of the tensor's dtype."""
    return read_chunk(src, facts, start, n, role)


def block_chunks(n: int) -> list[tuple[int, int]]:
    """The statistics chunks of a block of `n` elements, relative to its start, in the order they fold."""
    return [(s, min(STATS_BLOCK_ELEMS, n - s)) for s in range(0, n, STATS_BLOCK_ELEMS)]


def stream_stats(
    weights: Source,
    base: Source,
    name: str,
    block_bytes: int = BLOCK_BYTES,
    *,
    skip_identical: bool = False,
    pool: Executor | None = None,
) -> DeltaStats:
    """The statistics of W - W0 for tensor `name` of both sources (same shape), in the common dtype,
    its blocks on `pool`'s threads, each side of a block read in one piece and folded in its statistics
    chunks (`stat_chunks`). `skip_identical` (same dtypes): each chunk's raw bytes compared first; an
    identical pair's statistics are only its numel; a block with a differing chunk folds its equal ones
    from BASE's bytes at hand, and if only some blocks differ, the equal blocks are read again from BASE
    alone for what they add (||W0||^2), which a LoRA merge never causes (its delta reaches every row)."""
    fw, fb = weights.facts(name), base.facts(name)
    ct = common_dtype(fw.dtype, fb.dtype)
    blocks = block_ranges(fw.numel, max(1, block_bytes // max(fw.itemsize, fb.itemsize)))
    if skip_identical and fw.dtype == fb.dtype:
        size = fw.itemsize

        def raw(block: tuple[int, int]) -> list[ChunkStats] | None:
            xw, w = read_block(weights, fw, *block, "w")
            xb, w0 = read_block(base, fb, *block, "w0")
            return block_stats(xw, xb, w, w0, ct, skip_identical=True)

        def base_only(block: tuple[int, int]) -> list[ChunkStats]:
            xb, w0 = read_block(base, fb, *block, "w0")
            return [
                _identical_chunk_stats_read(xb[s * size : (s + k) * size], w0[s : s + k])
                for s, k in block_chunks(block[1])
            ]

        found = chunk_map(pool, raw, blocks)
        same = [i for i, part in enumerate(found) if part is None]
        if len(same) == len(blocks):
            return DeltaStats(numel=fw.numel)
        for i, part in zip(same, chunk_map(pool, base_only, [blocks[i] for i in same])):
            found[i] = part
        parts = [part for part in found if part is not None]  # (every block's, now)
    else:

        def upcast(block: tuple[int, int]) -> list[ChunkStats]:
            xw, w_all = read_block(weights, fw, *block, "w")
            xb, w0_all = read_block(base, fb, *block, "w0")
            return block_stats(xw, xb, w_all, w0_all, ct)

        parts = chunk_map(pool, upcast, blocks)
    st = DeltaStats()
    for part in parts:
        for c in part:
            st.fold(c)
    return st


def shared_names(weights: Source, base: Source) -> list[str]:
    """The tensor names both sources hold, sorted; none is an error (BASE is not this model's base)."""
    wk, bk = set(weights.names()), set(base.names())
    shared = sorted(wk & bk)
    if not shared:
        raise FormatError(
            f"WEIGHTS ({len(wk)} tensors) and BASE ({len(bk)} tensors) share no tensor name",
            path=weights.path,
            hint=f"is {base.path} the base model of this checkpoint? "
            f"e.g. WEIGHTS has {sorted(wk)[:2]}, BASE has {sorted(bk)[:2]}",
        )
    return shared


def tensors_identical(
    weights: Source, base: Source, name: str, block_bytes: int = BLOCK_BYTES
) -> tuple[bool, DeltaStats | None]:
    """(bitwise identical after exact upcast?, the statistics). Shapes that differ are not identical
    (no statistics). One read of each side (`stream_stats(skip_identical=True)`)."""
    fw, fb = weights.facts(name), base.facts(name)
    if fw.shape != fb.shape:
        return False, None
    st = stream_stats(weights, base, name, block_bytes, skip_identical=True)
    return not st.changed, st


def identical(weights: Source, base: Source, block_bytes: int = BLOCK_BYTES) -> bool:
    """Every shared tensor bitwise identical (after exact upcast): the weights are the base."""
    for name in shared_names(weights, base):
        same, _st = tensors_identical(weights, base, name, block_bytes)
        weights.release()
        base.release()
        if not same:
            return False
    return True
