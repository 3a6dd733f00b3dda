"""`ckpt inspect`: what a path holds, from metadata alone.

For a DCP checkpoint it reads `.metadata` plus a handful of tiny byte items (step, lr, scheduler
fields) and never a byte of tensor data. It also inspects an `outputs/checkpoints` dir (lists the
steps), an HF model dir and a PEFT adapter dir.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..alpha import resolve_alpha
from ..dcp.reader import METADATA_NAME, DcpCheckpoint, TensorEntry
from ..errors import AlphaError, CkptError, UsageError
from ..keys import FROZEN_GROUPS, GROUPS, classify, summarize_groups, summarize_lora, world_size_from_chunks

SLIM_MANIFEST = "ckpt-slim-manifest.json"   # written by `ckpt slim` next to .metadata


def detect_format(path: Path) -> str:
    p = Path(path)
    if not p.exists():
        raise UsageError("no such file or directory", path=p)
    if os.path.lexists(p / METADATA_NAME) or os.path.lexists(p / "trainer" / METADATA_NAME) or p.name == METADATA_NAME:
        return "dcp"
    if (p / "adapter_config.json").is_file():
        return "peft"
    if (p / "model.safetensors").is_file() or (p / "model.safetensors.index.json").is_file():
        return "hf"
    if p.is_dir() and any(_step_number(c) is not None for c in p.iterdir()):
        return "checkpoints"
    if (p / "checkpoints").is_dir():
        return "checkpoints"
    raise UsageError("cannot tell what this is: not a DCP checkpoint (.metadata), an outputs/checkpoints "
                     "dir (step_N/), an HF model dir (model.safetensors) or a PEFT adapter dir "
                     "(adapter_config.json)", path=p)


def _step_number(p: Path) -> int | None:
    m = re.fullmatch(r"step_(\d+)", p.name)
    return int(m.group(1)) if m and p.is_dir() else None


SCHEDULER_KINDS = (  # attributes that identify a torch LR scheduler's class
    ("SequentialLR", "_milestones"),
    ("CosineAnnealingLR", "T_max"),
    ("LinearLR", "start_factor"),
    ("ConstantLR", "factor"),
)


def scheduler_kind(fields: set[str]) -> str:
    for name, attr in SCHEDULER_KINDS:
        if attr in fields:
            return name
    return "unknown" if fields else "none"


def inspect_dcp(path: Path, *, alpha: float | None = None, run_config: Path | None = None,
                trust_pickle: bool = False) -> dict:
    ckpt = DcpCheckpoint.open(path, trust_pickle=trust_pickle)
    infos = [classify(k, e.path) for k, e in ckpt.entries.items()]
    by_key = {i.key: i for i in infos}
    stored = {k: e.stored_bytes for k, e in ckpt.entries.items()}
    payload = {k: e.nbytes for k, e in ckpt.entries.items()}
    shapes = {k: e.shape for k, e in ckpt.entries.items() if isinstance(e, TensorEntry)}
    groups = summarize_groups(infos, stored, payload)
    lora = summarize_lora(infos, shapes, payload)
    sharded = [len([c for c in e.chunks]) for e in ckpt.tensor_entries() if e.shape and e.shape[0] > 1]

    def value(group, field, idx=None, sub=None):
        for i in infos:
            if i.group == group and i.field == field and (idx is None or i.group_index == idx) \
                    and i.sub_scheduler == sub:
                return ckpt.read_object(i.key)
        return None

    sched_fields = {i.field for i in infos if i.group == "scheduler" and i.sub_scheduler is None}
    subs = sorted({i.sub_scheduler for i in infos if i.group == "scheduler" and i.sub_scheduler is not None})
    sched = {"type": scheduler_kind(sched_fields)}
    if subs:
        sched["schedulers"] = [scheduler_kind({i.field for i in infos if i.group == "scheduler"
                                               and i.sub_scheduler == j}) for j in subs]
        sched["milestones"] = value("scheduler", "_milestones")
    for f in ("last_epoch", "_last_lr", "base_lrs"):
        if f in sched_fields:
            sched[f] = value("scheduler", f)
    progress = {i.field: ckpt.read_object(i.key) for i in infos if i.group == "progress"}
    frozen = sum(groups[g].bytes for g in FROZEN_GROUPS)
    unique = sum(s.bytes for g, s in groups.items() if g not in FROZEN_GROUPS)
    meta_bytes = (ckpt.dir / METADATA_NAME).stat().st_size
    report = {
        "format": "dcp",
        "path": str(ckpt.dir),
        "keys": len(infos),
        "step": progress.get("step"),
        "world_size": world_size_from_chunks(sharded),
        "lr": value("param_groups", "lr", 0),
        "initial_lr": value("param_groups", "initial_lr", 0),
        "scheduler": sched,
        "progress": progress,
        "groups": {g: {"count": s.count, "bytes": s.bytes, "tensor_bytes": s.tensor_bytes}
                   for g, s in groups.items()},
        "frozen_bytes": frozen,
        "unique_bytes": unique,
        "frozen_fraction": frozen / (frozen + unique) if frozen + unique else 0.0,
        "total_bytes": frozen + unique + meta_bytes,
        "data_files": ckpt.data_files(),
        "lora": {"rank": lora.rank, "slots": list(lora.slots), "modules": lora.modules,
                 "targets": list(lora.targets), "bytes": lora.bytes,
                 "ranks_vary": lora.rank is None and lora.modules > 0},
        "other_keys": [i.key for i in infos if i.group == "other"],
        "warnings": [],
    }
    manifest = ckpt.dir / SLIM_MANIFEST
    report["slim"] = manifest.is_file()
    if report["slim"]:
        report["warnings"].append("this is a SLIM checkpoint (frozen base weights removed): prime-rl's strict "
                                  "loader cannot resume from it; rebuild it with `ckpt rehydrate`")
    if lora.modules:
        try:
            res = resolve_alpha(alpha=alpha, run_config=run_config, ckpt_dir=ckpt.dir, rank=lora.rank)
            report["alpha"] = {"alpha": res.alpha, "source": res.source,
                               "training_scale": res.alpha / lora.rank if lora.rank else None}
            report["warnings"] += list(res.warnings)
        except AlphaError as exc:
            report["alpha"] = None
            report["alpha_unresolved"] = exc.message
    if report["other_keys"]:
        report["warnings"].append(f"{len(report['other_keys'])} key(s) are not part of prime-rl's layout "
                                  "(group 'other')")
    ckpt.close()
    return report


def inspect_checkpoints_dir(path: Path) -> dict:
    root = Path(path)
    if (root / "checkpoints").is_dir() and not any(_step_number(c) is not None for c in root.iterdir()):
        root = root / "checkpoints"
    steps = []
    for c in sorted((c for c in root.iterdir() if _step_number(c) is not None), key=_step_number):
        trainer = c / "trainer"
        complete = (trainer / METADATA_NAME).is_file()
        size = sum(f.stat().st_size for f in trainer.iterdir() if f.is_file()) if trainer.is_dir() else 0
        steps.append({"step": _step_number(c), "path": str(c), "complete": complete, "bytes": size,
                      "resumes_at_step": _step_number(c)})
    return {"format": "checkpoints", "path": str(root), "steps": steps,
            "note": "prime-rl resumes from step_N at step N (set ckpt.resume_step = N)"}


def inspect_hf(path: Path) -> dict:
    from ..formats.hf_dir import HFModelDir

    d = HFModelDir.open(path)
    dtypes: dict[str, int] = {}
    for k in d.keys():
        info = d.info(k)
        dtypes[info.dtype] = dtypes.get(info.dtype, 0) + 1
    cfg = d.config or {}
    return {"format": "hf", "path": str(path), "tensors": len(d.keys()), "total_bytes": d.total_bytes,
            "dtypes": dtypes, "shards": sorted({str(d.info(k).path.name) for k in d.keys()}),
            "architecture": (cfg.get("architectures") or [None])[0],
            "config_dtype": cfg.get("torch_dtype") or cfg.get("dtype"),
            "tie_word_embeddings": cfg.get("tie_word_embeddings"),
            "lora_keys": sum(1 for k in d.keys() if "lora_" in k)}


def inspect_peft(path: Path) -> dict:
    from ..peft_adapter import open_peft_adapter

    a = open_peft_adapter(path, strict=False)
    rep = {"format": "peft", **a.describe(), "warnings": []}
    if a.unrecognized:
        rep["warnings"].append(
            f"{len(a.unrecognized)} key(s) do not follow PEFT's layout (e.g. {a.unrecognized[0]!r}): PEFT loads "
            "this without an error and applies NOTHING for them, vLLM rejects or ignores them; repair with "
            "`ckpt fix-adapter`")
    if not a.modules:
        rep["warnings"].append("zero LoRA modules match: a model loaded with this adapter equals the base")
    if a.full_tensors:
        rep["warnings"].append(f"modules_to_save tensors {sorted(a.full_tensors)}: vLLM rejects adapters with "
                               "modules_to_save embed_tokens/lm_head")
    return rep


def inspect_path(path: Path, **kw) -> dict:
    fmt = detect_format(path)
    if fmt == "dcp":
        return inspect_dcp(path, **kw)
    if fmt == "checkpoints":
        return inspect_checkpoints_dir(path)
    if fmt == "hf":
        return inspect_hf(path)
    return inspect_peft(path)


def list_dcp_keys(path: Path, *, trust_pickle: bool = False) -> list[dict]:
    """Every key with its group and layout (metadata only)."""
    with DcpCheckpoint.open(path, trust_pickle=trust_pickle) as ckpt:
        rows = []
        for k, e in ckpt.entries.items():
            tensor = isinstance(e, TensorEntry)
            rows.append({"key": k, "group": classify(k, e.path).group,
                         "dtype": str(e.dtype).replace("torch.", "") if tensor else None,
                         "shape": list(e.shape) if tensor else None,
                         "chunks": len(e.chunks) if tensor else 1, "stored_bytes": e.stored_bytes})
        return rows
