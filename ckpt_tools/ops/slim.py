"""`ckpt slim`: keep only a checkpoint's unique state; record what was dropped so it can be rebuilt.

A prime-rl LoRA checkpoint is ~97% frozen base weights: fp32 masters that are exact upcasts of the
public bf16 base model (docs/primerl-format.md §0). `plan_slim` decides, from metadata alone, what a
slim keeps (LoRA, AdamW state, param_groups, scheduler, progress, anything unrecognised: copied
VERBATIM by byte range) and drops (`formats.slim.partition`); `run_slim` writes it into an
`AtomicOutputDir` (`formats.slim.writer`): every dropped tensor identified in the manifest by the
CRC-32s its items store (read from their zip headers: its payload is never read) and, with `--base`,
proven equal to the base's upcast (CRC-32 per chunk) whose sha256 is recorded. So a slim reads the
checkpoint at most once: the kept items, and a few header bytes of each dropped one. The slim
checkpoint format, what each identification guarantees, and why prime-rl cannot resume from one until
`ckpt rehydrate`, are `formats.slim.manifest`'s.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..core.keys import classify
from ..core.progress import Progress
from ..dist import Group, SoloGroup, local_workers
from ..formats.dcp.reader import DcpCheckpoint
from ..formats.hf_dir.model_dir import HFModelDir
from ..formats.primerl.alpha import find_run_configs, orch_model_name
from ..formats.primerl.optimizers import optimizer_facts
from ..formats.slim.partition import SlimLayout, base_identity, partition
from ..formats.slim.writer import need_bytes, reads_payload, write_slim
from ..io.staging import SharedOutputDir
from ..sources.hashing import (
    BASE_BLOCK_BYTES,
    PIECE_VALUES,
    READ_BLOCK_BYTES,
    base_crc_check,
    base_hash_check,
)

__all__ = [
    "SlimOptions",
    "SlimPlan",
    "SlimReport",
    "SlimResult",
    "SlimSources",
    "open_slim_sources",
    "plan_slim",
    "run_slim",
]


@dataclass(frozen=True)
class SlimOptions:
    out: str | Path
    base: str | None = None  # the bf16 HF base: recorded in the manifest and checked now
    overwrite: bool = False
    trust_pickle: bool = False


@dataclass
class SlimSources:
    ckpt: DcpCheckpoint
    base: HFModelDir | None = None

    def close(self) -> None:
        if self.base is not None:
            self.base.close()
        self.ckpt.close()

    def __enter__(self) -> SlimSources:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_slim_sources(ckpt_path: str | Path, options: SlimOptions) -> SlimSources:
    ckpt = DcpCheckpoint.open(ckpt_path, trust_pickle=options.trust_pickle)
    try:
        base = HFModelDir.open_ref(options.base) if options.base is not None else None
    except BaseException:
        ckpt.close()
        raise
    return SlimSources(ckpt, base)


@dataclass(frozen=True)
class SlimPlan:
    out: str
    layout: SlimLayout
    base: dict | None  # base identity (from --base) or the run config's model name
    verify_base: bool
    warnings: tuple[str, ...] = ()  # e.g. what the checkpoint does not hold (no optimizer moments)

    @property
    def units(self) -> tuple[str, ...]:
        """The independent work units: the output data files (output file i <- source file i)."""
        return self.layout.data_files

    def to_json(self) -> dict:
        x = self.layout
        return {
            "source": x.source,
            "out": self.out,
            "world_size": x.world_size,
            "kept_items": len(x.kept),
            "kept_keys": len({k.key for k in x.kept}),
            "dropped_keys": len(x.dropped),
            "kept_bytes": x.kept_bytes,
            "dropped_bytes": x.dropped_bytes,
            "source_bytes": x.source_bytes,
            "size_ratio": x.source_bytes / max(1, x.kept_bytes),
            "extra_files": list(x.extra_files),
            "base": self.base,
            "verify_base": self.verify_base,
            "dropped": [d.key for d in x.dropped],
            "warnings": list(self.warnings),
        }


@dataclass
class SlimResult:
    out: str
    kept_items: int
    dropped_keys: int
    bytes_written: int
    bytes_read: int
    source_bytes: int
    out_bytes: int
    base_verified: bool
    seconds: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        d = asdict(self)
        d["size_ratio"] = self.source_bytes / max(1, self.out_bytes)
        return d


@dataclass(frozen=True)
class SlimReport:
    plan: SlimPlan
    result: SlimResult | None = None  # None: a dry run

    def to_json(self) -> dict:
        rep = {"plan": self.plan.to_json(), "dry_run": self.result is None}
        if self.result is not None:
            rep["result"] = self.result.to_json()
        return rep


def _base_from_run_config(ckpt_dir: Path) -> dict | None:
    """Without --base, record the model name from the run's orch.toml (unverified) so the user
    knows what to pass to rehydrate."""
    configs = find_run_configs(ckpt_dir)
    if len(configs) != 1:
        return None
    name = orch_model_name(configs[0])  # orch.toml [model] name or HEAD trainer.json model.name
    if not isinstance(name, str):
        return None
    return {"name": str(name), "source": str(configs[0])}


def plan_slim(sources: SlimSources, options: SlimOptions) -> SlimPlan:
    """What slim will keep and drop, from metadata alone (and the base's headers, with --base)."""
    base = sources.base
    info = (
        base_identity(base, str(options.base))
        if base is not None
        else _base_from_run_config(sources.ckpt.dir)
    )
    absent = optimizer_facts(classify(k, e.path) for k, e in sources.ckpt.entries.items()).absent
    notes = (f"{absent}: nothing of the optimizer to keep",) if absent else ()
    return SlimPlan(str(options.out), partition(sources.ckpt), info, base is not None, notes)


HASH_BUDGET_BYTES = 640 * 2**20  # what one rank's hashing threads hold at once


def hash_threads(layout: SlimLayout, with_base: bool = True) -> int:
    """Threads identifying dropped tensors: this rank's cores, as many as fit HASH_BUDGET_BYTES when each
    holds one base read block and one cast piece (`sources.hashing`; a row-block tensor's own bytes are never
    read) or, for a tensor that is read (`reads_payload`), one checkpoint chunk and one base block."""
    block = READ_BLOCK_BYTES + 4 * PIECE_VALUES if with_base else 0
    most = max(
        (
            block + (d.nbytes // max(1, len(d.chunks)) + BASE_BLOCK_BYTES if reads_payload(d) else 0)
            for d in layout.dropped
        ),
        default=1,
    )
    return max(1, min(local_workers(), HASH_BUDGET_BYTES // max(1, most)))


def run_slim(
    plan: SlimPlan,
    sources: SlimSources,
    progress: Progress | None = None,
    *,
    overwrite: bool = False,
    group: Group | None = None,
) -> SlimReport:
    """Write the slim checkpoint. Under torchrun (`group`), the ranks split the kept items by output
    file and the dropped tensors' hashing; rank 0 writes `.metadata` and the manifest, and commits."""
    group = group or SoloGroup()
    t0 = time.perf_counter()
    ckpt, base = sources.ckpt, sources.base
    base_hash = base_hash_check(base, plan.layout.dropped) if base is not None else None
    # dropped tensors are not read (local or remote): proven against the base by the CRC-32 their items store
    base_crcs = base_crc_check(base, plan.layout.dropped) if base is not None else None
    inputs = [ckpt.dir] + ([base.path] if base is not None else [])  # --base is an input too
    with SharedOutputDir(
        plan.out, group, inputs=inputs, need_bytes=need_bytes(ckpt.dir, plan.layout), overwrite=overwrite
    ) as tmp:
        written = write_slim(
            ckpt,
            tmp,
            plan.layout,
            base=plan.base,
            base_hash=base_hash,
            base_path=base.path if base is not None else None,
            progress=progress,
            group=group,
            hash_threads=hash_threads(plan.layout, base is not None),
            base_crcs=base_crcs,
        )
        (bytes_read,) = group.sum([ckpt.stats.bytes_read], "the bytes read")
    out_bytes = sum(f.stat().st_size for f in Path(plan.out).iterdir() if f.is_file())
    seconds = dict(written.seconds, total=round(time.perf_counter() - t0, 3))
    x = plan.layout
    return SlimReport(
        plan,
        SlimResult(
            out=plan.out,
            kept_items=len(x.kept),
            dropped_keys=len(x.dropped),
            bytes_written=written.bytes_written,
            bytes_read=bytes_read,
            source_bytes=x.source_bytes,
            out_bytes=out_bytes,
            base_verified=written.base_verified,
            seconds=seconds,
        ),
    )
