"""The slim manifest: what `ckpt slim` dropped from a checkpoint and how to rebuild it bit-exactly.

A slim checkpoint is a DCP dir holding every storage item of the original but the frozen base weights
(copied verbatim), plus `ckpt-slim-manifest.json` beside `.metadata`: for every dropped tensor its
key, planner path, shape, dtype, original chunk layout and its identification, the identity of the base
model it came from, and the CRC-32 of every kept item's stored bytes (`kept_crc32`, by `kept_item_id`;
optional, so manifests written before it still read). It is NOT loadable by prime-rl's strict DCP loader
on its own (`Missing key in checkpoint state_dict`): the manifest says so, `ckpt inspect` says so; `ckpt
rehydrate` rebuilds the full checkpoint from the base and proves each tensor against its identification.

A dropped tensor is identified by one or both of (`IDENTIFICATION`, recorded in the manifest too):
- `crc32`: per chunk (in `chunks` order), the CRC-32 its item's zip stores for the chunk's payload (the
  chunk's bytes in row-major order, `CRC_INPUT`), read from the item's central directory (tens of bytes;
  the payload is not read). Recorded for every tensor whose chunks are row blocks. It detects accidental
  change (another base revision, a damaged or wrong file): two different payloads share a CRC-32 with
  probability 2^-32; it is no defence against a crafted input.
- `sha256`: of the whole tensor's row-major bytes (`HASH_INPUT`). With `--base` it is the sha256 of the
  base's upcast, which slim proved equal (chunk by chunk, by CRC-32) to the checkpoint's items: rehydrate
  then proves cryptographically that it rebuilt exactly that upcast. Without a base it is recorded only
  for a tensor whose chunks are not row blocks (read and hashed).
Version 1 manifests have a sha256 for every tensor and no crc32; a manifest where some tensor has no
sha256 is version 2 (a version-1 reader would call it damaged); one where every tensor has a sha256 is
still written as version 1, which every reader of version 1 reads correctly (it ignores `crc32`).
`ckpt set-lr` / `ckpt set` on a slim record the CRC-32s of the items they write into a patch file under
`patched_crc32` (by the patch file's name: `with_patch`), beside what slim recorded; such a manifest is
version 3, which older readers refuse by its version.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from ...core.dtypes import ITEMSIZE
from ...core.errors import CkptError, FormatError, UsageError
from ...io.inputs import MAX_TABLE_VALUES, as_input, lexists, read_json
from ...io.remote_display import display
from ...io.remote_url import redact

__all__ = [
    "CRC_INPUT",
    "HASH_INPUT",
    "IDENTIFICATION",
    "KEPT_CRC_INPUT",
    "MANIFEST_FORMAT",
    "MANIFEST_VERSION",
    "NOT_LOADABLE",
    "PATCHED_VERSION",
    "READABLE_VERSIONS",
    "SLIM_MANIFEST",
    "ChunkLayout",
    "DroppedId",
    "DroppedTensor",
    "Manifest",
    "build_manifest",
    "is_slim",
    "kept_item_id",
    "read_manifest",
    "with_patch",
]

SLIM_MANIFEST = "ckpt-slim-manifest.json"  # beside .metadata
MANIFEST_FORMAT = "ckpt-tools/slim-manifest"
MANIFEST_VERSION = 2  # what slim writes; a manifest readable by version-1 readers is written as 1
PATCHED_VERSION = 3  # a slim set-lr / set changed since: older readers refuse it by version, not as "damaged"
READABLE_VERSIONS = (1, 2, 3)
NOT_LOADABLE = (
    "SLIM checkpoint: the frozen base weights were removed. It is NOT loadable by prime-rl's "
    "strict loader on its own; run `ckpt rehydrate SLIM OUT --base BASE` to rebuild the full "
    "checkpoint, then resume from OUT."
)
HASH_INPUT = "the tensor's bytes in its stored dtype, row-major (C order), little-endian"
KEPT_CRC_INPUT = "the storage item's bytes as stored in the data file (the whole torch.save archive)"
CRC_INPUT = (
    "per chunk, in `chunks` order: the CRC-32 its item's zip stores for the chunk's data/0 record (the "
    "chunk's bytes in its stored dtype, row-major, little-endian), read from the item's central directory"
)
IDENTIFICATION = {
    "crc32": "detects accidental change of a chunk (a wrong base revision, damage): two different payloads "
    "share "
    "a CRC-32 with probability 2^-32; not a defence against a crafted input",
    "sha256": "cryptographic identity of the whole tensor; with a verified base it is the base upcast's, "
    "which slim "
    "proved equal to the checkpoint's items chunk by chunk (by CRC-32)",
}


def kept_item_id(key: str, chunk_offsets) -> str:
    """How the manifest names one kept storage item: its key, and for a tensor chunk its offsets
    (`key@0,0`): a tensor of several chunks has one item per chunk."""
    return key if chunk_offsets is None else f"{key}@{','.join(str(int(o)) for o in chunk_offsets)}"


def is_slim(ckpt_dir: Path) -> bool:
    return (as_input(ckpt_dir) / SLIM_MANIFEST).is_file()


@dataclass(frozen=True)
class ChunkLayout:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str


@dataclass(frozen=True)
class DroppedId:
    """How one dropped tensor is identified: the sha256 of its row-major bytes and/or the CRC-32 its items
    store per chunk (in its `chunks` order); at least one."""

    sha256: str | None
    crc32: tuple[int, ...] | None


@dataclass(frozen=True)
class DroppedTensor:
    key: str
    path: tuple
    hf_name: str
    shape: tuple[int, ...]
    dtype: str  # "float32" (torch dtype name without "torch.")
    chunks: tuple[ChunkLayout, ...]
    nbytes: int


def _id_json(ident: DroppedId) -> dict:
    return {
        **({"sha256": ident.sha256} if ident.sha256 is not None else {}),
        **({"crc32": list(ident.crc32)} if ident.crc32 is not None else {}),
    }


def build_manifest(
    layout,
    base: dict | None,
    ids: dict[str, DroppedId],
    base_verified: bool,
    kept_crc32: dict[str, int] | None = None,
) -> dict:
    """The manifest of a slim checkpoint (`layout`: a `partition.SlimLayout`): every dropped tensor (key,
    path, shape, dtype, chunk layout, its `DroppedId`), the base it can be rebuilt from, and every kept
    item's CRC-32 (`kept_item_id` -> CRC of its stored bytes: rehydrate proves what it copies)."""
    plan = layout
    version = 1 if all(ids[d.key].sha256 is not None for d in plan.dropped) else MANIFEST_VERSION
    kept = (
        {}
        if kept_crc32 is None
        else {
            "kept_crc32": {
                "algorithm": "crc32",
                "input": KEPT_CRC_INPUT,
                "items": dict(sorted(kept_crc32.items())),
            }
        }
    )
    return {
        "format": MANIFEST_FORMAT,
        "version": version,
        "loadable_by_prime_rl": False,
        "note": NOT_LOADABLE,
        # (a URL's local stand-in shown as the URL: io.remote)
        "source": {
            "path": redact(display(plan.source)),
            "bytes": plan.source_bytes,
            "data_files": list(plan.data_files),
        },
        "base": dict(base or {}, verified=base_verified) if base else None,
        "world_size": plan.world_size,
        "hash": {"algorithm": "sha256", "input": HASH_INPUT},
        "chunk_crc32": {"algorithm": "crc32", "input": CRC_INPUT},
        "identification": IDENTIFICATION,
        "dropped_bytes": plan.dropped_bytes,
        "dropped_tensor_bytes": plan.dropped_tensor_bytes,
        "kept_bytes": plan.kept_bytes,
        "dropped": [
            {
                "key": d.key,
                "path": list(d.path),
                "hf_name": d.hf_name,
                "shape": list(d.shape),
                "dtype": d.dtype,
                "chunks": [
                    {"offsets": list(c.offsets), "sizes": list(c.sizes), "file": c.file} for c in d.chunks
                ],
                **_id_json(ids[d.key]),
            }
            for d in plan.dropped
        ],
        **kept,
    }


