"""One dropped tensor rebuilt from the base and checked against the slim manifest (`TensorRun`).

`start` (main thread) registers the tensor's output chunk items in write order, each streamed
(`formats.dcp.stream_item`: its bytes are torch.save's, known in length before its payload exists), and
hands its blocks (`blocks.tensor_layout`) to the pipeline's workers. A worker reads the block's base rows
into its buffer, casts them (bf16 -> fp32: exact), takes the CRC-32 of each output chunk's piece, and
writes it at its place; the last block of a chunk joins the chunk's CRC-32 (`core.crc.crc32_combine`) and
writes the item's head and tail (zip records, data descriptor, central directory). The checks are joined
the same way: each original chunk's CRC-32 (a `Segment` of the manifest) from the blocks in it, the whole
tensor's sha256 fed in row order by whichever worker finishes the block whose turn it is (a sha256 is
serial: other tensors' blocks run meanwhile). The tensor's last block compares them all; the first mismatch
fails the run (nothing appears at OUT).

What does not stream is rebuilt by the main thread as the sequential writer did (`_inline`): a scalar or an
empty tensor (bytes), a chunk whose payload needs zip64 records (> 4 GiB) or a torch whose torch.save writes
another layout (`tensor_item_parts` is None): one chunk held, its bytes acquired from the budget.

Under ranks: a chunk of another rank's file is only counted (`writer.skip`); its rows are read only by the
rank that checks this tensor whole (`verify`), else not at all.
"""

from __future__ import annotations

import threading
from functools import partial
from pathlib import Path

import torch

from ...core.crc import crc32, crc32_combine
from ...core.dtypes import ITEMSIZE, torch_dtype
from ...core.errors import FormatError
from ...core.keys import expert_names, is_stacked_pattern
from ...formats.dcp.stream_item import TensorItemParts, tensor_item_parts
from ...formats.dcp.writer import ItemSlot
from ...formats.slim.rowcheck import RowCheck
from ...sources.hashing import read_as, read_rows_as, read_rows_into
from .blocks import Block, TensorLayout, row_blocks_in_order, tensor_layout
from .pipeline import Hold, Pipeline

__all__ = ["Tally", "TensorRun"]

_WRONG_BASE = (
    "this is not the base model the run trained on (another revision or a re-export?); pass the "
    "exact base, e.g. the snapshot recorded in the manifest"
)


