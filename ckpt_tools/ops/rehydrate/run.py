"""`ckpt rehydrate`, run: the slim's items copied and the dropped tensors rebuilt into an atomic output, by
the pipeline's workers (`pipeline`), within one memory budget.

The main thread registers every item in the order the sequential writer wrote them: the slim's items (in
their files' order), then each rebuilt tensor's chunks (in base file order). That fixes every item's place
in its data file, so the files are byte for byte what writing the items one after another gives, whichever
worker writes which bytes when. Each kept item is checked as it is read (its zip CRC-32s, then the CRC-32
the manifest recorded of it, `kept_crc32`) and copied by `copy_file_range`; each dropped tensor is rebuilt
block by block from the base (`rebuild.TensorRun`). Several files are written at once, and one file's
items are written by several workers at their places. Every block's writeback to disk starts as it is
written, so the final fsync finds little left. The first failure anywhere aborts the whole run (nothing
appears at OUT).
"""

from __future__ import annotations

import gc
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ...core.errors import ChecksumError, FormatError
from ...core.keys import expert_names, is_stacked_pattern
from ...core.parts import assign_units
from ...core.progress import Progress, report
from ...dist import Group, SoloGroup
from ...formats.dcp.item_copy import write_checked_item
from ...formats.dcp.layout import extra_bytes
from ...formats.dcp.model import BytesEntry
from ...formats.dcp.reader import DcpCheckpoint
from ...formats.dcp.writer import DcpWriter
from ...formats.slim.writer import copy_extra_entries
from ...io.inputs import as_input
from ...io.staging import SharedOutputDir
from .blocks import row_blocks_in_order
from .pipeline import Pipeline
from .plan import ITEM_OVERHEAD_BYTES, RebuildItem, RehydratePlan, RehydrateSources
from .rebuild import Tally, TensorRun

__all__ = ["RehydrateReport", "RehydrateResult", "run_rehydrate"]


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
    threads: int = 1

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RehydrateReport:
    plan: RehydratePlan
    result: RehydrateResult | None = None  # None: a dry run

    def to_json(self) -> dict:
        rep = {"plan": self.plan.to_json(), "dry_run": self.result is None}
        if self.result is not None:
            rep["result"] = self.result.to_json()
        return rep


def _checked_by_owners(r: RebuildItem) -> bool:
    """Whether the rebuilt chunks are exactly the original chunks whose CRC-32s identify the tensor (and no
    sha256 needs every row in one process): then each chunk's writer checks it, no rank reads rows twice."""
    if r.sha256 is not None or r.segments is None or row_blocks_in_order(r.shape, r.chunks) is None:
        return False
    rows = sorted((o[0], s[0]) for o, s, _fi in r.chunks if s and s[0])
    return rows == [(g.start, g.rows) for g in r.segments]


def _file_weights(plan: RehydratePlan) -> list[int]:
    """Bytes each output data file receives (copied items and rebuilt chunks): the ranks' units."""
    w = [0] * plan.files
    for _key, _rel, _off, length, fi in plan.copy_items:
        w[fi % plan.files] += length
    for r in plan.rebuild:
        per_row = r.nbytes // r.shape[0] if r.shape and r.shape[0] else r.nbytes
        for _offsets, sizes, fi in r.chunks:
            w[fi % plan.files] += per_row * (sizes[0] if sizes else 1)
    return w


def _copy_one(
    ckpt: DcpCheckpoint, slot, n: int, key: str, rel: str, offset: int, length: int, want: int | None
):
    """A worker's unit: kept item `n` checked and written into its slot, against the manifest's CRC-32."""

    def copy(hold) -> None:
        try:
            got = write_checked_item(
                ckpt, slot, key, rel, offset, length, buf=hold.buffer() if hold.has_buffer else None
            )
        finally:
            hold.release()
        if want is not None and got != want:
            raise ChecksumError(
                f"the item's bytes differ from what `ckpt slim` copied (CRC-32 {got:#010x}, the manifest "
                f"recorded "
                f"{want:#010x}); OUT was not created",
                path=ckpt.dir / rel,
                key=key,
                hint="the slim checkpoint is damaged: rehydrate an intact copy of it (after gc it may be the "
                "only "
                "copy of the run's trained state)",
            )

    return copy


def _register_copies(plan: RehydratePlan, ckpt: DcpCheckpoint, writer, pipe: Pipeline) -> None:
    """Every slim item registered in order, its check and copy handed to the workers."""
    for n, (key, rel, offset, length, fi) in enumerate(plan.copy_items):
        if not writer.owns(fi):
            writer.skip(key)
            continue
        e = ckpt.entries[key]
        if isinstance(e, BytesEntry):
            slot = writer.reserve_bytes(key, e.path, length, file_index=fi)
        else:
            chunk = next(c for c in e.chunks if c.file == rel and c.offset == offset)
            slot = writer.reserve_chunk(
                key, e.path, e.dtype, e.shape, chunk.offsets, chunk.sizes, length, file_index=fi
            )
        want = None if plan.kept_crc32 is None else plan.kept_crc32[n]
        # a large item is read in blocks of a slot's buffer, a small one (or a remote one) whole
        large = length > (1 << 20)
        if not pipe.submit(
            _copy_one(ckpt, slot, n, key, rel, offset, length, want),
            min(length, pipe.slot_bytes) if large else length,
            buffer=large,
        ):
            pipe.raise_failure()


