"""`ckpt rehydrate`, planned: the slim checkpoint's manifest and the base's headers checked against each
other (every problem before a tensor byte is read), and the output laid out: the items copied verbatim,
the dropped tensors rebuilt from the base (their chunk layout, the base tensor each is read from, what
identifies it: each original chunk's CRC-32 and/or the whole tensor's sha256), the data files (the work
units of the ranks), and the workers and memory bound of the run (`pipeline`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ...core.errors import FormatError, UsageError
from ...core.keys import classify, expert_names, is_stacked_pattern
from ...dist import local_workers
from ...formats.dcp.layout import extra_entries, row_chunks
from ...formats.dcp.model import BytesEntry, TensorEntry
from ...formats.dcp.reader import DcpCheckpoint
from ...formats.dcp.stream_item import MAX_STREAMED_BYTES
from ...formats.hf_dir.model_dir import HFModelDir
from ...formats.primerl.optimizers import optimizer_facts
from ...formats.slim.manifest import SLIM_MANIFEST, Manifest, kept_item_id, read_manifest
from ...formats.slim.partition import base_identity, map_to_base
from ...formats.slim.rowcheck import Segment, segments_of
from ...io.inputs import as_input
from .pipeline import BUDGET_BYTES

__all__ = [
    "ITEM_OVERHEAD_BYTES",
    "RebuildItem",
    "RehydrateOptions",
    "RehydratePlan",
    "RehydrateSources",
    "default_threads",
    "memory_bound",
    "open_rehydrate_sources",
    "plan_rehydrate",
]

# Per-item overhead of a torch.save archive (zip records, data.pkl): ~1.5 KB measured; 4 KB is safe.
ITEM_OVERHEAD_BYTES = 4096
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


@dataclass(frozen=True)
class RebuildItem:
    key: str
    path: tuple
    base_name: str  # tensor read from the base model
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...]  # (offsets, sizes, file index)
    sha256: str | None  # of the whole tensor (None: identified by its chunks' CRC-32s only)
    nbytes: int
    segments: tuple[Segment, ...] | None = None  # the original chunks' rows and CRC-32s


@dataclass(frozen=True)
class RehydratePlan:
    slim: str
    out: str
    base: str
    layout: str  # "original" | "world_size=W"
    files: int
    copy_items: tuple[tuple[str, str, int, int, int], ...]  # (key, rel, offset, length, file index)
    rebuild: tuple[RebuildItem, ...]
    copy_bytes: int
    rebuild_bytes: int
    extra_files: tuple[str, ...]
    warnings: tuple[str, ...]
    kept_crc32: tuple[int, ...] | None = None  # the manifest's CRC of each copy item; None: an old manifest
    threads: int = 1  # workers making and writing the items
    memory_bound_bytes: int = BUDGET_BYTES  # the items' buffers in flight, whatever `threads` (`pipeline`)

    @property
    def units(self) -> tuple[int, ...]:
        """The independent work units: the output data files (file index k: the items copied into it
        and the rebuilt chunks that land in it)."""
        return tuple(range(self.files))

    def to_json(self) -> dict:
        return {
            "slim": self.slim,
            "out": self.out,
            "base": self.base,
            "layout": self.layout,
            "files": self.files,
            "copied_items": len(self.copy_items),
            "copied_bytes": self.copy_bytes,
            "rebuilt_tensors": len(self.rebuild),
            "rebuilt_bytes": self.rebuild_bytes,
            "extra_files": list(self.extra_files),
            "warnings": list(self.warnings),
            "kept_items_in_manifest": self.kept_crc32 is not None,
            "threads": self.threads,
            "memory_bound_bytes": self.memory_bound_bytes,
            "rebuild": [
                {
                    "key": r.key,
                    "from": r.base_name,
                    "shape": list(r.shape),
                    "dtype": r.dtype,
                    "chunks": len(r.chunks),
                    "checked_by": [n for n, v in (("sha256", r.sha256), ("crc32", r.segments)) if v],
                }
                for r in self.rebuild
            ],
        }


def _file_index(rel: str, fallback: dict[str, int]) -> int:
    m = _RANK_FILE.match(rel)
    return int(m.group(1)) if m else fallback[rel]


@dataclass(frozen=True)
class RehydrateOptions:
    out: str | Path
    base: str
    world_size: int | None = None  # None: the original chunk layout and rank files
    overwrite: bool = False
    trust_pickle: bool = False
    threads: int | None = None  # workers (None: this rank's share of the cores, `dist.local_workers`)


@dataclass
class RehydrateSources:
    slim: DcpCheckpoint
    base: HFModelDir

    def close(self) -> None:
        self.base.close()
        self.slim.close()

    def __enter__(self) -> RehydrateSources:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_rehydrate_sources(slim_path: str | Path, options: RehydrateOptions) -> RehydrateSources:
    ckpt = DcpCheckpoint.open(slim_path, trust_pickle=options.trust_pickle)
    try:
        return RehydrateSources(ckpt, HFModelDir.open_ref(options.base))
    except BaseException:
        ckpt.close()
        raise


def plan_rehydrate(sources: RehydrateSources, options: RehydrateOptions) -> RehydratePlan:
    """Validate everything that can be checked without tensor bytes (manifest, key overlap, base
    names and shapes, world size) and lay out the output."""
    ckpt, hf = sources.slim, sources.base
    out, base_name, world_size = Path(options.out), str(options.base), options.world_size
    manifest = read_manifest(ckpt.dir)
    if world_size is not None and world_size < 1:
        raise UsageError(f"--world-size must be >= 1, got {world_size}")
    if options.threads is not None and options.threads < 1:
        raise UsageError(f"--threads must be >= 1, got {options.threads}")
    clash = sorted(d.key for d in manifest.dropped if d.key in ckpt.entries)
    if clash:
        raise FormatError(
            f"{len(clash)} key(s) are both in the checkpoint and listed as dropped, e.g. {clash[0]}",
            path=manifest.path,
            hint="the manifest does not belong to this checkpoint",
        )
    mapping = map_to_base(
        manifest.dropped, {n: hf.facts(n).shape for n in hf.names()}, hf.config, as_input(hf.path)
    )
    warnings = _base_changed(hf, base_name, manifest)
    absent = optimizer_facts(classify(k, e.path) for k, e in ckpt.entries.items()).absent
    if absent:  # SignSGD: the rebuilt checkpoint holds no moments either; prime-rl's SignSGD needs none
        warnings.append(f"{absent}: the rebuilt checkpoint has none either, as the original")
    slim_files = ckpt.data_files()
    copy_items = _copy_items(ckpt, slim_files)
    kept_crc = _kept_crcs(ckpt, manifest, copy_items)
    if kept_crc is None:
        warnings.append(
            f"{manifest.path.name} records no CRC-32 of the kept items (an older ckpt-tools wrote "
            "it): each copied item is checked against its own zip CRC-32 only; the dropped tensors "
            "are still proven against their sha256"
        )
    rebuild = _rebuild_items(manifest, mapping, world_size)
    # Read the base in file order (sequential I/O on the base shards).
    infos = {
        r.key: hf.info(expert_names(r.base_name, 0, 1)[0] if is_stacked_pattern(r.base_name) else r.base_name)
        for r in rebuild
    }
    rebuild.sort(key=lambda r: (str(infos[r.key].path), infos[r.key].begin, r.key))
    max_index = max([t[4] for t in copy_items] + [c[2] for r in rebuild for c in r.chunks] + [0])
    files = max(max_index + 1, world_size or 1, len(manifest.data_files))
    extra = extra_entries(ckpt.dir, set(slim_files), exclude={SLIM_MANIFEST})
    return RehydratePlan(
        slim=str(ckpt.dir),
        out=str(out),
        base=str(hf.path),
        layout="original" if world_size is None else f"world_size={world_size}",
        files=files,
        copy_items=tuple(copy_items),
        rebuild=tuple(rebuild),
        copy_bytes=sum(t[3] for t in copy_items),
        rebuild_bytes=sum(r.nbytes for r in rebuild),
        extra_files=tuple(extra),
        warnings=tuple(warnings),
        kept_crc32=kept_crc,
        threads=options.threads or default_threads(),
        memory_bound_bytes=memory_bound(rebuild),
    )


def _base_changed(hf: HFModelDir, base_name: str, manifest: Manifest) -> list[str]:
    """A warning where the base's weight headers differ from those the manifest recorded at slim time."""
    mb = manifest.base or {}
    if mb.get("headers_sha256"):
        now = base_identity(hf, base_name)
        if now["headers_sha256"] != mb["headers_sha256"]:
            return [
                f"the base model's weight headers differ from the one recorded at slim time "
                f"({mb.get('name') or mb.get('path')}); every tensor is still checked by hash"
            ]
    return []


