"""Typed errors. Every error we raise on purpose is a CkptError: the CLI prints its message as one
line (no traceback unless -v) and exits with its exit_code. Messages name the file and/or key and
end with what to do about it."""
from __future__ import annotations

from pathlib import Path


class CkptError(Exception):
    """Base of every error we raise on purpose. CLI prints `error: <message>` and exits with .exit_code."""

    exit_code = 1

    def __init__(self, message: str, *, path: str | Path | None = None, key: str | None = None,
                 hint: str | None = None):
        self.message = message
        self.path = str(path) if path is not None else None
        self.key = key
        self.hint = hint
        super().__init__(self.render())

    def render(self) -> str:
        where = []
        if self.path:
            where.append(self.path)
        if self.key:
            where.append(f"key {self.key!r}")
        text = (": ".join([", ".join(where), self.message]) if where else self.message)
        if self.hint:
            text += f" ({self.hint})"
        return text


class UsageError(CkptError):
    exit_code = 2


class FormatError(CkptError):
    """Malformed or inconsistent file contents."""


class MissingFileError(FormatError):
    pass


class TruncatedFileError(FormatError):
    pass


class UnsafePickleError(FormatError):
    pass


class DiskSpaceError(CkptError):
    pass


class OutputExistsError(CkptError):
    pass


class LockedError(CkptError):
    pass


class AlphaError(CkptError):
    """LoRA alpha is not stored in a DCP checkpoint and could not be resolved."""