def run_rehydrate(
    plan: RehydratePlan,
    sources: RehydrateSources,
    progress: Progress | None = None,
    *,
    overwrite: bool = False,
    group: Group | None = None,
) -> RehydrateReport:
    """Write the full checkpoint. Under torchrun (`group`), each rank writes its share of the output
    data files and checks its share of the rebuilt tensors; rank 0 writes `.metadata` and commits."""
    ckpt, hf = sources.slim, sources.base
    group = group or SoloGroup()
    t0 = time.perf_counter()
    need = (
        plan.copy_bytes
        + plan.rebuild_bytes
        + extra_bytes(ckpt.dir, plan.extra_files)
        + ITEM_OVERHEAD_BYTES * (1 + sum(len(r.chunks) for r in plan.rebuild))
    )
    seconds: dict[str, float] = {}
    with SharedOutputDir(
        plan.out, group, inputs=[ckpt.dir, hf.path], need_bytes=need, overwrite=overwrite
    ) as tmp:
        verified, bytes_written = _write(plan, sources, tmp, group, progress, seconds, t0)
        if group.leader:
            copy_extra_entries(ckpt.dir, tmp, plan.extra_files)
    out_bytes = sum(f.stat().st_size for f in Path(plan.out).iterdir() if f.is_file())
    seconds["total"] = round(time.perf_counter() - t0, 3)
    base_read = sum(
        hf.facts(n).nbytes
        for r in plan.rebuild  # the base tensors the plan rebuilds
        for n in (
            expert_names(r.base_name, 0, r.shape[0]) if is_stacked_pattern(r.base_name) else [r.base_name]
        )
    )
    return RehydrateReport(
        plan,
        RehydrateResult(
            out=plan.out,
            copied_items=len(plan.copy_items),
            rebuilt_tensors=len(plan.rebuild),
            verified_tensors=verified,
            bytes_written=bytes_written,
            base_bytes_read=base_read,
            out_bytes=out_bytes,
            seconds=seconds,
            threads=plan.threads,
        ),
    )


def _write(
    plan: RehydratePlan,
    sources: RehydrateSources,
    tmp: Path,
    group: Group,
    progress: Progress | None,
    seconds: dict[str, float],
    t0: float,
) -> tuple[int, int]:
    """Every item of this rank's data files registered in order and written by the pipeline's workers
    into `tmp`, the rebuilt tensors checked; returns (the tensors verified, the bytes written), over
    every rank."""
    ckpt, hf = sources.slim, sources.base
    # which rank checks each rebuilt tensor whole, reading all its rows (every one, in one process); a tensor
    # identified by CRC-32s of exactly its output chunks needs none: each chunk's writer checks it
    verifier = assign_units([r.nbytes for r in plan.rebuild], group.part.world)
    by_owner = [_checked_by_owners(r) for r in plan.rebuild]
    tally = Tally()
    owned_files = group.part.mine(_file_weights(plan)) if group.part.world > 1 else None
    writer = DcpWriter(tmp, files=plan.files, owned_files=owned_files)
    hf.open_all()  # every base shard's fd now, before the workers read
    # the workers are the parallelism: torch's own intra-op threads on top of them (the cast of each
    # block) would oversubscribe the cores
    intra_op = torch.get_num_threads()
    torch.set_num_threads(1)
    # the objects alive now (torch's, the plan's) are never garbage: the collector, which holds the GIL
    # while it walks them, then skips them (it walked them on every collection: 4% of a 2-core run)
    gc.freeze()
    pipe = Pipeline(plan.threads)
    ok = False
    shown = -1

    def tick() -> None:
        nonlocal shown
        if tally.done_bytes != shown:
            shown = tally.done_bytes
            report(progress, "rebuild", tally.done_bytes, plan.rebuild_bytes)

    try:
        ckpt.hint_reads(
            (rel, offset, length) for _k, rel, offset, length, fi in plan.copy_items if writer.owns(fi)
        )
        _register_copies(plan, ckpt, writer, pipe)
        for i, r in enumerate(plan.rebuild):
            verify = verifier[i] == group.part.rank and not by_owner[i]
            run = TensorRun(
                i,
                len(plan.rebuild),
                r,
                hf,
                writer,
                verify=verify,
                by_owner=by_owner[i],
                tally=tally,
                base_path=as_input(plan.base),
            )
            run.start(pipe)
            tick()
        seconds["registered"] = round(time.perf_counter() - t0, 3)
        pipe.drain(tick)
        seconds["written"] = round(time.perf_counter() - t0, 3)
        totals = _totals(plan, ckpt, writer, group, tally, by_owner)
        writer.finish(group)
        ok = True
    except BaseException:
        writer.abort()
        raise
    finally:
        pipe.close(wait=ok)
        torch.set_num_threads(intra_op)
        gc.unfreeze()
    return totals


def _totals(
    plan: RehydratePlan,
    ckpt: DcpCheckpoint,
    writer: DcpWriter,
    group: Group,
    tally: Tally,
    by_owner: list[bool],
) -> tuple[int, int]:
    """(The tensors verified, the bytes written) over every rank, once every key is written exactly once
    and every rebuilt chunk its writer checks was checked (internal invariants)."""
    expected = set(ckpt.entries) | {r.key for r in plan.rebuild}
    if writer.keys() != expected:  # an internal invariant: every key exactly once
        raise FormatError(
            f"output would hold {len(writer.keys())} keys, expected {len(expected)}", path=plan.out
        )
    verified, bytes_written, owned = group.sum(
        [tally.verified, writer.bytes_written, tally.owner_checked], "the rehydrate totals"
    )
    owner_checks = sum(len(r.segments or ()) for r, own in zip(plan.rebuild, by_owner) if own)
    if owned != owner_checks:  # an internal invariant: every chunk checked by its writer
        raise FormatError(f"{owned} of {owner_checks} rebuilt chunks were checked", path=plan.out)
    return verified + sum(by_owner), bytes_written