def _copy_items(ckpt: DcpCheckpoint, slim_files: list[str]) -> list[tuple[str, str, int, int, int]]:
    """(key, file, offset, length, output file index) of every item of the slim, in file order."""
    fallback = {rel: i for i, rel in enumerate(slim_files)}
    copy_items = []
    for key, e in ckpt.entries.items():
        if isinstance(e, TensorEntry):
            for c in e.chunks:
                copy_items.append((key, c.file, c.offset, c.length, _file_index(c.file, fallback)))
        else:
            copy_items.append((key, e.file, e.offset, e.length, _file_index(e.file, fallback)))
    copy_items.sort(key=lambda t: (t[1], t[2]))
    return copy_items


def _rebuild_items(manifest: Manifest, mapping: dict[str, str], world_size: int | None) -> list[RebuildItem]:
    """Each dropped tensor to rebuild from its base tensor (`mapping`), in the manifest's order: its chunks
    as the original wrote them (output file: the source file's index), or row blocks of `world_size`."""
    src_index = {rel: i for i, rel in enumerate(manifest.data_files)}
    rebuild = []
    for d in manifest.dropped:
        chunks: tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...]
        if world_size is None:
            chunks = tuple((c.offsets, c.sizes, src_index.get(c.file, i)) for i, c in enumerate(d.chunks))
        elif not d.shape:
            chunks = (((), (), 0),)
        else:
            chunks = tuple(
                ((s,) + (0,) * (len(d.shape) - 1), (n,) + tuple(d.shape[1:]), k)
                for k, (s, n) in enumerate(row_chunks(d.shape[0], world_size))
            )
        ident = manifest.ids[d.key]
        rebuild.append(
            RebuildItem(
                d.key,
                d.path,
                mapping[d.key],
                d.dtype,
                d.shape,
                chunks,
                ident.sha256,
                d.nbytes,
                segments_of(d.chunks, ident.crc32),
            )
        )
    return rebuild


