"""`ckpt gc`: keep every checkpoint of a run, the newest N whole and every older one slim, in place.

For each older `step_N/trainer` (oldest first): slim it next to itself into `step_N/.trainer.gc-slim`
(`formats.slim.writer.write_slim`, with the base model checked: every dropped tensor must equal the base's
upcast, so
`ckpt rehydrate` can rebuild it), verify the slim against the original (every kept storage item's
bytes by sha256, the key sets, the dropped tensors' layout), swap the two directories atomically
(`io.files.exchange_paths`, renameat2 RENAME_EXCHANGE), move the full one aside to `.trainer.gc-old`
and delete it. The step lock `step_N/.trainer.lock` (the one `AtomicOutputDir` and in-place editors
of `step_N/trainer` take) is held throughout.

Why a kill at any moment leaves every step full or slim: until the exchange, `trainer` is the
untouched original; the exchange is one syscall; after it `trainer` is a complete, verified slim.
What a killed run leaves (`.trainer.gc-slim`, `.trainer.gc-old`, `..trainer.gc-slim.tmp-*`) is
hidden, named for what it is, and finished or removed by the next run (`recover_step`). Where the
filesystem cannot exchange (some network filesystems), the swap is two renames with signals held;
a SIGKILL between them leaves `trainer` absent and the full copy at `.trainer.gc-old` until the next
gc (or `ckpt gc --dry-run`) puts it back.

Left alone: the newest N complete checkpoints, anything without `.metadata` (being written, or a
save that died), anything modified within `min_age_s`, anything whose step lock is held or that
holds a lock file we do not know, and checkpoints already slim. Refuses to start when free disk is
below the largest slim it would write.
"""

from .layout import ASIDE, STAGED, STEP_LOCK, TRAINER
from .plan import DEFAULT_MIN_AGE_S, GcPlan, StepPlan, plan_gc
from .run import GcReport, GcResult, StepResult, gc, run_gc, write_verified_slim
from .swap import (
    check_slim,
    recover_step,
    remove_file,
    remove_tree,
    set_aside,
    swap_in_slim,
    verify_slim_against,
)

__all__ = [
    "ASIDE",
    "DEFAULT_MIN_AGE_S",
    "STAGED",
    "STEP_LOCK",
    "TRAINER",
    "GcPlan",
    "GcReport",
    "GcResult",
    "StepPlan",
    "StepResult",
    "check_slim",
    "gc",
    "plan_gc",
    "recover_step",
    "remove_file",
    "remove_tree",
    "run_gc",
    "set_aside",
    "swap_in_slim",
    "verify_slim_against",
    "write_verified_slim",
]
