"""Genuine torchtitan checkpoints of the layouts beyond FSDP2, written by torchtitan 0.3.0's own code on CPU
(gloo): what `tests/test_torchtitan.py` reads or refuses by name.

- `hsdp-tp`: the llama3 debugmodel of `torchtitan_factory` on 8 ranks, `dp_replicate` 2 x `dp_shard` 2 x `tp` 2:
  torchtitan's tensor parallel plan (`Llama3Model.parallelize`, what `parallelize_llama` calls) then HSDP
  (`apply_fsdp_to_decoder` on the ("dp_replicate", "fsdp") mesh), trained 3 steps, saved by `CheckpointManager`.
- `moe`: torchtitan's qwen3 MoE builders (`_build_qwen3_moe_layers`, the `debugmodel_moe` flavor's) at a
  committable size, FSDP2 on 2 ranks, initialized and saved by `CheckpointManager` as a run's last step
  (model only, torchtitan's default; no training step: the refusal reads its keys only).

Run with the trainers' venv (torchtitan 0.3.0, torch 2.13.0+cpu), from the repository root:
    python -m tests.factory.torchtitan_layouts hsdp-tp OUT_DIR
    python -m tests.factory.torchtitan_layouts moe OUT_DIR
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings
from pathlib import Path

from .torchtitan_factory import STEPS, VOCAB, TrainState, model_config, write_hf_config
from .torchtitan_probe import free_port

REPLICATE, SHARD, TP = 2, 2, 2
MOE_DIM, MOE_HEADS, MOE_KV_HEADS, MOE_HEAD_DIM, MOE_LAYERS, MOE_VOCAB, EXPERTS, TOP_K = 32, 4, 2, 8, 2, 64, 4, 2


def _cpu_meshes() -> None:
    """`torchtitan.tools.utils.device_type` is `_get_available_device_type() or "cuda"`: "cuda" on a CPU host,
    and `ParallelDims.build_mesh` builds its world mesh on it. The same mesh on "cpu" (gloo)."""
    import torchtitan.distributed.parallel_dims as pd
    pd.device_type = "cpu"


def _force_sum(model) -> None:
    """`apply_fsdp_to_decoder`'s gradient_divide_factor=1.0 reduces by PREMUL_SUM, which gloo lacks: a plain
    SUM is the same reduction (what torchtitan's own `enable_fsdp_symm_mem` sets)."""
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)


def build_hsdp_tp(world: int, lr: float = 8e-4):
    """Trainer.__init__'s order with `ParallelDims(dp_replicate=2, dp_shard=2, tp=2)`: the model config's
    sharding (`Llama3Model.Config.update_from_config` -> `set_llama3_sharding_config`), build on meta,
    `parallelize_llama` (TP, then HSDP), to_empty + init_weights, the recipe's optimizer and schedulers."""
    import torch
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3.parallelize import parallelize_llama
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config
    _cpu_meshes()
    cfg = model_config()
    # "partial_dtensor": DTensor on the model-parallel dims (one of the config's backends); with the default,
    # "spmd_types", fully_shard refuses this setup's plain parameters (the fixture's README)
    parallelism = ParallelismConfig(data_parallel_replicate_degree=REPLICATE, data_parallel_shard_degree=SHARD,
                                    tensor_parallel_degree=TP, spmd_backend="partial_dtensor")
    set_llama3_sharding_config(cfg, enable_sp=parallelism.enable_sequence_parallel)
    dims = ParallelDims.from_config(parallelism, world)
    dims.build_mesh()
    with torch.device("meta"):
        model = cfg.build()
    training = TrainingConfig(mixed_precision_param="float32", mixed_precision_reduce="float32")
    parallelize_llama(model, parallel_dims=dims, training=training, parallelism=parallelism,
                      compile_config=CompileConfig(), ac_config=None, dump_folder="")
    _force_sum(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    opt_cfg = default_adamw(lr=lr)
    opt_cfg.implementation = "for-loop"   # "fused" is the CUDA kernel
    optimizers = opt_cfg.build(model_parts=[model])
    lr_cfg = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0)
    schedulers = lr_cfg.build(optimizers=optimizers, training_steps=10)
    return cfg, model, optimizers, schedulers, dims


