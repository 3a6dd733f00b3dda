"""Where a DCP checkpoint's files are and how its items are laid out (pure names and arithmetic).

A checkpoint dir holds `.metadata` (a pickle of the whole layout, written last) and `.distcp` data
files, one per saving rank (`__<rank>_0.distcp`). prime-rl saves it as `<outputs>/checkpoints/step_N/
trainer`; a step dir is accepted for its `trainer/`. FSDP2 shards every tensor by dim-0 row blocks
with `torch.chunk` boundaries (`row_chunks`).
"""

from __future__ import annotations

from pathlib import Path

from ...core.errors import MissingPathError, UsageError
from ...io.inputs import as_input, lexists, list_names, scan_tree
from .metadata import METADATA_NAME

__all__ = [
    "METADATA_NAME",
    "METADATA_TMP_TAG",
    "PATCH_PREFIX",
    "data_file_name",
    "extra_bytes",
    "extra_entries",
    "is_checkpoint_path",
    "resolve_checkpoint_dir",
    "row_chunks",
]

# `ckpt set-lr` / `ckpt set` write the new values into `__patch_<n>.distcp` and point .metadata at it
# (formats.dcp.patch); the old values stay in the hard-linked data files, referenced by nothing
PATCH_PREFIX = "__patch_"

METADATA_TMP_TAG = ".tmp-"  # `.metadata.tmp-<pid>-<hex>`: a new metadata before its rename


def row_chunks(rows: int, world_size: int) -> list[tuple[int, int]]:
    """(start, length) of each rank's dim-0 block, `torch.chunk` semantics as FSDP2 uses:
    ceil(rows / W) rows per rank, the last rank the remainder, ranks past the end nothing."""
    if rows == 0:
        return [(0, 0)]
    per = -(-rows // max(1, world_size))
    return [(s, min(per, rows - s)) for s in range(0, rows, per)]


def data_file_name(index: int) -> str:
    return f"__{index}_0.distcp"


def is_checkpoint_path(p: Path) -> bool:
    """A trainer dir, a step dir holding trainer/, or a `.metadata` file itself. lexists, not is_file:
    a `.metadata` that is a FIFO or a dangling link marks a checkpoint the reader then refuses by name."""
    p = as_input(p)
    return (
        lexists(p / METADATA_NAME)
        or lexists(p / "trainer" / METADATA_NAME)
        or (p.name == METADATA_NAME and lexists(p) and not p.is_dir())
    )


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """Accept a trainer dir (holding .metadata) or a prime-rl step dir (holding trainer/)."""
    p = as_input(path)
    if not p.exists():
        raise MissingPathError(p)
    if p.name == METADATA_NAME and not p.is_dir():
        return p.parent
    if lexists(p / METADATA_NAME):
        return p
    if lexists(p / "trainer" / METADATA_NAME):
        return p / "trainer"
    raise UsageError(
        "not a DCP checkpoint: no .metadata here or in trainer/",
        path=p,
        hint="pass a prime-rl checkpoint dir like outputs/checkpoints/step_N/trainer",
    )


def extra_entries(ckpt_dir: Path, data_files, *, exclude=()) -> list[str]:
    """Entries of a checkpoint dir that are neither its metadata nor data files: prime-rl's sft
    `dataloader/` folder and anything else a user put there travel along with a copy of the checkpoint.
    Not: hidden entries (`.metadata.bak-*` backups and temp files of our own surgery), `.distcp` files
    (referenced or stale), the `data_files`, and the names in `exclude`. Each is checked as an input now
    (`inputs.scan_tree`: no FIFO, device, socket or symlink out of the checkpoint)."""
    out = []
    for name in list_names(ckpt_dir):
        if name == METADATA_NAME or name in data_files or name in exclude:
            continue
        if name.startswith(".") or name.endswith(".distcp"):
            continue
        scan_tree(as_input(ckpt_dir) / name, root=ckpt_dir, what="checkpoint entry")
        out.append(name)
    return out


def extra_bytes(ckpt_dir: Path, names) -> int:
    """Bytes a copy of the extra entries `names` writes."""
    return sum(
        size
        for n in names
        for _p, size in scan_tree(as_input(ckpt_dir) / n, root=ckpt_dir, what="checkpoint entry")
    )
