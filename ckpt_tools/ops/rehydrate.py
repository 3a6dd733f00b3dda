"""`ckpt rehydrate`: slim checkpoint + the bf16 HF base -> the full checkpoint prime-rl resumes from.

Every item of the slim checkpoint is copied verbatim by byte range (a large one by `copy_file_range`),
checked against its zip CRC-32s and the manifest's CRC of it (`kept_crc32`; an older manifest has none,
and the plan says so). Every tensor the slim manifest lists as dropped is rebuilt from the base model
(bf16 -> the checkpoint's fp32, an exact upcast) and checked against the manifest's identification of
it (`formats.slim.rowcheck`: each original chunk's CRC-32 and/or the whole tensor's sha256); the first
mismatch aborts the whole run (nothing appears at OUT: the output is atomic, and the temp dir is
removed). The rebuilt tensors are written as row chunks: by default in the exact original chunk layout
and rank files recorded in the manifest, or for `--world-size W` ranks. Each chunk item is streamed
(`formats.dcp.stream_item`: the bytes torch.save writes, its payload from the base in blocks of
`BASE_BLOCK_BYTES`): memory is one block in bf16 + fp32, not the chunk, not the tensor.
"""
from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..core.dtypes import torch_dtype
from ..core.errors import ChecksumError, FormatError, UsageError
from ..core.keys import expert_names, is_stacked_pattern
from ..core.parts import assign_units
from ..dist import Group, SoloGroup
from ..core.progress import Progress, report
from ..formats.dcp.item_copy import copy_checked_item
from ..formats.dcp.layout import extra_bytes, extra_entries, row_chunks
from ..formats.dcp.model import BytesEntry, TensorEntry
from ..formats.dcp.reader import DcpCheckpoint
from ..formats.dcp.stream_item import tensor_item_parts
from ..formats.dcp.writer import DcpWriter
from ..formats.slim.manifest import SLIM_MANIFEST, kept_item_id, read_manifest
from ..formats.slim.partition import base_identity, map_to_base
from ..formats.slim.rowcheck import RowCheck, Segment, segments_of
from ..formats.slim.writer import copy_extra_entries
from ..io.staging import SharedOutputDir
from ..sources.hashing import BASE_BLOCK_BYTES, read_as, read_rows_as
from ..formats.hf_dir.model_dir import HFModelDir

__all__ = ["RehydrateOptions", "RehydrateSources", "open_rehydrate_sources", "RebuildItem", "RehydratePlan",
           "RehydrateResult", "RehydrateReport", "plan_rehydrate", "run_rehydrate"]

# Per-item overhead of a torch.save archive (zip records, data.pkl): ~1.5 KB measured; 4 KB is safe.
_ITEM_OVERHEAD_BYTES = 4096
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


@dataclass(frozen=True)
class RebuildItem:
    key: str
    path: tuple
    base_name: str                  # tensor read from the base model
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...], int], ...]   # (offsets, sizes, file index)
    sha256: str | None              # of the whole tensor (None: identified by its chunks' CRC-32s only)
    nbytes: int
    segments: tuple[Segment, ...] | None = None   # the original chunks' rows and CRC-32s


@dataclass(frozen=True)
class RehydratePlan:
    slim: str
    out: str
    base: str
    layout: str                     # "original" | "world_size=W"
    files: int
    copy_items: tuple[tuple[str, str, int, int, int], ...]   # (key, rel, offset, length, file index)
    rebuild: tuple[RebuildItem, ...]
    copy_bytes: int
    rebuild_bytes: int
    extra_files: tuple[str, ...]
    warnings: tuple[str, ...]
    kept_crc32: tuple[int, ...] | None = None     # the manifest's CRC of each copy item; None: an old manifest

    @property
    def units(self) -> tuple[int, ...]:
        """The independent work units: the output data files (file index k: the items copied into it
        and the rebuilt chunks that land in it)."""
        return tuple(range(self.files))

    def to_json(self) -> dict:
        return {"slim": self.slim, "out": self.out, "base": self.base, "layout": self.layout, "files": self.files,
                "copied_items": len(self.copy_items), "copied_bytes": self.copy_bytes,
                "rebuilt_tensors": len(self.rebuild), "rebuilt_bytes": self.rebuild_bytes,
                "extra_files": list(self.extra_files), "warnings": list(self.warnings),
                "kept_items_in_manifest": self.kept_crc32 is not None,
                "rebuild": [{"key": r.key, "from": r.base_name, "shape": list(r.shape), "dtype": r.dtype,
                             "chunks": len(r.chunks),
                             "checked_by": [n for n, v in (("sha256", r.sha256), ("crc32", r.segments)) if v]}
                            for r in self.rebuild]}


