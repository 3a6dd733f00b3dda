"""What `ckpt inspect` and `ckpt verify` say about a verl checkpoint: from the rank files' zip directories and
data.pkl (no tensor byte, but for `verify --deep`, which reads every storage record against its CRC-32)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from ...core.crc import crc32
from ...core.errors import AlphaError, CkptError
from ...core.problems import VerifyReport
from ...io.inputs import OpenFiles, as_input
from .archive import open_archive, walk_records
from .layout import actor_dirs, rank_file, resolve_actor_dir, step_of
from .lora import resolve_verl_alpha
from .reader import VerlCheckpoint

__all__ = ["describe_verl", "list_verl_keys", "verify_verl"]

_READ = 1 << 24  # verify --deep reads records in pieces of this size


def _optimizer(ckpt: VerlCheckpoint) -> dict:
    """Rank 0's optimizer file: its class-independent facts (lr, initial_lr, how many params have state)."""
    name = rank_file("optim", ckpt.world_size, 0)
    if not (ckpt.dir / name).is_file():
        return {"file": None}
    obj = open_archive(ckpt.files, name).obj
    groups = obj.get("param_groups") if isinstance(obj, dict) else None
    g0 = groups[0] if isinstance(groups, list) and groups and isinstance(groups[0], dict) else {}
    state = obj.get("state") if isinstance(obj, dict) else None
    return {
        "file": name,
        "lr": g0.get("lr"),
        "initial_lr": g0.get("initial_lr"),
        "param_groups": len(groups) if isinstance(groups, list) else None,
        "params_with_state": len(state) if isinstance(state, dict) else None,
    }


def _scheduler(ckpt: VerlCheckpoint) -> dict | None:
    name = rank_file("extra_state", ckpt.world_size, 0)
    if not (ckpt.dir / name).is_file():
        return None
    obj = open_archive(ckpt.files, name).obj
    sched = obj.get("lr_scheduler") if isinstance(obj, dict) else None
    if not isinstance(sched, dict):
        return None
    return {k: sched.get(k) for k in ("last_epoch", "base_lrs", "_last_lr") if k in sched}


def _lora(ckpt: VerlCheckpoint, alpha: float | None) -> dict | None:
    lora = [i for i in ckpt.infos.values() if i.group == "lora"]
    if not lora:
        return None
    ranks = sorted({ckpt.entries[i.key].shape[0] for i in lora if i.ab == "A"})
    out: dict = {"modules": len({i.module for i in lora}), "rank": ranks[0] if len(ranks) == 1 else ranks}
    out["targets"] = sorted({(i.module or "").rsplit(".", 1)[-1] for i in lora})
    try:
        res = resolve_verl_alpha(ckpt, alpha, ranks[0] if len(ranks) == 1 else None)
        out.update(alpha=res.alpha, alpha_source=res.source, warnings=list(res.warnings))
    except AlphaError as exc:
        out.update(alpha=None, alpha_unresolved=exc.message)
    return out


def describe_verl(path: Path, *, alpha: float | None = None) -> dict:
    """The inspect report of a verl run dir, global_step dir or actor dir."""
    p = as_input(path)
    steps = (
        [{"step": s, "path": str(d)} for s, d in actor_dirs(p)] if p.is_dir() and step_of(p) is None else []
    )
    with VerlCheckpoint.open(resolve_actor_dir(p)) as ckpt:
        groups = Counter(i.group for i in ckpt.infos.values())
        lora = _lora(ckpt, alpha)
        return {
            "format": "verl",
            "path": str(ckpt.dir),
            "trainer": "verl (FSDPCheckpointManager)",
            "step": step_of(ckpt.dir.parent),
            "steps": steps,
            "fsdp_version": ckpt.fsdp_version,
            "world_size": ckpt.world_size,
            "keys": len(ckpt.entries),
            "groups": dict(sorted(groups.items())),
            "placements": dict(Counter(e.placement for e in ckpt.entries.values())),
            "model_bytes": sum(e.nbytes for e in ckpt.entries.values()),
            "dtypes": sorted({e.dtype for e in ckpt.entries.values()}),
            "training": "LoRA" if lora else "full fine-tune",
            "lora": lora,
            "optimizer": _optimizer(ckpt),
            "scheduler": _scheduler(ckpt),
            "hf_config": str(ckpt.hf_config_dir) if ckpt.hf_config_dir else None,
            "warnings": list(lora.get("warnings", [])) if lora else [],
        }


def list_verl_keys(path: Path) -> list[dict]:
    with VerlCheckpoint.open(path) as ckpt:
        return [
            {
                "key": k,
                "group": ckpt.infos[k].group,
                "hf_name": ckpt.infos[k].hf_name,
                "dtype": e.dtype,
                "shape": list(e.shape),
                "placement": e.placement,
                "pieces": len(e.pieces),
            }
            for k, e in ckpt.entries.items()
        ]


def _deep(files: OpenFiles, rel: str, report: VerifyReport) -> int:
    """Every record of one rank file against its stored CRC-32; the records checked."""
    layout = walk_records(files, rel)
    files.hint([(rel, off, size) for _name, off, size, _crc in layout.records])  # fetched ahead at a URL
    for name, off, size, crc in layout.records:
        got = 0
        for at in range(off, off + size, _READ):
            got = crc32(files.read(rel, at, min(_READ, off + size - at), rel), got)
        if crc and got != crc:
            report.problem(
                files.root / rel, name, f"fails its zip CRC-32 (stored {crc:#010x}, computed {got:#010x})"
            )
    return len(layout.records)


def verify_verl(path: Path, report: VerifyReport, *, deep: bool) -> None:
    """Structure (every rank file decodes, the shards tile each tensor, keys known), and with `deep` every
    record of every rank file (model, optim, extra_state) against its CRC-32."""
    try:
        ckpt = VerlCheckpoint.open(path)
    except CkptError as exc:
        report.problem(exc.path or path, exc.key, exc.message + (f" ({exc.hint})" if exc.hint else ""))
        return
    with ckpt:
        report.path = str(ckpt.dir)
        report.checked = {"tensors": len(ckpt.entries), "ranks": ckpt.world_size}
        if not deep:
            return
        records = 0
        for kind in ("model", "optim", "extra_state"):
            for r in range(ckpt.world_size):
                rel = rank_file(kind, ckpt.world_size, r)
                if (ckpt.dir / rel).is_file():
                    records += _deep(ckpt.files, rel, report)
                else:
                    report.warn(ckpt.dir / rel, None, "missing: the run cannot resume from this step")
        report.checked["records"] = records
