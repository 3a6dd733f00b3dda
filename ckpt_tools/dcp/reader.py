"""A streaming reader for DCP checkpoint directories.

Opening reads `.metadata` only (allow-list unpickling). Tensors are read one at a time by `pread`
of exactly their chunks' byte ranges and reassembled into the full tensor; FSDP2 row-block chunks
(`Shard(0)`) are read straight into their rows of the destination, anything else falls back to
`torch.load(weights_only=True)` of the item. Byte items (lr, scheduler, progress) load with
`torch.load(weights_only=True)`. Nothing returns "the whole state dict".
"""
from __future__ import annotations

import io
import math
import os
import threading
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import FormatError, MissingFileError, TruncatedFileError, UnsafePickleError, UsageError
from ..inputs import MAX_METADATA_BYTES, open_input, read_input, register
from ..safe_pickle import load_metadata_pickle
from .zipitem import _Window, decode_tensor_pickle, parse_item

METADATA_NAME = ".metadata"
# Items up to this size are read with one pread and parsed in memory (one syscall beats three
# scattered ones for the thousands of tiny LoRA/optimizer chunks); larger ones are parsed from
# their tail and the payload is read straight into the destination tensor.
SMALL_ITEM_BYTES = 1 << 20


@dataclass(frozen=True)
class Chunk:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str           # relative path inside the checkpoint dir
    offset: int         # item start in the file
    length: int         # item length in bytes

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


