"""`ckpt rehydrate`: slim checkpoint + the bf16 HF base -> the full checkpoint prime-rl resumes from.

Every item of the slim checkpoint is copied verbatim by byte range (a large one by `copy_file_range`),
checked against its zip CRC-32s and the manifest's CRC of it (`kept_crc32`; an older manifest has none,
and the plan says so). Every tensor the slim manifest lists as dropped is rebuilt from the base model
(bf16 -> the checkpoint's fp32, an exact upcast) and checked against the manifest's identification of
it (each original chunk's CRC-32 and/or the whole tensor's sha256); the first mismatch aborts the whole run
(nothing appears at OUT: the output is atomic, and the temp dir is removed). The rebuilt tensors are written
in the exact original chunk layout and rank files recorded in the manifest, or as row chunks for
`--world-size W` ranks, each chunk item streamed (`formats.dcp.stream_item`).

plan (`plan`) -> run (`run`): the items registered in order, their bytes made by a pool of workers
(`pipeline`, `rebuild`: blocks of rows, `blocks`) within one memory budget, whatever the number of workers.
"""

from __future__ import annotations

from .plan import (
    RebuildItem,
    RehydrateOptions,
    RehydratePlan,
    RehydrateSources,
    open_rehydrate_sources,
    plan_rehydrate,
)
from .run import RehydrateReport, RehydrateResult, run_rehydrate

__all__ = [
    "RebuildItem",
    "RehydrateOptions",
    "RehydratePlan",
    "RehydrateReport",
    "RehydrateResult",
    "RehydrateSources",
    "open_rehydrate_sources",
    "plan_rehydrate",
    "run_rehydrate",
]
