"""What `ckpt inspect` and `ckpt verify` say about a torchtitan checkpoint (metadata and a few byte items)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from ...core.errors import CkptError
from ...core.problems import VerifyReport
from ...io.inputs import as_input
from ..dcp.checks import verify_dcp
from ..dcp.model import TensorEntry
from .layout import DEFAULT_FOLDER, resolve_step_dir, step_dirs
from .reader import TorchtitanCheckpoint, model_bytes

__all__ = ["describe_torchtitan", "list_torchtitan_keys", "verify_torchtitan"]


def _value(ckpt: TorchtitanCheckpoint, group: str, field: str):
    for k, i in ckpt.infos.items():
        if i.group == group and i.field == field:
            return ckpt.read_object(k)
    return None


def describe_torchtitan(path: Path) -> dict:
    p = as_input(path)
    steps = step_dirs(p) or step_dirs(p / DEFAULT_FOLDER)
    with TorchtitanCheckpoint.open(resolve_step_dir(p)) as ckpt:
        groups = Counter(i.group for i in ckpt.infos.values())
        lrs = {
            ckpt.read_object(k)
            for k, i in ckpt.infos.items()
            if i.group == "param_groups" and i.field == "lr"
        }
        return {
            "format": "torchtitan",
            "path": str(ckpt.dir),
            "trainer": "torchtitan (CheckpointManager)",
            "steps": [{"step": s, "path": str(d)} for s, d in steps],
            "step": _value(ckpt, "train_state", "step"),
            "ntokens_seen": _value(ckpt, "train_state", "ntokens_seen"),
            "lr_scheduler_last_epoch": _value(ckpt, "scheduler", "last_epoch"),
            "lr": sorted(lrs) if len(lrs) > 1 else next(iter(lrs), None),
            "model_family": ckpt.family,
            "hf_rows_permuted": ckpt.permuted,
            "keys": len(ckpt.entries),
            "groups": dict(sorted(groups.items())),
            "model_tensors": groups.get("model", 0),
            "model_bytes": model_bytes(ckpt),
            "model_only": groups.get("optimizer_state", 0) == 0,
            "world_size_chunks": max((len(e.chunks) for e in ckpt.dcp.tensor_entries()), default=0),
            "training": "full fine-tune",
            "warnings": [],
        }


def list_torchtitan_keys(path: Path) -> list[dict]:
    with TorchtitanCheckpoint.open(path) as ckpt:
        rows = []
        for k, e in ckpt.entries.items():
            tensor = isinstance(e, TensorEntry)
            i = ckpt.infos[k]
            rows.append(
                {
                    "key": k,
                    "group": i.group,
                    "hf_name": i.hf_name,
                    "dtype": e.dtype if tensor else None,
                    "shape": list(e.shape) if tensor else None,
                    "chunks": len(e.chunks) if tensor else 1,
                }
            )
        return rows


def verify_torchtitan(path: Path, report: VerifyReport, *, deep: bool, progress=None, group=None) -> None:
    """DCP's checks of the step dir (`formats.dcp.checks.verify_dcp`), then torchtitan's key model."""
    step = resolve_step_dir(path)
    verify_dcp(step, report, deep=deep, progress=progress, group=group)
    # DCP's checks classify keys by prime-rl's key model; torchtitan's own (below) replaces that warning
    report.warnings = [w for w in report.warnings if "prime-rl key model" not in w.message]
    try:
        TorchtitanCheckpoint.open(step).close()
    except CkptError as exc:
        report.problem(exc.path or step, exc.key, exc.message + (f" ({exc.hint})" if exc.hint else ""))
