"""A slim checkpoint, written: every kept storage item copied verbatim by byte range (output file i
receives source file i's items: rank files stay rank files; checked against its zip CRC-32s, a large one
copied by `copy_file_range`: `dcp.item_copy`), every dropped tensor identified without reading its
payload (the CRC-32 each of its items stores, from its zip central directory; with a base, compared with
the CRC-32 of the base's upcast, whose sha256 is recorded too), the manifest, the extra entries. Only a
dropped tensor whose chunks are not row blocks is read (and sha256-hashed). So a slim reads the kept items
once and a few header bytes of each dropped item. Memory: one small item or one block at a time.
"""

from __future__ import annotations

import hashlib
import json
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ...core.dtypes import itemsize
from ...core.errors import FormatError
from ...core.parts import SOLO
from ...core.progress import Progress, report
from ...dist import map_units
from ...io.copy import copy_input_tree
from ...io.files import write_new_file
from ..dcp.item import DataCrcReader, ItemError
from ..dcp.item_copy import copy_checked_item
from ..dcp.layout import extra_bytes
from ..dcp.model import TensorEntry
from ..dcp.reader import DcpCheckpoint
from ..dcp.writer import DcpWriter
from .manifest import SLIM_MANIFEST, DroppedId, DroppedTensor, build_manifest, kept_item_id
from .partition import SlimLayout

__all__ = [
    "SlimWritten",
    "checked_by_crc",
    "checkpoint_tensor_sha256",
    "copy_extra_entries",
    "need_bytes",
    "reads_payload",
    "stored_crcs",
    "write_slim",
]

# Base tensor hash for a dropped tensor: (the base tensor's name, sha256 of it upcast to the dtype).
BaseHash = Callable[[DroppedTensor], tuple[str, str]]
# The same with the CRC-32 of each row block given: (name, sha256, [crc32 per block]) (sources.hashing),
# `threads=` splitting one tensor's CRC-32s over more threads.
BaseCrcs = Callable[..., tuple[str, str, list]]


@dataclass
class SlimWritten:
    hashes: dict[str, DroppedId]
    kept_crc32: dict[str, int]
    bytes_written: int
    base_verified: bool
    seconds: dict = field(default_factory=dict)


