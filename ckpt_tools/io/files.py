"""New files, the one rule of the write side: every file ckpt-tools writes is created fresh with
`O_CREAT|O_EXCL|O_NOFOLLOW` (`create_new`), so nothing is ever written through a symlink or a hard
link someone planted. A single file that must replace another (a patched `.metadata`, an index) is
written under a fresh temp name beside it, fsynced, renamed over the target, and the directory fsynced
(`atomic_write_bytes`): readers see the old file or the new one, never a part.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import secrets
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Literal

__all__ = [
    "WrittenFileHasher",
    "atomic_write_bytes",
    "atomic_write_text",
    "create_new",
    "exchange_paths",
    "fsync_path",
    "fsync_tree",
    "hash_written_file",
    "link_entry",
    "make_dirs",
    "pwrite_all",
    "remove_empty_dir",
    "remove_file",
    "remove_path",
    "rename_entry",
    "start_writeback",
    "stdout_to_devnull",
    "temp_name",
    "write_new_file",
]

_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def create_new(path: str | os.PathLike, mode: int = 0o644) -> int:
    """A write fd of a NEW file at `path` (O_CREAT|O_EXCL|O_NOFOLLOW): fails with FileExistsError
    if anything, a symlink included, is there. Every file ckpt-tools writes is created here."""
    return os.open(path, _NEW_FILE_FLAGS, mode)


def _write_all(fd: int, raw: bytes) -> None:
    view = memoryview(raw).cast("B")
    done = 0
    while done < len(view):
        done += os.write(fd, view[done:])


def pwrite_all(fd: int, data, offset: int) -> None:
    """Write all of `data` at byte `offset` of the open file `fd` (positioned: threads writing disjoint
    ranges of one file need no lock and no shared file position)."""
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done : done + (1 << 30)], offset + done)


def write_new_file(path: str | os.PathLike, data: bytes | str) -> int:
    """Write `data` (str: UTF-8) into a new file at `path`; returns its size."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    fd = create_new(path)
    try:
        _write_all(fd, raw)
    finally:
        os.close(fd)
    return len(raw)


def hash_written_file(
    path: str | os.PathLike, *, algorithm: str = "sha256", block_bytes: int = 8 << 20
) -> str:
    """The hex digest of a file this command has just written (its bytes are in the page cache), read
    sequentially in `block_bytes` blocks (memory: one block). Not for inputs: those are read through
    `inputs`."""
    import hashlib

    h = hashlib.new(algorithm)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    try:
        buf = bytearray(block_bytes)
        view = memoryview(buf)
        while True:
            n = os.readv(fd, [view])
            if not n:
                break
            h.update(view[:n])
    finally:
        os.close(fd)
    return h.hexdigest()


