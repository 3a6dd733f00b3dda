"""Which files of a model dir travel into a model we derive from it (config, generation config,
tokenizer, chat template, README, ...): regular top-level files that are not weights, not an index, not
hidden and not a SHA256SUMS (the derived model writes its own). Everything else at the top level is
skipped (and reported): extra weight files (a stale pickle next to new weights would be loaded by
someone), subdirectories, hidden entries."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from ...io.inputs import as_input, check_input
from .digests import SUMS_NAME
from .names import is_weight_like

__all__ = ["carry_files", "classify_entries"]


def classify_entries(d: Path, exclude: Collection[str] = ()) -> list[tuple[str, str]]:
    """(name, "carry" | "skip") for every top-level entry of `d` except those in `exclude`, by name.
    `is_file()` follows symlinks: an HF cache snapshot is all symlinks into blobs/."""
    out = []
    for entry in sorted(as_input(d).iterdir()):
        if entry.name in exclude:
            continue
        # SHA256SUMS describes the files of its own dir: a derived model writes its own
        carry = (
            entry.is_file()
            and not entry.name.startswith(".")
            and not is_weight_like(entry.name)
            and entry.name != SUMS_NAME
        )
        out.append((entry.name, "carry" if carry else "skip"))
    return out


def carry_files(d: Path, exclude: Collection[str] = ()) -> tuple[list[Path], list[str]]:
    """(the files to carry, the names skipped). Each carried file is checked as an input of the tree
    `d` now: a symlink out of it is refused before anything runs."""
    d = as_input(d)
    carry, skip = [], []
    for name, kind in classify_entries(d, exclude):
        if kind == "carry":
            check_input(d / name, root=d, what="model file")
            carry.append(d / name)
        else:
            skip.append(name)
    return carry, skip