@dataclass(frozen=True)
class Manifest:
    path: Path
    raw: dict
    dropped: tuple[DroppedTensor, ...]
    ids: dict[str, DroppedId]
    world_size: int | None
    base: dict | None
    data_files: tuple[str, ...]
    kept_crc32: dict[str, int] | None = None  # None: an older manifest, without kept-item CRCs
    # items `ckpt set-lr` / `ckpt set` wrote into the slim after `ckpt slim`: data file -> item name -> CRC-32
    patched: dict[str, dict[str, int]] = field(default_factory=dict)

    def expected_crc32(self, item: str, rel: str) -> int | None:
        """The CRC-32 the manifest records for kept item `item` stored in data file `rel`: the one a later
        set-lr / set recorded for its patch file, else the one slim recorded (None: an older manifest)."""
        if item in self.patched.get(rel, {}):
            return self.patched[rel][item]
        return None if self.kept_crc32 is None else self.kept_crc32.get(item)


def read_manifest(ckpt_dir: Path) -> Manifest:
    """Load and validate `ckpt-slim-manifest.json` completely (every problem is an error that
    names the file and the key)."""
    p, m = _manifest_json(ckpt_dir)
    dropped: list[DroppedTensor] = []
    ids: dict[str, DroppedId] = {}
    for i, d in enumerate(m.get("dropped") or []):
        key = d.get("key") if isinstance(d, dict) else None
        try:
            tensor, ident = _dropped_entry(d, key, m.get("version"))
        except CkptError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(
                f"dropped entry #{i} is malformed: {type(exc).__name__}: {exc}",
                path=p,
                key=key,
                hint="the manifest was edited or damaged; slim the original again",
            ) from None
        dropped.append(tensor)
        ids[tensor.key] = ident
    if not dropped:
        raise FormatError("lists no dropped tensors", path=p)
    return Manifest(
        p,
        m,
        tuple(dropped),
        ids,
        m.get("world_size"),
        m.get("base"),
        tuple((m.get("source") or {}).get("data_files") or ()),
        _kept_crc32(m, p),
        _patched(m.get("patched_crc32"), p),
    )


