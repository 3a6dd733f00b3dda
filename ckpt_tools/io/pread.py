"""The one positioned read: `pread_into` (short reads looped, the file ending first is a named error).

Nothing here decodes or opens: a reader asks for `[offset, offset + n)` of an fd that
`inputs.open_input` checked, straight into the caller's buffer (one copy, from the page cache), and
gets a `TruncatedFileError` naming the file and key when the file ends first. The fd of a remote
object's placeholder (`io.remote`) is served by range requests instead, through the same two calls.
`inputs.OpenFiles`
holds the fds of one input tree and reads through here.
"""

from __future__ import annotations

import os

from ..core.errors import TruncatedFileError
from . import remote

__all__ = ["MAX_IO_BYTES", "pread_exact", "pread_into"]

# Linux moves at most 0x7ffff000 bytes per read call; larger requests come back short.
MAX_IO_BYTES = 0x7FFFF000


def pread_into(
    fd: int, buf, offset: int, *, path, key: str | None = None, hint: str = "re-copy or re-download the file"
) -> None:
    """Fill `buf` (anything a memoryview takes) from `fd` at `offset`, looping over short reads; the
    file ending first is a TruncatedFileError naming `path` and `key`."""
    mv = memoryview(buf).cast("B")
    if remote.active():
        obj = remote.object_of_fd(fd)
        if obj is not None:  # a placeholder of a remote object: the range is fetched (`io.remote`)
            obj.read_into(mv, offset)
            return
    done, total = 0, len(mv)
    while done < total:
        n = os.preadv(fd, [mv[done : done + MAX_IO_BYTES]], offset + done)
        if n == 0:
            raise TruncatedFileError(
                f"file ended at byte {offset + done} while reading bytes [{offset}, {offset + total}); "
                "it shrank or was truncated after it was opened",
                path=path,
                key=key,
                hint=hint,
            )
        done += n


def pread_exact(
    fd: int,
    offset: int,
    n: int,
    *,
    path,
    key: str | None = None,
    hint: str = "re-copy or re-download the file",
) -> bytes:
    """Bytes [offset, offset + n) of `fd` (see `pread_into`). One syscall when the file has them all
    (the thousands of small items of a checkpoint), the rest looped."""
    if remote.active() and remote.object_of_fd(fd) is not None:
        buf = bytearray(n)
        pread_into(fd, buf, offset, path=path, key=key, hint=hint)
        return bytes(buf)
    data = os.pread(fd, min(n, MAX_IO_BYTES), offset)
    if len(data) == n:
        return data
    buf = bytearray(n)  # short: read it again whole, looping (and naming the whole range if it ends)
    pread_into(fd, buf, offset, path=path, key=key, hint=hint)
    return bytes(buf)
