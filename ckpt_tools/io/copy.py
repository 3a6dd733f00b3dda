"""Copies of input files into new output files: every source read through `inputs.open_input` (checked:
no symlink out of its tree, no FIFO), every destination created new (`files.create_new`); and
`copy_range`, a byte range of one open file into another at an offset, in the kernel. A source may be a
URL's file (`io.remote`): its bytes are fetched by range (never linked, reflinked or copied in the kernel),
or, into an output bound for a URL, left for the upload to copy server-side (`link_or_copy`)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from pathlib import Path

from ..core.errors import FormatError, TruncatedFileError
from . import inputs, upload
from .files import create_new, make_dirs, pwrite_all
from .pread import RangeReader, pread_exact, pread_into
from .remote import RemotePath

__all__ = [
    "copy_input_file",
    "copy_input_tree",
    "copy_patched",
    "copy_range",
    "link_input_tree",
    "link_or_copy",
    "link_writes_bytes",
]

_FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)


def copy_input_file(
    src: str | os.PathLike, dst: str | os.PathLike, *, root: str | os.PathLike | None, what: str = "file"
) -> int:
    """Copy the regular file `src` (of the tree `root`, checked by `inputs.open_input`) into a NEW
    file `dst` (`create_new`). Returns the bytes copied."""
    fd = inputs.open_input(src, root=root, what=what)
    try:
        out = create_new(dst)
        try:
            done = 0
            if not isinstance(fd, int):  # a remote object: fetched by range, written here
                size = fd.size
                while done < size:
                    b = pread_exact(fd, done, min(1 << 24, size - done), path=src)
                    os.write(out, b)
                    done += len(b)
                return done
            while True:
                n = os.sendfile(out, fd, done, 1 << 30) if hasattr(os, "sendfile") else 0
                if n == 0:
                    break
                done += n
            if done != os.fstat(fd).st_size:  # no sendfile here (or it stopped short): plain copy
                while True:
                    b = os.pread(fd, 1 << 24, done)
                    if not b:
                        break
                    os.write(out, b)
                    done += len(b)
        finally:
            os.close(out)
    finally:
        inputs.close_input(fd)
    return done


def copy_input_tree(
    src: str | os.PathLike, dst: str | os.PathLike, *, root: str | os.PathLike, what: str = "entry"
) -> int:
    """Copy a file or directory `src` of the tree `root` to the new path `dst`: directories are
    created, regular files copied by content (`copy_input_file`; a symlink inside the tree is copied
    as the file it names). Every entry is checked first (`inputs.scan_tree`): one that leaves the
    tree or is not a regular file/directory refuses the whole copy. Returns the bytes copied."""
    src, dst = inputs.as_input(src), Path(dst)
    files = inputs.scan_tree(src, root=root, what=what)
    if isinstance(src, RemotePath):  # a URL's tree: its directories are those its files are in
        if src.is_dir():
            os.mkdir(dst)
        for f, _size in files:
            for d in reversed(f.relative_to(src).parents[:-1]):
                if not (dst / d).is_dir():
                    os.mkdir(dst / d)
    elif os.path.isdir(src):
        os.mkdir(dst)
        for dirpath, dirnames, _ in os.walk(src, followlinks=True):
            rel = Path(dirpath).relative_to(src)
            for d in sorted(dirnames):
                os.mkdir(dst / rel / d)
    total = 0
    for f, _size in files:
        target = dst if f == src else dst / f.relative_to(src)
        total += copy_input_file(f, target, root=root, what=what)
    return total


def link_or_copy(src, dst: Path, *, root) -> str:
    """Hard link the data file `src` (of the tree `root`, checked as an input: no symlink out of it,
    no FIFO) at the new path `dst`; across filesystems (or where links are refused) a reflink, else a
    copy. Returns the method used. Never opens `src` for writing; `dst` is new.

    A URL's file (`io.remote`): into an output bound for a URL, it is left for the upload to copy
    (`upload.copy_later`; "remote": server-side where the store offers it, nothing fetched here);
    anywhere else its bytes are fetched ("fetch")."""
    if inputs.is_url(src):
        obj = inputs.remote_source(src)
        if upload.is_staged(dst):
            upload.copy_later(dst, obj)
            return "remote"
        copy_input_file(src, dst, root=root, what="data file")
        return "fetch"
    real, _st = inputs.check_input(src, root=root, what="data file")
    try:
        os.link(real, dst, follow_symlinks=False)  # the checked file itself, never a link's target
        return "hardlink"
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
    try:
        fs = inputs.open_input(src, root=root, what="data file")
        try:
            fd = create_new(dst)
            try:
                fcntl.ioctl(fd, _FICLONE, fs)  # type: ignore[arg-type]  # a local file's fd: no URL here
            finally:
                os.close(fd)
        finally:
            inputs.close_input(fs)
        return "reflink"
    except OSError:
        with contextlib.suppress(FileNotFoundError):
            dst.unlink()
    copy_input_file(src, dst, root=root, what="data file")
    return "copy"


def link_input_tree(
    src: Path, dst: Path, *, root: Path, skip: frozenset[Path] = frozenset()
) -> dict[str, int]:
    """Every regular file of the tree `src` (of the tree `root`, each checked as `inputs.scan_tree` checks
    it) at its place under the new dir `dst`, by `link_or_copy`, but the files in `skip` (absolute paths
    under `src`); directories made (empty ones too). Returns {method: files}."""
    counts: dict[str, int] = {}
    files = inputs.scan_tree(src, root=root, what="checkpoint entry")
    make_dirs(dst)
    if isinstance(src, RemotePath):  # a URL's tree: its directories are those its files are in
        for f, _size in files:
            for d in reversed(f.relative_to(src).parents[:-1]):
                make_dirs(dst / d)
    else:
        for dirpath, dirnames, _ in os.walk(src, followlinks=True):
            for d in sorted(dirnames):
                make_dirs(dst / Path(dirpath).relative_to(src) / d)
    for f, _size in files:
        if f in skip:
            continue
        m = link_or_copy(f, dst / f.relative_to(src), root=root)
        counts[m] = counts.get(m, 0) + 1
    return counts


def _clone_or_copy(fs: int | RangeReader, fd: int, size: int, src) -> str:
    """The whole of `fs` into the empty `fd`: a reflink (the extents shared, nothing copied) where the
    filesystem has them, else by `copy_range` (in the kernel; a URL's object fetched by range)."""
    if not isinstance(fs, int):
        return copy_range(fs, 0, fd, 0, size, path=src, block_bytes=1 << 26)
    try:
        fcntl.ioctl(fd, _FICLONE, fs)
        return "reflink"
    except OSError:
        return copy_range(fs, 0, fd, 0, size, path=src, block_bytes=1 << 26)


def copy_patched(
    src: Path, dst: Path, *, root: Path, edits: list[tuple[int, bytes, bytes]], what: str = "file"
) -> str:
    """A NEW file `dst` equal to the input `src` but at each edit `(offset, old, new)` (`old` and `new` of
    one length): cloned or copied whole (`_clone_or_copy`), each `old` checked in the copy, then `new`
    written over it. A copy whose bytes at an edit are not `old` (the source changed after it was planned)
    raises, naming the offset. Returns the copy's method."""
    fs = inputs.open_input(src, root=root, what=what)
    try:
        size = inputs.reader_size(fs)
        fd = create_new(dst)
        try:
            method = _clone_or_copy(fs, fd, size, src)
            check = os.open(dst, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
            try:
                for offset, old, new in edits:
                    if len(old) != len(new) or pread_exact(check, offset, len(old), path=dst) != old:
                        raise FormatError(
                            f"bytes [{offset}, {offset + len(old)}) are not what was planned: the file "
                            "changed after it was read",
                            path=src,
                            hint="run the command again once nothing writes the checkpoint",
                        )
                    pwrite_all(fd, new, offset)
            finally:
                os.close(check)
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        inputs.close_input(fs)
    return method


def link_writes_bytes(src_root, dst_dir: Path) -> bool:
    """Whether `link_or_copy` of the files of `src_root` into `dst_dir` writes their bytes there (for the
    free-space check): another filesystem, or a remote input going to a local output."""
    if inputs.is_url(src_root):
        return not upload.is_staged(dst_dir)
    try:
        return os.stat(src_root).st_dev != os.stat(dst_dir).st_dev
    except OSError:
        return True


# copy_file_range refused for this pair of files (another filesystem, an old kernel, a filesystem
# without it): the range is copied through a buffer instead.
_NO_KERNEL_COPY = {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EBADF}


def copy_range(
    src_fd: int | RangeReader,
    src_offset: int,
    dst_fd: int,
    dst_offset: int,
    nbytes: int,
    *,
    path,
    key: str | None = None,
    block_bytes: int,
) -> str:
    """Bytes [src_offset, src_offset + nbytes) of `src_fd` to `dst_offset` of `dst_fd`. By
    `os.copy_file_range`, page cache to page cache in the kernel: the bytes never enter this process's
    memory (RSS), and nothing is decoded. Where the kernel refuses it, pread + pwrite through one buffer
    of at most `block_bytes`. Calls move at most `block_bytes` each, so a signal is seen between them.
    The source ending first is a TruncatedFileError naming `path` and `key`. Returns the method."""
    done = 0
    if hasattr(os, "copy_file_range") and isinstance(src_fd, int):
        try:
            while done < nbytes:
                n = os.copy_file_range(
                    src_fd, dst_fd, min(block_bytes, nbytes - done), src_offset + done, dst_offset + done
                )
                if n == 0:
                    _ended(path, key, src_offset, done, nbytes)
                done += n
            return "copy_file_range"
        except OSError as exc:
            if exc.errno not in _NO_KERNEL_COPY:
                raise
    buf = memoryview(bytearray(min(block_bytes, nbytes - done)))
    while done < nbytes:
        n = min(len(buf), nbytes - done)
        pread_into(src_fd, buf[:n], src_offset + done, path=path, key=key)
        view, at = buf[:n], 0
        while at < n:
            at += os.pwrite(dst_fd, view[at:], dst_offset + done + at)
        done += n
    return "pread+pwrite"


def _ended(path, key, offset: int, done: int, total: int):
    raise TruncatedFileError(
        f"file ended at byte {offset + done} while copying bytes [{offset}, {offset + total}); "
        "it shrank or was truncated after it was opened",
        path=path,
        key=key,
        hint="re-copy or re-download the file",
    )