def _manifest_json(ckpt_dir: Path) -> tuple[Path, dict]:
    """The manifest's path and JSON object, a slim manifest of a version this reader reads."""
    p = as_input(ckpt_dir) / SLIM_MANIFEST
    if not lexists(p):
        raise UsageError(
            f"not a slim checkpoint: no {SLIM_MANIFEST}",
            path=ckpt_dir,
            hint="rehydrate takes the output of `ckpt slim`",
        )
    m = read_json(p, root=ckpt_dir, what="slim manifest", max_values=MAX_TABLE_VALUES)
    if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT:
        raise FormatError(
            f"not a slim manifest (format is {m.get('format') if isinstance(m, dict) else None!r})", path=p
        )
    if m.get("version") not in READABLE_VERSIONS:
        raise FormatError(
            f"manifest version {m.get('version')!r}; this ckpt-tools reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}",
            path=p,
            hint="use the ckpt-tools version that wrote it",
        )
    return p, m


def _dropped_entry(d, key, version) -> tuple[DroppedTensor, DroppedId]:
    """One `dropped` entry of a manifest of `version`, checked: its path flattens to its key, a known
    dtype, chunks that lie inside its shape and cover it, a sha256 or per-chunk CRC-32s (KeyError,
    TypeError, ValueError for a malformed one)."""
    path = tuple(d["path"])
    if ".".join(map(str, path)) != key:
        raise ValueError(f"path {list(path)} does not flatten to the key")
    shape = tuple(int(s) for s in d["shape"])
    dtype = d["dtype"]
    if dtype not in ITEMSIZE:
        raise FormatError(f"unknown dtype {dtype!r} in the slim manifest")
    chunks = _chunk_layouts(d["chunks"], shape)
    digest = str(d["sha256"]) if "sha256" in d or version == 1 else None
    if digest is not None and (len(digest) != 64 or any(ch not in "0123456789abcdef" for ch in digest)):
        raise ValueError("sha256 is not 64 hex digits")
    crcs = _crc_list(d.get("crc32"), chunks, shape) if "crc32" in d else None
    if digest is None and crcs is None:
        raise ValueError("has neither a sha256 nor chunk CRC-32s")
    tensor = DroppedTensor(
        key, path, str(d["hf_name"]), shape, dtype, chunks, math.prod(shape) * ITEMSIZE[dtype]
    )
    return tensor, DroppedId(digest, crcs)


