"""One view of "a model's named weights" over an HF dir, a hub id in the local cache, or a DCP
checkpoint's base weights (`app.model.<HF name>`, fp32 in prime-rl).

Opening reads headers only (safetensors headers, `.metadata`). Tensors are then read one at a time,
whole (`read_tensor`) or as byte / element ranges of their row-major contents (`read_bytes`,
`read_elems`), so a comparison can stream two tensors block by block with memory bounded by the
block size. For DCP, FSDP2 row-block chunks map to contiguous byte ranges of the full tensor (each
item's zip layout is parsed once, from its tail); any other chunk layout falls back to reading the
whole tensor once (memory: that tensor).

    src = open_weights("Qwen/Qwen3-8B")          # or a directory, or .../step_N/trainer
    for name in src.keys():
        info = src.info(name)                   # WeightInfo(name, dtype, shape)
        raw = src.read_bytes(name, 0, 1 << 20)  # the first MiB of its bytes, no decoding
"""
from __future__ import annotations

import io
import math
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from .dcp.reader import METADATA_NAME, DcpCheckpoint, TensorEntry
from .dcp.zipitem import _Window, decode_tensor_pickle, parse_item
from .errors import FormatError, MissingFileError, TruncatedFileError, UnsafePickleError, UsageError
from .inputs import open_input
from .keys import classify

# Reads of at most this many bytes per syscall (Linux moves at most 0x7ffff000 per call).
_MAX_IO_BYTES = 0x7FFFF000


@dataclass(frozen=True)
class WeightInfo:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class _Extent:
    """Bytes [start, start+nbytes) of a tensor's row-major contents live at `offset` in `file`."""
    start: int
    nbytes: int
    file: str
    offset: int


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