def need_bytes(ckpt_dir: Path, layout: SlimLayout) -> int:
    """Free disk a slim needs: the kept items, the manifest (~64 KB per 100 tensors), the extras."""
    return (
        layout.kept_bytes
        + 64 * 1024 * (1 + len(layout.dropped) // 100)
        + extra_bytes(ckpt_dir, layout.extra_files)
    )


def output_file_index(data_files) -> dict[str, int]:
    """Output file i (`__i_0.distcp`) receives source file i's items: rank files stay rank files."""
    return {rel: i for i, rel in enumerate(data_files)}


def _row_block_payloads(ckpt: DcpCheckpoint, e: TensorEntry):
    """Yield each non-empty chunk's payload in row-major order when the chunks are dim-0 row blocks
    tiling the tensor (FSDP2's Shard(0)), else return None; a chunk whose payload is not its plain
    row-major bytes yields None (the caller then hashes the tensor assembled). Each chunk's zip CRC-32
    is checked on the way: we never record a hash of corrupt bytes as the truth."""
    chunks = sorted((c for c in e.chunks if c.numel), key=lambda c: c.offsets[0] if c.offsets else 0)
    expect_row = 0
    for c in chunks:
        if c.sizes and (
            any(o != 0 for o in c.offsets[1:]) or c.sizes[1:] != e.shape[1:] or c.offsets[0] != expect_row
        ):
            return None
        expect_row += c.sizes[0] if c.sizes else 1
    if e.shape and expect_row != e.shape[0]:
        return None

    def gen():
        for c in chunks:
            try:
                dec = ckpt.decode_chunk(e.key, c)
            except ItemError as exc:
                raise FormatError(
                    f"chunk at {list(c.offsets)} is not a readable tensor item: {exc}",
                    path=ckpt.dir / c.file,
                    key=e.key,
                    hint="run `ckpt verify`",
                ) from None
            if not dec.payload_is(e.dtype, c.sizes):
                yield None
                return
            payload = (
                dec.payload()
                if dec.raw is not None
                else memoryview(
                    ckpt.read_item_bytes(c.file, c.offset + dec.payload_offset, dec.payload_size, e.key)
                )
            )
            if dec.layout.data_crc and zlib.crc32(payload) != dec.layout.data_crc:  # (0: not computed)
                raise FormatError(
                    f"chunk at {list(c.offsets)} fails its CRC-32 check (stored {dec.layout.data_crc:#010x})",
                    path=ckpt.dir / c.file,
                    key=e.key,
                    hint="the checkpoint is corrupt; slim an intact copy",
                )
            yield payload
            del dec, payload  # before the next chunk is read: one chunk in memory, not two

    return gen()


def _row_block_chunks(e: TensorEntry):
    """The non-empty chunks of `e` in row order when they are dim-0 row blocks tiling it, else None."""
    chunks = sorted((c for c in e.chunks if c.numel), key=lambda c: c.offsets[0] if c.offsets else 0)
    expect_row = 0
    for c in chunks:
        if (
            not c.sizes
            or any(o != 0 for o in c.offsets[1:])
            or c.sizes[1:] != e.shape[1:]
            or c.offsets[0] != expect_row
        ):
            return None
        expect_row += c.sizes[0]
    return chunks if e.shape and expect_row == e.shape[0] else None


def reads_payload(d: DroppedTensor) -> bool:
    """Whether a slim reads this dropped tensor's bytes: its chunks are not dim-0 row blocks tiling it (every
    other tensor is identified by the CRC-32s its items store, `stored_crcs`)."""
    if not d.shape:
        return True
    expect = 0
    for c in sorted((c for c in d.chunks if all(c.sizes)), key=lambda c: c.offsets[0]):
        if (
            any(o != 0 for o in c.offsets[1:])
            or tuple(c.sizes[1:]) != tuple(d.shape[1:])
            or c.offsets[0] != expect
        ):
            return True
        expect += c.sizes[0]
    return expect != d.shape[0]


def _aligned(e: TensorEntry, chunks, crcs) -> list[int]:
    """`crcs` of the non-empty row-block `chunks`, as a list in `e.chunks`' order (an empty chunk: 0)."""
    by_chunk = {id(c): v for c, v in zip(chunks, crcs)}
    return [by_chunk.get(id(c), 0) for c in e.chunks]


def _item_reader(ckpt: DcpCheckpoint, rel: str, key: str) -> Callable[[int, int], bytes]:
    return lambda off, n: ckpt.read_item_bytes(rel, off, n, key)


def stored_crcs(ckpt: DcpCheckpoint, e: TensorEntry, crc_reader: DataCrcReader) -> list[int] | None:
    """The CRC-32 each chunk item of `e` stores for its payload (its `data/0` record), read from the item's
    zip central directory, never from the payload (`DataCrcReader`: tens of bytes per item), in `e.chunks`'
    order; None when the chunks are not row blocks tiling the tensor, an item's records are not a plain
    stored payload of the chunk's size, or one stores no CRC (0) (then the tensor is read and hashed)."""
    chunks = _row_block_chunks(e)
    if chunks is None:
        return None
    size = itemsize(e.dtype)
    try:
        got = [
            crc_reader.crc(_item_reader(ckpt, c.file, e.key), c.offset, c.length, c.numel * size)
            for c in chunks
        ]
    except ItemError:
        return None
    if 0 in got:  # torch.save's "not computed" (`set_crc32_options(False)`): nothing to identify it by
        return None
    return _aligned(e, chunks, got)


def checked_by_crc(
    ckpt: DcpCheckpoint,
    e: TensorEntry,
    d: DroppedTensor,
    base_crcs: BaseCrcs,
    crc_reader: DataCrcReader,
    base_path,
    threads: int = 1,
) -> tuple[str, list[int]] | None:
    """A dropped tensor proven equal to its base upcast without reading its bytes: the CRC-32 each of its
    items stores (`stored_crcs`) against that of the base's rows; returns (the upcast's sha256, the chunks'
    CRC-32s), or None when its layout is not row blocks (then it is read and hashed as usual). `threads`: how
    many threads compute the base's side (`sources.hashing.upcast_sha256_crc32s`)."""
    stored = stored_crcs(ckpt, e, crc_reader)
    if stored is None:
        return None
    chunks = _row_block_chunks(e)
    name, sha, got = base_crcs(d, [(c.offsets[0], c.sizes[0]) for c in chunks], threads=threads)
    want_by = dict(zip(map(id, e.chunks), stored))
    for c, have in zip(chunks, got):
        want = want_by[id(c)]
        if want != have:
            raise FormatError(
                f"the base model's {name} upcast to {d.dtype} differs from the checkpoint's frozen tensor "
                f"(rows "
                f"{c.offsets[0]}..{c.offsets[0] + c.sizes[0]}: CRC-32 {have:#010x} vs the item's "
                f"{want:#010x})",
                path=base_path,
                key=d.key,
                hint="this is not the base the run trained on (another revision?), or the tensor was "
                "trained; "
                "pass the right --base",
            )
    return sha, stored


def checkpoint_tensor_sha256(ckpt: DcpCheckpoint, e: TensorEntry) -> str:
    """sha256 of a checkpoint tensor's row-major bytes. Row-block chunks are hashed chunk by chunk
    straight from their items (memory: one chunk); any other layout is assembled first."""
    payloads = _row_block_payloads(ckpt, e)
    if payloads is not None:
        h = hashlib.sha256()
        for p in payloads:
            if p is None:
                break
            h.update(p)
            del p
        else:
            return h.hexdigest()
    from ...core.tensor_math import sha256_of_tensor  # lazy: an unusual layout, assembled by torch

    return sha256_of_tensor(ckpt.read_tensor(e.key))


def copy_extra_entries(src_dir: Path, dst_dir: Path, names) -> None:
    """Copy the extra entries by content (files and directories, checked as inputs of `src_dir`)."""
    for name in names:
        copy_input_tree(src_dir / name, dst_dir / name, root=src_dir, what="checkpoint entry")


def write_slim(
    ckpt: DcpCheckpoint,
    out_dir: Path,
    layout: SlimLayout,
    *,
    base: dict | None,
    base_hash: BaseHash | None = None,
    base_path: Path | None = None,
    progress: Progress | None = None,
    group=None,
    hash_threads: int = 1,
    base_crcs: BaseCrcs | None = None,
) -> SlimWritten:
    """Write the slim of `ckpt` into the (new, empty) dir `out_dir`. With `base_hash`, every dropped
    tensor must equal its base tensor's upcast, else nothing is finished (FormatError naming
    `base_path` and the key) and the manifest records the base as verified. Without a base, a dropped
    tensor is identified by the CRC-32 each of its items stores (`stored_crcs`: its payload is not read).

    Split over ranks (`group`, a `ckpt_tools.dist.Group` of 2+): each rank copies the kept items of
    its share of the output files and hashes its share of the dropped tensors; rank 0 gathers the
    hashes and writes `.metadata`, the manifest and the extra entries.

    With `base_crcs` (given with `base_hash`), a dropped tensor is not read: the CRC-32 its items store is
    compared with that of the base's upcast rows (`checked_by_crc`), and the manifest records both the
    chunks' CRC-32s and the upcast's sha256; `base_hash` alone (gc) reads and hashes every dropped tensor."""
    t0 = time.perf_counter()
    verified = base_hash is not None
    file_index = output_file_index(layout.data_files)
    files = max(1, len(layout.data_files))
    part = group.part if group is not None else SOLO
    seconds = {}
    owned = None
    if part.world > 1:
        weights = [0] * files
        for k in layout.kept:
            weights[file_index[k.file] % files] += k.length
        owned = part.mine(weights)
    writer = DcpWriter(out_dir, files=files, owned_files=owned)
    try:
        kept_crc = _copy_kept(ckpt, writer, layout, file_index, progress)
        seconds["copy"] = round(time.perf_counter() - t0, 3)
        t1 = time.perf_counter()
        identify = _Identify(ckpt, layout, base_hash, base_crcs, base_path, hash_threads)
        ids = identify.every(group, progress)
        seconds["hash"] = round(time.perf_counter() - t1, 3)
        bytes_written = writer.bytes_written
        if part.world > 1:
            (bytes_written,) = group.sum([bytes_written], "the bytes written")
            every_crc = group.gather(kept_crc, "the kept items' CRC-32")
            if every_crc is not None:
                kept_crc = {k: v for d in every_crc for k, v in d.items()}
        writer.finish(group)
    except BaseException:
        writer.abort()
        raise
    if part.leader:
        manifest = build_manifest(layout, base, ids, base_verified=verified, kept_crc32=kept_crc)
        write_new_file(out_dir / SLIM_MANIFEST, json.dumps(manifest, indent=1, allow_nan=False) + "\n")
        copy_extra_entries(ckpt.dir, out_dir, layout.extra_files)
    return SlimWritten(ids, kept_crc, bytes_written, verified, seconds)


def _copy_kept(
    ckpt: DcpCheckpoint, writer: DcpWriter, layout: SlimLayout, file_index: dict[str, int], progress
) -> dict[str, int]:
    """Every kept item of the files this rank writes copied verbatim, in source order (sequential
    reads); returns {kept_item_id: the CRC-32 of its bytes}, for the manifest."""
    kept_crc: dict[str, int] = {}
    done = 0
    ckpt.files.hint((k.file, k.offset, k.length) for k in layout.kept if writer.owns(file_index[k.file]))
    for k in layout.kept:
        if not writer.owns(file_index[k.file]):
            writer.skip(k.key)
            continue
        chunk = (
            None
            if k.kind == "bytes"
            else next(c for c in ckpt.tensor_entry(k.key).chunks if c.file == k.file and c.offset == k.offset)
        )
        kept_crc[kept_item_id(k.key, k.chunk_offsets)] = copy_checked_item(
            ckpt, writer, k.key, k.file, k.offset, k.length, file_index=file_index[k.file], chunk=chunk
        )
        done += k.length
        report(progress, "copy", done, layout.kept_bytes)
    return kept_crc


class _Identify:
    """Each dropped tensor identified: proven equal to its base's upcast by the CRC-32s its items store
    (`base_crcs`), or by the sha256 of its bytes (`base_hash`), or, without a base, recorded by its
    items' CRC-32s; a layout other than row blocks is read and hashed."""

    def __init__(
        self, ckpt: DcpCheckpoint, layout: SlimLayout, base_hash, base_crcs, base_path, hash_threads: int
    ):
        self.ckpt, self.layout, self.base_path = ckpt, layout, base_path
        self.base_hash, self.base_crcs, self.hash_threads = base_hash, base_crcs, hash_threads
        self.crc_reader = DataCrcReader()
        # largest first (each rank's share too), so the biggest tensor is not the last one to start; a tensor
        # bigger than one thread's share of the whole splits its base CRC-32s over every thread
        self.order = sorted(range(len(layout.dropped)), key=lambda i: (-layout.dropped[i].nbytes, i))
        self.share = sum(d.nbytes for d in layout.dropped) / max(1, hash_threads)

    def every(self, group, progress) -> dict[str, DroppedId]:
        """{key: its DroppedId} of every dropped tensor on rank 0, {} on the others. Identified in parallel
        (hashlib, zlib and preadv release the GIL) on `hash_threads` threads and split over torchrun's
        ranks; rank 0 gets every result, in the layout's order."""
        dropped, order = self.layout.dropped, self.order
        done = 0

        def identified(i: int) -> None:
            nonlocal done
            done += dropped[i].nbytes
            report(progress, "hash", done, self.layout.dropped_tensor_bytes)

        got = map_units(
            lambda j: self.one(dropped[order[j]]),
            [dropped[i].nbytes for i in order],
            group,
            threads=self.hash_threads,
            done=lambda j, _h: identified(order[j]),
        )
        if got is None:
            return {}
        by_unit = dict(zip(order, got))
        every = [by_unit[i] for i in range(len(order))]
        return {d.key: DroppedId(h[0], None if h[1] is None else tuple(h[1])) for d, h in zip(dropped, every)}

    def one(self, d: DroppedTensor) -> tuple[str | None, list[int] | None]:
        """(sha256 or None, [CRC-32 per chunk] or None): plain values, for gather."""
        e = self.ckpt.tensor_entry(d.key)
        if self.base_crcs is not None:  # proven against the base by the CRC-32s its items store: not read
            threads = self.hash_threads if self.hash_threads > 1 and d.nbytes > self.share else 1
            got = checked_by_crc(
                self.ckpt, e, d, self.base_crcs, self.crc_reader, self.base_path, threads=threads
            )
            if got is not None:
                return got[0], list(got[1])
        elif self.base_hash is None:  # no base: identified by the CRC-32s its items store
            stored = stored_crcs(self.ckpt, e, self.crc_reader)
            if stored is not None:
                return None, list(stored)
        got_ckpt = checkpoint_tensor_sha256(self.ckpt, e)  # another layout: read and hashed
        if self.base_hash is not None:
            name, got_base = self.base_hash(d)
            if got_base != got_ckpt:
                raise FormatError(
                    f"the base model's {name} upcast to {d.dtype} differs from the "
                    f"checkpoint's frozen tensor (sha256 {got_base[:12]}… vs {got_ckpt[:12]}…)",
                    path=self.base_path,
                    key=d.key,
                    hint="this is not the base the run trained on (another revision?), or the "
                    "tensor was trained; pass the right --base, or slim without --base",
                )
        return got_ckpt, None
