"""The one positioned read: `pread_into` (short reads looped, the file ending first is a named error).

Nothing here decodes or opens: a reader asks for `[offset, offset + n)` of an fd that
`inputs.open_input` checked, straight into the caller's buffer (one copy, from the page cache), and
gets a `TruncatedFileError` naming the file and key when the file ends first. A range reader
that is not an fd (a URL's object: `io.remote_object.RemoteObject`) is read by its own `read_into`
(range requests), through the same two calls. `inputs.OpenFiles` holds the readers of one input
tree and reads through here.
"""

from __future__ import annotations

import os
from typing import Protocol

from ..core.errors import TruncatedFileError

__all__ = ["MAX_IO_BYTES", "RangeReader", "pread_exact", "pread_into"]


class RangeReader(Protocol):
    """A file read by range that is not a local fd (`io.remote_object.RemoteObject`): its size, as checked
    when it was opened, and its reads."""

    size: int

    def read_into(self, buf, offset: int) -> None: ...


# Linux moves at most 0x7ffff000 bytes per read call; larger requests come back short.
MAX_IO_BYTES = 0x7FFFF000


def pread_into(
    fd: int | RangeReader,
    buf,
    offset: int,
    *,
    path,
    key: str | None = None,
    hint: str = "re-copy or re-download the file",
) -> None:
    """Fill `buf` (anything a memoryview takes) from `fd` at `offset`, looping over short reads; the
    file ending first is a TruncatedFileError naming `path` and `key`."""
    mv = memoryview(buf).cast("B")
    if not isinstance(fd, int):  # a remote object: the range is fetched (`io.remote_object`)
        fd.read_into(mv, offset)
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
    fd: int | RangeReader,
    offset: int,
    n: int,
    *,
    path,
    key: str | None = None,
    hint: str = "re-copy or re-download the file",
) -> bytes:
    """Bytes [offset, offset + n) of `fd` (see `pread_into`). One syscall when the file has them all
    (the thousands of small items of a checkpoint), the rest looped."""
    if not isinstance(fd, int):
        buf = bytearray(n)
        pread_into(fd, buf, offset, path=path, key=key, hint=hint)
        return bytes(buf)
    data = os.pread(fd, min(n, MAX_IO_BYTES), offset)
    if len(data) == n:
        return data
    buf = bytearray(n)  # short: read it again whole, looping (and naming the whole range if it ends)
    pread_into(fd, buf, offset, path=path, key=key, hint=hint)
    return bytes(buf)
