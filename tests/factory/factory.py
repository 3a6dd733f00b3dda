"""Write prime-rl-layout LoRA training checkpoints for real, the way prime-rl's trainer does.

``make_run(out_dir, spec)`` builds a whole prime-rl-like output tree:

- ``base_model/``: a random bf16 HF ``Qwen3ForCausalLM`` ("the hub model");
- ``outputs/checkpoints/step_<N>/trainer/``: a DCP checkpoint written by ``dcp.save`` from
  ``spec.world_size`` gloo processes that ran FSDP2 (``fully_shard`` per decoder layer, then the root) on
  a CPU ``DeviceMesh`` with a prime-rl-style LoRA wrapper, AdamW over the LoRA params, a prime-rl
  scheduler and ``spec.steps`` real optimizer steps, saved through a mirror of prime-rl's ``AppState``;
- ``outputs/run_default/configs/orch.toml`` (the orchestrator's ``[model.lora] alpha`` sets the scale);
- ``outputs/run_default/broadcasts/step_<N>/``: an adapter export with prime-rl's key bug (no
  ``base_model.model.`` prefix) and an ``adapter_config.json`` that claims ``trainer_alpha``;
- ``truth.safetensors`` / ``truth.json``: the unsharded LoRA and AdamW state gathered from the live model
  after training, for tests.

Facts mirrored here come from ``shared/docs/primerl-format.md`` (a genuine prime-rl checkpoint). Nothing
in this module is needed at runtime by the toolkit; it exists to make test and benchmark inputs.

CLI: ``python -m tests.factory OUT [--preset tiny|qwen3-1.7b|qwen3-8b] ...`` (from the repository root)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import shutil
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_tools.core.tensor_math import bf16_round
from ckpt_tools.formats.dcp.layout import row_chunks
from ckpt_tools.formats.hf_dir.model_dir import HFModelDir

logger = logging.getLogger(__name__)

ALL_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
SCHEDULERS = ("constant", "linear", "sequential", "cosine")

# Tokenizer / chat files of the genuine fixture's base model (vocab 1000). Copied only when the vocab matches.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")
_GENUINE_TINY_REL = Path("tests") / "fixtures" / "primerl-tiny"


# --------------------------------------------------------------------------------------------------------
# Spec
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FactorySpec:
    """Shapes and training knobs of a generated run. Defaults are the CI tiny config.

    The training-time LoRA scale is ``lora_alpha_orch / lora_rank`` (prime-rl takes it from the
    orchestrator's config, §6.1 of primerl-format.md); ``trainer_alpha`` is only what the run's
    ``adapter_config.json`` files claim (``None``: the same as the orchestrator's alpha).
    """

    hidden_size: int = 64
    intermediate_size: int = 162  # uneven FSDP shards over 4 ranks: 41/41/41/39
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    vocab_size: int = 1000
    tie_word_embeddings: bool = False
    lora_rank: int = 8
    lora_alpha_orch: float = 16.0
    trainer_alpha: float | None = None
    targets: tuple[str, ...] = ALL_TARGETS
    num_slots: int = 1
    world_size: int = 4
    steps: int = 3
    lr: float = 1e-2
    scheduler: str = "linear"
    seed: int = 0
    # --- scheduler details (prime-rl's setup_linear_scheduler / setup_cosine_scheduler) ---
    warmup_steps: int = 2
    decay: str = "linear"  # only for scheduler="sequential": "linear" (WSD, 3 x LinearLR) or "cosine"
    decay_steps: int = 5  # sequential + linear decay: the decay phase starts at max_steps - decay_steps
    max_steps: int = 10  # the run's configured max_steps (not how many steps we run)
    min_lr: float = 0.0
    # --- optimizer / trainer details ---
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_norm: float | None = 1.0  # prime-rl clips the grad norm at 1.0
    mixed_precision: bool = True  # FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32), as prime-rl
    seq_len: int = 16  # tokens per sample; random tokens, cross entropy
    batch_size: int = 1  # samples per rank per step
    # --- base model details ---
    base_max_shard_size: str | int | None = None  # e.g. "200KB" to get model-0000k-of-0000n + index
    max_position_embeddings: int = 512
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    bos_token_id: int | None = 997
    eos_token_id: int | None = 999

    def __post_init__(self) -> None:
        problems = []
        if self.scheduler not in SCHEDULERS:
            problems.append(f"scheduler={self.scheduler!r} must be one of {SCHEDULERS}")
        if self.decay not in ("linear", "cosine"):
            problems.append(f"decay={self.decay!r} must be 'linear' or 'cosine'")
        if self.steps < 1:
            problems.append(
                f"steps={self.steps}: at least 1 optimizer step is needed (prime-rl never checkpoints "
                "before a step, and DCP would invent AdamW state for a fresh optimizer)"
            )
        if self.world_size < 1:
            problems.append(f"world_size={self.world_size} must be >= 1")
        if self.num_slots < 1:
            problems.append(f"num_slots={self.num_slots} must be >= 1")
        if self.lora_rank < 1:
            problems.append(f"lora_rank={self.lora_rank} must be >= 1")
        unknown = [t for t in self.targets if t not in ALL_TARGETS]
        if unknown or not self.targets:
            problems.append(f"targets={self.targets!r}: each must be one of {ALL_TARGETS}, at least one")
        if self.num_heads % self.num_kv_heads:
            problems.append(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.seq_len < 2:
            problems.append(f"seq_len={self.seq_len} must be >= 2 (the shifted cross entropy needs 2 tokens)")
        cosine = self.scheduler == "cosine" or (self.scheduler == "sequential" and self.decay == "cosine")
        if self.scheduler == "linear" and self.warmup_steps < 1:
            problems.append("scheduler='linear' needs warmup_steps >= 1 (use 'sequential' for a decay)")
        if cosine and not (1 <= self.warmup_steps < self.max_steps):
            problems.append("a cosine decay needs 1 <= warmup_steps < max_steps")
        if self.scheduler == "sequential" and not cosine:
            if not (1 <= self.warmup_steps <= self.max_steps - self.decay_steps) or self.decay_steps < 2:
                problems.append(
                    "scheduler='sequential' with linear decay needs 1 <= warmup_steps <= max_steps - decay_steps "
                    f"and decay_steps >= 2 (got warmup_steps={self.warmup_steps}, max_steps={self.max_steps}, "
                    f"decay_steps={self.decay_steps})"
                )
        if problems:
            raise ValueError("invalid FactorySpec: " + "; ".join(problems))
        object.__setattr__(self, "targets", tuple(self.targets))
        object.__setattr__(self, "betas", tuple(self.betas))

    # ---- presets ----
    @classmethod
    def tiny(cls, **overrides: Any) -> FactorySpec:
        """The CI config: genuine fixture A's shapes with 2 layers (fixture A has 3)."""
        return cls(**overrides)

    @classmethod
    def qwen3_1_7b(cls, **overrides: Any) -> FactorySpec:
        """Qwen3-1.7B shapes (tied embeddings), LoRA r=32. For benchmarks on a large machine."""
        kw: dict[str, Any] = dict(
            hidden_size=2048, intermediate_size=6144, num_layers=28, num_heads=16, num_kv_heads=8,
            head_dim=128, vocab_size=151936, tie_word_embeddings=True, lora_rank=32,
            max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645, seq_len=4,
        )
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def qwen3_8b(cls, **overrides: Any) -> FactorySpec:
        """Qwen3-8B shapes (untied embeddings), LoRA r=32. For benchmarks on a large machine."""
        kw: dict[str, Any] = dict(
            hidden_size=4096, intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8,
            head_dim=128, vocab_size=151936, tie_word_embeddings=False, lora_rank=32,
            max_position_embeddings=40960, bos_token_id=151643, eos_token_id=151645, seq_len=4,
        )
        kw.update(overrides)
        return cls(**kw)

    # ---- derived facts ----
    @property
    def scale(self) -> float:
        """The training-time LoRA scale, bf16-rounded like prime-rl's ``Runs.scaling_factors``."""
        return bf16_round(self.lora_alpha_orch / self.lora_rank)

    @property
    def adapter_config_alpha(self) -> float:
        return float(self.trainer_alpha if self.trainer_alpha is not None else self.lora_alpha_orch)

    def target_modules(self) -> list[str]:
        """HF module FQNs that get a LoRA, in prime-rl's optimizer order (per layer q,k,v,o,gate,up,down)."""
        out = []
        for layer in range(self.num_layers):
            for t in ALL_TARGETS:
                if t in self.targets:
                    kind = "self_attn" if t in _ATTN_TARGETS else "mlp"
                    out.append(f"model.layers.{layer}.{kind}.{t}")
        return out

    def module_shape(self, module: str) -> tuple[int, int]:
        """``(out_features, in_features)`` of a target projection."""
        t = module.rsplit(".", 1)[-1]
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {
            "q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i),
        }[t]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["targets"] = list(self.targets)
        d["betas"] = list(self.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FactorySpec:
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        if "targets" in kw:
            kw["targets"] = tuple(kw["targets"])
        if "betas" in kw:
            kw["betas"] = tuple(kw["betas"])
        return cls(**kw)


@dataclass(frozen=True)
class RunPaths:
    """Where ``make_run`` put things."""

    root: Path
    base_model: Path
    checkpoint: Path  # the DCP trainer dir: outputs/checkpoints/step_<N>/trainer
    orch_toml: Path
    broadcast_dir: Path
    truth: Path  # truth.safetensors (truth.json beside it)

    @property
    def truth_json(self) -> Path:
        return self.truth.with_suffix(".json")


class FactoryError(RuntimeError):
    """A child process of the factory (or of fsdp_check) failed; the message holds its traceback."""


# --------------------------------------------------------------------------------------------------------
# Model pieces shared by the writer (make_run) and the strict loader (fsdp_check.load_strict)
# --------------------------------------------------------------------------------------------------------

_LORA_PREFIX = "base_layer."


def _lora_module_class():
    """Define the LoRA wrapper lazily so importing this module does not import torch.nn."""
    global _LoRALinear
    if _LoRALinear is not None:
        return _LoRALinear
    import torch
    from torch import nn

    class PrimeLoRALinear(nn.Module):
        """prime-rl's ``MultiLoRALinear`` naming: ``base_layer`` + ``nn.ParameterList`` ``lora_A``/``lora_B``.

        A state-dict post hook strips ``base_layer.`` (base keys keep HF names), a load pre-hook adds it
        back, and attribute lookups fall through to the base layer (DCP's FQN walk relies on that, as in
        prime-rl). LoRA keys are ``<module>.lora_A.<slot>`` with no ``.weight``.
        """

        def __init__(self, base_layer: nn.Linear, rank: int, n_slots: int, scales: list[float]):
            super().__init__()
            self.base_layer = base_layer
            for p in self.base_layer.parameters():
                p.requires_grad = False
            self.rank = rank
            self.n_slots = n_slots
            self.scales = [float(s) for s in scales]
            self.in_features = base_layer.in_features
            self.out_features = base_layer.out_features
            dev, dt = base_layer.weight.device, base_layer.weight.dtype
            self.lora_A = nn.ParameterList(
                [nn.Parameter(torch.empty(rank, self.in_features, device=dev, dtype=dt)) for _ in range(n_slots)]
            )
            self.lora_B = nn.ParameterList(
                [nn.Parameter(torch.empty(self.out_features, rank, device=dev, dtype=dt)) for _ in range(n_slots)]
            )
            self._register_state_dict_hook(self._post_state_dict_hook)
            self.register_load_state_dict_pre_hook(self._pre_load_state_dict_hook)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = self.base_layer(x)
            # Every slot takes part (each with its scale) so every slot gets gradients and AdamW state.
            for a, b, s in zip(self.lora_A, self.lora_B, self.scales):
                out = out + s * torch.nn.functional.linear(torch.nn.functional.linear(x, a), b)
            return out

        def __getattr__(self, name: str) -> Any:
            try:
                return super().__getattr__(name)
            except AttributeError:
                return getattr(self.base_layer, name)

        @staticmethod
        def _post_state_dict_hook(module, state_dict, prefix, *args):
            old_prefix = f"{prefix}{_LORA_PREFIX}"
            for key in list(state_dict.keys()):
                if key.startswith(old_prefix):
                    state_dict[prefix + key[len(old_prefix):]] = state_dict.pop(key)
            return state_dict

        @staticmethod
        def _pre_load_state_dict_hook(module, state_dict, prefix, *args):
            for key in list(state_dict.keys()):
                if not key.startswith(prefix) or "lora_A" in key or "lora_B" in key:
                    continue
                state_dict[f"{prefix}{_LORA_PREFIX}{key[len(prefix):]}"] = state_dict.pop(key)

    _LoRALinear = PrimeLoRALinear
    return _LoRALinear


_LoRALinear = None


@dataclass
class Progress:
    """prime-rl's ``Progress`` (``asdict`` order: step, total_tokens, total_samples)."""

    step: int = 0
    total_tokens: int = 0
    total_samples: int = 0


def app_state_class():
    global _AppState
    if _AppState is not None:
        return _AppState
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.checkpoint.stateful import Stateful

    class AppState(Stateful):
        """A mirror of prime-rl's ``trainer/ckpt.py::AppState``."""

        def __init__(self, model, optimizers, scheduler, progress):
            self.model = model
            self.optimizers = optimizers
            self.scheduler = scheduler
            self.progress = progress

        def state_dict(self) -> dict[str, Any]:
            model_state_dict, optimizer_state_dict = get_state_dict(self.model, self.optimizers)
            state_dict = {"model": model_state_dict, "optimizers": optimizer_state_dict}
            if self.scheduler is not None:
                state_dict["scheduler"] = self.scheduler.state_dict()
            if self.progress is not None:
                state_dict["progress"] = dataclasses.asdict(self.progress)
            return state_dict

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            set_state_dict(
                self.model, self.optimizers,
                model_state_dict=state_dict["model"], optim_state_dict=state_dict["optimizers"],
            )
            if self.scheduler is not None:
                self.scheduler.load_state_dict(state_dict["scheduler"])
            if self.progress is not None:
                for key, value in state_dict["progress"].items():
                    setattr(self.progress, key, value)

    _AppState = AppState
    return _AppState


_AppState = None


def build_scheduler(optimizer, spec: FactorySpec):
    """prime-rl's ``trainer/scheduler.py`` for the spec's kind."""
    from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, LinearLR, SequentialLR

    min_lr_factor = spec.min_lr / spec.lr if spec.min_lr > 0 else 1e-8
    if spec.scheduler == "constant":
        return ConstantLR(optimizer, factor=1.0)
    if spec.scheduler == "linear":  # setup_linear_scheduler with decay_steps=0: a lone warmup LinearLR
        return LinearLR(optimizer, start_factor=min_lr_factor, end_factor=1.0, total_iters=spec.warmup_steps)
    warmup = LinearLR(optimizer, start_factor=min_lr_factor, end_factor=1.0, total_iters=spec.warmup_steps)
    if spec.scheduler == "cosine" or spec.decay == "cosine":  # setup_cosine_scheduler
        cosine = CosineAnnealingLR(optimizer, T_max=spec.max_steps - spec.warmup_steps, eta_min=spec.min_lr)
        return SequentialLR(optimizer, [warmup, cosine], milestones=[spec.warmup_steps])
    # setup_linear_scheduler with warmup and decay (WSD): warmup, constant, linear decay
    decay_start = spec.max_steps - spec.decay_steps
    constant = LinearLR(optimizer, start_factor=1.0, end_factor=1.0, total_iters=decay_start - spec.warmup_steps)
    decay = LinearLR(optimizer, start_factor=1.0, end_factor=min_lr_factor, total_iters=spec.decay_steps - 1)
    return SequentialLR(optimizer, [warmup, constant, decay], milestones=[spec.warmup_steps, decay_start])


def _chunk_rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """FSDP2's ``Shard(0)`` rows [start, stop) of ``rank``: the library's ``row_chunks`` (``torch.chunk``
    rule); ranks past the end hold none."""
    chunks = row_chunks(n, world)
    if rank >= len(chunks):
        return n, n
    start, rows = chunks[rank]
    return start, start + rows


def _full_lora_init(spec: FactorySpec, module_index: int, slot: int, module: str):
    """Deterministic full-size LoRA init, identical on every rank and for every world size.

    A is kaiming-uniform(a=sqrt(5)) like prime-rl (bound 1/sqrt(in)), B is zeros.
    """
    import torch

    out_f, in_f = spec.module_shape(module)
    g = torch.Generator().manual_seed((spec.seed * 1_000_003 + module_index * 101 + slot) % (2**63))
    bound = 1.0 / math.sqrt(in_f)
    a = torch.empty(spec.lora_rank, in_f).uniform_(-bound, bound, generator=g)
    b = torch.zeros(out_f, spec.lora_rank)
    return a, b


def build_fsdp_model(spec: FactorySpec, base_dir: Path, rank: int, world: int):
    """Build the FSDP2 LoRA model the way prime-rl does, with fp32 masters from the bf16 base.

    The model is created on the meta device, wrapped, sharded and then materialized on CPU; each rank
    reads only its own rows of the base weights (exact bf16 -> fp32 upcast), so memory per rank is 1/W
    of the model even for the big presets. Returns ``(model, mesh)``.
    """
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, Qwen3ForCausalLM

    config = AutoConfig.from_pretrained(str(base_dir))
    config.use_cache = False
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    model.to(torch.float32)
    model.config.dtype = torch.float32  # prime-rl's exported config says float32 (loaded in fp32)

    lora_cls = _lora_module_class()
    scales = [spec.scale] * spec.num_slots
    for module in spec.target_modules():
        parent_name, child_name = module.rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        setattr(parent, child_name, lora_cls(getattr(parent, child_name), spec.lora_rank, spec.num_slots, scales))

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard_cp",))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if spec.mixed_precision \
        else MixedPrecisionPolicy()
    layers = model.model.layers
    for i, block in enumerate(layers):
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    model.to_empty(device="cpu")

    # Non-persistent buffers (rotary inv_freq) were never materialized: rebuild them on CPU.
    rotary = model.model.rotary_emb
    model.model.rotary_emb = type(rotary)(config=config)
    for name, buf in model.named_buffers():
        if not name.startswith("model.rotary_emb."):
            raise RuntimeError(f"unexpected buffer {name!r}: the meta-device build does not know how to init it")

    base = HFModelDir.open(base_dir)   # the library's reader: each rank reads only its own rows
    lora_index = {m: i for i, m in enumerate(spec.target_modules())}
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            n = p.shape[0]
            start, stop = _chunk_rows(n, world, rank)
            if stop - start != local.shape[0]:
                raise RuntimeError(f"{name}: local shard has {local.shape[0]} rows, expected rows [{start}:{stop}]")
            if ".lora_A." in name or ".lora_B." in name:
                module, kind, slot = name.rsplit(".", 2)
                a, b = _full_lora_init(spec, lora_index[module], int(slot), module)
                local.copy_((a if kind == "lora_A" else b)[start:stop])
            else:
                hf_name = name.replace(".base_layer.", ".")
                if hf_name not in base:
                    raise KeyError(f"{hf_name!r} is not in the base model at {base_dir}")
                local.copy_(base.read_rows(hf_name, start, stop - start).to(torch.float32))
    base.close()
    if spec.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight:
        raise RuntimeError("tied embeddings came untied during the FSDP build")
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_A." in name or ".lora_B." in name)
    return model, mesh


def sharded_lora_skeleton(spec: FactorySpec, world: int, device: str = "cpu"):
    """The FSDP2 LoRA model of `spec` (one LoRA slot, prime-rl's bf16/fp32 mixed precision), built on the
    meta device, sharded and materialized empty on `device`: the bench generators (bench/seed_scale.py,
    bench/sparse_ckpt.py) fill its parameters themselves. Returns ``(model, config)``."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import Qwen3ForCausalLM

    config = qwen3_config(spec)
    config.use_cache = False
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    model.to(torch.float32)
    lora_cls = lora_module_class()
    for module in spec.target_modules():
        parent_name, child_name = module.rsplit(".", 1)
        parent = model.get_submodule(parent_name)
        setattr(parent, child_name, lora_cls(getattr(parent, child_name), spec.lora_rank, 1, [spec.scale]))
    mesh = init_device_mesh(device, (world,), mesh_dim_names=("dp_shard_cp",))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    layers = model.model.layers
    for i, block in enumerate(layers):
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    model.to_empty(device=device)
    with torch.device(device):   # non-persistent buffers (rotary inv_freq) were never materialized
        model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    return model, config


def lora_named_parameters(model) -> list[tuple[str, Any]]:
    """LoRA params in prime-rl's optimizer order: per layer q,k,v,o,gate,up,down; per module slot by slot,
    A before B. (prime-rl's single-run optimizer holds slot 0 only; with more slots we keep them all.)"""
    lora_cls = _lora_module_class()
    out = []
    for mname, mod in model.named_modules():
        if isinstance(mod, lora_cls):
            for slot in range(mod.n_slots):
                out.append((f"{mname}.lora_A.{slot}", mod.lora_A[slot]))
                out.append((f"{mname}.lora_B.{slot}", mod.lora_B[slot]))
    return out


def build_optimizer(model, spec: FactorySpec):
    import torch

    params = [p for _, p in lora_named_parameters(model)]
    return torch.optim.AdamW(params, lr=spec.lr, weight_decay=spec.weight_decay, betas=tuple(spec.betas), eps=spec.eps)


# --------------------------------------------------------------------------------------------------------
# Process plumbing
# --------------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_entry(workdir: str, rank_s: str, port_s: str) -> None:
    """Entry point of one rank (``python -c`` in a fresh interpreter, see ``run_distributed``).

    Any failure, ``BaseException`` included (DCP's ``CheckpointException`` is one), is written to
    ``error_<rank>.json`` with its traceback and the time it happened, then the process exits 1.
    """
    import datetime
    import importlib
    import pickle

    rank, port = int(rank_s), int(port_s)
    with open(os.path.join(workdir, "args.pkl"), "rb") as f:
        fn_name, world, args = pickle.load(f)
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
        try:
            mod_name, func = fn_name.split(":")
            getattr(importlib.import_module(mod_name), func)(rank, world, *args)
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - see docstring
        err = {"rank": rank, "time": time.time(), "error": f"{type(e).__name__}: {e}",
               "traceback": traceback.format_exc()}
        with open(os.path.join(workdir, f"error_{rank}.json"), "w") as f:
            json.dump(err, f)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    # Skip interpreter teardown (module finalizers, gloo/c10d objects): every result is already on disk
    # and closed, and on a busy 2-core machine the teardown of 4 ranks was seconds of pure waiting.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# Modules every rank needs. Importing them costs ~7 s of CPU per interpreter (transformers alone ~4 s);
# with 4 ranks on 2 cores that was most of a tiny run. The zygote imports them once and forks the ranks.
_PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "safetensors.torch",
    "transformers",
    "transformers.models.qwen3.modeling_qwen3",
)


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    pkg_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _verbose() -> bool:
    return os.environ.get("CKPT_TOOLS_FACTORY_VERBOSE", "") not in ("", "0")


def _read_exit_code(workdir: str, rank: int) -> int | None:
    try:
        with open(os.path.join(workdir, f"exit_{rank}")) as f:
            return int(f.read())
    except (FileNotFoundError, ValueError):
        return None


class _SubprocessRanks:
    """One fresh ``python -c`` interpreter per rank (portable; pays the imports once per rank)."""

    def __init__(self, workdir: str, world: int, port: int):
        import subprocess

        code = "import sys; from tests.factory.factory import child_entry; child_entry(*sys.argv[1:])"
        env = _child_env()
        self.procs, self.logs = [], []
        for rank in range(world):
            log = None if _verbose() else open(os.path.join(workdir, f"rank_{rank}.log"), "wb")
            self.logs.append(log)
            self.procs.append(subprocess.Popen(
                [sys.executable, "-c", code, workdir, str(rank), str(port)],
                env=env, stdout=log, stderr=subprocess.STDOUT if log else None,
            ))

    def poll(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()
        for log in self.logs:
            if log is not None:
                log.close()


class _Zygote:
    """A helper interpreter that imports ``_PRELOAD`` once, then forks the ranks of each launch.

    It lives as long as this process (one per process, started on first use), so a test session pays
    the torch/transformers imports once instead of once per rank per launch. Protocol on its stdin/stdout:
    one JSON line per launch ``{"workdir", "world", "port"}`` -> ``{"pids": [...]}`` right away, then
    ``{"done": true}`` when every rank has exited (each rank's exit code goes to ``<workdir>/exit_<rank>``).
    """

    _instance: _Zygote | None = None

    def __init__(self) -> None:
        import subprocess

        code = "from tests.factory.factory import zygote_main; zygote_main()"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code], env=_child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=None, bufsize=0,
        )
        self._buf = b""

    @classmethod
    def get(cls) -> _Zygote:
        z = cls._instance
        if z is None or z.proc.poll() is not None:
            z = cls._instance = cls()
            import atexit

            atexit.register(z.close)
        return z

    @classmethod
    def prestart(cls) -> None:
        """Start the zygote now so its imports overlap with the caller's own work."""
        if _launch_mode() == "zygote":
            cls.get()

    def _reply(self, timeout_s: float) -> dict:
        # Unbuffered reads into our own buffer: select() on a buffered reader can miss a second line
        # that already sits in the reader's buffer (pids and done arrive together when ranks fail fast).
        import select

        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            r, _, _ = select.select([fd], [], [], max(0.0, left))
            chunk = os.read(fd, 65536) if r else b""
            if not chunk:
                self.close(kill=True)
                raise FactoryError("the factory's zygote process stopped answering (it is restarted on the next call)")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def launch(self, workdir: str, world: int, port: int) -> _ZygoteRanks:
        req = {"workdir": workdir, "world": world, "port": port, "verbose": _verbose()}
        self.proc.stdin.write((json.dumps(req) + "\n").encode())
        return _ZygoteRanks(self, workdir, world, self._reply(600)["pids"])

    def close(self, kill: bool = False) -> None:
        if self.proc.poll() is None:
            try:
                if kill:
                    raise TimeoutError
                self.proc.stdin.close()  # EOF: the zygote leaves its loop and exits
                self.proc.wait(timeout=10)
            except Exception:  # noqa: BLE001 - best effort
                self.proc.kill()
                self.proc.wait()
        if _Zygote._instance is self:
            _Zygote._instance = None


class _ZygoteRanks:
    def __init__(self, zygote: _Zygote, workdir: str, world: int, pids: list[int]):
        self.zygote, self.workdir, self.world, self.pids = zygote, workdir, world, pids
        self.finished = False

    def poll(self) -> list[int | None]:
        codes = [_read_exit_code(self.workdir, r) for r in range(self.world)]
        if not self.finished and all(c is not None for c in codes):
            self.zygote._reply(60)  # the "done" line: keep the protocol in step
            self.finished = True
        return codes

    def kill(self) -> None:
        if self.finished:
            return
        import signal

        for r, pid in enumerate(self.pids):
            if _read_exit_code(self.workdir, r) is None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.zygote._reply(60)
        self.finished = True


def zygote_main() -> None:
    import importlib

    for m in _PRELOAD:
        importlib.import_module(m)
    for line in sys.stdin:
        req = json.loads(line)
        workdir, world, port = req["workdir"], int(req["world"]), int(req["port"])
        sys.stdout.flush()
        sys.stderr.flush()
        pids = []
        for rank in range(world):
            pid = os.fork()
            if pid == 0:
                try:
                    devnull = os.open(os.devnull, os.O_RDONLY)
                    os.dup2(devnull, 0)
                    if req.get("verbose"):
                        os.dup2(2, 1)  # never write to the protocol pipe
                    else:
                        log = os.open(os.path.join(workdir, f"rank_{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                        os.dup2(log, 1)
                        os.dup2(log, 2)
                    child_entry(workdir, str(rank), str(port))
                finally:
                    os._exit(1)
            pids.append(pid)
        print(json.dumps({"pids": pids}), flush=True)
        remaining = dict(zip(pids, range(world)))
        while remaining:
            pid, status = os.waitpid(-1, 0)
            if pid in remaining:
                rank = remaining.pop(pid)
                tmp = os.path.join(workdir, f".exit_{rank}.tmp")
                with open(tmp, "w") as f:
                    f.write(str(os.waitstatus_to_exitcode(status)))
                os.replace(tmp, os.path.join(workdir, f"exit_{rank}"))
        print(json.dumps({"done": True}), flush=True)


def _launch_mode() -> str:
    mode = os.environ.get("CKPT_TOOLS_FACTORY_LAUNCH", "zygote" if hasattr(os, "fork") and sys.platform == "linux" else "subprocess")
    if mode not in ("zygote", "subprocess"):
        raise ValueError(f"CKPT_TOOLS_FACTORY_LAUNCH={mode!r} must be 'zygote' or 'subprocess'")
    return mode


def run_distributed(fn_name: str, world: int, args: tuple = (), timeout_s: float | None = 3600.0) -> None:
    """Run ``"module:function"(rank, world, *args)`` on ``world`` gloo ranks (separate processes), and wait.

    Ranks are forked from a zygote that has torch and transformers imported (Linux; set
    ``CKPT_TOOLS_FACTORY_LAUNCH=subprocess`` for one fresh interpreter per rank). Neither path re-imports
    the caller's ``__main__`` (unlike ``multiprocessing`` spawn), so this works from scripts without a
    main guard, from stdin and from pytest alike. Ranks get ``OMP_NUM_THREADS=1``; their output goes to a
    log that is shown only on failure (``CKPT_TOOLS_FACTORY_VERBOSE=1`` shows it live).

    Raises ``FactoryError`` with the first failing rank's traceback (failures on other ranks are usually
    consequences of it).
    """
    import pickle

    for attempt in range(3):  # a probed free port can be taken before gloo binds it: retry
        with tempfile.TemporaryDirectory(prefix="ckpt_tools_dist_") as tmp:
            with open(os.path.join(tmp, "args.pkl"), "wb") as f:
                pickle.dump((fn_name, world, tuple(args)), f)
            port = _free_port()
            ranks = _Zygote.get().launch(tmp, world, port) if _launch_mode() == "zygote" else _SubprocessRanks(tmp, world, port)
            failed_at = None
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            try:
                while True:
                    codes = ranks.poll()
                    if all(c == 0 for c in codes):
                        return
                    if failed_at is None and any(c not in (None, 0) for c in codes):
                        failed_at = time.monotonic()
                    # After a failure give the others a moment to record their own errors, then stop them.
                    if failed_at is not None and (all(c is not None for c in codes) or time.monotonic() - failed_at > 3):
                        break
                    if deadline is not None and time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
            finally:
                ranks.kill()
            if failed_at is None:
                raise FactoryError(f"{fn_name} did not finish within {timeout_s}s on {world} ranks")
            errors = []
            for rank in range(world):
                ep = os.path.join(tmp, f"error_{rank}.json")
                if os.path.exists(ep):
                    with open(ep) as f:
                        errors.append(json.load(f))
            if errors:
                first = min(errors, key=lambda e: e["time"])
                text = first["error"] + "\n" + first["traceback"]
                if ("EADDRINUSE" in text or "Address already in use" in text) and attempt < 2:
                    continue
                others = sorted(e["rank"] for e in errors if e is not first)
                raise FactoryError(
                    f"rank {first['rank']} failed: {first['error']}"
                    + (f" (ranks {others} failed too)" if others else "")
                    + f"\n--- traceback of rank {first['rank']} ---\n{first['traceback']}"
                )
            # A rank died without reaching our handler (killed, segfault, import error before it).
            bad = [(r, c) for r, c in enumerate(codes) if c not in (0, None)]
            tail = ""
            log_path = os.path.join(tmp, f"rank_{bad[0][0]}.log") if bad else ""
            if log_path and os.path.exists(log_path):
                with open(log_path, "rb") as f:
                    tail = f.read()[-4000:].decode(errors="replace")
            raise FactoryError(f"ranks exited abnormally (rank, exit code): {bad}\n{tail}")
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------------------------------------
# The training child
# --------------------------------------------------------------------------------------------------------


def train_step(model, optimizer, scheduler, progress: Progress, lora_params, input_ids, spec: FactorySpec,
               world: int) -> tuple[float, float | None]:
    """One prime-rl optimizer step on `input_ids` (cross entropy on themselves): backward, grad-norm clip of
    the LoRA params at spec.max_norm, AdamW and scheduler steps, progress counted over `world` ranks.
    Returns (this rank's loss, the clipped grad norm or None)."""
    import torch

    out = model(input_ids=input_ids, labels=input_ids)
    out.loss.backward()
    grad_norm = None
    if spec.max_norm is not None:
        gn = torch.nn.utils.clip_grad_norm_(lora_params, max_norm=spec.max_norm)
        grad_norm = float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn)
    apply_step(optimizer, scheduler, progress, spec, world)
    return float(out.loss.detach()), grad_norm


def apply_step(optimizer, scheduler, progress: Progress, spec: FactorySpec, world: int) -> None:
    """The end of an optimizer step once the gradients are in: AdamW and scheduler steps, progress counted
    over `world` ranks (train_step's, and bench/sparse_ckpt.py's after its random gradient)."""
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    progress.step += 1
    progress.total_tokens += spec.batch_size * spec.seq_len * world
    progress.total_samples += spec.batch_size * world


def train_child(rank: int, world: int, spec_dict: dict, root: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    spec = FactorySpec.from_dict(spec_dict)
    paths = _paths(Path(root), spec)
    model, _mesh = build_fsdp_model(spec, paths.base_model, rank, world)
    optimizer = build_optimizer(model, spec)
    scheduler = build_scheduler(optimizer, spec)
    progress = Progress()
    lora_params = [p for _, p in lora_named_parameters(model)]

    steps_log = []
    for step in range(spec.steps):
        g = torch.Generator().manual_seed(spec.seed * 7919 + step * 104729 + rank)
        input_ids = torch.randint(0, spec.vocab_size, (spec.batch_size, spec.seq_len), generator=g)
        loss, grad_norm = train_step(model, optimizer, scheduler, progress, lora_params, input_ids, spec, world)
        steps_log.append({
            "step": step, "loss_rank0": loss, "grad_norm": grad_norm,
            "lr_after_scheduler_step": float(optimizer.param_groups[0]["lr"]),
        })

    # prime-rl's CheckpointManager.save_to_path: dcp_save({"app": AppState(...)}, checkpoint_id=path)
    paths.checkpoint.mkdir(parents=True, exist_ok=True)
    app = app_state_class()(model, [optimizer], scheduler, progress)
    dcp.save({"app": app}, checkpoint_id=paths.checkpoint)

    # Ground truth from the live model. Only the LoRA params are gathered (one all-gather each), so the
    # big presets never hold a full base model on rank 0. (StateDictOptions(ignore_frozen_params=True)
    # cannot be used: with the base_layer-stripping hook it raises KeyError '...q_proj.base_layer.weight'.)
    msd = {}
    for name, p in lora_named_parameters(model):
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        if rank == 0:
            msd[name] = full.detach().cpu()
    osd = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        _write_truth_and_broadcast(spec, paths, msd, osd, optimizer, scheduler, progress, steps_log)
    dist.barrier()


def _write_truth_and_broadcast(spec, paths, msd, osd, optimizer, scheduler, progress, steps_log) -> None:
    import torch
    from safetensors.torch import save_file

    truth: dict[str, torch.Tensor] = {}
    lora_keys = [k for k in msd if ".lora_A." in k or ".lora_B." in k]
    expected = 2 * spec.num_slots * len(spec.target_modules())
    if len(lora_keys) != expected:
        raise RuntimeError(f"gathered {len(lora_keys)} LoRA tensors, expected {expected}")
    broadcast: dict[str, torch.Tensor] = {}
    for k in lora_keys:
        module, kind, slot = k.rsplit(".", 2)
        t = msd[k].detach().to(torch.float32).contiguous().clone()
        truth[f"lora.{module}.slot{slot}.{kind[-1]}"] = t
        if slot == "0":  # run_default is slot 0
            broadcast[f"{module}.{kind}.weight"] = t
    for fqn, state in osd["state"].items():
        for field, v in state.items():
            truth[f"optim.{fqn}.{field}"] = v.detach().to(torch.float32).contiguous().clone()
    paths.truth.parent.mkdir(parents=True, exist_ok=True)
    save_file(truth, str(paths.truth), metadata={"format": "pt"})

    # prime-rl FileSystemWeightBroadcast: adapter only, fp32, keys without base_model.model.
    paths.broadcast_dir.mkdir(parents=True, exist_ok=True)
    save_file(dict(sorted(broadcast.items())), str(paths.broadcast_dir / "adapter_model.safetensors"),
              metadata={"format": "pt"})

    info = {
        "lr": float(optimizer.param_groups[0]["lr"]),
        "scheduler": jsonable(scheduler.state_dict()),
        "progress": dataclasses.asdict(progress),
        "steps": steps_log,
        "optimizer_param_order": list(osd["param_groups"][0]["params"]),
    }
    (paths.truth.parent / ".truth_child.json").write_text(json.dumps(info))
    _make_world_readable(paths.truth)
    _make_world_readable(paths.broadcast_dir)


def jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (int, float, str, bool)) or x is None:
        return x
    if hasattr(x, "item"):
        return x.item()
    return repr(x)


# --------------------------------------------------------------------------------------------------------
# make_run
# --------------------------------------------------------------------------------------------------------


def _paths(root: Path, spec: FactorySpec) -> RunPaths:
    root = Path(root)
    return RunPaths(
        root=root,
        base_model=root / "base_model",
        checkpoint=root / "outputs" / "checkpoints" / f"step_{spec.steps}" / "trainer",
        orch_toml=root / "outputs" / "run_default" / "configs" / "orch.toml",
        broadcast_dir=root / "outputs" / "run_default" / "broadcasts" / f"step_{spec.steps}",
        truth=root / "truth.safetensors",
    )


def _find_genuine_tiny() -> Path | None:
    # tests/factory/factory.py -> repo root is parents[2]; the repository carries the fixture.
    c = Path(__file__).resolve().parents[2] / _GENUINE_TINY_REL
    return c if (c / "base_model").is_dir() else None


def qwen3_config(spec: FactorySpec):
    """The ``Qwen3Config`` of the spec's shapes (the base model's config.json)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings, rms_norm_eps=spec.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta},
        tie_word_embeddings=spec.tie_word_embeddings, max_window_layers=spec.num_layers,
        bos_token_id=spec.bos_token_id, eos_token_id=spec.eos_token_id,
        architectures=["Qwen3ForCausalLM"],
    )


def write_base_model(path: Path, spec: FactorySpec) -> None:
    """A random-init bf16 ``Qwen3ForCausalLM`` saved with ``save_pretrained`` (safetensors)."""
    import torch
    from transformers import GenerationConfig, Qwen3ForCausalLM

    config = qwen3_config(spec)
    # HF's own init (normal_ on bf16 tensors, one module at a time) took 75 s for Qwen3-1.7B on 16 cores;
    # build on the meta device and fill the tensors ourselves: fp32 normal(0, initializer_range) cast to
    # bf16, norms = 1, one generator per tensor (deterministic whatever the thread count), in threads.
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    model.to(torch.bfloat16)
    model.to_empty(device="cpu")
    if config.tie_word_embeddings:  # to_empty gives each module its own new Parameter: tie again
        model.lm_head.weight = model.model.embed_tokens.weight
    _random_init_(model, spec.seed, config.initializer_range)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    model.config.dtype = torch.bfloat16
    path.mkdir(parents=True, exist_ok=True)
    kw: dict[str, Any] = {}
    if spec.base_max_shard_size is not None:
        kw["max_shard_size"] = spec.base_max_shard_size
    model.save_pretrained(str(path), **kw)
    del model
    _make_world_readable(path)

    genuine = _find_genuine_tiny()
    if genuine is not None and spec.vocab_size == 1000:
        for name in _TOKENIZER_FILES + ("generation_config.json",):
            src = genuine / "base_model" / name
            if src.exists():
                shutil.copyfile(src, path / name)
                os.chmod(path / name, 0o644)
    if not (path / "generation_config.json").exists():
        GenerationConfig(bos_token_id=spec.bos_token_id, eos_token_id=spec.eos_token_id).save_pretrained(str(path))


def _random_init_(model, seed: int, std: float) -> None:
    import torch
    from concurrent.futures import ThreadPoolExecutor

    named = list(model.named_parameters())  # tied weights appear once
    if model.config.tie_word_embeddings and model.lm_head.weight is not model.model.embed_tokens.weight:
        raise RuntimeError("tied embeddings are not tied in the meta-built base model")

    def fill(i_name_param) -> None:
        i, (name, p) = i_name_param
        with torch.no_grad():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                return
            g = torch.Generator().manual_seed(seed * 1_000_003 + i)
            flat = p.view(-1)
            block = 1 << 24  # bound the fp32 scratch to 64 MB per thread
            for start in range(0, flat.numel(), block):
                stop = min(flat.numel(), start + block)
                flat[start:stop].copy_(torch.empty(stop - start).normal_(0.0, std, generator=g))

    with ThreadPoolExecutor(max_workers=max(1, min(8, os.cpu_count() or 1))) as ex:
        list(ex.map(fill, enumerate(named)))


def _make_world_readable(path: Path) -> None:
    # safetensors writes through a 0600 temp file; the genuine fixture's files are world-readable.
    for f in [path] if path.is_file() else path.iterdir():
        if f.is_file():
            os.chmod(f, 0o644)


def _orch_toml(spec: FactorySpec, model_name: str) -> str:
    alpha = float(spec.lora_alpha_orch)
    return (
        "# written by tests.factory (mimics prime-rl's orchestrator config dump)\n"
        'output_dir = "outputs/run_default"\n'
        "max_async_level = 1\n"
        "seed = 42\n\n"
        "[model]\n"
        f"name = {json.dumps(model_name)}\n"
        "trust_remote_code = false\n\n"
        "[model.lora]\n"
        f'name = "r{spec.lora_rank}-a{alpha!r}"\n'
        f"alpha = {alpha!r}\n\n"
        "[optim]\n"
        f"lr = {float(spec.lr)!r}\n\n"
        "[weight_broadcast]\n"
        'type = "filesystem"\n'
    )


def _adapter_config(spec: FactorySpec, base_name: str) -> dict[str, Any]:
    # prime-rl's save_lora_config: r and lora_alpha from the *trainer* LoRAConfig (not what training used).
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_name,
        "r": spec.lora_rank,
        "lora_alpha": spec.adapter_config_alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(spec.targets),
        "modules_to_save": None,
    }


def make_run(out_dir: str | os.PathLike, spec: FactorySpec | None = None) -> RunPaths:
    """Write a whole prime-rl-like run tree under ``out_dir`` (created; must be empty or absent).

    Returns the paths. Raises ``FactoryError`` if a training child fails.
    """
    spec = spec or FactorySpec.tiny()
    root = Path(out_dir).resolve()
    if root.exists() and any(root.iterdir()):
        raise FileExistsError(f"{root} is not empty; make_run writes a fresh tree (pick a new directory)")
    root.mkdir(parents=True, exist_ok=True)
    paths = _paths(root, spec)
    t0 = time.perf_counter()

    _Zygote.prestart()  # its imports overlap with writing the base model
    write_base_model(paths.base_model, spec)
    t_base = time.perf_counter()

    run_distributed("tests.factory.factory:train_child", spec.world_size, (spec.to_dict(), str(root)))
    t_train = time.perf_counter()

    # Orchestrator config: the run was launched from `root` with model.name = "base_model", as in the
    # genuine fixture, so the name is relative to the run root.
    base_name = "base_model"
    paths.orch_toml.parent.mkdir(parents=True, exist_ok=True)
    paths.orch_toml.write_text(_orch_toml(spec, base_name))
    (paths.broadcast_dir / "adapter_config.json").write_text(json.dumps(_adapter_config(spec, base_name), indent=2))
    (paths.broadcast_dir / "STABLE").touch()

    child_info_path = root / ".truth_child.json"
    child_info = json.loads(child_info_path.read_text())
    child_info_path.unlink()
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(paths.checkpoint)).read_metadata()
    import torch

    truth_json = {
        "spec": spec.to_dict(),
        "scale": spec.scale,
        "scales": [spec.scale] * spec.num_slots,
        "adapter_config_alpha": spec.adapter_config_alpha,
        "lr": child_info["lr"],
        "step": spec.steps,
        "progress": child_info["progress"],
        "scheduler": child_info["scheduler"],
        "steps": child_info["steps"],
        "optimizer_param_order": child_info["optimizer_param_order"],
        "num_dcp_keys": len(md.state_dict_metadata),
        "num_truth_tensors": None,
        "torch": torch.__version__,
        "world_size": spec.world_size,
        "paths": {k: str(v.relative_to(root)) for k, v in dataclasses.asdict(paths).items() if k != "root"},
        "truth_names": {
            "lora.<module>.slot<i>.A|B": "full fp32 LoRA A [r,in] / B [out,r] of slot i after training",
            "optim.<param fqn>.exp_avg|exp_avg_sq|step": "full AdamW state (get_optimizer_state_dict)",
        },
        "seconds": {"base_model": round(t_base - t0, 2), "train_and_save": round(t_train - t_base, 2)},
    }
    from safetensors import safe_open

    with safe_open(str(paths.truth), "pt") as f:
        truth_json["num_truth_tensors"] = len(list(f.keys()))
    paths.truth_json.write_text(json.dumps(truth_json, indent=2))
    logger.info("wrote %s in %.1fs", root, time.perf_counter() - t0)
    return paths


# --------------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------------

_PRESETS = {"tiny": FactorySpec.tiny, "qwen3-1.7b": FactorySpec.qwen3_1_7b, "qwen3-8b": FactorySpec.qwen3_8b}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tests.factory",
        description="Write a prime-rl-layout LoRA run (base model, DCP checkpoint, orch.toml, broadcast, truth).",
        epilog="Example: python -m tests.factory demo-out/run --preset tiny --world-size 4",
    )
    p.add_argument("out", type=Path)
    p.add_argument("--preset", choices=sorted(_PRESETS), default="tiny")
    p.add_argument("--world-size", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--tied", action="store_true", help="tie word embeddings")
    p.add_argument("--scheduler", choices=SCHEDULERS)
    p.add_argument("--slots", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--rank", type=int, help="LoRA rank")
    p.add_argument("--orch-alpha", type=float, help="orchestrator LoRA alpha (sets the training scale)")
    p.add_argument("--trainer-alpha", type=float, help="alpha written into adapter_config.json")
    p.add_argument("--seed", type=int)
    p.add_argument("--base-max-shard-size", help="e.g. 200KB: write a sharded base model")
    a = p.parse_args(argv)
    overrides: dict[str, Any] = {}
    for attr, field in [
        ("world_size", "world_size"), ("layers", "num_layers"), ("scheduler", "scheduler"), ("slots", "num_slots"),
        ("steps", "steps"), ("rank", "lora_rank"), ("orch_alpha", "lora_alpha_orch"),
        ("trainer_alpha", "trainer_alpha"), ("seed", "seed"), ("base_max_shard_size", "base_max_shard_size"),
    ]:
        v = getattr(a, attr)
        if v is not None:
            overrides[field] = v
    if a.tied:
        overrides["tie_word_embeddings"] = True
    try:
        spec = _PRESETS[a.preset](**overrides)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        paths = make_run(a.out, spec)
    except (FactoryError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {paths.root} in {time.perf_counter() - t0:.1f}s")
    for k, v in dataclasses.asdict(paths).items():
        print(f"  {k:14s} {v}")
    return 0


if __name__ == "__main__":
    # Re-import under the package name so spawned children unpickle functions from
    # tests.factory.factory, not from __main__.
    from tests.factory.factory import main as _main

    sys.exit(_main())


# Public names of the factory's pieces for the tools that build runs of their own (bench/seed_scale.py)
run_paths = _paths
lora_module_class = _lora_module_class
orch_toml_text = _orch_toml