def _save(out: str, model, optimizers, schedulers, state, adapter, step: int, model_only: bool = False) -> None:
    """`CheckpointManager.save(step)` (`model_only`: as the last step of a run, with torchtitan's default
    `last_save_model_only=True`: the model's weights only), then, with an `adapter`, the state dict it saved
    (each DTensor gathered) through the adapter's own `to_hf`: `truth_hf.safetensors` (rank 0)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torchtitan.components.checkpoint import CheckpointManager, ModelWrapper
    manager = CheckpointManager(
        CheckpointManager.Config(enable=True, folder="checkpoint", interval=step, last_save_model_only=model_only,
                                 keep_latest_k=0),
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": state}, sd_adapter=adapter, base_folder=out)
    manager.save(curr_step=step, last_step=model_only)
    if adapter is not None:
        full = {k: v.full_tensor() if isinstance(v, DTensor) else v
                for k, v in ModelWrapper([model]).state_dict().items()}
        if dist.get_rank() == 0:
            from safetensors.torch import save_file
            truth = {k: v.detach().to(torch.float32).contiguous().clone() for k, v in full.items()}
            hf = {k: v.contiguous().clone() for k, v in adapter.to_hf(dict(truth)).items()}
            save_file(hf, str(Path(out) / "truth_hf.safetensors"))
    manager.close()
    dist.barrier()


def _init(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)


def hsdp_tp_main(rank: int, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor
    _init(rank, world, port)
    torch.manual_seed(0)
    cfg, model, optimizers, schedulers, dims = build_hsdp_tp(world)
    state = TrainState()
    batch = rank // TP   # the data-parallel index (world mesh: pp, dp_replicate, fsdp, tp); TP ranks share it
    gen = torch.Generator().manual_seed(1234 + batch)
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (2, 16), generator=gen)
        logits = model(tokens[:, :-1])
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        state.step += 1
        state.ntokens_seen += tokens.numel() * world // TP
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
    _save(out, model, optimizers, schedulers, state, Llama3StateDictAdapter(cfg, None), STEPS)
    dist.destroy_process_group()


def moe_config():
    """The qwen3 `debugmodel_moe` flavor's builders at a committable size (dim 32, 2 layers, 4 experts top 2)."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.qwen3 import _EMBEDDING_INIT, _LINEAR_INIT, _build_qwen3_moe_layers, _qwen3_norm
    from torchtitan.models.qwen3.model import Qwen3Model
    from torchtitan.models.common.attention import ScaledDotProductAttention
    cfg = Qwen3Model.Config(
        vocab_size=MOE_VOCAB, dim=MOE_DIM, norm=_qwen3_norm(MOE_DIM),
        tok_embeddings=Embedding.Config(num_embeddings=MOE_VOCAB, embedding_dim=MOE_DIM,
                                        param_init=_EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=MOE_DIM, out_features=MOE_VOCAB, param_init=_LINEAR_INIT),
        layers=_build_qwen3_moe_layers(
            fuse_qkv=True, n_layers=MOE_LAYERS, dim=MOE_DIM, n_heads=MOE_HEADS, n_kv_heads=MOE_KV_HEADS,
            head_dim=MOE_HEAD_DIM, moe_hidden_dim=48, num_experts=EXPERTS, top_k=TOP_K, attn_backend="flex",
            rope=CosSinRoPE.Config(dim=MOE_HEAD_DIM, max_seq_len=64, theta=1000000.0),
            moe_comm_backend="standard"))
    for layer in cfg.layers:   # holds no parameter (see torchtitan_factory.model_config)
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg


def moe_main(rank: int, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    _init(rank, world, port)
    torch.manual_seed(0)
    cfg = moe_config()
    with torch.device("meta"):
        model = cfg.build()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    apply_fsdp_to_decoder(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    opt_cfg = default_adamw(lr=8e-4)
    opt_cfg.implementation = "for-loop"
    optimizers = opt_cfg.build(model_parts=[model])
    schedulers = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=optimizers, training_steps=10)
    _save(out, model, optimizers, schedulers, TrainState(), None, 1, model_only=True)
    dist.destroy_process_group()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("layout", choices=["hsdp-tp", "moe"])
    ap.add_argument("out")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=False)
    import torch.multiprocessing as mp
    world = REPLICATE * SHARD * TP if args.layout == "hsdp-tp" else 2
    fn = hsdp_tp_main if args.layout == "hsdp-tp" else moe_main
    mp.spawn(fn, args=(world, free_port(), str(out)), nprocs=world, join=True)
    if args.layout == "hsdp-tp":
        write_hf_config(out / "hf_assets")
    info = {"layout": args.layout, "world": world}
    if args.layout == "hsdp-tp":
        info.update(dp_replicate=REPLICATE, dp_shard=SHARD, tp=TP, steps=STEPS)
    (out / "factory.json").write_text(json.dumps(info, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
