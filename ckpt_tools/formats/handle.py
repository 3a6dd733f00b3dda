"""The one way tensors are read: a `Source` of named tensors, whatever holds them. Each format's one
handle implements it (`formats.hf_dir.model_dir.HFModelDir`, the DCP checkpoint's views
`formats.dcp.views`, a single weights file `sources.files`), so an op asks a source for what it needs
(the capabilities below) and never which class it is.

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
Reads are thread-safe and do not serialize: workers may read one source in parallel. A remote input
(`io.remote`) plugs in under `inputs.OpenFiles`: the same handle, the same preads, served by range requests.

Capabilities an op may ask any source (defaults here; a kind overrides what it can do):
`ref(name)` the name a plan records for the tensor (a DCP key), `masters` (the tensors are a training
checkpoint's fp32 masters), `config` (the model's config.json, or None), `config_dir` (a dir of the
model's config.json and tokenizer that a checkpoint carries, or None), `file_of(name)` (the one file
holding the tensor's bytes, or None), `quantized` (block-FP8 weights, and `read_codes` / `read_scales` of
them), `copy_range(name)` (the tensor's stored bytes as one checked range of an open file, for a verbatim
copy by the kernel, or None), `disk_order()`, `open_all()`.

    src = open_weights("Qwen/Qwen3-8B")          # or a directory, or .../step_N/trainer
    for name in src.names():
        facts = src.facts(name)                 # TensorFacts(name, dtype, shape)
        src.read_into(name, buf, rows=(0, 16))  # the first 16 rows' bytes, no decoding
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Protocol, TypeGuard

from ..core.dtypes import ShapedBytes, torch_dtype
from ..core.errors import FormatError, UsageError
from ..core.lora_math import check_alpha, lora_scale
from ..io.pread import RangeReader

if TYPE_CHECKING:  # annotations only: torch is imported where tensors are built
    import torch

    from .dcp.reader import DcpCheckpoint
    from .peft.adapter import PeftAdapter

__all__ = [
    "AlphaOrigin",
    "ByteRange",
    "Extent",
    "LoraModule",
    "LoraSource",
    "RawTensor",
    "Source",
    "TensorFacts",
    "is_torch_tensor",
    "tensor_bytes",
]


@dataclass(frozen=True)
class TensorFacts(ShapedBytes):
    name: str
    dtype: str  # torch dtype name, e.g. "bfloat16"
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


@dataclass(frozen=True)
class ByteRange:
    """A tensor's stored bytes, verbatim: [offset, offset + nbytes) of the open file `fd` (owned by the
    source, already checked to lie inside the file), which is `path`."""

    fd: int | RangeReader  # a remote object's range is fetched (io.copy.copy_range)
    offset: int
    nbytes: int
    path: Path


def is_torch_tensor(x) -> TypeGuard[torch.Tensor]:
    """Whether `x` is a torch.Tensor, without importing torch (no tensor exists before torch is imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


_UINTS = {1: "uint8", 2: "uint16", 4: "uint32", 8: "uint64"}


@dataclass(frozen=True)
class RawTensor(ShapedBytes):
    """A tensor as its dtype's name, its shape and its row-major little-endian bytes: what the commands that
    only move or cast bytes (extract-adapter) read and write without torch."""

    dtype: str
    shape: tuple[int, ...]
    data: bytearray | memoryview | bytes

    def __post_init__(self) -> None:
        if len(memoryview(self.data).cast("B")) != self.nbytes:
            raise ValueError(
                f"{len(memoryview(self.data).cast('B'))} bytes for a {self.dtype} {list(self.shape)}"
            )

    @classmethod
    def of(cls, value) -> RawTensor:
        """`value` itself, or a CPU torch.Tensor's bytes (copied, row-major)."""
        if isinstance(value, RawTensor):
            return value
        if not is_torch_tensor(value):
            raise TypeError(f"not a tensor: {type(value).__name__}")
        from ..core.dtypes import dtype_name

        t = value.detach().cpu().contiguous()
        return cls(dtype_name(t.dtype), tuple(t.shape), bytearray(tensor_bytes(t.reshape(-1))))

    def bits(self):
        """The values' bits as a numpy array of this shape (unsigned ints of the item size): for placing
        values,
        never arithmetic."""
        import numpy as np  # lazy, as torch: the metadata side imports neither

        if self.itemsize not in _UINTS:
            raise FormatError(f"no bit view of {self.dtype}")
        return np.frombuffer(self.data, dtype=_UINTS[self.itemsize]).reshape(self.shape)

    @classmethod
    def from_bits(cls, dtype: str, bits) -> RawTensor:
        return cls(dtype, tuple(bits.shape), bytearray(bits.tobytes()))

    def cast(self, dtype: str) -> RawTensor:
        """The values cast to `dtype` exactly as torch casts them (`core.casts`; a pair it does not cast
        exactly goes through torch)."""
        from ..core.casts import cast_into, exact_cast
        from ..core.dtypes import dtype_name, itemsize

        dtype = dtype_name(dtype)
        if dtype == self.dtype:
            return self
        out = bytearray(self.numel * itemsize(dtype))
        if not out:
            pass
        elif exact_cast(self.dtype, dtype):
            cast_into(self.dtype, dtype, self.data, out)
        else:
            import torch

            t = torch.frombuffer(bytearray(self.data), dtype=torch_dtype(self.dtype)).to(torch_dtype(dtype))
            out[:] = tensor_bytes(t)
        return RawTensor(dtype, self.shape, out)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (no copy)."""
    import torch  # lazy: metadata commands (inspect, verify) import this module without torch (2-3 s)

    return t.reshape(-1).view(torch.uint8).numpy().data


class Source:
    """Named tensors, read lazily. A kind fills `_facts`; implements `_extents`, `_pread`, `_read_whole`."""

    kind: str = ""
    path: Path
    label: str
    masters: bool = False  # the tensors are a training checkpoint's fp32 masters (a DCP base)
    config: dict | None = None  # the model's config.json, where the source has one (an HF dir)
    # a dir of config.json (+ tokenizer) a checkpoint carries (verl's huggingface/)
    config_dir: Path | None = None
    # block-FP8 weights (read as float32 of fl32(q * scale)) -> their weight_scale_inv; their stored codes and
    # scales by `read_codes` / `read_scales` (an FP8 HF dir: `formats.hf_dir.fp8`)
    quantized: Mapping[str, str] = MappingProxyType({})

    def __init__(self) -> None:
        self._facts: dict[str, TensorFacts] = {}
        self._extent_cache: dict[str, list[Extent] | None] = {}
        self._whole: tuple[str, torch.Tensor] | None = None  # the tensor of an extent-less layout, read once
        self._lock = threading.Lock()
        self.bytes_read = 0  # tensor bytes delivered, for reports and tests

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
        return {
            "kind": self.kind,
            "path": str(self.path),
            "label": self.label,
            "tensors": len(self._facts),
            "bytes": self.total_bytes,
            "dtypes": dtypes,
        }

    # ---------------------------------------------------------------- capabilities
    def ref(self, name: str) -> str:
        """What a plan records as the tensor's source: its name (a DCP view: the DCP key, `key[e]`)."""
        self.facts(name)
        return name

    def file_of(self, name: str) -> str | None:
        """The one file (relative to `path`) that holds all of tensor `name`'s bytes, or None."""
        return None

    def copy_range(self, name: str) -> ByteRange | None:
        """Tensor `name`'s stored bytes as one range of one open file, checked to lie inside it, for a
        verbatim copy by the kernel; None when the bytes are not stored that way (read and write them)."""
        return None

    def disk_order(self) -> list[str]:
        """Tensor names in the order their bytes lie on disk (sequential reads); by name by default."""
        return self.names()

    def non_weight_files(self) -> list[Path]:
        """The files beside the weights that a model derived from this one carries (config, tokenizer, ...):
        an HF dir's; none by default."""
        return []

    def skipped_entries(self) -> list[str]:
        """Entries beside the weights that are neither weights nor carried, for callers to report: an HF
        dir's; none by default."""
        return []

    def read_codes(self, name: str, start: int, count: int) -> torch.Tensor:
        """A block-FP8 weight's stored codes, rows [start, start + count), as uint8 (names in `quantized`)."""
        raise FormatError("not a block-FP8 weight", path=self.path, key=name)

    def read_scales(self, name: str) -> torch.Tensor:
        """A block-FP8 weight's weight_scale_inv grid, float32 (names in `quantized`)."""
        raise FormatError("not a block-FP8 weight", path=self.path, key=name)

    def open_all(self) -> None:
        """Open every file now (before worker threads start reading); nothing by default."""

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
            raise ValueError(
                f"byte range [{start}, {start + n}) outside tensor {name} of {info.nbytes} bytes"
            )
        if n == 0:
            return
        self._count(n)
        extents = self.extents(name)
        if extents is None:
            with self._lock:
                if self._whole is None or self._whole[0] != name:
                    self._whole = None  # drop the previous tensor before reading the next
                    self._whole = (name, self._read_whole(name).contiguous())
                whole = self._whole[1]
            out[:] = tensor_bytes(whole)[start : start + n]
            return
        end = start + n
        for e in extents:
            lo, hi = max(start, e.start), min(end, e.start + e.nbytes)
            if lo < hi:
                view = out[lo - start : hi - start]
                self._pread(e.file, e.offset + (lo - e.start), view, name)
                if e.record is not None:
                    self._check_piece(e, lo - e.start, view, name)

    def read_into(self, name: str, buffer, rows: tuple[int, int] | None = None) -> None:
        """Fill `buffer` (a contiguous CPU tensor, or anything a memoryview takes) with the stored bytes
        of rows [start, start + count) of tensor `name` (`rows=None`: all of it)."""
        import torch  # lazy: metadata commands (inspect, verify) import this module without torch (2-3 s)

        info = self.facts(name)
        mv = tensor_bytes(buffer) if isinstance(buffer, torch.Tensor) else memoryview(buffer).cast("B")
        start = 0 if rows is None else rows[0] * info.row_bytes
        self.read_span(name, start, mv)

    def read_rows(self, name: str, start: int, count: int) -> torch.Tensor:
        """Rows [start, start + count) of tensor `name`, a new tensor of its dtype."""
        import torch  # lazy: metadata commands (inspect, verify) import this module without torch (2-3 s)

        info = self.facts(name)
        t = torch.empty((count,) + tuple(info.shape[1:]), dtype=torch_dtype(info.dtype))
        if t.numel():
            self.read_into(name, t, rows=(start, count))
        return t

    def read_tensor(self, name: str) -> torch.Tensor:
        """The whole tensor, a new CPU tensor."""
        import torch  # lazy: metadata commands (inspect, verify) import this module without torch (2-3 s)

        info = self.facts(name)
        if self.extents(name) is None:  # assembled by the kind's own whole-tensor read
            t = self._read_whole(name)
            self._count(info.nbytes)
            return t
        t = torch.empty(info.shape, dtype=torch_dtype(info.dtype))
        if t.numel():
            self.read_into(name, t)
        return t

    def read_elems(self, name: str, start: int, count: int) -> torch.Tensor:
        """Elements [start, start+count) of the flattened tensor, as a new 1-D tensor."""
        import torch  # lazy: metadata commands (inspect, verify) import this module without torch (2-3 s)

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


@dataclass(frozen=True)
class LoraModule:
    module: str
    rank: int
    scale: float
    a_key: str
    b_key: str
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]
    fan_in_fan_out: bool = False
    a_dtype: str = "float32"
    expert: int | None = None  # grouped-expert LoRA: the keys are stacked [E, r, in] / [E, out, r]; this
    #                                 module's factors are their dim-0 slice `expert` (shapes are the slice's)
    part: str | None = None  # a fused PEFT expert LoRA (`formats.peft.experts`): the keys are the fused
    #                                 parameter's; this module is projection `part` of expert `expert` in it

    @property
    def weight_name(self) -> str:
        return f"{self.module}.weight"

    def factor_ref(self, ab: str) -> str:
        """Where factor A or B is read from: its key, or `key[e]` for an expert's slice of a stacked one."""
        key = self.a_key if ab == "A" else self.b_key
        if self.expert is None:
            return key
        return f"{key}[{self.expert}]" + (f".{self.part}" if self.part else "")


