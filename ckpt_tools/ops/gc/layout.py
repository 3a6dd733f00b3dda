"""The names gc gives a step's directories, and what state a step is in (listings and lock probes only)."""

from __future__ import annotations

from pathlib import Path

from ...formats.dcp.layout import METADATA_NAME
from ...formats.slim.manifest import SLIM_MANIFEST
from ...io.lock import lock_holder

__all__ = ["ASIDE", "OWN_LOCKS", "STAGED", "STEP_LOCK", "TRAINER", "is_complete", "is_slim", "lock_holder"]

TRAINER = "trainer"
STAGED = ".trainer.gc-slim"  # the slim being written and verified
ASIDE = ".trainer.gc-old"  # the full checkpoint after the swap, being deleted
STEP_LOCK = ".trainer.lock"  # AtomicOutputDir(step_N/trainer)'s lock name
OWN_LOCKS = {STEP_LOCK, f".{STAGED}.lock"}


def is_complete(d: Path) -> bool:
    return (d / METADATA_NAME).is_file()


def is_slim(d: Path) -> bool:
    return (d / SLIM_MANIFEST).is_file()