class Tally:
    """What the tensors of this rank did, added up as they finish (any thread)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.verified = 0  # tensors checked whole here
        self.owner_checked = 0  # original chunks checked by their writer (tensors checked by owners)
        self.done_bytes = 0  # rebuilt bytes finished (progress)

    def add(self, verified: bool, owner_checked: int, nbytes: int) -> None:
        with self.lock:
            self.verified += verified
            self.owner_checked += owner_checked
            self.done_bytes += nbytes


def _joined(pieces: dict[int, tuple[int, int]]) -> int:
    """The CRC-32 of pieces {block index: (crc, length)} laid end to end in block order."""
    crc = None
    for k in sorted(pieces):
        c, n = pieces[k]
        crc = c if crc is None else crc32_combine(crc, c, n)
    return crc or 0


def _strides(shape) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape`."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def _bytes_of(t: torch.Tensor) -> memoryview:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().data


class TensorRun:
    """Tensor `index` of the plan (`r`, a `RebuildItem`) rebuilt from `hf` into `writer`; `verify`: this rank
    checks it whole (every row read: its sha256 and every original chunk's CRC-32), else only the original
    chunks whose rows this rank writes. `by_owner`: its original chunks are exactly its output chunks, and
    their writers check them (counted in `Tally.owner_checked`)."""

    def __init__(
        self,
        index: int,
        total: int,
        r,
        hf,
        writer,
        *,
        verify: bool,
        by_owner: bool,
        tally: Tally,
        base_path: Path,
    ):
        self.index, self.total, self.r, self.hf, self.writer = index, total, r, hf, writer
        self.verify, self.by_owner, self.tally, self.base_path = verify, by_owner, tally, base_path
        rows = r.shape[0] if r.shape else 1
        self.check = RowCheck(r.nbytes // max(1, rows), rows, r.sha256 if verify else None, r.segments)
        self.out_dtype = torch_dtype(r.dtype)
        first = expert_names(r.base_name, 0, 1)[0] if is_stacked_pattern(r.base_name) else r.base_name
        self.in_dtype = torch_dtype(hf.facts(first).dtype)
        self.lock = threading.Lock()

    # ---------------------------------------------------------------- main thread
    def start(self, pipe: Pipeline) -> None:
        """Register the chunks and hand the blocks to `pipe` (or rebuild inline, see the module)."""
        r = self.r
        out_item, in_item = ITEMSIZE[r.dtype], self.in_dtype.itemsize
        self.cast = self.in_dtype != self.out_dtype
        box = bool(r.shape) and row_blocks_in_order(r.shape, r.chunks) is None
        # a block's buffer per row: the output row, and a scratch row (the base row before the cast, or a
        # chunk's piece gathered out of a full row)
        out_row = (r.nbytes // r.shape[0]) if r.shape and r.shape[0] else 0
        self.scratch_row = max(out_row * in_item // out_item if self.cast else 0, out_row if box else 0)
        layout = tensor_layout(
            r.shape,
            out_item,
            r.chunks,
            r.segments,
            pipe.slot_bytes * out_row // max(1, out_row + self.scratch_row),
        )
        parts = None if layout is None else self._streamed_parts(layout)
        if layout is None or parts is None:
            self._inline(pipe)
            return
        self.layout = layout
        self.outs = self._register_chunks(layout, parts)
        self._count_checks(layout)
        if not self.read:
            self._finish()
            return
        for b in self.read:
            if not pipe.submit(partial(self._make, b), b.rows * (out_row + self.scratch_row)):
                pipe.raise_failure()

    def _streamed_parts(self, layout: TensorLayout) -> list[TensorItemParts | None] | None:
        """The bytes around the payload of each output chunk this rank writes (None for the others), or
        None where one of them does not stream: then the whole tensor is rebuilt inline."""
        writer = self.writer
        parts = [
            tensor_item_parts(self.r.dtype, c.sizes) if not c.empty and writer.owns(c.file_index) else None
            for c in layout.chunks
        ]
        if any(p is None and not c.empty and writer.owns(c.file_index) for p, c in zip(parts, layout.chunks)):
            return None
        return parts

    def _register_chunks(
        self, layout: TensorLayout, parts: list[TensorItemParts | None]
    ) -> list[tuple[ItemSlot, TensorItemParts] | None]:
        """Each output chunk registered in write order: another rank's counted, an empty one written now,
        each other one's slot reserved; returns (its slot, its parts) per chunk the workers write."""
        r, writer = self.r, self.writer
        outs: list[tuple[ItemSlot, TensorItemParts] | None] = []
        for c, p in zip(layout.chunks, parts):
            if not writer.owns(c.file_index):
                writer.skip(r.key)
                outs.append(None)
            elif (
                c.empty
            ):  # torch.save of what the sequential writer wrote: a box's slice keeps the tensor's strides
                empty = (
                    torch.empty(c.sizes, dtype=self.out_dtype)
                    if layout.row_blocks
                    else torch.empty_strided(c.sizes, _strides(r.shape), dtype=self.out_dtype)
                )
                writer.write_chunk(
                    r.key, r.path, empty, size=r.shape, offsets=c.offsets, file_index=c.file_index
                )
                outs.append(None)
            else:
                assert p is not None  # an owned chunk's (_streamed_parts)
                slot = writer.reserve_chunk(
                    r.key, r.path, r.dtype, r.shape, c.offsets, c.sizes, p.size, file_index=c.file_index
                )
                assert slot is not None  # a file this rank owns
                outs.append((slot, p))
        return outs

    def _count_checks(self, layout: TensorLayout) -> None:
        """The blocks this rank reads (every one when it verifies the tensor, else those of its chunks),
        and what each output chunk and each checked original chunk waits for."""
        owned = {i for i, o in enumerate(self.outs) if o is not None}
        self.read = [b for b in layout.blocks if self.verify or any(p.chunk in owned for p in b.pieces)]
        read = {b.index for b in self.read}
        self.chunk_left = {i: len(layout.chunk_blocks(i)) for i in owned}
        self.chunk_crcs: dict[int, dict[int, tuple[int, int]]] = {i: {} for i in owned}
        # an original chunk is checked where every one of its rows is read (verify: all)
        self.seg_left = {
            j: len(bs)
            for j in range(len(self.r.segments or ()))
            if (bs := layout.segment_blocks(j)) and set(bs) <= read
        }
        self.seg_crcs: dict[int, dict[int, tuple[int, int]]] = {j: {} for j in self.seg_left}
        self.left = len(self.read)
        self.pending: dict[int, tuple] = {}  # finished blocks waiting for the sha256's turn
        self.hashing = False
        self.next_hash = 0

    def _inline(self, pipe: Pipeline) -> None:
        """What does not stream, as the sequential writer wrote it, holding one chunk (or the tensor, for a
        layout that is not row blocks) of the budget."""
        r, writer = self.r, self.writer
        chunks = row_blocks_in_order(r.shape, r.chunks)
        hold = pipe.hold(
            r.nbytes * 3 // 2
            if chunks is None
            else max([0] + [r.nbytes // r.shape[0] * s[0] * 3 // 2 for _o, s, _fi in chunks])
        )
        if hold is None:
            pipe.raise_failure()
        assert hold is not None  # (None only once a unit failed: raised above)
        try:
            if chunks is None:
                if self.verify or any(writer.owns(fi) for _o, _s, fi in r.chunks):
                    t = read_as(self.hf, r.base_name, self.out_dtype)
                    for offsets, sizes, fi in r.chunks:
                        if writer.owns(fi):
                            writer.write_tensor(r.key, r.path, t, chunks=[(offsets, sizes)], file_index=fi)
                        else:
                            writer.skip(r.key)
                    self.check.feed(0, _bytes_of(t))
                    del t
                else:
                    for _chunk in r.chunks:
                        writer.skip(r.key)
            else:
                for offsets, sizes, fi in chunks:
                    mine = writer.owns(fi)
                    if sizes[0] == 0 or not (mine or self.verify):
                        if mine:
                            writer.write_chunk(
                                r.key,
                                r.path,
                                torch.empty(sizes, dtype=self.out_dtype),
                                size=r.shape,
                                offsets=offsets,
                                file_index=fi,
                            )
                        else:
                            writer.skip(r.key)
                        continue
                    piece = read_rows_as(self.hf, r.base_name, self.out_dtype, offsets[0], sizes[0])
                    self.check.feed(offsets[0], _bytes_of(piece))
                    if mine:
                        writer.write_chunk(r.key, r.path, piece, size=r.shape, offsets=offsets, file_index=fi)
                    else:
                        writer.skip(r.key)
                    del piece
        finally:
            hold.release()
        self._finish()

    # ---------------------------------------------------------------- workers
    def _make(self, b: Block, hold: Hold) -> None:
        """Block `b`: its base rows read and cast into `hold`'s buffer, each of its pieces written at its
        place, its CRC-32s joined into the chunks' and the original chunks'."""
        r, layout = self.r, self.layout
        buf = hold.buffer()
        out = buf[: b.rows * layout.row_bytes]
        scratch = buf[len(out) : len(out) + b.rows * self.scratch_row]
        if self.cast:
            src = scratch[: b.rows * layout.row_bytes * self.in_dtype.itemsize // self.out_dtype.itemsize]
            read_rows_into(self.hf, r.base_name, b.start, b.rows, src)
            torch.frombuffer(out, dtype=self.out_dtype).copy_(torch.frombuffer(src, dtype=self.in_dtype))
        else:
            read_rows_into(self.hf, r.base_name, b.start, b.rows, out)
        whole = None  # the CRC-32 of the block's rows (its piece's, in a row-block layout)
        for p in b.pieces:
            dest = self.outs[p.chunk]
            if dest is None:
                continue
            slot, parts = dest
            data = out if layout.row_blocks else self._gather(out, scratch, b, p.chunk, p.nbytes)
            crc = crc32(data)
            if layout.row_blocks:
                whole = crc
            slot.write_at(len(parts.head) + p.at, data)
            self._piece_done(p.chunk, b.index, crc, p.nbytes, slot, parts)
        segs = [j for j in b.segments if j in self.seg_left]
        if segs:
            whole = crc32(out) if whole is None else whole
            for j in segs:
                self._segment_piece(j, b.index, whole, len(out))
        if self.check.sha256 is not None:
            self._hash_in_turn(b, out, hold)
        else:
            hold.release()
            self._block_done()

    def _gather(self, out: memoryview, scratch: memoryview, b: Block, chunk: int, nbytes: int) -> memoryview:
        """Output chunk `chunk`'s part of block `b`'s rows (its box's other dims), contiguous in `scratch`."""
        c = self.layout.chunks[chunk]
        rows = torch.frombuffer(out, dtype=self.out_dtype).view((b.rows,) + tuple(self.r.shape[1:]))
        region = rows[(slice(None),) + tuple(slice(o, o + s) for o, s in zip(c.offsets[1:], c.sizes[1:]))]
        dst = scratch[:nbytes]
        torch.frombuffer(dst, dtype=self.out_dtype).view(region.shape).copy_(region)
        return dst

    def _piece_done(
        self, chunk: int, block: int, crc: int, nbytes: int, slot: ItemSlot, parts: TensorItemParts
    ) -> None:
        with self.lock:
            self.chunk_crcs[chunk][block] = (crc, nbytes)
            self.chunk_left[chunk] -= 1
            if self.chunk_left[chunk]:
                return
            crcs = self.chunk_crcs.pop(chunk)
        crc = _joined(crcs)
        slot.write_at(0, parts.head)
        slot.write_at(len(parts.head) + parts.payload_bytes, parts.tail(crc))

    def _segment_piece(self, seg: int, block: int, crc: int, nbytes: int) -> None:
        with self.lock:
            self.seg_crcs[seg][block] = (crc, nbytes)
            self.seg_left[seg] -= 1
            if not self.seg_left[seg]:
                self.check.segment_crc(seg, _joined(self.seg_crcs.pop(seg)))

    def _hash_in_turn(self, b: Block, out: memoryview, hold: Hold) -> None:
        """Feed the sha256 every finished block whose turn has come (rows in order), by this worker unless
        another one is at it; a block waits, holding its buffer, until its turn."""
        with self.lock:
            self.pending[b.index] = (b, out, hold)
            if self.hashing:
                return
            self.hashing = True
        while True:
            with self.lock:
                item = self.pending.pop(self.next_hash, None)
                if item is None:
                    self.hashing = False
                    return
                self.next_hash += 1
            blk, data, h = item
            self.check.feed(blk.start, data, segments=False)  # (only this worker feeds now)
            h.release()
            self._block_done()

    def _block_done(self) -> None:
        with self.lock:
            self.left -= 1
            last = self.left == 0
        if last:
            self._finish()

    # ---------------------------------------------------------------- the verdict
    def _finish(self) -> None:
        """The tensor's checks, once every block is in: a mismatch fails the run, naming the key."""
        r, check = self.r, self.check
        where = (
            f"{r.base_name} from the base, as {r.dtype}; tensor {self.index + 1} of {self.total} in the plan"
        )
        if check.failed:
            raise FormatError(
                f"rebuilt tensor does not match the original: {check.failed[0]} ({where}); OUT was "
                "not created",
                path=self.base_path,
                key=r.key,
                hint=_WRONG_BASE,
            )
        got = check.sha256_done()
        if self.verify and r.sha256 is not None and got != r.sha256:
            raise FormatError(
                f"rebuilt tensor does not match the original: sha256 of {r.base_name} from the base, "
                f"as {r.dtype}, is {(got or '?')[:16]}…, the slim manifest recorded {r.sha256[:16]}… "
                f"(tensor {self.index + 1} of {self.total} in the plan); OUT was not created",
                path=self.base_path,
                key=r.key,
                hint=_WRONG_BASE,
            )
        if self.verify and not check.complete():  # an internal invariant: the verifier reads every row
            raise FormatError("rebuilt tensor was not checked whole", path=self.base_path, key=r.key)
        self.tally.add(self.verify, check.checked if self.by_owner else 0, r.nbytes)
