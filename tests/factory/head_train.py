"""One rank of a HEAD-style training run: prime-rl 559b447's ``train()`` loop on CPU/gloo, for real.

``train_child(rank, world, spec_dict, root)`` is launched on every rank by ``factory.run_distributed``. It
builds the FSDP2 model (``head_model.build_model``), AdamW over every ``requires_grad`` parameter in
``named_parameters`` order with ``fused=False`` (prime-rl's default ``optim_cpu_offload=True`` wraps AdamW
in ``CPUOffloadOptimizer``, whose state moves are no-ops on CPU and whose DCP state is the inner AdamW's),
the HEAD scheduler, and runs the loop as rl/train.py does: startup broadcast of ``step_0``; per step
forward/backward, grad clipping, ``optimizer.step``, ``scheduler.step``, the step's broadcast and its
retention, an interval checkpoint (saved before the step's totals are added to ``Progress``: it lags one
step), the totals; after the loop the final checkpoint. Rank 0 then writes the gathered live state.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, LinearLR, SequentialLR

from tests.factory.head_files import adapter_config, prime_to_hf, write_json
from tests.factory.head_model import adapter_tensors, build_model, gather, placements_sample
from tests.factory.head_spec import HeadSpec, head_paths, lr_factor_floor

RAW_TRUTH = ".head_truth_raw.safetensors"  # rank 0's gathered live state, assembled by the parent
RAW_FACTS = ".head_truth_raw.json"


@dataclass
class Progress:
    """prime-rl HEAD's ``trainer/ckpt.py::Progress`` (a fresh run starts at step 1)."""

    step: int = 1
    total_tokens: int = 0
    total_samples: int = 0


class AppState(Stateful):
    """A mirror of prime-rl HEAD's ``AppState`` save path: ``get_state_dict`` defaults, then the extras."""

    def __init__(self, model, optimizer, scheduler, progress: Progress):
        self.model, self.optimizer, self.scheduler, self.progress = model, optimizer, scheduler, progress

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, [self.optimizer])
        return {"model": model_sd, "optimizers": optim_sd, "scheduler": self.scheduler.state_dict(),
                "progress": dataclasses.asdict(self.progress)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, [self.optimizer], model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optimizers"])
        self.scheduler.load_state_dict(state_dict["scheduler"])
        for k, v in state_dict["progress"].items():
            setattr(self.progress, k, v)


class SignSGD(torch.optim.Optimizer):
    """prime-rl's ``trainer/sign_sgd.py`` (#3303) in effect: ``W -= lr * wd * W`` (when wd > 0), then
    ``W -= lr * sign(grad)``. It keeps no per-parameter state: its ``state_dict()["state"]`` stays empty."""

    def __init__(self, params, lr: float, weight_decay: float):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if group["weight_decay"] > 0.0:
                    p.add_(p, alpha=-group["lr"] * group["weight_decay"])
                p.add_(torch.sign(p.grad), alpha=-group["lr"])
        return None


def build_optimizer(params: list[torch.Tensor], spec: HeadSpec) -> torch.optim.Optimizer:
    """``optim.type`` as prime-rl's ``_create_optimizer`` builds it (inside its default CPUOffloadOptimizer,
    whose DCP state is the inner optimizer's): AdamW with ``fused=False``, or SignSGD."""
    if spec.optimizer == "sign_sgd":
        return SignSGD(params, lr=spec.lr, weight_decay=spec.weight_decay)
    return torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay, betas=spec.betas, fused=False)


def build_scheduler(optimizer, spec: HeadSpec):
    """prime-rl HEAD's ``trainer/scheduler.py`` (constant; linear warmup and/or WSD decay; cosine)."""
    floor = lr_factor_floor(spec)
    if spec.scheduler == "constant":
        return ConstantLR(optimizer, factor=1.0)
    schedulers, milestones = [], []
    if spec.warmup_steps > 0:
        schedulers.append(LinearLR(optimizer, start_factor=floor, end_factor=1.0, total_iters=spec.warmup_steps))
        milestones.append(spec.warmup_steps)
    if spec.scheduler == "cosine":
        schedulers.append(CosineAnnealingLR(optimizer, T_max=spec.max_steps - spec.warmup_steps, eta_min=spec.min_lr))
    elif spec.decay_steps > 0:
        decay_start = spec.max_steps - spec.decay_steps
        schedulers.append(LinearLR(optimizer, start_factor=1.0, end_factor=1.0, total_iters=decay_start - spec.warmup_steps))
        schedulers.append(LinearLR(optimizer, start_factor=1.0, end_factor=floor, total_iters=spec.decay_steps - 1))
        milestones.append(decay_start)
    if len(schedulers) == 1:
        return schedulers[0]
    return SequentialLR(optimizer, schedulers, milestones=milestones)


