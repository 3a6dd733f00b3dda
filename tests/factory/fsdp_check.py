"""Prove a checkpoint resumes in prime-rl: a strict FSDP2 load in gloo processes, then the full state back.

``load_strict(ckpt_dir, base_model_dir, spec, world_size=4)`` spawns ``world_size`` gloo processes that set
up the objects exactly as the factory's trainer (and prime-rl) does -- HF Qwen3 from the base model, the
LoRA wrapper, FSDP2 ``fully_shard``, AdamW, the spec's scheduler, a fresh ``Progress`` -- and call
``torch.distributed.checkpoint.load({"app": AppState}, checkpoint_id=ckpt_dir)`` with DCP's default
(strict) planner, as prime-rl's ``CheckpointManager.load_from_path`` does. Rank 0 then gathers the full
model and optimizer state and hands it back through a temp dir.

A checkpoint that prime-rl would refuse (a missing key, a wrong shape) raises ``StrictLoadError`` with the
child's message, e.g. ``Missing key in checkpoint state_dict: app.model.lm_head.weight``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from .factory import (
    FactoryError,
    FactorySpec,
    Progress,
    app_state_class,
    build_fsdp_model,
    build_optimizer,
    build_scheduler,
    jsonable,
    run_distributed,
)


class StrictLoadError(FactoryError):
    """The strict DCP load (or the setup around it) failed in a child process; the message says why."""


def _coerce_spec(spec_like: Any) -> FactorySpec:
    if isinstance(spec_like, FactorySpec):
        return spec_like
    if isinstance(spec_like, (str, os.PathLike)):
        d = json.loads(Path(spec_like).read_text())
        return FactorySpec.from_dict(d["spec"] if "spec" in d else d)
    if isinstance(spec_like, dict):
        return FactorySpec.from_dict(spec_like["spec"] if "spec" in spec_like else spec_like)
    raise TypeError(
        f"spec_like must be a FactorySpec, a truth.json path or its dict, not {type(spec_like).__name__}"
    )


def load_strict(
    ckpt_dir: str | os.PathLike,
    base_model_dir: str | os.PathLike,
    spec_like: FactorySpec | dict | str | os.PathLike,
    world_size: int = 4,
    steps_after: int = 0,
) -> dict[str, Any]:
    """Strictly load ``ckpt_dir`` into freshly set-up FSDP2 objects on ``world_size`` gloo ranks.

    ``spec_like`` gives the shapes and the scheduler kind: a ``FactorySpec``, or ``truth.json`` (path or
    dict) as written by ``make_run``. ``world_size`` may differ from the writer's (DCP reshards).

    Returns ``{"model": {fqn: fp32 tensor}, "optim": {"<param fqn>.<exp_avg|exp_avg_sq|step>": tensor},
    "lr": float, "scheduler": dict, "progress": dict, "lr_trace": [float] * steps_after}``. ``model``
    holds every key of the model state dict (base weights under HF names, ``...lora_A.<slot>``);
    ``lr_trace`` is the lr after each of ``steps_after`` further ``scheduler.step()`` calls.

    Raises ``StrictLoadError`` if the load fails (missing/unexpected keys, shape mismatch, ...).
    """
    spec = dataclasses.replace(_coerce_spec(spec_like), world_size=world_size)
    ckpt_dir = Path(ckpt_dir).resolve()
    base_model_dir = Path(base_model_dir).resolve()
    if not (ckpt_dir / ".metadata").is_file():
        raise FileNotFoundError(f"{ckpt_dir} has no .metadata: not a DCP checkpoint directory")
    with tempfile.TemporaryDirectory(prefix="ckpt_tools_load_strict_") as tmp:
        try:
            run_distributed(
                "tests.factory.fsdp_check:load_child",
                world_size,
                (spec.to_dict(), str(ckpt_dir), str(base_model_dir), tmp, int(steps_after)),
            )
        except FactoryError as e:
            raise StrictLoadError(f"strict load of {ckpt_dir} failed: {e}") from None
        from safetensors.torch import load_file

        info = json.loads((Path(tmp) / "info.json").read_text())
        model = load_file(str(Path(tmp) / "model.safetensors"))
        optim = load_file(str(Path(tmp) / "optim.safetensors"))
    return {
        "model": model,
        "optim": optim,
        "lr": info["lr"],
        "scheduler": info["scheduler"],
        "progress": info["progress"],
        "lr_trace": info["lr_trace"],
        "param_groups": info["param_groups"],
    }


def load_child(rank: int, world: int, spec_dict: dict, ckpt_dir: str, base_dir: str, out: str, steps_after: int):
    import warnings

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    spec = FactorySpec.from_dict(spec_dict)
    model, _mesh = build_fsdp_model(spec, Path(base_dir), rank, world)
    optimizer = build_optimizer(model, spec)
    scheduler = build_scheduler(optimizer, spec)
    progress = Progress()
    app = app_state_class()(model, [optimizer], scheduler, progress)
    # prime-rl CheckpointManager.load_from_path: dcp_load(state_dict={"app": app_state}, checkpoint_id=path)
    dcp.load(state_dict={"app": app}, checkpoint_id=Path(ckpt_dir))

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=opts)
    osd = get_optimizer_state_dict(model, optimizer, options=opts)
    lr = float(optimizer.param_groups[0]["lr"])
    sched_state = jsonable(scheduler.state_dict())
    groups = [jsonable({k: v for k, v in g.items() if k != "params"}) for g in osd.get("param_groups", [])]
    lr_trace = []
    with warnings.catch_warnings():
        # "Detected call of `lr_scheduler.step()` before `optimizer.step()`": intended, we only trace the lr.
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(steps_after):
            scheduler.step()
            lr_trace.append(float(optimizer.param_groups[0]["lr"]))

    if rank == 0:
        model_t = {k: v.detach().to(torch.float32).contiguous().clone() for k, v in msd.items()}
        optim_t = {
            f"{fqn}.{field}": v.detach().to(torch.float32).contiguous().clone()
            for fqn, st in osd["state"].items()
            for field, v in st.items()
        }
        save_file(model_t, str(Path(out) / "model.safetensors"))
        save_file(optim_t, str(Path(out) / "optim.safetensors"))
        info = {
            "lr": lr,
            "scheduler": sched_state,
            "progress": dataclasses.asdict(progress),
            "lr_trace": lr_trace,
            "param_groups": groups,
        }
        (Path(out) / "info.json").write_text(json.dumps(info))
    dist.barrier()