class AlphaOrigin(Protocol):
    """Where a checkpoint's LoRA alpha was found (`formats.primerl.alpha.AlphaResolution`, verl's)."""

    @property
    def config_path(self) -> Path | None:  # the run config it was read from, if any
        ...


class LoraSource:
    """LoRA factors by module (`modules`), read one module at a time: the LoRA view of a PEFT adapter
    (`formats.peft.lora`) or of a DCP checkpoint (`formats.dcp.lora`), or one computed (`sources.delta`).
    `ckpt` / `adapter`: the format's handle the factors are read from (a `DcpCheckpoint`, a `PeftAdapter`),
    None where there is none of that kind: what an op asks instead of the class."""

    kind: str
    path: Path
    ckpt: DcpCheckpoint | None = None
    adapter: PeftAdapter | None = None
    modules: dict[str, LoraModule]
    full_tensors: dict[str, str]  # modules_to_save replacements: HF name -> source key
    alpha_source: str
    alpha: float | None
    resolution: AlphaOrigin | None = None  # a checkpoint's LoRA: how its alpha was found (its run config)
    use_rslora: bool = False
    warnings: tuple[str, ...] = ()
    slot: int | None = None
    resident_bytes: int = 0  # bytes held for the whole run (a .bin adapter is loaded whole)
    config_path: Path  # what errors about its configuration name (adapter_config.json, .metadata)
    weights_path: Path  # what errors about its weights name

    def read_key(self, key: str) -> torch.Tensor:
        raise NotImplementedError

    def key_facts(self, key: str) -> TensorFacts:
        raise NotImplementedError

    def read_ref(self, ref: str) -> torch.Tensor:
        """The tensor a `LoraModule.factor_ref` names."""
        refs = getattr(self, "_ref_map", None)
        if refs is None:  # built once: the refs do not change with --alpha
            refs = self._ref_map = {
                m.factor_ref(ab): (name, ab) for name, m in self.modules.items() for ab in "AB"
            }
        m, ab = refs[ref]
        return self.read_factor(m, ab)

    def read_factor(self, module: str, ab: str) -> torch.Tensor:
        """The stored A or B of one module (its expert's slice for grouped-expert LoRA), stored dtype."""
        m = self.modules[module]
        return self.read_key(m.a_key if ab == "A" else m.b_key)

    def read_pair(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 (A, B) of one module."""
        import torch  # lazy: metadata commands (inspect, verify) import this module without torch (2-3 s)

        return self.read_factor(module, "A").to(torch.float32), self.read_factor(module, "B").to(
            torch.float32
        )

    def read_full(self, name: str) -> torch.Tensor:
        return self.read_key(self.full_tensors[name])

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def describe(self) -> dict:
        ranks = sorted({m.rank for m in self.modules.values()})
        scales = sorted({m.scale for m in self.modules.values()})
        return {
            "kind": self.kind,
            "path": str(self.path),
            "modules": len(self.modules),
            "rank": ranks[0] if len(ranks) == 1 else ranks,
            "alpha": self.alpha,
            "scale": scales[0] if len(scales) == 1 else scales,
            "alpha_source": self.alpha_source,
            "modules_to_save": sorted(self.full_tensors),
        }

    def with_alpha(self, alpha: float) -> None:
        """An explicit --alpha over the adapter's own (its ranks kept)."""
        self.alpha = check_alpha(alpha, "--alpha", error=UsageError)
        self.alpha_source = "--alpha (overrides adapter_config.json)"
        self.modules = {
            k: replace(m, scale=lora_scale(alpha, m.rank, self.use_rslora)) for k, m in self.modules.items()
        }
