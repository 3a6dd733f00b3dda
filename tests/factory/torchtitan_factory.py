"""Genuine torchtitan checkpoints on CPU (gloo, 2 ranks), written by torchtitan's own CheckpointManager.

Run with the trainers' venv (torchtitan 0.3.0, torch 2.13.0+cpu):
    python -m tests.factory.torchtitan_factory OUT_DIR   (from the repository root)
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import warnings
from pathlib import Path

STEPS = 3
DIM, N_HEADS, N_KV_HEADS, N_LAYERS, VOCAB = 64, 4, 2, 2, 256


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_config():
    """`torchtitan.models.llama3._debugmodel` (the llama3 "debugmodel" flavor) at a committable size: the same
    builders and inits, dim 64, 4 heads over 2 KV heads (GQA), 2 layers, vocab 256."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.llama3 import (_EMBEDDING_INIT, _NORM_INIT, _build_llama3_layers,
                                          _output_linear_init)
    from torchtitan.models.llama3.model import Llama3Model
    cfg = Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_output_linear_init(DIM)),
        layers=_build_llama3_layers(
            fuse_qkv=True, n_layers=N_LAYERS, dim=DIM, n_heads=N_HEADS, n_kv_heads=N_KV_HEADS,
            hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=256),
            rope=ComplexRoPE.Config(dim=DIM // N_HEADS, max_seq_len=256, theta=500000, scaling="llama"),
            attn_backend="flex"))
    # The attention kernel holds no parameters, so it changes nothing in a checkpoint; but on CPU none of the
    # language-model backends trains: FlexAttention "does not support backward on CPU", varlen is a CUDA
    # kernel, and get_attention_config refuses "sdpa" for language models. Its SDPA module (what the
    # graph_trainer tests build) runs both passes on CPU.
    from torchtitan.models.common.attention import ScaledDotProductAttention
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return cfg


class TrainState:
    """The trainer's own train_state (`Trainer.state_dict`: step and ntokens_seen)."""

    def __init__(self):
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd):
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def build(world: int, lr: float = 8e-4):
    """Trainer.__init__'s order: build on meta, FSDP2 (`apply_fsdp_to_decoder`, as `parallelize_llama`),
    to_empty + init_weights, then the optimizers and LR schedulers of the llama3 debugmodel recipe (the
    config's lr: `lr`)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
    cfg = model_config()
    with torch.device("meta"):
        model = cfg.build()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    apply_fsdp_to_decoder(model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False)
    # apply_fsdp_to_decoder sets gradient_divide_factor=1.0, which FSDP2 reduces with ReduceOp.PREMUL_SUM:
    # "Cannot use ReduceOp.PREMUL_SUM with Gloo". A plain SUM is the same reduction (factor 1.0), and is
    # what torchtitan itself forces for symmetric-memory comms (`enable_fsdp_symm_mem`).
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    opt_cfg = default_adamw(lr=lr)
    opt_cfg.implementation = "for-loop"   # "fused" is the CUDA kernel
    optimizers = opt_cfg.build(model_parts=[model])
    lr_cfg = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0)
    schedulers = lr_cfg.build(optimizers=optimizers, training_steps=10)
    return cfg, model, optimizers, schedulers


def rank_main(rank: int, world: int, port: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    warnings.simplefilter("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    cfg, model, optimizers, schedulers = build(world)
    state = TrainState()
    gen = torch.Generator().manual_seed(1234 + rank)
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (2, 17), generator=gen)
        inputs = tokens[:, :-1]
        logits = model(inputs)   # SDPA: causal, no masks
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        state.step += 1
        state.ntokens_seen += tokens.numel() * world
    from torchtitan.components.checkpoint import CheckpointManager
    from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter
    adapter = Llama3StateDictAdapter(cfg, None)
    manager = CheckpointManager(
        CheckpointManager.Config(enable=True, folder="checkpoint", interval=STEPS, last_save_model_only=False,
                                 keep_latest_k=0),
        dataloader=None, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
        states={"train_state": state}, sd_adapter=adapter, base_folder=out)
    manager.save(curr_step=STEPS)
    # the state dict the manager saved (ModelWrapper: the model's canonical keys, its fused QKV split by the
    # model's own state-dict hook), each DTensor gathered whole
    from torch.distributed.tensor import DTensor
    from torchtitan.components.checkpoint import ModelWrapper
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in ModelWrapper([model]).state_dict().items()}
    if rank == 0:
        from safetensors.torch import save_file
        truth = {k: v.detach().to(torch.float32).contiguous().clone() for k, v in full.items()}
        save_file(truth, str(Path(out) / "truth.safetensors"))
        hf = {k: v.contiguous().clone() for k, v in adapter.to_hf(dict(truth)).items()}
        save_file(hf, str(Path(out) / "truth_hf.safetensors"))
    manager.close()
    dist.barrier()
    dist.destroy_process_group()


def write_hf_config(out: Path) -> None:
    """The HF config of the same model (what `hf_assets_path` holds for a real run): transformers' Llama."""
    from transformers import LlamaConfig
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=256, num_hidden_layers=N_LAYERS,
                      num_attention_heads=N_HEADS, num_key_value_heads=N_KV_HEADS, rope_theta=500000.0,
                      max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-5)
    cfg.save_pretrained(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=False)
    import torch.multiprocessing as mp
    mp.spawn(rank_main, args=(args.world, _free_port(), str(out)), nprocs=args.world, join=True)
    write_hf_config(out / "hf_assets")
    (out / "factory.json").write_text(json.dumps({"world": args.world, "steps": STEPS}, indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
