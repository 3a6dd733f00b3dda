"""A verl checkpoint resumed by verl's own loading code on CPU (gloo, its ranks), and what it resumed to.

Run with the trainers' venv (verl 0.9.1), from the repository root:
    python -m tests.factory.verl_probe FIXTURE_DIR ACTOR_DIR OUT_PREFIX

Each rank builds the fixture's model, FSDP wrapping, optimizer and a scheduler as the fixture's factory does
(`verl_factory`: verl's own builders), loads ACTOR_DIR with `FSDPCheckpointManager.load_checkpoint` (model,
optimizer, extra state: the path a resumed PPO run takes), then writes OUT_PREFIX.rank<R>.json: the optimizer's
lr and initial_lr, the scheduler's base_lrs / _last_lr / last_epoch, the lr of the next scheduler steps (the
resumed schedule), digests of every loaded optimizer-state and model tensor and of the CPU RNG state, and the
change one training step makes to each parameter (the lr it trains with, in effect).

The scheduler is verl's cosine with warmup (`get_cosine_schedule_with_warmup`, min_lr_ratio 0.1): a run's
lambda comes from its config, its base_lrs from the checkpoint, so the resumed lr trace shows both.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings
from pathlib import Path

from .verl_factory import build_module, shard

TRACE_STEPS = 8


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _digest(t) -> str:
    import torch

    local = t.to_local() if hasattr(t, "to_local") else t
    return hashlib.sha256(local.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _optim_digests(optimizer) -> dict:
    import torch

    out = {}
    for pid, st in optimizer.state_dict()["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"{pid}.{k}"] = _digest(v)
    return out


def _one_step(module, optimizer) -> list[float]:
    """One step of next-token loss on seeded tokens; each parameter's change (fp64 sum of the local shard)."""
    import torch

    before = [p.detach().clone() for p in module.parameters()]
    gen = torch.Generator().manual_seed(99)
    ids = torch.randint(0, 256, (2, 16), generator=gen)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        out = module(input_ids=ids, labels=ids)
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    deltas = []
    for b, p in zip(before, module.parameters()):
        d = (p.detach() - b).to_local() if hasattr(p, "to_local") else p.detach() - b
        deltas.append(float(d.double().sum()))
    return deltas


def rank_main(rank: int, world: int, port: int, args) -> None:
    import torch
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    fixture = Path(args.fixture)
    facts = json.loads((fixture / "factory.json").read_text())
    module = build_module(fixture / "base", facts["lora_rank"], facts["lora_alpha"])
    module = shard(module, facts["strategy"], world, facts["lora_rank"] > 0)
    from omegaconf import OmegaConf
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
    from verl.utils.torch_functional import get_cosine_schedule_with_warmup
    from verl.workers.config.optimizer import FSDPOptimizerConfig, build_optimizer

    optimizer = build_optimizer(module.parameters(), FSDPOptimizerConfig(lr=1e-2, weight_decay=0.01,
                                                                         lr_warmup_steps=1, total_training_steps=10))
    scheduler = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=1, num_training_steps=10,
                                                min_lr_ratio=0.1)
    cfg = OmegaConf.create({"save_contents": ["model", "optimizer", "extra"],
                            "load_contents": ["model", "optimizer", "extra"]})
    manager = FSDPCheckpointManager(model=module, optimizer=optimizer, lr_scheduler=scheduler,
                                    processing_class=None, checkpoint_config=cfg)
    manager.load_checkpoint(args.actor)
    g = optimizer.param_groups[0]
    report = {
        "lr": g["lr"], "initial_lr": g["initial_lr"], "weight_decay": g["weight_decay"],
        "base_lrs": scheduler.base_lrs, "last_lr": scheduler._last_lr, "last_epoch": scheduler.last_epoch,
        "optimizer_state": _optim_digests(optimizer),
        "model": {k: _digest(v) for k, v in module.state_dict().items()},
        "rng_cpu": hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest(),
    }
    report["step_deltas"] = _one_step(module, optimizer)
    trace = []
    for _ in range(TRACE_STEPS):
        scheduler.step()
        trace.append(optimizer.param_groups[0]["lr"])
    report["lr_trace"] = trace
    Path(f"{args.out}.rank{rank}.json").write_text(json.dumps(report, indent=1, sort_keys=True))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("fixture")
    ap.add_argument("actor")
    ap.add_argument("out")
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp
    mp.spawn(rank_main, args=(args.world, free_port(), args), nprocs=args.world, join=True)


if __name__ == "__main__":
    sys.exit(main())
