"""The files of a HEAD-style run that are not the DCP checkpoint, written the way their owners write them.

- ``write_base_model``: the hub model, a random bf16 ``Qwen3ForCausalLM`` / ``Qwen3MoeForCausalLM`` saved by
  transformers (``save_pretrained``: per-expert ``mlp.experts.<e>.{gate,up,down}_proj.weight``);
- ``write_prime_conversion``: what prime-rl's first load of an HF MoE writes, ``prime/model.safetensors``
  (stacked ``mlp.experts.w1/w2/w3``, ``mlp.router.gate.weight``, bf16);
- ``trainer_config``: ``configs/trainer.json`` in prime-rl's ``dump_resolved_config(TrainerConfig)`` layout;
- ``adapter_config``: the broadcast's ``adapter_config.json`` (prime-rl's ``save_lora_config``);
- ``prime_to_hf``: the prime -> HF key rule of prime-rl's Qwen3-MoE conversion (w1=gate, w3=up, w2=down).
"""

from __future__ import annotations

import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.factory.head_spec import EXPERT_PROJ, HeadSpec

BASE_NAME = "base_model"  # model.name in trainer.json: the run is launched from its root
# Tokenizer / chat files of the genuine HEAD fixtures' base model (vocab 1000); copied when the vocab matches.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "generation_config.json")
_GENUINE_BASE = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "primerl-head" / "E_head_dense" / "base_model"


def hf_config(spec: HeadSpec):
    from transformers import Qwen3Config, Qwen3MoeConfig

    common: dict[str, Any] = dict(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings, rms_norm_eps=spec.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=spec.tie_word_embeddings, bos_token_id=spec.bos_token_id,
        eos_token_id=spec.eos_token_id, pad_token_id=spec.bos_token_id,
    )
    if spec.arch == "moe":
        return Qwen3MoeConfig(
            moe_intermediate_size=spec.moe_intermediate_size, num_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok, norm_topk_prob=spec.norm_topk_prob,
            decoder_sparse_step=1, mlp_only_layers=[], architectures=["Qwen3MoeForCausalLM"], **common,
        )
    return Qwen3Config(architectures=["Qwen3ForCausalLM"], **common)


def write_base_model(path: Path, spec: HeadSpec) -> None:
    """A random-init bf16 HF model saved with ``save_pretrained`` (deterministic: one generator per tensor)."""
    from transformers import GenerationConfig, Qwen3ForCausalLM, Qwen3MoeForCausalLM

    config = hf_config(spec)
    cls = Qwen3MoeForCausalLM if spec.arch == "moe" else Qwen3ForCausalLM
    with torch.device("meta"):  # HF's own init is slow and thread-count dependent; fill tensors ourselves
        model = cls(config)
    model.to(torch.bfloat16)
    model.to_empty(device="cpu")
    if config.tie_word_embeddings:  # to_empty gives every module a new Parameter: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    std = config.initializer_range

    def fill(item) -> None:
        i, (name, p) = item
        with torch.no_grad():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                g = torch.Generator().manual_seed(spec.seed * 1_000_003 + i)
                p.copy_(torch.empty(p.shape).normal_(0.0, std, generator=g))

    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as ex:
        list(ex.map(fill, enumerate(model.named_parameters())))
    model.config.dtype = torch.bfloat16
    path.mkdir(parents=True, exist_ok=True)
    kw = {} if spec.base_max_shard_size is None else {"max_shard_size": spec.base_max_shard_size}
    model.save_pretrained(str(path), **kw)
    if spec.vocab_size == 1000 and _GENUINE_BASE.is_dir():
        for name in _TOKENIZER_FILES:
            if (_GENUINE_BASE / name).exists():
                shutil.copyfile(_GENUINE_BASE / name, path / name)
    if not (path / "generation_config.json").exists():
        GenerationConfig(bos_token_id=spec.bos_token_id, eos_token_id=spec.eos_token_id).save_pretrained(str(path))
    make_world_readable(path)


def make_world_readable(path: Path) -> None:
    # safetensors writes through a 0600 temp file; the genuine fixtures' files are world-readable.
    for f in [path] if path.is_file() else path.rglob("*"):
        if f.is_file():
            os.chmod(f, 0o644)


def hf_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of an HF safetensors dir (sharded or not), in file then key order."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                yield k, h.get_tensor(k)


def hf_to_prime(hf: dict[str, torch.Tensor], spec: HeadSpec) -> dict[str, torch.Tensor]:
    """HF Qwen3-MoE names -> prime format: stack each layer's experts, rename the router."""
    out: dict[str, torch.Tensor] = {}
    for k, v in hf.items():
        if ".mlp.experts." in k:
            continue
        out[k.replace(".mlp.gate.weight", ".mlp.router.gate.weight")] = v
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}.mlp.experts"
        for w, proj in EXPERT_PROJ.items():
            out[f"{p}.{w}"] = torch.stack([hf[f"{p}.{e}.{proj}.weight"] for e in range(spec.num_experts)])
    return out


def prime_to_hf(name: str, tensor: torch.Tensor, spec: HeadSpec) -> list[tuple[str, torch.Tensor]]:
    """One prime-format tensor -> its HF name(s): stacked experts split per expert, the router renamed."""
    stem, _, last = name.rpartition(".")
    if stem.endswith(".mlp.experts") and last in EXPERT_PROJ:
        return [(f"{stem}.{e}.{EXPERT_PROJ[last]}.weight", tensor[e]) for e in range(tensor.shape[0])]
    return [(name.replace(".mlp.router.gate.weight", ".mlp.gate.weight"), tensor)]