def _file_index(rel: str, fallback: dict[str, int]) -> int:
    m = _RANK_FILE.match(rel)
    return int(m.group(1)) if m else fallback[rel]


@dataclass(frozen=True)
class RehydrateOptions:
    out: str | Path
    base: str
    world_size: int | None = None      # None: the original chunk layout and rank files
    overwrite: bool = False
    trust_pickle: bool = False


@dataclass
class RehydrateSources:
    slim: DcpCheckpoint
    base: HFModelDir

    def close(self) -> None:
        self.base.close()
        self.slim.close()

    def __enter__(self) -> "RehydrateSources":
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
    clash = sorted(d.key for d in manifest.dropped if d.key in ckpt.entries)
    if clash:
        raise FormatError(f"{len(clash)} key(s) are both in the checkpoint and listed as dropped, e.g. {clash[0]}",
                          path=manifest.path, hint="the manifest does not belong to this checkpoint")
    mapping = map_to_base(manifest.dropped, {n: hf.facts(n).shape for n in hf.names()}, hf.config, Path(hf.path))

    warnings = []
    mb = manifest.base or {}
    if mb.get("headers_sha256"):
        now = base_identity(hf, base_name)
        if now["headers_sha256"] != mb["headers_sha256"]:
            warnings.append(f"the base model's weight headers differ from the one recorded at slim time "
                            f"({mb.get('name') or mb.get('path')}); every tensor is still checked by hash")

    slim_files = ckpt.data_files()
    fallback = {rel: i for i, rel in enumerate(slim_files)}
    source_files = list(manifest.data_files)
    src_index = {rel: i for i, rel in enumerate(source_files)}
    copy_items = []
    for key, e in ckpt.entries.items():
        if isinstance(e, TensorEntry):
            for c in e.chunks:
                copy_items.append((key, c.file, c.offset, c.length, _file_index(c.file, fallback)))
        else:
            copy_items.append((key, e.file, e.offset, e.length, _file_index(e.file, fallback)))
    copy_items.sort(key=lambda t: (t[1], t[2]))
    kept_crc = _kept_crcs(ckpt, manifest, copy_items)
    if kept_crc is None:
        warnings.append(f"{manifest.path.name} records no CRC-32 of the kept items (an older ckpt-tools wrote "
                        "it): each copied item is checked against its own zip CRC-32 only; the dropped tensors "
                        "are still proven against their sha256")

    rebuild = []
    for d in manifest.dropped:
        if world_size is None:
            chunks = tuple((c.offsets, c.sizes, src_index.get(c.file, i)) for i, c in enumerate(d.chunks))
        elif not d.shape:
            chunks = (((), (), 0),)
        else:
            chunks = tuple(((s,) + (0,) * (len(d.shape) - 1), (n,) + tuple(d.shape[1:]), k)
                           for k, (s, n) in enumerate(row_chunks(d.shape[0], world_size)))
        ident = manifest.ids[d.key]
        rebuild.append(RebuildItem(d.key, d.path, mapping[d.key], d.dtype, d.shape, chunks, ident.sha256,
                                   d.nbytes, segments_of(d.chunks, ident.crc32)))
    # Read the base in file order (sequential I/O on the base shards).
    infos = {r.key: hf.info(expert_names(r.base_name, 0, 1)[0] if is_stacked_pattern(r.base_name) else r.base_name)
             for r in rebuild}
    rebuild.sort(key=lambda r: (str(infos[r.key].path), infos[r.key].begin, r.key))
    max_index = max([t[4] for t in copy_items] + [c[2] for r in rebuild for c in r.chunks] + [0])
    files = max(max_index + 1, world_size or 1, len(source_files))
    extra = extra_entries(ckpt.dir, set(slim_files), exclude={SLIM_MANIFEST})
    return RehydratePlan(
        slim=str(ckpt.dir), out=str(out), base=str(hf.path),
        layout="original" if world_size is None else f"world_size={world_size}", files=files,
        copy_items=tuple(copy_items), rebuild=tuple(rebuild), copy_bytes=sum(t[3] for t in copy_items),
        rebuild_bytes=sum(r.nbytes for r in rebuild), extra_files=tuple(extra), warnings=tuple(warnings),
        kept_crc32=kept_crc)


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
    ids = [_item_id(ckpt, key, rel, off) for key, rel, off, _n, _fi in copy_items]
    missing = sorted(set(manifest.kept_crc32) - set(ids))
    extra = sorted(set(ids) - set(manifest.kept_crc32))
    if missing or extra:
        what = (f"{len(missing)} kept item(s) of the manifest are not in the checkpoint, e.g. {missing[0]}"
                if missing else f"{len(extra)} item(s) of the checkpoint are not in the manifest, e.g. {extra[0]}")
        raise FormatError(f"the slim checkpoint does not hold the items it was written with: {what}",
                          path=manifest.path, hint="the slim was edited or damaged after `ckpt slim` wrote it; "
                                                   "slim the original again")
    return tuple(manifest.kept_crc32[i] for i in ids)


