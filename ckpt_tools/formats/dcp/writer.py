"""A streaming DCP writer of our own.

`dcp.save` keeps every tensor of a file alive until the file closes (filesystem
`_write_files_from_queue`), so it cannot write a 126 GB checkpoint on a small machine. The format
is simple enough to write directly: each storage item is one `torch.save` archive appended to a
`.distcp` file; `.metadata` (a pickled `Metadata`) is written last, atomically. Tensors are split
into dim-0 row chunks with `torch.chunk` boundaries for the consumer's world size, so each
resuming FSDP2 rank reads only its own rows; chunk k goes to file `__k_0.distcp` like a real save.
Memory: one tensor plus one chunk copy at a time (`write_tensor`); `write_streamed_chunk` holds one block
of the payload, and a `FileRange` copy none (in the kernel).

Split over ranks (`owned_files`: the data files this rank writes, `ckpt_tools.dist`): every rank makes
the same sequence of write calls from the same plan; a call whose file is another rank's is only
counted (`skip`, or the write methods themselves), so each item has the same sequence number on
every rank. `finish(group)` gathers every rank's item records on rank 0, which registers them in
sequence order, exactly the single-process insertion order, and writes `.metadata`.

Paths are never stored in the metadata (`checkpoint_id=None`): Python <= 3.12 cannot unpickle
Python 3.13's pathlib objects, and prime-rl runs 3.12. The metadata names torch's own DCP classes (what
prime-rl's loader unpickles), encoded without torch (`metadata_pickle`): a command that copies items
verbatim (slim, rehydrate's copies, set-lr) needs no torch; torch is imported where a tensor is saved.
"""
from __future__ import annotations

import io
import os
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

from ...core.dtypes import dtype_name, itemsize
from ...core.errors import UsageError
from ...core.crc import crc32
from ...io.copy import copy_range
from ...io.files import atomic_write_bytes, make_dirs, open_new
from .layout import METADATA_NAME, METADATA_TMP_TAG, data_file_name, row_chunks
from .metadata_pickle import DCP_VERSION, StorageRecord, TensorRecord, metadata_pickle
from .stream_item import TensorItemParts

if TYPE_CHECKING:   # annotations only: torch is imported where a tensor is saved (torch.save)
    import torch

__all__ = ["DcpWriter", "DCP_VERSION", "FileRange"]


@dataclass(frozen=True)
class FileRange:
    """A stored item to copy verbatim from bytes [offset, offset + length) of the open input `fd` (in the
    kernel, `io.copy.copy_range`: the bytes never pass through this process)."""
    fd: int
    offset: int
    length: int
    path: object
    key: str


def _write_raw(fh, raw) -> None:
    if isinstance(raw, FileRange):
        fh.flush()
        start = fh.tell()
        copy_range(raw.fd, raw.offset, fh.fileno(), start, raw.length, path=raw.path, key=raw.key,
                   block_bytes=1 << 30)
        fh.seek(start + raw.length)
    else:
        fh.write(raw)


@dataclass
class _TensorDecl:
    path: tuple
    dtype: str                 # a dtype name ("float32")
    size: tuple[int, ...]
    chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]


def _torch_save(obj, fh) -> None:
    import torch   # lazy: copying items verbatim and writing `.metadata` need no torch
    torch.save(obj, fh)