@dataclass(frozen=True)
class TensorEntry:
    key: str
    path: tuple          # planner_data path, e.g. ('app', 'model', 'model.layers.0.mlp.up_proj.weight')
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunks: tuple[Chunk, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def stored_bytes(self) -> int:
        return sum(c.length for c in self.chunks)

    @property
    def is_tensor(self) -> bool:
        return True


@dataclass(frozen=True)
class BytesEntry:
    key: str
    path: tuple
    file: str
    offset: int
    length: int

    @property
    def stored_bytes(self) -> int:
        return self.length

    @property
    def nbytes(self) -> int:
        return 0

    @property
    def is_tensor(self) -> bool:
        return False


Entry = TensorEntry | BytesEntry


@dataclass
class ReadStats:
    """Every byte range read from data files, for tests and benchmarks."""
    bytes_read: int = 0
    ranges: list[tuple[str, int, int]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, file: str, offset: int, length: int) -> None:
        with self._lock:
            self.bytes_read += length
            self.ranges.append((file, offset, length))


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """Accept a trainer dir (holding .metadata) or a prime-rl step dir (holding trainer/)."""
    p = Path(path)
    if not p.exists():
        raise MissingFileError("no such file or directory", path=p)
    # lexists, not is_file: a `.metadata` that is a FIFO or a dangling link is this checkpoint's,
    # and the read refuses it by name
    if p.name == METADATA_NAME and not p.is_dir():
        return p.parent
    if os.path.lexists(p / METADATA_NAME):
        return p
    if os.path.lexists(p / "trainer" / METADATA_NAME):
        return p / "trainer"
    raise UsageError("not a DCP checkpoint: no .metadata here or in trainer/", path=p,
                     hint="pass a prime-rl checkpoint dir like outputs/checkpoints/step_N/trainer")


def _tuple(x) -> tuple[int, ...]:
    return tuple(int(v) for v in x)


def _plain_file_name(rel: str, ckpt_dir: Path, key: str) -> str:
    if not isinstance(rel, str) or not rel or "/" in rel or "\\" in rel or "\0" in rel or rel in (".", ".."):
        raise FormatError(f"storage item points at {rel!r}, which is not a file name inside the "
                          "checkpoint directory", path=ckpt_dir / METADATA_NAME, key=key,
                          hint="the metadata is corrupt or crafted; refusing to read outside the checkpoint")
    return rel


def _check_chunk_geometry(shape: tuple[int, ...], chunks: list[Chunk], meta_path: Path, key: str) -> None:
    """The chunks of a tensor lie inside it, do not overlap and cover it exactly (0-size chunks
    skipped), as DCP's own planner checks on save. Checked before any byte is read or any
    destination allocated: overlapping chunks would otherwise leave rows of the tensor unwritten
    (garbage from torch.empty) without an error, and an absurd shape would be allocated."""
    def bad(msg: str) -> FormatError:
        return FormatError(msg, path=meta_path, key=key, hint="the metadata is corrupt or crafted; run `ckpt verify`")

    if any(d < 0 for d in shape):
        raise bad(f"tensor shape {list(shape)} has a negative dimension")
    boxes = []
    for ch in chunks:
        if len(ch.offsets) != len(shape) or len(ch.sizes) != len(shape):
            raise bad(f"chunk offsets {list(ch.offsets)} / sizes {list(ch.sizes)} do not have the tensor's "
                      f"{len(shape)} dimensions")
        if any(s < 0 for s in ch.sizes) or (0 not in ch.sizes and any(
                o < 0 or o + s > d for o, s, d in zip(ch.offsets, ch.sizes, shape))):
            raise bad(f"chunk at offsets {list(ch.offsets)} sizes {list(ch.sizes)} lies outside the tensor's "
                      f"shape {list(shape)}")
        if ch.numel:
            boxes.append(ch)
    covered = sum(ch.numel for ch in boxes)
    if covered != math.prod(shape):
        raise bad(f"chunks cover {covered} of {math.prod(shape)} elements")
    # sweep along dim 0: only chunks whose row ranges intersect are compared
    boxes.sort(key=lambda c: c.offsets[0] if c.offsets else 0)
    active: list[Chunk] = []
    for ch in boxes:
        if not shape:
            break  # a scalar has one element: covered == 1 leaves room for one chunk only
        active = [a for a in active if a.offsets[0] + a.sizes[0] > ch.offsets[0]]
        for a in active:
            if all(ao < co + cs and co < ao + as_ for ao, as_, co, cs in zip(a.offsets, a.sizes, ch.offsets, ch.sizes)):
                raise bad(f"chunks at offsets {list(a.offsets)} and {list(ch.offsets)} overlap")
        active.append(ch)


def _check_chunk_bytes(chunks: list[Chunk], dtype: torch.dtype, meta_path: Path, key: str) -> None:
    """Each chunk's item must be at least as long as the elements it declares: a torch.save item
    stores every element (plus ~1 KB of zip records). A shorter item is an expanded (stride-0) view
    or a crafted size, and reading it would allocate by the metadata's claim, not by the bytes on
    disk (a 1.5 KB item claimed GBs). With the items' ranges checked against their files before any
    allocation (`read_tensor`), a tensor never costs more memory than its bytes on disk."""
    for ch in chunks:
        need = ch.numel * dtype.itemsize
        if ch.length < need:
            raise FormatError(f"chunk at offsets {list(ch.offsets)} declares {list(ch.sizes)} {dtype} "
                              f"({need:,} bytes) but its item holds {ch.length:,} bytes: an expanded (stride-0) or "
                              "crafted item", path=meta_path, key=key,
                              hint="the metadata is corrupt or crafted; refusing to allocate by its claim")


class DcpCheckpoint:
    """An open DCP checkpoint: metadata in memory, data files opened lazily."""

    def __init__(self, ckpt_dir: Path, metadata, *, trust_pickle: bool = False):
        self.dir = ckpt_dir
        self.metadata = metadata
        self.trust_pickle = trust_pickle
        self.stats = ReadStats()
        self._fds: dict[str, int] = {}
        self._sizes: dict[str, int] = {}
        self._fd_lock = threading.Lock()
        self.entries: dict[str, Entry] = self._build_entries(metadata)

    # ---------------------------------------------------------------- opening
    @classmethod
    def open(cls, path: str | Path, *, trust_pickle: bool = False) -> "DcpCheckpoint":
        ckpt_dir = resolve_checkpoint_dir(path)
        register(ckpt_dir)   # the whole checkpoint is an input: no OUT inside it
        meta_path = ckpt_dir / METADATA_NAME
        data = read_input(meta_path, root=ckpt_dir, what="DCP .metadata", max_bytes=MAX_METADATA_BYTES)
        if not data:
            raise FormatError("empty .metadata (0 bytes)", path=meta_path,
                              hint="the save was interrupted; use an earlier step")
        md = load_metadata_pickle(data, str(meta_path), trust=trust_pickle)
        return cls(ckpt_dir, md, trust_pickle=trust_pickle)

    def _build_entries(self, md) -> dict[str, Entry]:
        meta_path = self.dir / METADATA_NAME
        try:
            sdm = md.state_dict_metadata
            planner = getattr(md, "planner_data", None) or {}
            storage = md.storage_data
            if not isinstance(sdm, dict) or not isinstance(storage, dict) or not isinstance(planner, dict):
                raise TypeError("state_dict_metadata/storage_data/planner_data are not dicts")
            where: dict[tuple, object] = {}
            for idx, info in storage.items():
                off = None if idx.offset is None else _tuple(idx.offset)
                where[(idx.fqn, off)] = info
            entries: dict[str, Entry] = {}
            for key in sorted(sdm):
                if not isinstance(key, str):
                    raise TypeError(f"key {key!r} is not a string")
                item = sdm[key]
                path = tuple(planner.get(key) or ())
                if hasattr(item, "chunks"):
                    chunks = []
                    for ch in item.chunks:
                        offs, sizes = _tuple(ch.offsets), _tuple(ch.sizes)
                        info = where.get((key, offs))
                        if info is None:
                            raise FormatError(f"chunk at offsets {list(offs)} has no storage entry",
                                              path=meta_path, key=key,
                                              hint="the metadata is corrupt; run `ckpt verify`")
                        rel = _plain_file_name(info.relative_path, self.dir, key)
                        if getattr(info, "transform_descriptors", None):
                            raise FormatError(f"chunk uses transforms {info.transform_descriptors} "
                                              "(compression?), which we do not read", path=meta_path, key=key)
                        chunks.append(Chunk(offs, sizes, rel, int(info.offset), int(info.length)))
                    dtype = item.properties.dtype
                    if not isinstance(dtype, torch.dtype):
                        raise TypeError(f"dtype {dtype!r} of {key} is not a torch dtype")
                    shape = _tuple(item.size)
                    _check_chunk_geometry(shape, chunks, meta_path, key)
                    _check_chunk_bytes(chunks, dtype, meta_path, key)
                    entries[key] = TensorEntry(key, path, dtype, shape, tuple(chunks))
                else:
                    info = where.get((key, None))
                    if info is None:
                        raise FormatError("byte item has no storage entry", path=meta_path, key=key,
                                          hint="the metadata is corrupt; run `ckpt verify`")
                    rel = _plain_file_name(info.relative_path, self.dir, key)
                    entries[key] = BytesEntry(key, path, rel, int(info.offset), int(info.length))
            return entries
        except (FormatError, UnsafePickleError):
            raise
        except Exception as exc:  # a crafted or damaged Metadata of the allowed classes
            raise FormatError(f"malformed DCP metadata: {type(exc).__name__}: {exc}", path=meta_path,
                              hint="the file is corrupt; run `ckpt verify`") from None

    # ---------------------------------------------------------------- files
    def _fd(self, rel: str, key: str) -> int:
        with self._fd_lock:
            fd = self._fds.get(rel)
            if fd is None:
                p = self.dir / rel
                if not os.path.lexists(p):
                    raise MissingFileError("data file is missing", path=p, key=key,
                                           hint="copy the whole checkpoint directory; every rank's "
                                                "__<rank>_0.distcp is needed")
                try:   # symlinks out of the checkpoint, FIFOs, devices, sparse files: refused here
                    fd = open_input(p, root=self.dir, what="data file")
                except (MissingFileError, FormatError) as exc:
                    raise type(exc)(exc.message, path=p, key=key,
                                    hint=exc.hint or "copy the checkpoint's __<rank>_0.distcp files again") from None
                st = os.fstat(fd)
                self._fds[rel] = fd
                self._sizes[rel] = st.st_size
            return fd

    def file_size(self, rel: str, key: str = "") -> int:
        self._fd(rel, key)
        return self._sizes[rel]

    def _check_range(self, rel: str, offset: int, length: int, key: str) -> int:
        fd = self._fd(rel, key)
        size = self._sizes[rel]
        if offset < 0 or length < 0 or offset + length > size:
            raise TruncatedFileError(f"item [{offset}, {offset + length}) lies beyond the end of the "
                                     f"file ({size} bytes)", path=self.dir / rel, key=key,
                                     hint="the file is truncated (disk full or an interrupted copy?)")
        return fd

    def _pread(self, rel: str, offset: int, length: int, key: str) -> bytes:
        fd = self._check_range(rel, offset, length, key)
        data = os.pread(fd, length, offset)
        self.stats.add(rel, offset, len(data))
        if len(data) != length:
            raise TruncatedFileError(f"short read at {offset}: got {len(data)} of {length} bytes",
                                     path=self.dir / rel, key=key)
        return data

    def close(self) -> None:
        with self._fd_lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ---------------------------------------------------------------- queries
    def keys(self) -> list[str]:
        return list(self.entries)

    def entry(self, key: str) -> Entry:
        try:
            return self.entries[key]
        except KeyError:
            raise FormatError("no such item in the checkpoint", path=self.dir / METADATA_NAME, key=key,
                              hint="`ckpt inspect --keys` lists every key") from None

    def tensor_entries(self) -> list[TensorEntry]:
        return [e for e in self.entries.values() if isinstance(e, TensorEntry)]

    def data_files(self) -> list[str]:
        files = set()
        for e in self.entries.values():
            if isinstance(e, TensorEntry):
                files.update(c.file for c in e.chunks)
            else:
                files.add(e.file)
        return sorted(files)

    # ---------------------------------------------------------------- reading
    def read_object(self, key: str):
        """Load a byte item (lr, scheduler field, progress...) with torch.load(weights_only=True)."""
        e = self.entry(key)
        if not isinstance(e, BytesEntry):
            raise UsageError("is a tensor, not a byte item", key=key)
        raw = self._pread(e.file, e.offset, e.length, key)
        return load_byte_item(raw, trust=self.trust_pickle, path=self.dir / e.file, key=key)

    def read_item_bytes(self, rel: str, offset: int, length: int, key: str) -> bytes:
        """Raw bytes of one storage item (verbatim copies in surgery)."""
        return self._pread(rel, offset, length, key)

    def read_tensor(self, key: str) -> torch.Tensor:
        e = self.entry(key)
        if not isinstance(e, TensorEntry):
            raise UsageError("is a byte item, not a tensor", key=key)
        for ch in e.chunks:   # every item inside its file BEFORE the destination is allocated
            if ch.numel:
                self._check_range(ch.file, ch.offset, ch.length, key)
        dest = torch.empty(e.shape, dtype=e.dtype)
        covered = 0
        for ch in sorted(e.chunks, key=lambda c: (c.file, c.offset)):
            if ch.numel == 0:
                continue  # FSDP ranks past the end of dim 0 hold empty chunks
            self._read_chunk_into(e, ch, dest)
            covered += ch.numel
        if covered != e.numel:
            raise FormatError(f"chunks cover {covered} of {e.numel} elements", path=self.dir / METADATA_NAME,
                              key=key, hint="a chunk is missing from the metadata; run `ckpt verify`")
        return dest

    def iter_tensors(self, keys: Iterable[str], *, threads: int = 1) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (key, full tensor) in the given order. With threads > 1, up to `threads` tensors
        are read ahead in parallel (memory: threads + 1 tensors)."""
        keys = list(keys)
        if threads <= 1:
            for k in keys:
                yield k, self.read_tensor(k)
            return
        pool = ThreadPoolExecutor(max_workers=threads)
        ok = False
        try:
            pending = []
            it = iter(keys)
            for k in it:
                pending.append((k, pool.submit(self.read_tensor, k)))
                if len(pending) >= threads:
                    break
            while pending:
                k, fut = pending.pop(0)
                nxt = next(it, None)
                if nxt is not None:
                    pending.append((nxt, pool.submit(self.read_tensor, nxt)))
                yield k, fut.result()
            ok = True
        finally:
            # on an error or a signal, do not wait for the reads in flight (each is bounded; they
            # end on their own): the command must stop now
            pool.shutdown(wait=ok, cancel_futures=True)

    def _read_chunk_into(self, e: TensorEntry, ch: Chunk, dest: torch.Tensor) -> None:
        key = e.key
        fd = self._check_range(ch.file, ch.offset, ch.length, key)
        small = ch.length <= SMALL_ITEM_BYTES
        try:
            if small:
                item = self._pread(ch.file, ch.offset, ch.length, key)
                src = io.BytesIO(item)
            else:
                item = None
                src = io.BufferedReader(_Window(lambda off, n: self._pread(ch.file, off, n, key),
                                                ch.offset, ch.length))
            layout = parse_item(src)
            if layout.data_offset is None:
                raise ValueError("item holds no tensor data")
            src.seek(layout.pkl_offset)
            rec = decode_tensor_pickle(src.read(layout.pkl_size))
        except UnsafePickleError as exc:
            raise UnsafePickleError(exc.message, path=self.dir / ch.file, key=key) from None
        except (ValueError, KeyError, EOFError, IndexError, TypeError) as exc:
            return self._fallback_chunk(e, ch, dest, f"{type(exc).__name__}: {exc}")
        row_block = (len(ch.sizes) == 0 or (all(o == 0 for o in ch.offsets[1:])
                                             and ch.sizes[1:] == e.shape[1:]))
        if not (rec.dtype == e.dtype and rec.size == ch.sizes and rec.is_contiguous_whole and row_block
                and layout.data_size == ch.numel * e.dtype.itemsize):
            return self._fallback_chunk(e, ch, dest, "non row-block layout")
        flat = dest.reshape(-1).view(torch.uint8)
        row_bytes = (math.prod(e.shape[1:]) if e.shape else 1) * e.dtype.itemsize
        start = (ch.offsets[0] * row_bytes) if ch.offsets else 0
        target = flat[start:start + layout.data_size].numpy()
        if small:
            target[:] = memoryview(item)[layout.data_offset:layout.data_offset + layout.data_size]
        else:
            n = os.preadv(fd, [memoryview(target)], ch.offset + layout.data_offset)
            self.stats.add(ch.file, ch.offset + layout.data_offset, n)
            if n != layout.data_size:
                raise TruncatedFileError(f"short read: {n} of {layout.data_size} payload bytes",
                                         path=self.dir / ch.file, key=key)

    def _fallback_chunk(self, e: TensorEntry, ch: Chunk, dest: torch.Tensor, why: str) -> None:
        """Any chunk layout torch.save can express: let torch decode it (weights_only)."""
        raw = self._pread(ch.file, ch.offset, ch.length, e.key)
        t = load_byte_item(raw, trust=self.trust_pickle, path=self.dir / ch.file, key=e.key)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != ch.sizes or t.dtype != e.dtype:
            got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
            raise FormatError(f"chunk at {list(ch.offsets)} holds {got}, metadata says "
                              f"{ch.sizes} {e.dtype} ({why})", path=self.dir / ch.file, key=e.key)
        region = dest[tuple(slice(o, o + s) for o, s in zip(ch.offsets, ch.sizes))] if ch.sizes else dest
        region.copy_(t)


def _check_own_bytes(obj, path, key: str) -> None:
    """Every tensor torch.load built holds its elements in its own storage: an expanded (stride-0)
    view of a few bytes would be materialized at its full size by the first `.to()` or copy."""
    todo = [obj]
    while todo:
        o = todo.pop()
        if isinstance(o, torch.Tensor):
            need = o.numel() * o.element_size()
            if need and (o.untyped_storage().nbytes() < need or any(st == 0 and n > 1 for st, n in
                                                                    zip(o.stride(), o.shape))):
                raise FormatError(f"tensor of shape {list(o.shape)} is an expanded view of "
                                  f"{o.untyped_storage().nbytes():,} stored bytes (strides {list(o.stride())}); "
                                  f"refusing to materialize {need:,} bytes from it", path=path, key=key,
                                  hint="a checkpoint stores every element; this item is crafted or corrupt")
        elif isinstance(o, dict):
            todo.extend(o.values())
        elif isinstance(o, (list, tuple)):
            todo.extend(o)


def load_byte_item(raw: bytes, *, trust: bool, path, key: str):
    """torch.load of one storage item; weights_only (an allow-list) unless the user trusts the file.
    Before torch.load: the archive's records must be stored (not compressed) and inside it, and its
    data.pkl must pass the pickle bounds (`safe_pickle.check_pickle_bounds`); after: no tensor may
    be an expanded view (`_check_own_bytes`). So what it builds is bounded by the item's bytes."""
    import pickle

    from ..safe_pickle import check_pickle_bounds
    from .zipitem import archive_pickle

    try:
        pkl = archive_pickle(raw)
    except ValueError as exc:
        raise FormatError(f"cannot decode item: {exc}", path=path, key=key,
                          hint="the file is corrupt or crafted; run `ckpt verify`") from None
    try:
        check_pickle_bounds(pkl, str(path), "the item's data.pkl")
    except UnsafePickleError as exc:
        raise UnsafePickleError(exc.message, path=path, key=key, hint=exc.hint) from None
    try:
        obj = torch.load(io.BytesIO(raw), weights_only=not trust, map_location="cpu")
        _check_own_bytes(obj, path, key)
        return obj
    except FormatError:
        raise
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()
        reason = next((ln for ln in first if "GLOBAL" in ln or "Unsupported" in ln), first[0] if first else "")
        raise UnsafePickleError(f"refusing to unpickle item: {reason.strip()[:300]}", path=path, key=key,
                                hint="torch.load(weights_only=True) rejected it; pass --trust-remote-pickle "
                                     "only if you trust where this checkpoint came from") from None
    except Exception as exc:
        raise FormatError(f"cannot decode item: {type(exc).__name__}: {str(exc)[:300]}", path=path, key=key,
                          hint="the file is corrupt; run `ckpt verify`") from None
