"""A streaming DCP writer of our own.

`dcp.save` keeps every tensor of a file alive until the file closes (filesystem
`_write_files_from_queue`), so it cannot write a 126 GB checkpoint on a small machine. The format
is simple enough to write directly: each storage item is one `torch.save` archive appended to a
`.distcp` file; `.metadata` (a pickled `Metadata`) is written last, atomically. Tensors are split
into dim-0 row chunks with `torch.chunk` boundaries for the consumer's world size, so each
resuming FSDP2 rank reads only its own rows; chunk k goes to file `__k_0.distcp` like a real save.
Memory: one tensor plus one chunk copy at a time (`write_tensor`); a `FileRange` copy none (in the kernel);
a reserved item (below) whatever its writers hold.

Every byte is written at its place (`pwrite`), never through a shared file position: the items of a file
are registered in order (which fixes each one's offset), and an item whose length is known beforehand can
be reserved (`reserve_chunk`, `reserve_bytes`: an `ItemSlot`) and its bytes written later, from any thread
and in any order (`ItemSlot.write_at`, `copy_at`), while the next items are registered behind it: a
streamed tensor item (`stream_item.TensorItemParts`: its head, its payload block by block, its tail once
the payload's CRC-32 is known), or a verbatim copy. The file is then byte for byte what writing the items
one after another gives.

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
import threading
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ...core.dtypes import dtype_name, itemsize
from ...core.errors import UsageError
from ...io.copy import copy_range
from ...io.files import atomic_write_bytes, create_new, make_dirs, pwrite_all, start_writeback
from ...io.pread import RangeReader
from .layout import METADATA_NAME, METADATA_TMP_TAG, data_file_name, row_chunks
from .metadata_pickle import DCP_VERSION, StorageRecord, TensorRecord, metadata_pickle

if TYPE_CHECKING:  # annotations only: torch is imported where a tensor is saved (torch.save)
    import torch

__all__ = ["DCP_VERSION", "DcpWriter", "FileRange", "ItemSlot"]


@dataclass(frozen=True)
class FileRange:
    """A stored item to copy verbatim from bytes [offset, offset + length) of the open input `fd` (in the
    kernel, `io.copy.copy_range`: the bytes never pass through this process)."""

    fd: int | RangeReader  # a remote object's range is fetched (io.copy.copy_range)
    offset: int
    length: int
    path: object
    key: str


_GATHER_BYTES = 1 << 16  # writes smaller than this are gathered into one pwrite
_WRITEBACK_BYTES = 1 << 20  # a write at least this large starts its writeback to disk at once


class _Sink:
    """A file object over bytes [start, ...) of the output file `fd`, written at their place: what torch.save
    and the verbatim copies write an item through. Small writes are gathered (torch.save writes each zip
    header apart); `pos` is the item's length so far."""

    def __init__(self, fd: int, start: int):
        self.fd, self.start, self.pos = fd, start, 0
        self._buf = bytearray()

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        n = len(view)
        if len(self._buf) + n <= _GATHER_BYTES:
            self._buf += view
        else:
            self.flush()
            pwrite_all(self.fd, view, self.start + self.pos)
        self.pos += n
        return n

    def flush(self) -> None:
        if self._buf:
            pwrite_all(self.fd, self._buf, self.start + self.pos - len(self._buf))
            self._buf.clear()

    def tell(self) -> int:
        return self.pos

    def copy(self, raw: FileRange) -> None:
        """The bytes of `raw` appended, copied in the kernel (`io.copy.copy_range`)."""
        self.flush()
        copy_range(
            raw.fd,
            raw.offset,
            self.fd,
            self.start + self.pos,
            raw.length,
            path=raw.path,
            key=raw.key,
            block_bytes=1 << 30,
        )
        self.pos += raw.length


def _write_raw(sink: _Sink, raw) -> None:
    if isinstance(raw, FileRange):
        sink.copy(raw)
    else:
        sink.write(raw)


@dataclass(frozen=True)
class ItemSlot:
    """Bytes [start, start + length) of output data file `rel`, reserved for one item
    (`DcpWriter.reserve_chunk`,
    `reserve_bytes`): its bytes are written at their place, from any thread, in any order."""

    writer: DcpWriter
    rel: str
    start: int
    length: int

    def _range(self, pos: int, n: int) -> int:
        if pos < 0 or pos + n > self.length:  # an internal invariant: an item never spills into the next
            raise UsageError(
                f"bytes [{pos}, {pos + n}) outside the item's {self.length} bytes at {self.start} of "
                f"{self.rel}"
            )
        return self.start + pos

    def write_at(self, pos: int, data) -> None:
        """Bytes `data` at byte `pos` of the item."""
        view = memoryview(data).cast("B")
        self.writer._pwrite(self.rel, self._range(pos, len(view)), view)

    def copy_at(self, pos: int, raw: FileRange) -> None:
        """The stored bytes `raw` of an input at byte `pos` of the item, copied in the kernel."""
        self.writer._copy(self.rel, self._range(pos, raw.length), raw)


