"""A torchtitan checkpoint resumed by torchtitan's own CheckpointManager on CPU (gloo, 2 ranks) under a config
lr of our choosing, and the lr it then trains with.

Run with the trainers' venv (torchtitan 0.3.0), from the repository root:
    python -m tests.factory.torchtitan_probe FIXTURE_DIR LR OUT_JSON

The trainer is built as the fixture's factory builds it (`torchtitan_factory.build`: the debugmodel recipe's
optimizer and LRSchedulersContainer), with the config's optimizer lr set to LR, then `CheckpointManager.load`
restores the fixture's step. Rank 0 writes OUT_JSON: the param group's lr before the first resumed step, the
scheduler's base_lrs and last_epoch, and the lr after each of the next scheduler steps. What it shows: the
checkpoint's lr serves that one step; every later lr is LR x lambda(step), the config's (docs/reference/
torchtitan-format.md).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import warnings
from pathlib import Path

from .torchtitan_factory import TrainState, build

TRACE_STEPS = 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, world: int, port: int, args) -> None:
    import torch
    import torch.distributed as dist

    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    cfg, model, optimizers, schedulers = build(world, lr=float(args.lr))
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
    state = TrainState()
    manager = CheckpointManager(
        CheckpointManager.Config(enable=True, folder="checkpoint", interval=1000, last_save_model_only=False,
                                 keep_latest_k=0),
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": state}, sd_adapter=Llama3StateDictAdapter(cfg, None), base_folder=args.fixture)
    assert manager.load(step=-1)
    opt = optimizers.optimizers[0]
    sched = schedulers.schedulers[0]
    report = {"step": state.step, "lr_now": opt.param_groups[0]["lr"], "base_lrs": list(sched.base_lrs),
              "last_epoch": sched.last_epoch, "trace": []}
    for _ in range(TRACE_STEPS):
        schedulers.step()
        report["trace"].append(opt.param_groups[0]["lr"])
    if rank == 0:
        Path(args.out).write_text(json.dumps(report, indent=1))
    manager.close()
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("fixture")
    ap.add_argument("lr")
    ap.add_argument("out")
    args = ap.parse_args(argv)
    import torch.multiprocessing as mp
    mp.spawn(rank_main, args=(2, free_port(), args), nprocs=2, join=True)


if __name__ == "__main__":
    sys.exit(main())