def _row_blocks_in_order(r: RebuildItem):
    """The chunks sorted by row when they are dim-0 row blocks tiling the tensor in order (empty
    chunks anywhere), else None."""
    if not r.shape:
        return None
    chunks = sorted(r.chunks, key=lambda c: (c[0][0], c[1][0] != 0))
    expect = 0
    for offsets, sizes, _fi in chunks:
        if any(o != 0 for o in offsets[1:]) or tuple(sizes[1:]) != tuple(r.shape[1:]):
            return None
        if sizes[0] == 0:
            continue
        if offsets[0] != expect:
            return None
        expect += sizes[0]
    return chunks if expect == r.shape[0] else None


def _bytes_of(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _ahead(make, args):
    """`make(a)` for each of `args`, in order, the next one made on a worker thread while the caller uses
    the current one (preadv, the upcast, hashing and writes release the GIL): memory two results."""
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = None
        for a in args:
            nxt = pool.submit(make, a)
            if pending is not None:
                yield pending.result()
            pending = nxt
            del nxt
        if pending is not None:
            yield pending.result()


def _rows(hf: HFModelDir, r: RebuildItem, dtype, start: int, count: int, check: RowCheck, segments: bool = True):
    """Rows [start, start + count) of `r` from the base as `dtype`, in blocks of at most BASE_BLOCK_BYTES
    (the next one read and upcast meanwhile), each fed to `check` on the way (`segments=False`: to its
    sha256 only)."""
    row_bytes = r.nbytes // max(1, r.shape[0])
    step = max(1, BASE_BLOCK_BYTES // max(1, row_bytes))

    def make(s: int):
        return s, _bytes_of(read_rows_as(hf, r.base_name, dtype, s, min(step, start + count - s)))
    for s, block in _ahead(make, range(start, start + count, step)):
        check.feed(s, block, segments=segments)
        yield block
        del block


def _rebuild_one(writer, hf: HFModelDir, r: RebuildItem, verify: bool = True) -> RowCheck:
    """Write this rank's chunks of one dropped tensor rebuilt from the base (every chunk, in one process)
    and return the check of what was rebuilt against the manifest (`RowCheck`). With `verify` (split
    over ranks, one rank per tensor) every row is read, so the check is complete; without, only the
    original chunks this rank rebuilt whole are checked. Row-block layouts (FSDP's) stream block by block
    into streamed items: memory is one block, not the chunk. The caller raises on a failed check before
    finishing; a mismatch aborts the whole (atomic) output."""
    dtype = torch_dtype(r.dtype)
    rows = r.shape[0] if r.shape else 1
    check = RowCheck(r.nbytes // max(1, rows), rows, r.sha256 if verify else None, r.segments)
    chunks = _row_blocks_in_order(r)
    if chunks is None:
        if not verify and not any(writer.owns(fi) for _o, _s, fi in r.chunks):
            for _chunk in r.chunks:
                writer.skip(r.key)
            return check
        t = read_as(hf, r.base_name, dtype)
        for offsets, sizes, fi in r.chunks:
            if writer.owns(fi):
                writer.write_tensor(r.key, r.path, t, chunks=[(offsets, sizes)], file_index=fi)
            else:
                writer.skip(r.key)
        check.feed(0, _bytes_of(t))
        return check
    for offsets, sizes, fi in chunks:
        mine = writer.owns(fi)
        if sizes[0] == 0 or not (mine or verify):
            if mine:
                writer.write_chunk(r.key, r.path, torch.empty(sizes, dtype=dtype), size=r.shape, offsets=offsets,
                                   file_index=fi)
            else:
                writer.skip(r.key)
            continue
        parts = tensor_item_parts(r.dtype, tuple(sizes)) if mine else None
        seg = check.segment_of(offsets[0], sizes[0]) if parts is not None else None
        blocks = _rows(hf, r, dtype, offsets[0], sizes[0], check, segments=seg is None)
        if parts is not None:   # (the item's CRC-32 is the original chunk's when the chunk is one: not computed twice)
            crc = writer.write_streamed_chunk(r.key, r.path, r.dtype, r.shape, offsets, sizes, parts, blocks,
                                              file_index=fi)
            if seg is not None:
                check.segment_crc(seg, crc)
        elif mine:   # this torch's torch.save is not what stream_item writes: the chunk through torch.save
            piece = torch.cat([torch.frombuffer(b, dtype=torch.uint8) for b in blocks]).view(dtype).reshape(sizes)
            writer.write_chunk(r.key, r.path, piece, size=r.shape, offsets=offsets, file_index=fi)
            del piece
        else:
            writer.skip(r.key)
            for _b in blocks:
                pass
    return check


def _checked_by_owners(r: RebuildItem) -> bool:
    """Whether the rebuilt chunks are exactly the original chunks whose CRC-32s identify the tensor (and no
    sha256 needs every row in one process): then each chunk's writer checks it, no rank reads rows twice."""
    if r.sha256 is not None or r.segments is None or _row_blocks_in_order(r) is None:
        return False
    rows = sorted((o[0], s[0]) for o, s, _fi in r.chunks if s and s[0])
    return rows == [(g.start, g.rows) for g in r.segments]


def _file_weights(plan: "RehydratePlan") -> list[int]:
    """Bytes each output data file receives (copied items and rebuilt chunks): the ranks' units."""
    w = [0] * plan.files
    for _key, _rel, _off, length, fi in plan.copy_items:
        w[fi % plan.files] += length
    for r in plan.rebuild:
        per_row = r.nbytes // r.shape[0] if r.shape and r.shape[0] else r.nbytes
        for _offsets, sizes, fi in r.chunks:
            w[fi % plan.files] += per_row * (sizes[0] if sizes else 1)
    return w


@dataclass
class RehydrateResult:
    out: str
    copied_items: int
    rebuilt_tensors: int
    verified_tensors: int
    bytes_written: int
    base_bytes_read: int
    out_bytes: int
    seconds: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RehydrateReport:
    plan: RehydratePlan
    result: RehydrateResult | None = None    # None: a dry run

    def to_json(self) -> dict:
        rep = {"plan": self.plan.to_json(), "dry_run": self.result is None}
        if self.result is not None:
            rep["result"] = self.result.to_json()
        return rep


def run_rehydrate(plan: RehydratePlan, sources: RehydrateSources, progress: Progress | None = None, *,
                  overwrite: bool = False, group: Group | None = None) -> RehydrateReport:
    """Write the full checkpoint. Under torchrun (`group`), each rank writes its share of the output
    data files and hashes its share of the rebuilt tensors; rank 0 writes `.metadata` and commits."""
    ckpt, hf = sources.slim, sources.base
    group = group or SoloGroup()
    split = group.part.world > 1
    t0 = time.perf_counter()
    need = (plan.copy_bytes + plan.rebuild_bytes + extra_bytes(ckpt.dir, plan.extra_files)
            + _ITEM_OVERHEAD_BYTES * (1 + sum(len(r.chunks) for r in plan.rebuild)))
    seconds = {}
    verified = 0
    # which rank checks each rebuilt tensor whole, reading all its rows (every one, in one process); a tensor
    # identified by CRC-32s of exactly its output chunks needs none: each chunk's writer checks it
    verifier = assign_units([r.nbytes for r in plan.rebuild], group.part.world)
    by_owner = [_checked_by_owners(r) for r in plan.rebuild]
    owner_checks = [0, sum(len(r.segments) for r, own in zip(plan.rebuild, by_owner) if own)]
    with SharedOutputDir(plan.out, group, inputs=[ckpt.dir, hf.path], need_bytes=need, overwrite=overwrite) as tmp:
        writer = DcpWriter(tmp, files=plan.files,
                           owned_files=group.part.mine(_file_weights(plan)) if split else None)
        try:
            ckpt.hint_reads((rel, offset, length) for _k, rel, offset, length, fi in plan.copy_items if writer.owns(fi))
            for n, (key, rel, offset, length, fi) in enumerate(plan.copy_items):
                if not writer.owns(fi):
                    writer.skip(key)
                    continue
                e = ckpt.entries[key]
                chunk = None if isinstance(e, BytesEntry) else next(
                    c for c in e.chunks if c.file == rel and c.offset == offset)
                got = copy_checked_item(ckpt, writer, key, rel, offset, length, file_index=fi, chunk=chunk)
                if plan.kept_crc32 is not None and got != plan.kept_crc32[n]:
                    raise ChecksumError(
                        f"the item's bytes differ from what `ckpt slim` copied (CRC-32 {got:#010x}, the "
                        f"manifest recorded {plan.kept_crc32[n]:#010x}); OUT was not created",
                        path=ckpt.dir / rel, key=key, hint="the slim checkpoint is damaged: rehydrate an intact "
                                                           "copy of it (after gc it may be the only copy of the run's "
                                                           "trained state)")
            seconds["copy"] = round(time.perf_counter() - t0, 3)
            t1 = time.perf_counter()
            done = 0
            for i, r in enumerate(plan.rebuild):
                verify = verifier[i] == group.part.rank and not by_owner[i]
                check = _rebuild_one(writer, hf, r, verify)
                if by_owner[i]:
                    owner_checks[0] += check.checked
                if check.failed:
                    raise FormatError(
                        f"rebuilt tensor does not match the original: {check.failed[0]} ({r.base_name} from the "
                        f"base, as {r.dtype}; {i} of {len(plan.rebuild)} tensors matched before this one); OUT "
                        "was not created", path=Path(plan.base), key=r.key,
                        hint="this is not the base model the run trained on (another revision or a "
                             "re-export?); pass the exact base, e.g. the snapshot recorded in the manifest")
                got = check.sha256_done()
                if verify and r.sha256 is not None and got != r.sha256:
                    raise FormatError(
                        f"rebuilt tensor does not match the original: sha256 of {r.base_name} from the base, as "
                        f"{r.dtype}, is {(got or '?')[:16]}…, the slim manifest recorded {r.sha256[:16]}… "
                        f"({i} of {len(plan.rebuild)} tensors matched before this one); OUT was not created",
                        path=Path(plan.base), key=r.key,
                        hint="this is not the base model the run trained on (another revision or a "
                             "re-export?); pass the exact base, e.g. the snapshot recorded in the manifest")
                if verify and not check.complete():   # an internal invariant: the verifier reads every row
                    raise FormatError("rebuilt tensor was not checked whole", path=plan.out, key=r.key)
                verified += verify
                done += r.nbytes
                report(progress, "rebuild", done, plan.rebuild_bytes)
            seconds["rebuild"] = round(time.perf_counter() - t1, 3)
            expected = set(ckpt.entries) | {r.key for r in plan.rebuild}
            if writer.keys() != expected:   # an internal invariant: every key exactly once
                raise FormatError(f"output would hold {len(writer.keys())} keys, expected {len(expected)}",
                                  path=plan.out)
            verified, bytes_written, owned = group.sum([verified, writer.bytes_written, owner_checks[0]],
                                                       "the rehydrate totals")
            if owned != owner_checks[1]:   # an internal invariant: every chunk checked by its writer
                raise FormatError(f"{owned} of {owner_checks[1]} rebuilt chunks were checked", path=plan.out)
            verified += sum(by_owner)
            writer.finish(group)
        except BaseException:
            writer.abort()
            raise
        if group.leader:
            copy_extra_entries(ckpt.dir, tmp, plan.extra_files)
    out_bytes = sum(f.stat().st_size for f in Path(plan.out).iterdir() if f.is_file())
    seconds["total"] = round(time.perf_counter() - t0, 3)
    base_read = sum(hf.facts(n).nbytes for r in plan.rebuild   # the base tensors the plan rebuilds
                    for n in (expert_names(r.base_name, 0, r.shape[0]) if is_stacked_pattern(r.base_name)
                              else [r.base_name]))
    return RehydrateReport(plan, RehydrateResult(
        out=plan.out, copied_items=len(plan.copy_items), rebuilt_tensors=len(plan.rebuild), verified_tensors=verified,
        bytes_written=bytes_written, base_bytes_read=base_read, out_bytes=out_bytes, seconds=seconds))