class DcpWriter:
    """Append items, then `finish()` writes `.metadata`. Use inside an AtomicOutputDir."""

    def __init__(self, out_dir: str | Path, *, files: int = 1, owned_files: Collection[int] | None = None):
        self.dir = make_dirs(out_dir)
        self.files = max(1, files)
        # None: this process writes every file; else the data file names (`__i_0.distcp`) that are its own
        self._owned = None if owned_files is None else frozenset(data_file_name(i) for i in owned_files)
        self._seq = 0                      # the next item's sequence number (the same on every rank)
        self._records: list[list] = []     # this rank's items, for rank 0's .metadata (split mode)
        self._seen: set[str] = set()       # keys of items counted but written by another rank
        self._fh: dict[str, io.BufferedWriter] = {}
        self._tensors: dict[str, _TensorDecl] = {}
        self._bytes: set[str] = set()
        self._planner: dict[str, tuple] = {}
        # (fqn, chunk offsets or None) -> where the item lies: DCP's MetadataIndex compares so
        self._storage: dict[tuple, StorageRecord] = {}
        self._finished = False
        self.bytes_written = 0

    # ---------------------------------------------------------------- ranks
    def owns(self, file_index: int) -> bool:
        """Whether this rank writes data file `file_index` (always, in one process)."""
        return self._owned is None or data_file_name(file_index % self.files) in self._owned

    def _owns_rel(self, rel: str) -> bool:
        return self._owned is None or rel in self._owned

    def skip(self, key: str) -> None:
        """Count one item of `key` that another rank writes (instead of producing its bytes here)."""
        self._seq += 1
        self._seen.add(key)

    def _record(self, kind: str, key: str, path: tuple, rel: str, start: int, length: int, chunk=None) -> None:
        if self._owned is not None:
            self._records.append([self._seq, kind, key, list(path), rel, start, length, chunk])
        self._seq += 1

    def _put_storage(self, key: str, offsets, index, rel: str, start: int, length: int) -> None:
        """storage_data[MetadataIndex(key, offsets, index)] = _StorageInfo(rel, start, length): an index equal
        to one already there (same key and offsets) keeps its place and its first `index`, as a dict keyed by
        DCP's MetadataIndex (equal by fqn and offset) does."""
        at = (key, None if offsets is None else tuple(offsets))
        old = self._storage.get(at)
        fqn, index = (key, index) if old is None else (old.fqn, old.index)
        self._storage[at] = StorageRecord(fqn, at[1], index, rel, start, length)

    # ---------------------------------------------------------------- low level
    def _file(self, rel: str) -> io.BufferedWriter:
        fh = self._fh.get(rel)
        if fh is None:
            fh = open_new(self.dir / rel)  # new files only: never write through a link
            self._fh[rel] = fh
        return fh

    def _append(self, rel: str, write) -> tuple[int, int]:
        fh = self._file(rel)
        start = fh.tell()
        write(fh)
        length = fh.tell() - start
        self.bytes_written += length
        return start, length

    def _declare(self, key: str, path: tuple) -> None:
        if not path or ".".join(map(str, path)) != key:
            raise UsageError(f"planner path {path!r} does not flatten to the key", key=key)
        self._planner[key] = tuple(path)

    # ---------------------------------------------------------------- tensors
    def write_tensor(self, key: str, path: tuple, tensor: torch.Tensor, *, world_size: int = 1,
                     chunks: list[tuple[tuple[int, ...], tuple[int, ...]]] | None = None,
                     file_index: int | None = None) -> None:
        """Write a full tensor as row chunks for `world_size` ranks, or as the explicit `chunks`
        (offsets, sizes) given (any layout, empty chunks included)."""
        t = tensor.detach().cpu()
        if chunks is None:
            if t.dim() == 0:
                chunks = [((), ())]
            else:
                chunks = [((s,) + (0,) * (t.dim() - 1), (n,) + tuple(t.shape[1:]))
                          for s, n in row_chunks(t.shape[0], world_size)]
        for i, (offs, sizes) in enumerate(chunks):
            region = t[tuple(slice(o, o + s) for o, s in zip(offs, sizes))] if sizes else t
            # torch.save of a view would store the whole base storage: copy into its own storage.
            piece = region.contiguous().clone() if region.data_ptr() != t.data_ptr() or \
                region.numel() != t.numel() else region.contiguous()
            fi = (file_index if file_index is not None else i) % self.files
            self._add_chunk_item(key, path, dtype_name(t.dtype), tuple(t.shape), tuple(offs), tuple(sizes),
                                 data_file_name(fi), lambda fh, p=piece: _torch_save(p, fh))

    def write_chunk(self, key: str, path: tuple, piece: torch.Tensor, *, size: tuple[int, ...],
                    offsets: tuple[int, ...], file_index: int = 0) -> None:
        """Write one chunk, given as its own tensor, of a tensor of global `size` at `offsets`
        (callers that produce a big tensor chunk by chunk never hold the whole of it)."""
        p = piece.detach().cpu().contiguous()
        if p.untyped_storage().nbytes() != p.numel() * p.element_size():
            p = p.clone()  # torch.save of a view would store its whole base storage
        self._add_chunk_item(key, path, dtype_name(p.dtype), tuple(size), tuple(offsets), tuple(p.shape),
                             data_file_name(file_index % self.files), lambda fh: _torch_save(p, fh))

    def copy_tensor_chunk(self, key: str, path: tuple, dtype, size: tuple[int, ...],
                          offsets: tuple[int, ...], sizes: tuple[int, ...], raw_item,
                          file_index: int = 0) -> None:
        """Append a storage item verbatim (no decode/encode): slim, rehydrate, surgery. `dtype`: a name
        or a torch dtype; `raw_item`: its bytes, or a `FileRange` of an input to copy them from."""
        self._add_chunk_item(key, path, dtype_name(dtype), tuple(size), tuple(offsets), tuple(sizes),
                             data_file_name(file_index % self.files), lambda fh: _write_raw(fh, raw_item))

    def write_streamed_chunk(self, key: str, path: tuple, dtype, size: tuple[int, ...], offsets: tuple[int, ...],
                             sizes: tuple[int, ...], parts: TensorItemParts, blocks, file_index: int = 0) -> int | None:
        """Write one row chunk as torch.save would, its payload taken from `blocks` (buffers, in order,
        `parts.payload_bytes` in all) without ever holding it whole (`stream_item`). Returns the payload's
        CRC-32 (None: another rank's file, nothing read from `blocks`). Fewer or more bytes than the
        chunk holds is a UsageError; the caller checks the CRC and aborts the output on a mismatch."""
        got = {}

        def write(fh) -> None:
            fh.write(parts.head)
            crc, n = 0, 0
            for b in blocks:
                fh.write(b)
                crc = crc32(b, crc)
                n += len(memoryview(b).cast("B"))
                del b   # before the next block is made: one in memory, not two
            if n != parts.payload_bytes:
                raise UsageError(f"chunk at {list(offsets)} got {n:,} payload bytes, expected {parts.payload_bytes:,}",
                                 key=key)
            fh.write(parts.tail(crc))
            got["crc"] = crc
        self._add_chunk_item(key, path, dtype_name(dtype), tuple(size), tuple(offsets), tuple(sizes),
                             data_file_name(file_index % self.files), write)
        return got.get("crc")

    def _add_chunk_item(self, key, path, dtype, size, offs, sizes, rel, write) -> None:
        itemsize(dtype)   # a dtype torch has (else a FormatError naming it)
        decl = self._tensors.get(key)
        if decl is None:
            if key in self._bytes:
                raise UsageError("written both as bytes and as a tensor", key=key)
            self._declare(key, path)
            decl = self._tensors[key] = _TensorDecl(tuple(path), dtype, size, [])
        elif decl.dtype != dtype or decl.size != size:
            raise UsageError(f"chunk disagrees with earlier chunks ({dtype} {size} vs {decl.dtype} "
                             f"{decl.size})", key=key)
        index = len(decl.chunks)
        decl.chunks.append((offs, sizes))
        if not self._owns_rel(rel):   # another rank's file: counted, not written
            self._seq += 1
            return
        start, length = self._append(rel, write)
        self._put_storage(key, offs, index, rel, start, length)
        self._record("chunk", key, path, rel, start, length, [dtype, list(size), list(offs), list(sizes)])

    def register_existing_chunk(self, key: str, path: tuple, dtype, size: tuple[int, ...],
                                offsets: tuple[int, ...], sizes: tuple[int, ...], rel: str, offset: int,
                                length: int) -> None:
        """Point at an item already present in this dir (a hard-linked source file)."""
        itemsize(dtype)
        decl = self._tensors.get(key)
        if decl is None:
            self._declare(key, path)
            decl = self._tensors[key] = _TensorDecl(tuple(path), dtype_name(dtype), tuple(size), [])
        index = len(decl.chunks)
        decl.chunks.append((tuple(offsets), tuple(sizes)))
        self._put_storage(key, tuple(offsets), index, rel, offset, length)

    # ---------------------------------------------------------------- byte items
    def write_object(self, key: str, path: tuple, obj, *, file_index: int = 0) -> None:
        buf = io.BytesIO()
        _torch_save(obj, buf)
        self.copy_bytes_item(key, path, buf.getvalue(), file_index=file_index)

    def copy_bytes_item(self, key: str, path: tuple, raw_item, *, file_index: int = 0,
                        rel: str | None = None) -> None:
        if key in self._bytes or key in self._tensors:
            raise UsageError("written twice", key=key)
        self._declare(key, path)
        self._bytes.add(key)
        rel = rel or data_file_name(file_index % self.files)
        if not self._owns_rel(rel):   # another rank's file: counted, not written
            self._seq += 1
            return
        start, length = self._append(rel, lambda fh: _write_raw(fh, raw_item))
        self._put_storage(key, None, None, rel, start, length)
        self._record("bytes", key, path, rel, start, length)

    def register_existing_bytes(self, key: str, path: tuple, rel: str, offset: int, length: int) -> None:
        self._declare(key, path)
        self._bytes.add(key)
        self._put_storage(key, None, None, rel, offset, length)

    # ---------------------------------------------------------------- finish
    def keys(self) -> set[str]:
        """Every key written (or, split over ranks, counted)."""
        return set(self._tensors) | self._bytes | self._seen

    def metadata_bytes(self, save_id: str | None = None) -> bytes:
        """`.metadata` for every item written: torch's `Metadata` pickled (`metadata_pickle`), without torch."""
        tensors = {k: TensorRecord(d.dtype, d.size, d.chunks) for k, d in self._tensors.items()}
        return metadata_pickle(tensors, self._bytes, dict(self._planner), list(self._storage.values()),
                               save_id=str(uuid.uuid4()) if save_id is None else save_id, version=DCP_VERSION)

    def finish(self, group=None) -> None:
        """fsync every data file, then write `.metadata` atomically (last: without it the
        directory is not a checkpoint): a fresh temp name `.metadata.tmp-<pid>-<hex>` (in-place surgery
        writes into a stranger's directory, where a `.metadata.tmp` may already be a symlink to
        anywhere: it is never followed), fsync, rename over `.metadata`, fsync the directory."""
        for fh in self._fh.values():
            fh.flush()
            os.fsync(fh.fileno())
            fh.close()
        self._fh.clear()
        if self._owned is not None:   # split over ranks: rank 0 registers every rank's items in order
            gathered = group.gather(self._records, "the checkpoint's item records")
            if gathered is None:
                self._finished = True
                return
            data = self._replayed([r for part in gathered for r in part]).metadata_bytes()
        else:
            data = self.metadata_bytes()
        atomic_write_bytes(self.dir / METADATA_NAME, data, temp_prefix=f"{METADATA_NAME}{METADATA_TMP_TAG}")
        self._finished = True

    def _replayed(self, records: list[list]) -> "DcpWriter":
        """A writer whose items are `records` (every rank's), registered in sequence order."""
        whole = DcpWriter(self.dir, files=self.files)
        for seq, kind, key, path, rel, start, length, chunk in sorted(records, key=lambda r: r[0]):
            if kind == "bytes":
                whole.register_existing_bytes(key, tuple(path), rel, start, length)
            else:
                dtype, size, offs, sizes = chunk
                whole.register_existing_chunk(key, tuple(path), dtype, tuple(size), tuple(offs), tuple(sizes), rel,
                                              start, length)
        return whole

    def abort(self) -> None:
        for fh in self._fh.values():
            fh.close()
        self._fh.clear()