class WeightsSource:
    """Named tensors, read lazily. Subclasses fill `_infos` and implement `_extents` / `_full`."""

    kind: str = ""
    path: Path
    label: str

    def __init__(self) -> None:
        self._infos: dict[str, WeightInfo] = {}
        self._layout_cache: tuple[str, list[_Extent] | None] | None = None
        self._full_cache: tuple[str, torch.Tensor] | None = None
        self.bytes_read = 0   # tensor bytes delivered (read_bytes / read_tensor), for reports and tests
        # one read at a time per source: callers may prefetch from a thread while consuming
        self._lock = threading.RLock()

    # ---------------------------------------------------------------- metadata
    def keys(self) -> list[str]:
        """Tensor names, sorted."""
        return sorted(self._infos)

    def __contains__(self, name: object) -> bool:
        return name in self._infos

    def __len__(self) -> int:
        return len(self._infos)

    def info(self, name: str) -> WeightInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise FormatError("no such tensor", path=self.path, key=name) from None

    @property
    def total_bytes(self) -> int:
        return sum(i.nbytes for i in self._infos.values())

    def describe(self) -> dict:
        dtypes = sorted({dtype_name(i.dtype) for i in self._infos.values()})
        return {"kind": self.kind, "path": str(self.path), "label": self.label, "tensors": len(self._infos),
                "bytes": self.total_bytes, "dtypes": dtypes}

    # ---------------------------------------------------------------- bytes
    def read_tensor(self, name: str) -> torch.Tensor:
        """The whole tensor, a new CPU tensor."""
        with self._lock:
            t = self._read_whole(name)
            self.bytes_read += t.numel() * t.element_size()
        return t

    def _read_whole(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def _extents(self, name: str) -> list[_Extent] | None:
        """Where the tensor's bytes lie, or None when only a whole-tensor read can assemble it."""
        raise NotImplementedError

    def _pread_into(self, file: str, offset: int, buf: memoryview, name: str) -> None:
        raise NotImplementedError

    def _layout(self, name: str) -> list[_Extent] | None:
        if self._layout_cache is None or self._layout_cache[0] != name:
            self._layout_cache = (name, self._extents(name))
        return self._layout_cache[1]

    def read_bytes(self, name: str, start: int, n: int) -> bytearray:
        """Bytes [start, start+n) of tensor `name`'s row-major contents (little-endian), no decoding.
        Thread-safe (reads of one source are serialized)."""
        out = bytearray(n)
        self.read_into(name, start, memoryview(out))
        return out

    def read_into(self, name: str, start: int, out: memoryview) -> None:
        """Like read_bytes, into the caller's buffer (reused buffers keep a scan cache-friendly)."""
        with self._lock:
            self._read_into(name, start, out)

    def _read_into(self, name: str, start: int, out: memoryview) -> None:
        info = self.info(name)
        n = len(out)
        if start < 0 or start + n > info.nbytes:
            raise ValueError(f"byte range [{start}, {start + n}) outside tensor {name} of {info.nbytes} bytes")
        if n == 0:
            return
        self.bytes_read += n
        extents = self._layout(name)
        if extents is None:
            if self._full_cache is None or self._full_cache[0] != name:
                self._full_cache = None  # drop the previous tensor before reading the next
                self._full_cache = (name, self._read_whole(name).contiguous())
            flat = self._full_cache[1].reshape(-1).view(torch.uint8)
            out[:] = flat[start:start + n].numpy().tobytes()
            return
        end = start + n
        for e in extents:
            lo, hi = max(start, e.start), min(end, e.start + e.nbytes)
            if lo >= hi:
                continue
            self._pread_into(e.file, e.offset + (lo - e.start), out[lo - start:hi - start], name)

    def read_elems(self, name: str, start: int, count: int) -> torch.Tensor:
        """Elements [start, start+count) of the flattened tensor, as a new 1-D tensor."""
        info = self.info(name)
        size = info.dtype.itemsize
        if count == 0:
            return torch.empty(0, dtype=info.dtype)
        raw = self.read_bytes(name, start * size, count * size)
        return torch.frombuffer(raw, dtype=info.dtype)

    def iter_raw(self, name: str, block_bytes: int) -> Iterator[bytearray]:
        nbytes = self.info(name).nbytes
        for off in range(0, nbytes, block_bytes):
            yield self.read_bytes(name, off, min(block_bytes, nbytes - off))

    def release(self) -> None:
        """Forget the tensor held for a fallback read (call when moving to the next tensor)."""
        self._full_cache = None
        self._layout_cache = None

    def close(self) -> None:
        self.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class HFWeights(WeightsSource):
    kind = "hf"

    def __init__(self, path: Path, label: str):
        from .formats.hf_dir import HFModelDir

        super().__init__()
        self.path = path
        self.label = label
        self.model = HFModelDir.open(path)
        from .formats.safetensors_io import torch_dtype

        for name in self.model.keys():
            ti = self.model.info(name)
            self._infos[name] = WeightInfo(name, torch_dtype(ti.dtype), tuple(ti.shape))
        self._fds: dict[str, int] = {}

    def _read_whole(self, name: str) -> torch.Tensor:
        self.info(name)
        return self.model.read_tensor(name)

    def _extents(self, name: str) -> list[_Extent]:
        ti = self.model.info(name)
        return [_Extent(0, ti.nbytes, str(ti.path), ti.begin)]

    def _pread_into(self, file: str, offset: int, buf: memoryview, name: str) -> None:
        fd = self._fds.get(file)
        if fd is None:
            if not os.path.lexists(file):
                raise MissingFileError("shard disappeared after the model was opened", path=file, key=name)
            fd = open_input(file, root=self.model.path, what="safetensors shard")
            self._fds[file] = fd
        n, done = len(buf), 0
        while done < n:   # straight into the caller's buffer: one copy from the page cache
            got = os.preadv(fd, [buf[done:done + _MAX_IO_BYTES]], offset + done)
            if not got:
                raise TruncatedFileError(f"file ended at byte {offset + done} while reading "
                                         f"[{offset}, {offset + n})", path=file, key=name,
                                         hint="the shard shrank or is truncated; run `ckpt verify`")
            done += got

    def close(self) -> None:
        super().close()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self.model.close()


class DcpWeights(WeightsSource):
    """The base weights of a DCP checkpoint (`app.model.<HF name>` keys that are not LoRA params)."""

    kind = "dcp"

    def __init__(self, path: Path, label: str, *, trust_pickle: bool = False, ckpt: DcpCheckpoint | None = None):
        super().__init__()
        self._owns = ckpt is None
        self.ckpt = ckpt if ckpt is not None else DcpCheckpoint.open(path, trust_pickle=trust_pickle)
        self.path = self.ckpt.dir
        self.label = label
        self._keys: dict[str, str] = {}
        for key, e in self.ckpt.entries.items():
            ki = classify(key, e.path)
            if ki.group == "base" and isinstance(e, TensorEntry):
                self._keys[ki.hf_name] = key
                self._infos[ki.hf_name] = WeightInfo(ki.hf_name, e.dtype, e.shape)
        if not self._infos:
            raise FormatError("the checkpoint holds no base weights (no app.model.<name> tensors)",
                              path=self.path / METADATA_NAME,
                              hint="a slim checkpoint has none: `ckpt rehydrate` it, or compare the HF base instead")

    def dcp_key(self, name: str) -> str:
        self.info(name)
        return self._keys[name]

    def _read_whole(self, name: str) -> torch.Tensor:
        return self.ckpt.read_tensor(self.dcp_key(name))

    def _extents(self, name: str) -> list[_Extent] | None:
        key = self.dcp_key(name)
        e = self.ckpt.entries[key]
        row_elems = math.prod(e.shape[1:]) if e.shape else 1
        item = e.dtype.itemsize
        out: list[_Extent] = []
        for ch in sorted((c for c in e.chunks if c.numel), key=lambda c: c.offsets):
            row_block = len(ch.sizes) == 0 or (all(o == 0 for o in ch.offsets[1:]) and ch.sizes[1:] == e.shape[1:])
            if not row_block:
                return None
            try:
                src = io.BufferedReader(_Window(
                    lambda off, n, f=ch.file: self.ckpt.read_item_bytes(f, off, n, key), ch.offset, ch.length))
                layout = parse_item(src)
                if layout.data_offset is None:
                    return None
                src.seek(layout.pkl_offset)
                rec = decode_tensor_pickle(src.read(layout.pkl_size))
            except UnsafePickleError as exc:
                raise UnsafePickleError(exc.message, path=self.path / ch.file, key=key,
                                        hint="the item's data.pkl is not a plain tensor record") from None
            except (ValueError, KeyError, EOFError, IndexError, TypeError):
                return None  # unusual item: let the reader's torch.load fallback decode it
            if not (rec.dtype == e.dtype and rec.size == ch.sizes and rec.is_contiguous_whole
                    and layout.data_size == ch.numel * item):
                return None
            start = (ch.offsets[0] * row_elems * item) if ch.offsets else 0
            out.append(_Extent(start, layout.data_size, ch.file, ch.offset + layout.data_offset))
        # the extents must tile the tensor exactly; anything else is for the reader to diagnose
        pos = 0
        for x in out:
            if x.start != pos:
                return None
            pos += x.nbytes
        if pos != e.numel * item:
            return None
        return out

    def _pread_into(self, file: str, offset: int, buf: memoryview, name: str) -> None:
        buf[:] = self.ckpt.read_item_bytes(file, offset, len(buf), self._keys.get(name, name))

    def close(self) -> None:
        super().close()
        if self._owns:
            self.ckpt.close()


def is_dcp_path(p: Path) -> bool:
    # lexists: a `.metadata` that is a FIFO or bad link marks a checkpoint the reader then refuses by name
    return os.path.lexists(p / METADATA_NAME) or os.path.lexists(p / "trainer" / METADATA_NAME) or \
        (p.is_file() and p.name == METADATA_NAME)


def open_weights(spec: str | os.PathLike, *, trust_pickle: bool = False) -> WeightsSource:
    """An HF model dir (single file or sharded), a hub id from the local HF cache (offline), or a
    DCP checkpoint (trainer dir or step dir: its base weights)."""
    label = str(spec)
    p = Path(spec).expanduser()
    if p.exists():
        if is_dcp_path(p):
            return DcpWeights(p, label, trust_pickle=trust_pickle)
        if p.is_dir() and (p / "adapter_config.json").is_file() and not (
                (p / "model.safetensors").is_file() or (p / "model.safetensors.index.json").is_file()):
            raise UsageError("is a PEFT adapter, not model weights", path=p,
                             hint="pass it as --adapter, and the model directories as WEIGHTS and BASE")
        if not p.is_dir():
            raise UsageError("expected a model directory, a hub id or a DCP checkpoint, got a file", path=p)
        return HFWeights(p, label)
    from .formats.hf_dir import resolve_model_dir

    return HFWeights(resolve_model_dir(label), label)