def default_threads() -> int:
    """Workers when none are asked for: this rank's cores (`dist.local_workers`), plus two, so that the cores
    stay busy while some workers wait for the disk."""
    return local_workers() + 2


def memory_bound(rebuild) -> int:
    """The most bytes of blocks the run holds at once: the budget (`pipeline.BUDGET_BYTES`), or alone the
    largest single row of a rebuilt tensor (a block holds one row at least; with its base row or a gathered
    piece, at most twice its bytes), or alone a chunk too large to stream (a payload over
    `MAX_STREAMED_BYTES` needs zip64 records: written through torch.save, whole, with its base rows)."""
    most = BUDGET_BYTES
    for r in rebuild:
        if r.shape and r.shape[0]:
            most = max(most, 2 * (r.nbytes // r.shape[0]))
        per_row = r.nbytes // r.shape[0] if r.shape and r.shape[0] else r.nbytes
        for _o, sizes, _fi in r.chunks:
            chunk = per_row * (sizes[0] if sizes else 1)
            if chunk > MAX_STREAMED_BYTES:
                most = max(most, chunk * 3 // 2)
    return most


def _item_id(ckpt: DcpCheckpoint, key: str, rel: str, offset: int) -> str:
    e = ckpt.entries[key]
    if isinstance(e, BytesEntry):
        return kept_item_id(key, None)
    return kept_item_id(key, next(c for c in e.chunks if c.file == rel and c.offset == offset).offsets)


def _kept_crcs(ckpt: DcpCheckpoint, manifest, copy_items) -> tuple[int, ...] | None:
    """The manifest's CRC-32 of each item to copy, in `copy_items` order; None for a manifest without
    them. The slim must hold exactly the items the manifest lists (else a FormatError naming one)."""
    if manifest.kept_crc32 is None:
        return None
    ids = [(_item_id(ckpt, key, rel, off), rel) for key, rel, off, _n, _fi in copy_items]
    names = {i for i, _rel in ids}
    missing = sorted(set(manifest.kept_crc32) - names)
    extra = sorted(names - set(manifest.kept_crc32))
    if missing or extra:
        what = (
            f"{len(missing)} kept item(s) of the manifest are not in the checkpoint, e.g. {missing[0]}"
            if missing
            else f"{len(extra)} item(s) of the checkpoint are not in the manifest, e.g. {extra[0]}"
        )
        raise FormatError(
            f"the slim checkpoint does not hold the items it was written with: {what}",
            path=manifest.path,
            hint="the slim was edited or damaged after `ckpt slim` wrote it; slim the original again",
        )
    # an item set-lr / set rewrote after slim is checked against the CRC-32 recorded for its patch file
    return tuple(manifest.expected_crc32(i, rel) for i, rel in ids)
