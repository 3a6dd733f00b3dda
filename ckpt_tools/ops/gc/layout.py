"""The names gc gives a step's directories, and what state a step is in (listings and lock probes only)."""
from __future__ import annotations

import fcntl
import os
from pathlib import Path

from ...formats.dcp.layout import METADATA_NAME
from ...formats.slim.manifest import SLIM_MANIFEST

__all__ = ["TRAINER", "STAGED", "ASIDE", "STEP_LOCK", "OWN_LOCKS", "is_complete", "is_slim", "lock_holder"]

TRAINER = "trainer"
STAGED = ".trainer.gc-slim"       # the slim being written and verified
ASIDE = ".trainer.gc-old"         # the full checkpoint after the swap, being deleted
STEP_LOCK = ".trainer.lock"       # AtomicOutputDir(step_N/trainer)'s lock name
OWN_LOCKS = {STEP_LOCK, f".{STAGED}.lock"}


def is_complete(d: Path) -> bool:
    return (d / METADATA_NAME).is_file()


def is_slim(d: Path) -> bool:
    return (d / SLIM_MANIFEST).is_file()


def lock_holder(lock: Path) -> str | None:
    """The pid text of a live holder of an flock lock file, None when nobody holds it (read-only
    probe: creates nothing)."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
        except OSError:
            return None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


