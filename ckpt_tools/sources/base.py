"""The one way tensors are read: a `Source` of named tensors, whatever holds them.

A source opens headers only (safetensors headers, `.metadata`, `adapter_config.json`) and says, per
tensor, its `TensorFacts` (name, dtype by name, shape). Bytes are then read one tensor at a time, or a
range of one: `read_into(name, buffer, rows=...)` fills the caller's buffer (a pooled one, in the
merge pipeline) with the rows' bytes straight from the page cache; `read_span` any byte range of the
row-major contents (a comparison streams two tensors block by block); `read_rows` / `read_tensor` /
`read_elems` return new tensors. Memory is bounded by what the caller asks for.

Where the bytes are is each kind's business (`_extents`): an HF shard holds a tensor as one extent;
a DCP checkpoint's FSDP2 row-block chunks map to contiguous extents (each item's zip layout decoded
once, by `formats.dcp.item`); any other layout has no extents and is read whole once (memory: that
tensor), then served from that copy. Every pread goes through `inputs.OpenFiles` (the one pread).
Reads are thread-safe and do not serialize: workers may read one source in parallel.

    src = open_weights("Qwen/Qwen3-8B")          # or a directory, or .../step_N/trainer
    for name in src.names():
        facts = src.facts(name)                 # TensorFacts(name, dtype, shape)
        src.read_into(name, buf, rows=(0, 16))  # the first 16 rows' bytes, no decoding
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

from ..core.dtypes import ShapedBytes, torch_dtype
from ..core.errors import FormatError

if TYPE_CHECKING:   # annotations only: torch is imported where tensors are built
    import torch

__all__ = ["TensorFacts", "Extent", "Source", "tensor_bytes"]


@dataclass(frozen=True)
class TensorFacts(ShapedBytes):
    name: str
    dtype: str                 # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]

    @property
    def row_bytes(self) -> int:
        """Bytes of one dim-0 row (the whole tensor for a scalar)."""
        return (math.prod(self.shape[1:]) if self.shape else 1) * self.itemsize


@dataclass(frozen=True)
class Extent:
    """Bytes [start, start + nbytes) of a tensor's row-major contents live at `offset` of `file`.
    Where a checksum covers them (a DCP item's payload record: `record` = (its offset in the file, its
    size, its stored CRC-32)), the extent's first byte is byte `record_pos` of that record."""
    start: int
    nbytes: int
    file: str
    offset: int
    record: tuple[int, int, int] | None = None
    record_pos: int = 0


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (no copy)."""
    import torch   # lazy: metadata commands (inspect, verify) import this module without torch (2-3 s)
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class Source:
    """Named tensors, read lazily. A kind fills `_facts` and implements `_extents`, `_pread`, `_read_whole`."""

    kind: str = ""
    path: Path
    label: str

    def __init__(self) -> None:
        self._facts: dict[str, TensorFacts] = {}
        self._extent_cache: dict[str, list[Extent] | None] = {}
        self._whole: tuple[str, torch.Tensor] | None = None   # the tensor of an extent-less layout, read once
        self._lock = threading.Lock()
        self.bytes_read = 0   # tensor bytes delivered, for reports and tests

    # ---------------------------------------------------------------- facts
    def names(self) -> list[str]:
        """Tensor names, sorted."""
        return sorted(self._facts)

    def __contains__(self, name: object) -> bool:
        return name in self._facts

    def __len__(self) -> int:
        return len(self._facts)

    def facts(self, name: str) -> TensorFacts:
        try:
            return self._facts[name]
        except KeyError:
            raise FormatError("no such tensor", path=self.path, key=name) from None

    @property
    def total_bytes(self) -> int:
        return sum(f.nbytes for f in self._facts.values())

    def describe(self) -> dict:
        dtypes = sorted({f.dtype for f in self._facts.values()})
        return {"kind": self.kind, "path": str(self.path), "label": self.label, "tensors": len(self._facts),
                "bytes": self.total_bytes, "dtypes": dtypes}

    # ---------------------------------------------------------------- kinds implement
    def _extents(self, name: str) -> list[Extent] | None:
        """Where the tensor's bytes lie, or None when only a whole-tensor read can assemble it."""
        raise NotImplementedError

    def _pread(self, file: str, offset: int, buf: memoryview, name: str) -> None:
        raise NotImplementedError

    def _read_whole(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def _check_piece(self, e: Extent, pos: int, data, name: str) -> None:
        """Bytes [pos, pos + len(data)) of extent `e` were just read: a kind with checksums checks them
        (the DCP sources: each item's zip CRC-32, once all its pieces are in)."""

    # ---------------------------------------------------------------- bytes
    def extents(self, name: str) -> list[Extent] | None:
        with self._lock:
            if name not in self._extent_cache:
                self._extent_cache[name] = self._extents(name)
            return self._extent_cache[name]

    def _count(self, n: int) -> None:
        with self._lock:
            self.bytes_read += n

    def read_span(self, name: str, start: int, out) -> None:
        """Bytes [start, start + len(out)) of tensor `name`'s row-major contents (little-endian), no
        decoding, into the caller's buffer (anything a memoryview takes)."""
        out = memoryview(out).cast("B")
        info = self.facts(name)
        n = len(out)
        if start < 0 or start + n > info.nbytes:
            raise ValueError(f"byte range [{start}, {start + n}) outside tensor {name} of {info.nbytes} bytes")
        if n == 0:
            return
        self._count(n)
        extents = self.extents(name)
        if extents is None:
            with self._lock:
                if self._whole is None or self._whole[0] != name:
                    self._whole = None   # drop the previous tensor before reading the next
                    self._whole = (name, self._read_whole(name).contiguous())
                whole = self._whole[1]
            out[:] = tensor_bytes(whole)[start:start + n]
            return
        end = start + n
        for e in extents:
            lo, hi = max(start, e.start), min(end, e.start + e.nbytes)
            if lo < hi:
                view = out[lo - start:hi - start]
                self._pread(e.file, e.offset + (lo - e.start), view, name)
                if e.record is not None:
                    self._check_piece(e, lo - e.start, view, name)

    def read_into(self, name: str, buffer, rows: tuple[int, int] | None = None) -> None:
        """Fill `buffer` (a contiguous CPU tensor, or anything a memoryview takes) with the stored bytes
        of rows [start, start + count) of tensor `name` (`rows=None`: all of it)."""
        import torch   # lazy: metadata commands (inspect, verify) import this module without torch (2-3 s)
        info = self.facts(name)
        mv = tensor_bytes(buffer) if isinstance(buffer, torch.Tensor) else memoryview(buffer).cast("B")
        start = 0 if rows is None else rows[0] * info.row_bytes
        self.read_span(name, start, mv)

    def read_rows(self, name: str, start: int, count: int) -> torch.Tensor:
        """Rows [start, start + count) of tensor `name`, a new tensor of its dtype."""
        import torch   # lazy: metadata commands (inspect, verify) import this module without torch (2-3 s)
        info = self.facts(name)
        t = torch.empty((count,) + tuple(info.shape[1:]), dtype=torch_dtype(info.dtype))
        if t.numel():
            self.read_into(name, t, rows=(start, count))
        return t

    def read_tensor(self, name: str) -> torch.Tensor:
        """The whole tensor, a new CPU tensor."""
        import torch   # lazy: metadata commands (inspect, verify) import this module without torch (2-3 s)
        info = self.facts(name)
        if self.extents(name) is None:     # assembled by the kind's own whole-tensor read
            t = self._read_whole(name)
            self._count(info.nbytes)
            return t
        t = torch.empty(info.shape, dtype=torch_dtype(info.dtype))
        if t.numel():
            self.read_into(name, t)
        return t

    def read_elems(self, name: str, start: int, count: int) -> torch.Tensor:
        """Elements [start, start+count) of the flattened tensor, as a new 1-D tensor."""
        import torch   # lazy: metadata commands (inspect, verify) import this module without torch (2-3 s)
        info = self.facts(name)
        t = torch.empty(count, dtype=torch_dtype(info.dtype))
        if count:
            self.read_span(name, start * info.itemsize, tensor_bytes(t))
        return t

    def release(self) -> None:
        """Forget the tensor held for an extent-less read (call when moving to the next tensor)."""
        with self._lock:
            self._whole = None

    def close(self) -> None:
        self.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