def clip_grad_norm(params: list[torch.Tensor], max_norm: float | None) -> float:
    """The global grad norm, then ``torch.nn.utils.clip_grad_norm_``'s scaling.

    Every grad is a DTensor whose local pieces are disjoint across all ranks (FSDP's ``Shard(0)`` on the
    world mesh, or EP x FSDP on the 2-D expert mesh), so the squared norm is one all-reduced sum. (torch's
    own clip cannot mix DTensors of the two meshes; prime-rl has its own EP-aware clip for that reason.)
    """
    local = torch.zeros((), dtype=torch.float64)
    grads = [p.grad for p in params if p.grad is not None]
    for g in grads:
        t = g.to_local() if isinstance(g, DTensor) else g
        local += t.detach().double().pow(2).sum()
    dist.all_reduce(local)
    norm = float(local.sqrt())
    if max_norm is not None:
        coef = min(1.0, max_norm / (norm + 1e-6))
        for g in grads:
            (g.to_local() if isinstance(g, DTensor) else g).mul_(coef)
    return norm


def partition_weights(sizes: dict[str, int], world: int) -> dict[str, int]:
    """prime-rl's ``partition_weights``: whole decoder layers to the least-loaded rank, biggest first."""
    unit_of = {k: (k.split(".layers.")[0] + ".layers." + k.split(".layers.")[1].split(".")[0]) if ".layers." in k else ""
               for k in sizes}
    unit_bytes: dict[str, int] = {}
    for k, n in sizes.items():
        unit_bytes[unit_of[k]] = unit_bytes.get(unit_of[k], 0) + n
    loads, owner = [0] * world, {}
    for unit in sorted(unit_bytes, key=lambda u: (-unit_bytes[u], u)):
        owner[unit] = min(range(world), key=lambda r: loads[r])
        loads[owner[unit]] += unit_bytes[unit]
    return {k: owner[unit_of[k]] for k in sizes}


def _broadcast_dir(step: int) -> Path:
    return Path("outputs") / "broadcasts" / f"step_{step}"


def broadcast_adapter(model, spec: HeadSpec, step: int, rank: int) -> dict[str, torch.Tensor]:
    """FileSystemWeightBroadcast, LoRA: the fp32 adapter + adapter_config.json + STABLE, by the master."""
    tensors = adapter_tensors(model, spec)
    if rank == 0:
        d = _broadcast_dir(step)
        d.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(d / "adapter_model.safetensors"), metadata={"format": "pt"})
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        write_json(d / "adapter_config.json", adapter_config(spec, trainable))
        (d / "STABLE").touch()
    return tensors


def broadcast_full(model, spec: HeadSpec, step: int, rank: int, world: int) -> None:
    """FileSystemWeightBroadcast, full FT: bf16 HF-named weights, each rank writing the layers it owns."""
    sd = model.state_dict()
    owners = partition_weights({k: v.numel() * 2 for k, v in sd.items()}, world)
    mine: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        full = gather(v, torch.bfloat16)  # collective: every rank takes part in every gather
        if owners[k] == rank:
            mine.update(prime_to_hf(k, full, spec))
    d = _broadcast_dir(step)
    d.mkdir(parents=True, exist_ok=True)
    split = split_torch_state_dict_into_shards(mine, filename_pattern=f"tmp-rank{rank}{{suffix}}.safetensors")
    local = []
    for tmp_name, names in split.filename_to_tensors.items():
        if names:
            save_file({n: mine[n].contiguous() for n in names}, str(d / tmp_name), metadata={"format": "pt"})
            local.append((tmp_name, {n: mine[n].nbytes for n in names}))
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, local)
    flat = [(r, tmp, sizes) for r, shards in enumerate(everyone) for tmp, sizes in shards]
    weight_map = {}
    for i, (r, tmp, sizes) in enumerate(flat, start=1):
        final = "model.safetensors" if len(flat) == 1 else f"model-{i:05d}-of-{len(flat):05d}.safetensors"
        weight_map.update(dict.fromkeys(sizes, final))
        if r == rank:
            (d / tmp).rename(d / final)
    dist.barrier()
    if rank == 0:
        if len(flat) > 1:
            index = {"metadata": {"total_size": sum(n for _, _, s in flat for n in s.values())}, "weight_map": weight_map}
            (d / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        (d / "STABLE").touch()


def maybe_clean(spec: HeadSpec, step: int) -> None:
    """prime-rl's ``maybe_clean``: drop the broadcast of step-2 unless it falls on the checkpoint interval."""
    candidate = max(step - 2, 0)
    if spec.ckpt_interval and candidate % spec.ckpt_interval == 0:
        return
    shutil.rmtree(_broadcast_dir(candidate), ignore_errors=True)


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, torch.Tensor):
        return x.item() if x.numel() == 1 else x.tolist()
    return x if isinstance(x, (int, float, str, bool)) or x is None else repr(x)