def _chunk_layouts(value, shape: tuple[int, ...]) -> tuple[ChunkLayout, ...]:
    """A dropped entry's chunks, each inside `shape`, together covering it (ValueError where not)."""
    chunks = tuple(
        ChunkLayout(
            tuple(int(o) for o in c["offsets"]), tuple(int(s) for s in c["sizes"]), str(c.get("file", ""))
        )
        for c in value
    )
    for c in chunks:
        if (
            len(c.offsets) != len(shape)
            or len(c.sizes) != len(shape)
            or any(o < 0 or s < 0 or o + s > n for o, s, n in zip(c.offsets, c.sizes, shape))
        ):
            raise ValueError(f"chunk {list(c.offsets)}+{list(c.sizes)} lies outside shape {list(shape)}")
    covered = sum(math.prod(c.sizes) for c in chunks if all(c.sizes))
    if covered != math.prod(shape) and shape:
        raise ValueError(f"chunks cover {covered} of {math.prod(shape)} elements")
    return chunks


def _kept_crc32(m: dict, p: Path) -> dict[str, int] | None:
    """The manifest's CRC-32 of each kept item, by name; None in a manifest without them."""
    if "kept_crc32" not in m:
        return None
    items = m["kept_crc32"].get("items") if isinstance(m["kept_crc32"], dict) else None
    return _crc_map(items, p, "kept_crc32.items")


def _crc_map(items, p: Path, what: str) -> dict[str, int]:
    """A map of item names to CRC-32 values, checked."""
    if not isinstance(items, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**32
        for k, v in items.items()
    ):
        raise FormatError(
            f"{what} is not a map of item names to CRC-32 values",
            path=p,
            hint="the manifest was edited or damaged; slim the original again",
        )
    return dict(items)


def _patched(value, p: Path) -> dict[str, dict[str, int]]:
    """`patched_crc32.files`: data file -> {item name -> CRC-32} ({} when absent)."""
    if value is None:
        return {}
    files = value.get("files") if isinstance(value, dict) else None
    if not isinstance(files, dict) or not all(isinstance(f, str) for f in files):
        raise FormatError(
            "patched_crc32.files is not a map of data files to item CRC-32s",
            path=p,
            hint="the manifest was edited or damaged; slim the original again",
        )
    return {f: _crc_map(items, p, f"patched_crc32.files[{f!r}]") for f, items in files.items()}


def with_patch(raw: dict, patch_file: str, crc32: dict[str, int], files: set[str]) -> dict:
    """The manifest `raw` of a slim into which `ckpt set-lr` / `ckpt set` wrote new byte items: their CRC-32s
    (item name -> CRC of the stored bytes) recorded under `patched_crc32` for the new data file `patch_file`,
    beside (never instead of) what slim recorded: the manifest then fits the old `.metadata` and the new
    one alike (an in-place edit swaps `.metadata` after this is written; a `.metadata.bak-*` restored by hand
    still rehydrates). Entries of data files not in `files` (gone) are dropped."""
    old = (raw.get("patched_crc32") or {}).get("files") or {}
    kept = {f: dict(items) for f, items in old.items() if f in files and f != patch_file}
    kept[patch_file] = dict(sorted(crc32.items()))
    return {
        **raw,
        "version": PATCHED_VERSION,
        "patched_crc32": {"algorithm": "crc32", "input": KEPT_CRC_INPUT, "files": dict(sorted(kept.items()))},
    }


def _crc_list(value, chunks, shape) -> tuple[int, ...]:
    """A dropped entry's `crc32`: one CRC-32 per chunk, the chunks dim-0 row blocks (what it identifies)."""
    if (
        not isinstance(value, list)
        or len(value) != len(chunks)
        or not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**32 for v in value)
    ):
        raise ValueError("crc32 is not one CRC-32 per chunk")
    if not shape or any(any(o != 0 for o in c.offsets[1:]) or c.sizes[1:] != shape[1:] for c in chunks):
        raise ValueError("crc32 is given for chunks that are not row blocks")
    return tuple(value)
