"""Safetensors files written by us: the whole header computed from the declared entries first, then each
tensor's bytes whole (`write`), in blocks (`write_chunk`, used by `read.copy_raw`) or copied in the
kernel from a range of another file (`copy_range_from`: an untouched tensor never passes through our
memory), into a new file (O_EXCL: an existing file is never overwritten). With `safetensors_save_order`
and at most one metadata entry, the bytes equal `safetensors.torch.save_file`'s (see `header` for the
layout).

With `strict_order=False` several threads may write different tensors of one file at once (the merge
pipeline's workers each write their own tensor at its precomputed offset): the bookkeeping is locked, the
writes themselves run in parallel, and `abort()` closes the fd only once no write is in flight (a
late worker never writes into a recycled fd number)."""

from __future__ import annotations

import ctypes
import json
import math
import os
import struct
import sys
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ...core.dtypes import SAFETENSORS, dtype_name, safetensors_code
from ...core.errors import FormatError, OutputExistsError
from ...io.copy import copy_range
from ...io.files import create_new, remove_file, start_writeback
from ...io.pread import MAX_IO_BYTES, RangeReader
from .header import is_int, require_little_endian

if TYPE_CHECKING:  # a tensor passed in means its caller imported torch; bytes need none
    import torch

__all__ = ["EntrySpec", "StreamingSafetensorsWriter", "WriteEntry", "build_header", "safetensors_save_order"]

_NAMES = {s.name for s in SAFETENSORS.values()}


