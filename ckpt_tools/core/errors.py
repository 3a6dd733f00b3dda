"""Typed errors. Every error we raise on purpose is a CkptError: the CLI prints its message as one
line (no traceback unless -v) and exits with its exit_code. Messages name the file and/or key and
end with what to do about it."""

from __future__ import annotations

from pathlib import Path

__all__ = [
    "MAX_KEY_CHARS",
    "MAX_MESSAGE_CHARS",
    "MAX_PATH_CHARS",
    "AlphaError",
    "ChecksumError",
    "CkptError",
    "DiskSpaceError",
    "FormatError",
    "LockedError",
    "MissingFileError",
    "MissingPathError",
    "OutputExistsError",
    "RankFailed",
    "TruncatedFileError",
    "UnsafeInputError",
    "UnsafePickleError",
    "UsageError",
]


class CkptError(Exception):
    """Base of every error we raise on purpose. CLI prints `error: <message>` and exits with .exit_code."""

    exit_code = 1

    def __init__(
        self, message: str, *, path: str | Path | None = None, key: str | None = None, hint: str | None = None
    ):
        self.message = message
        self.path = str(path) if path is not None else None
        self.key = key
        self.hint = hint
        super().__init__(self.render())

    def render(self) -> str:
        # Every part is clipped: a key, path or message can come from a stranger's file, and one
        # error must stay one readable line (a crafted key once made a 400 MB error line).
        where = []
        if self.path:
            where.append(_clip(self.path, MAX_PATH_CHARS))
        if self.key:
            where.append(f"key {_clip(repr(self.key), MAX_KEY_CHARS)}")
        message = _clip(self.message, MAX_MESSAGE_CHARS)
        text = ": ".join([", ".join(where), message]) if where else message
        if self.hint:
            text += f" ({_clip(self.hint, MAX_MESSAGE_CHARS)})"
        return text


MAX_PATH_CHARS = 1000
MAX_KEY_CHARS = 300
MAX_MESSAGE_CHARS = 2000


def _clip(text: str, limit: int) -> str:
    text = str(text).replace("\n", "\\n").replace("\r", "\\r")  # one error is one line
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [{len(text) - limit:,} more characters]"


class UsageError(CkptError):
    exit_code = 2


class MissingPathError(UsageError):
    """A path the user named that is not there: one message, `no such file or directory: P`, and one
    exit code (2) from every command and every argument."""

    def __init__(self, path: str | Path, *, hint: str | None = None):
        super().__init__(f"no such file or directory: {_clip(str(path), MAX_PATH_CHARS)}", hint=hint)
        self.path = str(path)

    def render(self) -> str:  # the path is in the message already
        return self.message + (f" ({_clip(self.hint, MAX_MESSAGE_CHARS)})" if self.hint else "")


class FormatError(CkptError):
    """Malformed or inconsistent file contents."""


class MissingFileError(FormatError):
    pass


class TruncatedFileError(FormatError):
    pass


class UnsafePickleError(FormatError):
    pass


class ChecksumError(FormatError):
    """Bytes that disagree with the checksum stored for them (a DCP item's zip CRC-32, a slim manifest's
    kept-item CRC, a SHA256SUMS line, a Hub blob's name): damaged after they were written."""


class UnsafeInputError(FormatError):
    """An input that is not what it claims to be, refused before it is opened: a symlink that
    leaves its tree, a FIFO, device or socket, a sparse file, a file too large to read whole."""


class DiskSpaceError(CkptError):
    pass


class OutputExistsError(CkptError):
    pass


class LockedError(CkptError):
    pass


class RankFailed(CkptError):
    """Under torchrun: another rank failed or stopped while this one waited for it; nothing was committed."""


class AlphaError(CkptError):
    """LoRA alpha is not stored in a DCP checkpoint and could not be resolved."""