@dataclass
class _TensorDecl:
    path: tuple
    dtype: str  # a dtype name ("float32")
    size: tuple[int, ...]
    chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]


def _torch_save(obj, fh) -> None:
    import torch  # lazy: copying items verbatim and writing `.metadata` need no torch

    torch.save(obj, fh)


class DcpWriter:
    """Append items, then `finish()` writes `.metadata`. Use inside an AtomicOutputDir."""

    def __init__(self, out_dir: str | Path, *, files: int = 1, owned_files: Collection[int] | None = None):
        self.dir = make_dirs(out_dir)
        self.files = max(1, files)
        # None: this process writes every file; else the data file names (`__i_0.distcp`) that are its own
        self._owned = None if owned_files is None else frozenset(data_file_name(i) for i in owned_files)
        self._seq = 0  # the next item's sequence number (the same on every rank)
        self._records: list[list] = []  # this rank's items, for rank 0's .metadata (split mode)
        self._seen: set[str] = set()  # keys of items counted but written by another rank
        self._fds: dict[str, int] = {}  # data file -> its fd (created new)
        self._end: dict[str, int] = {}  # data file -> the end of its last registered item
        self._lock = threading.Lock()  # the slots' writes against abort/finish (`_active`, `_closed`)
        self._active = 0  # slot writes in flight (other threads)
        self._closed = False
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

    def _record(
        self, kind: str, key: str, path: tuple, rel: str, start: int, length: int, chunk=None
    ) -> None:
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
    def _fd(self, rel: str) -> int:
        fd = self._fds.get(rel)
        if fd is None:
            fd = create_new(self.dir / rel)  # new files only: never write through a link
            self._fds[rel] = fd
            self._end[rel] = 0
        return fd

    def _append(self, rel: str, write) -> tuple[int, int]:
        """The next item of `rel`, `write(sink)` writing its bytes at their place (`_Sink`)."""
        sink = _Sink(self._fd(rel), self._end[rel])
        write(sink)
        sink.flush()
        self._end[rel] = sink.start + sink.pos
        self.bytes_written += sink.pos
        return sink.start, sink.pos

    def _reserve(self, length: int):
        def write(sink: _Sink) -> None:  # nothing yet: the slot's owner writes the bytes at their place
            sink.pos = length

        return write

    def _begin(self, rel: str) -> int:
        with self._lock:
            if self._closed:
                raise UsageError(f"write into {rel} after the checkpoint was finished or aborted")
            self._active += 1
            return self._fds[rel]

    def _end_write(self) -> None:
        with self._lock:
            self._active -= 1
            if self._closed and not self._active:
                self._close_fds()

    def _pwrite(self, rel: str, offset: int, view: memoryview) -> None:
        fd = self._begin(rel)
        try:
            pwrite_all(fd, view, offset)
            if len(view) >= _WRITEBACK_BYTES:
                start_writeback(fd, offset, len(view))
        finally:
            self._end_write()

    def _copy(self, rel: str, offset: int, raw: FileRange) -> None:
        fd = self._begin(rel)
        try:
            copy_range(
                raw.fd, raw.offset, fd, offset, raw.length, path=raw.path, key=raw.key, block_bytes=1 << 30
            )
            if raw.length >= _WRITEBACK_BYTES:
                start_writeback(fd, offset, raw.length)
        finally:
            self._end_write()

    def _close_fds(self) -> None:  # (under the lock, or with no write in flight)
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def _declare(self, key: str, path: tuple) -> None:
        if not path or ".".join(map(str, path)) != key:
            raise UsageError(f"planner path {path!r} does not flatten to the key", key=key)
        self._planner[key] = tuple(path)

    # ---------------------------------------------------------------- tensors
    def write_tensor(
        self,
        key: str,
        path: tuple,
        tensor: torch.Tensor,
        *,
        world_size: int = 1,
        chunks: list[tuple[tuple[int, ...], tuple[int, ...]]] | None = None,
        file_index: int | None = None,
    ) -> None:
        """Write a full tensor as row chunks for `world_size` ranks, or as the explicit `chunks`
        (offsets, sizes) given (any layout, empty chunks included)."""
        t = tensor.detach().cpu()
        if chunks is None:
            if t.dim() == 0:
                chunks = [((), ())]
            else:
                chunks = [
                    ((s,) + (0,) * (t.dim() - 1), (n,) + tuple(t.shape[1:]))
                    for s, n in row_chunks(t.shape[0], world_size)
                ]
        for i, (offs, sizes) in enumerate(chunks):
            region = t[tuple(slice(o, o + s) for o, s in zip(offs, sizes))] if sizes else t
            # torch.save of a view would store the whole base storage: copy into its own storage.
            piece = (
                region.contiguous().clone()
                if region.data_ptr() != t.data_ptr() or region.numel() != t.numel()
                else region.contiguous()
            )
            fi = (file_index if file_index is not None else i) % self.files
            self._add_chunk_item(
                key,
                path,
                dtype_name(t.dtype),
                tuple(t.shape),
                tuple(offs),
                tuple(sizes),
                data_file_name(fi),
                lambda fh, p=piece: _torch_save(p, fh),
            )

    def write_chunk(
        self,
        key: str,
        path: tuple,
        piece: torch.Tensor,
        *,
        size: tuple[int, ...],
        offsets: tuple[int, ...],
        file_index: int = 0,
    ) -> None:
        """Write one chunk, given as its own tensor, of a tensor of global `size` at `offsets`
        (callers that produce a big tensor chunk by chunk never hold the whole of it)."""
        p = piece.detach().cpu().contiguous()
        if p.untyped_storage().nbytes() != p.numel() * p.element_size():
            p = p.clone()  # torch.save of a view would store its whole base storage
        self._add_chunk_item(
            key,
            path,
            dtype_name(p.dtype),
            tuple(size),
            tuple(offsets),
            tuple(p.shape),
            data_file_name(file_index % self.files),
            lambda fh: _torch_save(p, fh),
        )

    def copy_tensor_chunk(
        self,
        key: str,
        path: tuple,
        dtype,
        size: tuple[int, ...],
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
        raw_item,
        file_index: int = 0,
    ) -> None:
        """Append a storage item verbatim (no decode/encode): slim, rehydrate, surgery. `dtype`: a name
        or a torch dtype; `raw_item`: its bytes, or a `FileRange` of an input to copy them from."""
        self._add_chunk_item(
            key,
            path,
            dtype_name(dtype),
            tuple(size),
            tuple(offsets),
            tuple(sizes),
            data_file_name(file_index % self.files),
            lambda fh: _write_raw(fh, raw_item),
        )

    def reserve_chunk(
        self,
        key: str,
        path: tuple,
        dtype,
        size: tuple[int, ...],
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
        length: int,
        *,
        file_index: int = 0,
    ) -> ItemSlot | None:
        """Register one chunk item of `length` bytes now, in item order, and return its place (`ItemSlot`)
        for its bytes to be written later, from any thread (None: another rank's file, only counted)."""
        return self._add_chunk_item(
            key,
            path,
            dtype_name(dtype),
            tuple(size),
            tuple(offsets),
            tuple(sizes),
            data_file_name(file_index % self.files),
            self._reserve(length),
        )

    def reserve_bytes(self, key: str, path: tuple, length: int, *, file_index: int = 0) -> ItemSlot | None:
        """`reserve_chunk` for a byte item."""
        return self._add_bytes_item(key, path, data_file_name(file_index % self.files), self._reserve(length))

    def _add_chunk_item(self, key, path, dtype, size, offs, sizes, rel, write) -> ItemSlot | None:
        itemsize(dtype)  # a dtype torch has (else a FormatError naming it)
        decl = self._tensors.get(key)
        if decl is None:
            if key in self._bytes:
                raise UsageError("written both as bytes and as a tensor", key=key)
            self._declare(key, path)
            decl = self._tensors[key] = _TensorDecl(tuple(path), dtype, size, [])
        elif decl.dtype != dtype or decl.size != size:
            raise UsageError(
                f"chunk disagrees with earlier chunks ({dtype} {size} vs {decl.dtype} {decl.size})", key=key
            )
        index = len(decl.chunks)
        decl.chunks.append((offs, sizes))
        if not self._owns_rel(rel):  # another rank's file: counted, not written
            self._seq += 1
            return None
        start, length = self._append(rel, write)
        self._put_storage(key, offs, index, rel, start, length)
        self._record("chunk", key, path, rel, start, length, [dtype, list(size), list(offs), list(sizes)])
        return ItemSlot(self, rel, start, length)

    def register_existing_chunk(
        self,
        key: str,
        path: tuple,
        dtype,
        size: tuple[int, ...],
        offsets: tuple[int, ...],
        sizes: tuple[int, ...],
        rel: str,
        offset: int,
        length: int,
    ) -> None:
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

    def copy_bytes_item(
        self, key: str, path: tuple, raw_item, *, file_index: int = 0, rel: str | None = None
    ) -> None:
        self._add_bytes_item(
            key, path, rel or data_file_name(file_index % self.files), lambda fh: _write_raw(fh, raw_item)
        )

    def _add_bytes_item(self, key: str, path: tuple, rel: str, write) -> ItemSlot | None:
        if key in self._bytes or key in self._tensors:
            raise UsageError("written twice", key=key)
        self._declare(key, path)
        self._bytes.add(key)
        if not self._owns_rel(rel):  # another rank's file: counted, not written
            self._seq += 1
            return None
        start, length = self._append(rel, write)
        self._put_storage(key, None, None, rel, start, length)
        self._record("bytes", key, path, rel, start, length)
        return ItemSlot(self, rel, start, length)

    def register_existing_bytes(self, key: str, path: tuple, rel: str, offset: int, length: int) -> None:
        self._declare(key, path)
        self._bytes.add(key)
        self._put_storage(key, None, None, rel, offset, length)

    # ---------------------------------------------------------------- finish
    def keys(self) -> set[str]:
        """Every key written (or, split over ranks, counted)."""
        return set(self._tensors) | self._bytes | self._seen

    def metadata_bytes(self, save_id: str | None = None) -> bytes:
        """`.metadata` for every item written: torch's `Metadata` pickled by `metadata_pickle`, no torch."""
        tensors = {k: TensorRecord(d.dtype, d.size, d.chunks) for k, d in self._tensors.items()}
        return metadata_pickle(
            tensors,
            self._bytes,
            dict(self._planner),
            list(self._storage.values()),
            save_id=str(uuid.uuid4()) if save_id is None else save_id,
            version=DCP_VERSION,
        )

    def finish(self, group=None) -> None:
        """fsync every data file, then write `.metadata` atomically (last: without it the
        directory is not a checkpoint): a fresh temp name `.metadata.tmp-<pid>-<hex>` (in-place surgery
        writes into a stranger's directory, where a `.metadata.tmp` may already be a symlink to
        anywhere: it is never followed), fsync, rename over `.metadata`, fsync the directory."""
        with self._lock:
            if self._active:  # an internal invariant: the slots' writers finish first
                raise UsageError("finish while a write into the checkpoint is in flight")
            self._closed = True
        for rel, fd in self._fds.items():
            size = os.fstat(fd).st_size
            if size != self._end[rel]:  # an internal invariant: every reserved byte was written
                raise UsageError(f"{rel} is {size:,} bytes, its items end at {self._end[rel]:,}")
            os.fsync(fd)
        with self._lock:
            self._close_fds()
        if self._owned is not None:  # split over ranks: rank 0 registers every rank's items in order
            gathered = group.gather(self._records, "the checkpoint's item records")
            if gathered is None:
                self._finished = True
                return
            data = self._replayed([r for part in gathered for r in part]).metadata_bytes()
        else:
            data = self.metadata_bytes()
        atomic_write_bytes(self.dir / METADATA_NAME, data, temp_prefix=f"{METADATA_NAME}{METADATA_TMP_TAG}")
        self._finished = True

    def _replayed(self, records: list[list]) -> DcpWriter:
        """A writer whose items are `records` (every rank's), registered in sequence order."""
        whole = DcpWriter(self.dir, files=self.files)
        for _seq, kind, key, path, rel, start, length, chunk in sorted(records, key=lambda r: r[0]):
            if kind == "bytes":
                whole.register_existing_bytes(key, tuple(path), rel, start, length)
            else:
                dtype, size, offs, sizes = chunk
                whole.register_existing_chunk(
                    key, tuple(path), dtype, tuple(size), tuple(offs), tuple(sizes), rel, start, length
                )
        return whole

    def abort(self) -> None:
        """Stop writing: the files are closed (after the last slot write still in flight, which finishes into
        a file the caller's staging directory removes)."""
        with self._lock:
            self._closed = True
            if not self._active:
                self._close_fds()