def _micro_batch_loss(model, spec: HeadSpec, step: int, rank: int, mb: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(spec.seed * 7919 + step * 104729 + rank * 131 + mb)
    ids = torch.randint(0, spec.vocab_size, (1, spec.seq_len), generator=g)
    return model(input_ids=ids, labels=ids).loss / spec.micro_batches


def resume(model, optimizer, scheduler, progress: Progress, step: int) -> None:
    """A new launch attempt resuming from ``checkpoints/step_<step>`` (``--resume.step``), as prime-rl's
    default CPU-offloaded optimizer resumes: the model and the optimizer state are loaded, the param groups
    are not (the lr stays the one this attempt's scheduler set from its own ``optim.lr``), the scheduler's
    and the progress' state are. The next step trained is ``step + 1``."""
    fresh = [(g["lr"], g.get("initial_lr")) for g in optimizer.param_groups]
    ckpt = Path("outputs") / "checkpoints" / f"step_{step}" / "trainer"
    dcp.load({"app": AppState(model, optimizer, scheduler, progress)}, checkpoint_id=ckpt)
    for g, (lr, initial) in zip(optimizer.param_groups, fresh):
        g["lr"] = lr
        if initial is not None:
            g["initial_lr"] = initial
    progress.step = step + 1


def train_child(rank: int, world: int, spec_dict: dict, root: str, resume_step: int | None = None) -> None:
    spec = HeadSpec.from_dict(spec_dict)
    os.chdir(root)  # prime-rl ran from the run dir: checkpoint ids are relative ("outputs/...")
    paths = head_paths(Path("."), spec)
    weights = paths.conversion if paths.conversion is not None else paths.base_model
    model, _meshes = build_model(spec, paths.base_model, weights)
    trainable = [p for _, p in model.named_parameters() if p.requires_grad]
    expert_params = [p for n, p in model.named_parameters() if p.requires_grad and ".mlp.experts." in n] \
        if spec.resolved_ep > 1 else []
    optimizer = build_optimizer(trainable, spec)
    scheduler = build_scheduler(optimizer, spec)
    progress = Progress()
    saves, steps_log = [], []
    if resume_step is not None:
        resume(model, optimizer, scheduler, progress, resume_step)

    def broadcast(step: int):
        if spec.lora:
            return broadcast_adapter(model, spec, step, rank)
        broadcast_full(model, spec, step, rank, world)
        return None

    def save(step: int) -> None:
        ckpt = Path("outputs") / "checkpoints" / f"step_{step}" / "trainer"
        ckpt.mkdir(parents=True, exist_ok=True)
        dcp.save({"app": AppState(model, optimizer, scheduler, progress)}, checkpoint_id=ckpt)
        saves.append({"step": step, "progress": dataclasses.asdict(progress),
                      "lr": float(optimizer.param_groups[0]["lr"]), "scheduler": _jsonable(scheduler.state_dict())})

    exported = broadcast(progress.step - 1)  # the startup policy, step_0 (a resume re-broadcasts its step)
    while True:
        is_last = progress.step == spec.max_steps
        loss_sum = 0.0
        for mb in range(spec.micro_batches):
            loss = _micro_batch_loss(model, spec, progress.step, rank, mb)
            loss.backward()
            loss_sum += float(loss.detach())
        for p in expert_params:  # FSDP divided by dp_shard_mod_ep; prime-rl's factor is the whole dp_shard
            p.grad.mul_(1.0 / spec.resolved_ep)
        grad_norm = clip_grad_norm(trainable, spec.max_norm)
        lr_used = float(optimizer.param_groups[0]["lr"])  # this step's update; "lr" below is after scheduler.step()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        exported = broadcast(progress.step)
        if rank == 0:
            maybe_clean(spec, progress.step)
        if spec.ckpt_interval and not is_last and progress.step % spec.ckpt_interval == 0:
            save(progress.step)
        progress.total_tokens += spec.tokens_per_step()
        progress.total_samples += spec.micro_batches
        steps_log.append({"step": progress.step, "loss_rank0": loss_sum, "grad_norm": grad_norm,
                          "lr": float(optimizer.param_groups[0]["lr"]), "lr_used": lr_used})
        if rank == 0:  # the "optim" line of prime-rl's file monitor (the other metric lines are not mirrored)
            with open(Path("outputs") / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": progress.step, "time": time.time(), "optim/lr": steps_log[-1]["lr"],
                                    "optim/grad_norm": grad_norm}) + "\n")
        if is_last:
            break
        progress.step += 1
    save(progress.step)
    _write_raw_truth(model, optimizer, spec, rank, exported, saves, steps_log)
    dist.barrier()


def _write_raw_truth(model, optimizer, spec, rank, exported, saves, steps_log) -> None:
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=opts)
    osd = get_optimizer_state_dict(model, optimizer, options=opts)
    sample = placements_sample(model)
    if rank != 0:
        return
    raw: dict[str, torch.Tensor] = {f"model.{k}": v.detach().clone().contiguous() for k, v in msd.items()}
    for fqn, state in osd["state"].items():
        for field, v in state.items():
            raw[f"optim.{fqn}.{field}"] = v.detach().clone().contiguous()
    for k, v in (exported or {}).items():
        raw[f"adapter_export.{k}"] = v.contiguous()
    save_file(raw, RAW_TRUTH, metadata={"format": "pt"})
    facts = {"saves": saves, "steps": steps_log, "param_groups": _jsonable(osd["param_groups"]),
             "dtensor_layout_sample": sample}
    Path(RAW_FACTS).write_text(json.dumps(facts))