def write_prime_conversion(base_dir: Path, out_file: Path, spec: HeadSpec) -> None:
    prime = hf_to_prime(dict(hf_tensors(base_dir)), spec)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: prime[k].contiguous() for k in sorted(prime)}, str(out_file), metadata={"format": "pt"})
    make_world_readable(out_file)


def _scheduler_section(spec: HeadSpec) -> dict[str, Any]:
    if spec.scheduler == "constant":
        return {"type": "constant"}
    if spec.scheduler == "linear":
        return {"type": "linear", "warmup_steps": spec.warmup_steps, "decay_steps": spec.decay_steps,
                "min_lr": spec.min_lr}
    return {"type": "cosine", "warmup_steps": spec.warmup_steps, "min_lr": spec.min_lr}


def _optim_section(spec: HeadSpec) -> dict[str, Any]:
    """``optim``: AdamWConfig or SignSGDConfig as prime-rl dumps them (configs/trainer.py, 559b447)."""
    base = {"lr": spec.lr, "weight_decay": spec.weight_decay, "max_norm": spec.max_norm}
    if spec.optimizer == "sign_sgd":
        return {**base, "type": "sign_sgd"}
    return {**base, "type": "adamw", "betas1": spec.betas[0], "betas2": spec.betas[1]}


def trainer_config(spec: HeadSpec, resume_step: int | None = None) -> dict[str, Any]:
    """``configs/trainer.json`` as prime-rl's rl entrypoint dumps the resolved ``TrainerConfig``."""
    lora = None
    if spec.lora:
        lora = {"rank": spec.lora_rank, "alpha": float(spec.lora_alpha), "dropout": 0.0,
                "target_modules": list(spec.config_targets), "modules_to_save": list(spec.modules_to_save)}
    model = {
        "name": BASE_NAME, "trust_remote_code": False, "vlm": None, "conversion_dir": spec.conversion_dir,
        "seq_len": spec.seq_len, "attn": "flash_attention_2", "compile": None,
        "ac": {"mode": "full", "freq": 1, "targets": ["norm"]}, "ac_offloading": None,
        "fsdp_cpu_offload": False, "optim_cpu_offload": True, "full_offload": None,
        "reshard_after_forward": True, "dp_replicate": 1, "ep": "auto" if spec.ep is None else spec.ep,
        "ep_comm_backend": "torch", "deepep_num_sms": 20, "deepep_token_chunk_size": None, "cp": 1,
        "cp_style": "ring", "impl": "auto", "optimization_dtype": "float32", "reduce_dtype": "float32",
        "moe_router_dtype": "float32", "moe_use_grouped_mm": True, "moe_fused_kernel": False,
        "quantization": None, "index_cache": None, "freeze_moe_router": False, "lora": lora,
        "debug": {"num_layers": None, "random_init": False, "force_balanced_routing": False},
        "fused_lm_head_token_chunk_size": 8192,
    }
    return {
        "model": model,
        "tokenizer": {"name": BASE_NAME, "trust_remote_code": False, "chat_template": None},
        "data": {"fake": None},
        "loss": {"type": "default", "dppo_mask_low": 0.2, "dppo_mask_high": 0.2, "adv_tau": 1.0, "kl_tau": 0.001},
        "optim": _optim_section(spec),
        "scheduler": _scheduler_section(spec),
        "ckpt": {"output_dir": None, "interval": spec.ckpt_interval, "keep_last": None, "keep_interval": None,
                 "skip_progress": False, "skip_scheduler": False, "skip_dataloader": False,
                 "skip_optimizer": False},
        "resume": None if resume_step is None else {"step": resume_step, "dir": None},
        "weight_broadcast": {"type": "filesystem"},
        "rollout_transport": {"type": "zmq", "host": "localhost", "port": 5555, "hwm": 10},
        "log": {"level": "info", "vf_level": "info", "json_logging": False, "log_data": False, "interval": 10.0,
                "ranks_filter": [0]},
        "monitors": {"wandb": None, "file": {"path": "metrics.jsonl"}},
        "output_dir": "outputs",
        "matmul_precision": "high",
        "max_steps": spec.max_steps,
        "enable_router_replay": False,
        "memory_profiler_path": None,
        "gc": {"interval": 50},
        "trace_path": None,
        "dist_timeout_seconds": 3600,
        "heartbeat": None,
        "metrics_server": None,
        "enable_token_export": False,
        "env_vars": {},
    }


def saved_module_suffixes(trainable_names: list[str]) -> list[str] | None:
    """``save_lora_config``'s ``modules_to_save``: the last component of each trainable non-LoRA param's
    module, sorted (``["lm_head", "norm"]``); None when there is none. prime-rl writes only this list: the
    broadcast holds none of those tensors."""
    names = {n.rsplit(".", 1)[0].split(".")[-1] for n in trainable_names if "lora_A" not in n and "lora_B" not in n}
    return sorted(names) if names else None


def adapter_config(spec: HeadSpec, trainable_names: list[str] | None = None) -> dict[str, Any]:
    """prime-rl's ``save_lora_config``: the trainer's r/alpha, the wrapped modules' suffixes, sorted, and
    the suffixes of the fully trained modules (``trainable_names``: the model's ``requires_grad`` params)."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": BASE_NAME,
        "r": spec.lora_rank, "lora_alpha": float(spec.lora_alpha), "lora_dropout": 0.0, "bias": "none",
        "target_modules": sorted(spec.lora_modules_suffixes()),
        "modules_to_save": saved_module_suffixes(trainable_names or []),
    }


def write_json(path: Path, obj: Any) -> None:
    """``json.dump(obj, f, indent=2)`` as prime-rl writes trainer.json and adapter_config.json (no newline)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2))
    os.chmod(path, 0o644)
