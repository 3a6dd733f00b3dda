"""Genuine verl FSDP checkpoints on CPU (gloo, 2 ranks), written by verl's own FSDPCheckpointManager.

Run with the trainers' venv (verl 0.9.1, torch 2.13.0+cpu):
    python -m tests.factory.verl_factory OUT_DIR   (from the repository root) [--strategy fsdp2|fsdp] [--lora-rank R] [--lora-alpha A]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

STEPS = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_base(base_dir: Path) -> None:
    """A tiny Qwen2 written by transformers in bf16 (what a user's base model is on disk)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False, torch_dtype="bfloat16")
    model = Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(base_dir, safe_serialization=True)


def build_module(base_dir: Path, lora_rank: int, lora_alpha: int):
    """FSDPEngine._build_module: the actor is loaded in fp32 for training; then its LoRA (verl's own
    `_build_lora_module`, PEFT's get_peft_model)."""
    import torch
    from transformers import AutoModelForCausalLM
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine
    module = AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    if lora_rank <= 0:
        return module
    cfg = SimpleNamespace(lora_rank=lora_rank, lora_alpha=lora_alpha, target_modules="all-linear",
                          target_parameters=None, exclude_modules=None, lora_adapter_path=None)
    return FSDPEngine._build_lora_module(SimpleNamespace(model_config=cfg), module)


def shard(module, strategy: str, world: int, is_lora: bool, fsdp_size: int = -1):
    """FSDPEngine._build_fsdp_module's two strategies, on a CPU mesh (its own device mesh and
    fsdp2_load_full_state_dict need an accelerator: every rank loads the same weights instead). With
    `fsdp_size` below `world`: verl's HSDP, its own `create_device_mesh` (`("ddp", "fsdp")`)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    if 0 < fsdp_size < world:
        import verl.workers.engine.fsdp.utils as engine_utils
        engine_utils.get_device_name = lambda: "cpu"   # "cuda" on a CPU host: the same mesh on gloo
        mesh = engine_utils.create_device_mesh(world, fsdp_size)
    else:
        mesh = init_device_mesh("cpu", mesh_shape=(world,), mesh_dim_names=["fsdp"])
    if strategy == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy
        from verl.utils.fsdp_utils import apply_fsdp2
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True)
        apply_fsdp2(module, {"mesh": mesh, "mp_policy": mp, "offload_policy": None, "reshard_after_forward": True},
                    {"wrap_policy": {}})
        return module
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy
    from verl.utils.fsdp_utils import get_fsdp_wrap_policy, init_fn
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, buffer_dtype=torch.float32)
    return FSDP(module, param_init_fn=init_fn, auto_wrap_policy=get_fsdp_wrap_policy(module, None, is_lora),
                device_id=torch.device("cpu"), sharding_strategy=ShardingStrategy.FULL_SHARD, mixed_precision=mp,
                # verl passes sync_module_states=True, which FSDP refuses for CPU parameters ("requires them to
                # be on GPU"); every rank loaded the same weights, so there is nothing to sync
                sync_module_states=False, device_mesh=mesh, use_orig_params=False)


def train(module, steps: int):
    """verl's optimizer and LR scheduler builders (FSDPEngine._build_optimizer / _build_lr_scheduler),
    then `steps` steps of next-token loss on seeded random tokens."""
    import torch
    from verl.utils.torch_functional import get_constant_schedule_with_warmup
    from verl.workers.config.optimizer import FSDPOptimizerConfig, build_optimizer
    opt_cfg = FSDPOptimizerConfig(lr=1e-2, weight_decay=0.01, lr_warmup_steps=1, total_training_steps=10)
    optimizer = build_optimizer(module.parameters(), opt_cfg)
    scheduler = get_constant_schedule_with_warmup(optimizer=optimizer, num_warmup_steps=opt_cfg.lr_warmup_steps)
    gen = torch.Generator().manual_seed(1234)
    for _ in range(steps):
        ids = torch.randint(0, 256, (2, 16), generator=gen)
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):   # as verl's actor forward (on its device)
            out = module(input_ids=ids, labels=ids)
        out.loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return optimizer, scheduler


def full_state(module) -> dict:
    """Every rank joins; each gets the full fp32 state dict (the truth), under the trainer's own names."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))


def rank_main(rank: int, world: int, port: int, args) -> None:
    import torch
    import torch.distributed as dist
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    out = Path(args.out)
    module = build_module(out / "base", args.lora_rank, args.lora_alpha)
    module = shard(module, args.strategy, world, args.lora_rank > 0, args.fsdp_size)
    optimizer, scheduler = train(module, STEPS)
    from omegaconf import OmegaConf
    from verl.utils.checkpoint.checkpoint_manager import get_checkpoint_tracker_filename
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
    ckpt_cfg = OmegaConf.create({"save_contents": ["model", "optimizer", "extra"],
                                 "load_contents": ["model", "optimizer", "extra"]})
    manager = FSDPCheckpointManager(model=module, optimizer=optimizer, lr_scheduler=scheduler,
                                    processing_class=None, checkpoint_config=ckpt_cfg)
    run = out / "checkpoints"
    manager.save_checkpoint(local_path=str(run / f"global_step_{STEPS}" / "actor"), global_step=STEPS)
    sd = full_state(module)
    if rank == 0:
        from safetensors.torch import save_file
        truth = {k: v.detach().to(torch.float32).contiguous().clone() for k, v in sd.items()}
        save_file(truth, str(out / "truth.safetensors"))
        # ray_trainer._save_checkpoint's tracker file beside the global_step_N dirs
        Path(get_checkpoint_tracker_filename(str(run))).write_text(str(STEPS))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--strategy", choices=["fsdp2", "fsdp"], default="fsdp2")
    ap.add_argument("--lora-rank", type=int, default=0)
    ap.add_argument("--lora-alpha", type=int, default=16)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--fsdp-size", type=int, default=-1, help="below --world: verl's HSDP mesh (ddp, fsdp)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=False)
    make_base(out / "base")
    import torch.multiprocessing as mp
    mp.spawn(rank_main, args=(args.world, _free_port(), args), nprocs=args.world, join=True)
    (out / "factory.json").write_text(json.dumps(vars(args) | {"steps": STEPS}, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    sys.exit(main())