class WrittenFileHasher:
    """The digest of a file this command is writing, hashed as its prefix becomes final: `hash_to(end)`
    reads bytes [hashed so far, end) back (from the page cache: they were just written) and hashes them;
    `hexdigest()` ends it. Calls come from one thread at a time (a writer's own hashing thread), so a
    file written out of order by many workers is hashed in order, behind them, and only what was
    written last is left to hash when it closes. Memory: one block."""

    def __init__(self, path: str | os.PathLike, *, algorithm: str = "sha256", block_bytes: int = 8 << 20):
        import hashlib

        self.path = Path(path)
        self._h = hashlib.new(algorithm)
        self._pos = 0
        self._fd: int | None = None
        self._block = block_bytes
        self._buf: memoryview | None = None

    def hash_to(self, end: int) -> None:
        from .pread import pread_into

        if end <= self._pos:
            return
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
            self._buf = memoryview(bytearray(self._block))
        buf = self._buf
        assert buf is not None  # made with the fd
        while self._pos < end:
            view = buf[: min(self._block, end - self._pos)]
            pread_into(self._fd, view, self._pos, path=self.path)
            self._h.update(view)
            self._pos += len(view)

    def hexdigest(self) -> str:
        self.close()
        return self._h.hexdigest()

    def close(self) -> None:
        fd, self._fd, self._buf = self._fd, None, None
        if fd is not None:
            os.close(fd)

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory by path (a directory's fsync makes renames in it durable)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start writeback of the range's dirty pages, do not wait
_sync_file_range: Callable[[int, int, int, int], int] | Literal[False] | None = None


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing bytes [offset, offset + nbytes) of `fd` to disk now, without
    waiting (`sync_file_range(SYNC_FILE_RANGE_WRITE)`). A writer that fsyncs at the end then finds the
    disk busy from its first block instead of waiting for its whole output at once: otherwise the
    kernel starts writeback only once dirty pages pass `dirty_background_ratio` (10% of RAM) or are
    30 s old. Advisory: a no-op where the call is missing or refused. The fsync is still what makes
    the bytes durable."""
    global _sync_file_range
    if _sync_file_range is None:
        try:
            f = ctypes.CDLL(None, use_errno=True).sync_file_range
            f.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
            f.restype = ctypes.c_int
            _sync_file_range = f
        except (OSError, AttributeError):
            _sync_file_range = False
    if _sync_file_range and nbytes > 0:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def fsync_tree(root: Path) -> None:
    """fsync every regular file and directory under `root` (cheap for files already fsynced)."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                fsync_path(p)
        fsync_path(dirpath)


def temp_name(prefix: str) -> str:
    """`<prefix><pid>-<hex>`: unique, and the pid tells a later run whether its writer is alive."""
    return f"{prefix}{os.getpid()}-{secrets.token_hex(4)}"


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, temp_prefix: str | None = None) -> None:
    """Write `data` to `path` via a new temp file in the same directory (`<temp_prefix><pid>-<hex>`,
    default `.<name>.tmp-`), fsync, rename (replacing `path` if it exists: the rename replaces a
    symlink, never follows it), fsync the directory. Readers see the old file or the new one."""
    path = Path(path)
    tmp = path.parent / temp_name(temp_prefix if temp_prefix is not None else f".{path.name}.tmp-")
    fd = create_new(tmp)
    try:
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    fsync_path(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def remove_path(path: Path) -> None:
    """Delete a file, link or directory tree (a link is removed, never followed)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def remove_file(path: str | os.PathLike) -> bool:
    """Remove one directory entry that is not a directory (a link itself, never its target); False when
    it was already gone."""
    try:
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


def link_entry(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """A second name for the entry `src` (a hard link of it, never of a symlink's target); `dst` must
    not exist."""
    os.link(src, dst, follow_symlinks=False)


def rename_entry(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename within one filesystem (atomic; replaces an existing file `dst`, or an empty dir)."""
    os.rename(src, dst)


def remove_empty_dir(path: str | os.PathLike) -> None:
    """Remove a directory that must already be empty (never a link: rmdir refuses one)."""
    os.rmdir(path)


def make_dirs(path: str | os.PathLike) -> Path:
    """A directory and its missing parents (an existing one is fine)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    return path


def stdout_to_devnull() -> None:
    """Point file descriptor 1 at /dev/null: the reader of a pipe left (`ckpt ... | head`), or this rank's
    report is the leader's; later writes must not fail."""
    fd = os.open(os.devnull, os.O_WRONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.dup2(fd, sys.stdout.fileno())
    finally:
        os.close(fd)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def exchange_paths(a: str | os.PathLike, b: str | os.PathLike) -> None:
    """Swap two existing paths of one filesystem atomically (Linux `renameat2(RENAME_EXCHANGE)`):
    at every instant each name holds one of the two entries, never neither. Raises OSError
    (ENOSYS/EINVAL/ENOTSUP) where the kernel, libc or filesystem cannot do it; callers decide how
    to fall back."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except AttributeError:
        raise OSError(errno.ENOSYS, "renameat2 is not available in this libc") from None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"cannot exchange {a} and {b}: {os.strerror(e)}")
    for d in {Path(a).parent, Path(b).parent}:
        fsync_path(d)