@dataclass(frozen=True)
class WriteEntry:
    """One declared tensor of a file being written; `begin` is relative to the data area."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    nbytes: int


EntrySpec = tuple  # (name, dtype code or torch.dtype, shape)


def safetensors_save_order(entries: Iterable[EntrySpec]) -> list[EntrySpec]:
    """`entries` in the order `safetensors.torch.save_file` lays tensors out: dtype rank descending
    (wider dtypes first), then name. Python's str order equals Rust's byte order for UTF-8."""
    return sorted(entries, key=lambda e: (-SAFETENSORS[safetensors_code(e[1])].rank, e[0]))


def _layout(entries: Sequence[EntrySpec]) -> list[WriteEntry]:
    out: list[WriteEntry] = []
    seen: set[str] = set()
    offset = 0
    for e in entries:
        if len(e) != 3:
            raise ValueError(f"entry {e!r} is not (name, dtype, shape)")
        name, dtype, shape = e
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor name {name!r} is not a non-empty string")
        if name == "__metadata__":
            raise ValueError("'__metadata__' is reserved by safetensors and cannot name a tensor")
        if name in seen:
            raise ValueError(f"tensor {name!r} is declared twice")
        seen.add(name)
        shape = tuple(shape)
        if not all(is_int(d) and d >= 0 for d in shape):
            raise ValueError(f"tensor {name!r}: shape {shape!r} is not non-negative integers")
        code = safetensors_code(dtype)
        nbytes = math.prod(shape) * SAFETENSORS[code].itemsize
        out.append(WriteEntry(name, code, shape, offset, nbytes))
        offset += nbytes
    return out


def build_header(entries: Sequence[EntrySpec], metadata: dict[str, str] | None = None) -> bytes:
    """The 8-byte length + padded JSON header for `entries` laid out in the given order."""
    return _header_bytes(_layout(entries), metadata)


def _header_bytes(layout: Sequence[WriteEntry], metadata: dict[str, str] | None) -> bytes:
    def dumps(x) -> str:
        # serde_json's compact form: same separators, no ASCII escaping, same control escapes.
        return json.dumps(x, separators=(",", ":"), ensure_ascii=False)

    parts = []
    if metadata is not None:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise ValueError("safetensors metadata must map strings to strings")
        parts.append('"__metadata__":' + dumps(dict(sorted(metadata.items()))))
    for e in layout:
        parts.append(
            f'{dumps(e.name)}:{{"dtype":"{e.dtype}","shape":{dumps(list(e.shape))},'
            f'"data_offsets":[{e.begin},{e.begin + e.nbytes}]}}'
        )
    body = ("{" + ",".join(parts) + "}").encode("utf-8")
    body += b" " * (-len(body) % 8)  # safetensors pads with spaces so the data area is 8-aligned
    return struct.pack("<Q", len(body)) + body


def _tensor_bytes(t: torch.Tensor) -> tuple[memoryview, torch.Tensor]:
    """A zero-copy byte view of contiguous CPU tensor `t` (returned with the tensor that owns it)."""
    if t.device.type != "cpu":
        t = t.cpu()
    n = t.numel() * t.element_size()
    raw = (ctypes.c_ubyte * n).from_address(t.data_ptr())
    return memoryview(raw).cast("B"), t


class StreamingSafetensorsWriter:
    """Writes one safetensors file whose layout is fixed up front by `entries` (kept in the given
    order: callers decide it, e.g. with `safetensors_save_order`).

    `write(name, tensor_or_bytes)` supplies a whole tensor, `write_chunk(name, buf)` the next
    block of one. With `strict_order` (default) tensors must come in declared order; otherwise
    any order is accepted (each block goes to its precomputed offset) but each tensor's blocks
    are still sequential. With `writeback`, each block's writeback to disk starts as soon as it is
    written (`io.files.start_writeback`), so a final fsync has little left to wait for. `close()`
    checks every byte was written, fsyncs and closes; leaving a `with` block by exception (or
    `abort()`) deletes the partial file.

    The file is created exclusively: an existing file is never overwritten."""

    def __init__(
        self,
        path: str | os.PathLike,
        entries: Sequence[EntrySpec],
        metadata: dict[str, str] | None = None,
        *,
        strict_order: bool = True,
        fsync: bool = True,
        writeback: bool = False,
    ):
        require_little_endian()
        self.path = Path(path)
        self.entries: tuple[WriteEntry, ...] = tuple(_layout(entries))
        self._by_name = {e.name: i for i, e in enumerate(self.entries)}
        self._header = _header_bytes(self.entries, metadata)
        self.data_start = len(self._header)
        self.file_bytes = self.data_start + sum(e.nbytes for e in self.entries)
        self.strict_order = strict_order
        self._fsync = fsync
        self._writeback = writeback  # start writing each block to disk as it is written
        self._written = [0] * len(self.entries)  # bytes written per entry
        self._complete = [False] * len(self.entries)
        self._next = 0  # strict order: first entry not complete
        self._closed = False
        self._lock = threading.Lock()  # the bookkeeping above; writes run outside it
        self._active = 0  # writes in flight (abort closes the fd after the last)
        self._fd_open = True
        try:
            self._fd = create_new(self.path)
        except FileExistsError:
            raise OutputExistsError(
                "refusing to overwrite an existing file", path=self.path, hint="write into a fresh directory"
            ) from None
        try:
            self._pwrite(memoryview(self._header), 0)
        except BaseException:
            self.abort()
            raise

    # -- internals
    def _error(self, message: str, key: str | None = None, hint: str | None = None) -> FormatError:
        return FormatError(message, path=self.path, key=key, hint=hint)

    def _pwrite(self, buf: memoryview, offset: int) -> None:
        done = 0
        while done < len(buf):
            done += os.pwrite(self._fd, buf[done : done + MAX_IO_BYTES], offset + done)

    def _entry_for_write(self, name: str) -> int:
        if self._closed:
            raise self._error("write after close", key=name)
        i = self._by_name.get(name)
        if i is None:
            raise self._error("tensor was not declared when the file was opened", key=name)
        if self._complete[i]:
            raise self._error("tensor was already written completely", key=name)
        if self.strict_order and i != self._next:
            expected = self.entries[self._next].name if self._next < len(self.entries) else None
            raise self._error(f"written out of order: expected {expected!r} next", key=name)
        return i

    def _advance(self, i: int) -> None:
        self._complete[i] = self._written[i] == self.entries[i].nbytes
        while self._next < len(self.entries) and self._complete[self._next]:
            self._next += 1

    # -- public
    def declared(self, name: str) -> WriteEntry:
        """The declared entry of tensor `name` (an error naming it when it was not declared)."""
        i = self._by_name.get(name)
        if i is None:
            raise FormatError("tensor was not declared when the file was opened", path=self.path, key=name)
        return self.entries[i]

    def _claim(self, name: str, nbytes: int) -> int:
        """Reserve the next `nbytes` of tensor `name` (under the lock); returns their file offset. The
        caller writes them and then calls `_release` (which also does when the write fails)."""
        with self._lock:
            i = self._entry_for_write(name)
            e = self.entries[i]
            if self._written[i] + nbytes > e.nbytes:
                raise self._error(
                    f"{self._written[i] + nbytes} bytes supplied, declared size is {e.nbytes}", key=name
                )
            offset = self.data_start + e.begin + self._written[i]
            self._written[i] += nbytes
            self._advance(i)
            self._active += 1
            return offset

    def _release(self) -> None:
        with self._lock:
            self._active -= 1
            if self._closed and self._active == 0:
                self._close_fd()

    def _close_fd(self) -> None:  # (under the lock, or single-threaded)
        if self._fd_open:
            self._fd_open = False
            os.close(self._fd)

    def write_chunk(self, name: str, buf) -> None:
        """Append the next block of tensor `name` (any bytes-like object)."""
        mv = memoryview(buf).cast("B")
        offset = self._claim(name, len(mv))
        try:
            self._pwrite(mv, offset)
            if self._writeback:
                start_writeback(self._fd, offset, len(mv))
        finally:
            self._release()

    def copy_range_from(
        self, name: str, src_fd: int | RangeReader, src_offset: int, nbytes: int, *, path, block_bytes: int
    ) -> str:
        """Append the next `nbytes` of tensor `name` straight from bytes [src_offset, + nbytes) of the
        open file `src_fd` (`io.copy.copy_range`: in the kernel where it can, else through a buffer of
        `block_bytes`). `path` names the source in errors. Returns the method used."""
        offset = self._claim(name, nbytes)
        try:
            method = copy_range(
                src_fd, src_offset, self._fd, offset, nbytes, path=path, key=name, block_bytes=block_bytes
            )
            if self._writeback:
                start_writeback(self._fd, offset, nbytes)
            return method
        finally:
            self._release()

    def write(self, name: str, data) -> None:
        """Write tensor `name` whole: a torch.Tensor (dtype and shape must match the declaration;
        contiguous) or bytes-like of exactly the declared size."""
        i = self._entry_for_write(name)
        e = self.entries[i]
        if self._written[i]:
            raise self._error(
                "tensor was partly written with write_chunk; finish it with write_chunk", key=name
            )
        torch = sys.modules.get("torch")  # (no tensor exists before torch is imported)
        if torch is not None and isinstance(data, torch.Tensor):
            code = safetensors_code(data.dtype) if dtype_name(data.dtype) in _NAMES else None
            if code != e.dtype:
                raise self._error(f"declared {e.dtype}, got a tensor of {data.dtype}", key=name)
            if tuple(data.shape) != e.shape:
                raise self._error(f"declared shape {list(e.shape)}, got {list(data.shape)}", key=name)
            if data.layout != torch.strided or not data.is_contiguous():
                raise self._error(
                    "tensor is not contiguous", key=name, hint="call `.contiguous()` on it before writing"
                )
            if e.nbytes == 0:
                with self._lock:
                    self._advance(i)
                return
            mv, _keepalive = _tensor_bytes(data)  # _keepalive owns mv's memory until we return
        else:
            mv = memoryview(data).cast("B")
            if len(mv) != e.nbytes:
                raise self._error(f"{len(mv)} bytes supplied, declared size is {e.nbytes}", key=name)
            if e.nbytes == 0:
                with self._lock:
                    self._advance(i)
                return
        self.write_chunk(name, mv)

    @property
    def missing(self) -> list[str]:
        """Declared tensors not (completely) written yet."""
        with self._lock:
            return [e.name for e, done in zip(self.entries, self._complete) if not done]

    def close(self) -> None:
        """Verify every declared byte was written, fsync, close. Idempotent."""
        if self._closed:
            return
        if self._active:
            raise self._error("close while a write is in flight (the writer's callers must finish first)")
        missing = self.missing
        if missing:
            shown = ", ".join(repr(m) for m in missing[:5]) + (
                f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            )
            self.abort()
            raise self._error(
                f"{len(missing)} of {len(self.entries)} declared tensors were not written: {shown}; "
                "the partial file was deleted"
            )
        try:
            size = os.fstat(self._fd).st_size
            if size != self.file_bytes:
                raise self._error(f"file is {size} bytes after writing, expected {self.file_bytes}")
            if self._fsync:
                os.fsync(self._fd)
        except BaseException:
            self.abort()
            raise
        with self._lock:
            self._closed = True
            self._close_fd()

    def abort(self) -> None:
        """Close and delete the partial file (no-op after a successful close). A write still in flight
        in another thread finishes into the unlinked file; the fd is closed after it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                if self._active == 0:
                    self._close_fd()
            finally:
                self._unlink()

    def _unlink(self) -> None:
        remove_file(self.path)

    def __enter__(self) -> StreamingSafetensorsWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
