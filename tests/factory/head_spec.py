"""What a prime-rl HEAD-style run is made of: the spec of a generated run and the paths of its files.

Pure data (no torch at import): the factory (``head_factory``), its model builder (``head_model``) and its
training child (``head_train``) all read the same ``HeadSpec``. Facts mirrored here come from
``shared/docs/primerl-head-format.md`` (prime-rl 559b447) and the genuine runs in
``tests/fixtures/primerl-head/`` (E dense LoRA, F MoE LoRA with EP, G full fine-tune).
"""

from __future__ import annotations

import dataclasses
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ARCHES = ("dense", "moe")
SCHEDULERS = ("constant", "linear", "cosine")
# prime-rl's optimizers the factory runs: AdamW (the default) and SignSGD (#3303: stateless, so its
# checkpoint holds no exp_avg / exp_avg_sq / step at all).
OPTIMIZERS = ("adamw", "sign_sgd")

# prime-rl's LoRAConfig.target_modules default (configs/trainer.py): what trainer.json says when a run
# does not name its targets. Only names that match a module of the model take effect.
PRIME_DEFAULT_TARGETS: tuple[str, ...] = (
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "experts",
    "fc1_latent_proj", "fc2_latent_proj",
)
ATTN_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
DENSE_MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
# The modules a target name can match, per architecture (prime-rl matches a name against any component
# of a module path; in its Qwen3-MoE the MLP is ``mlp.experts`` (GroupedExperts) + ``mlp.router.gate``).
ARCH_TARGETS = {"dense": ATTN_TARGETS + DENSE_MLP_TARGETS, "moe": ATTN_TARGETS + ("experts",)}

# Grouped expert LoRA -> HF per-expert projection (prime-rl's Qwen3-MoE conversion: w1=gate, w3=up, w2=down).
EXPERT_PROJ = {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def bf16_round(x: float) -> float:
    """``x`` rounded to bfloat16 (round to nearest even), as prime-rl stores its LoRA scale."""
    bits = struct.unpack("<I", struct.pack("<f", float(x)))[0]
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return struct.unpack("<f", struct.pack("<I", bits))[0]


@dataclass(frozen=True)
class HeadSpec:
    """Shapes, parallelism and training knobs of one generated HEAD-style run.

    Defaults are the genuine ``E_head_dense`` run; ``e_dense()``, ``f_moe()`` and ``g_fullft()`` give the
    three genuine runs' settings. ``ep=None`` is prime-rl's ``ep = "auto"`` (MoE: ``min(world_size, 8)``,
    dense: 1); ``ep=1`` turns expert parallelism off. ``ckpt_interval=None`` writes only the final
    checkpoint. ``targets=None`` writes prime-rl's default target list into trainer.json.
    """

    arch: str = "dense"
    lora: bool = True  # False: full fine-tune (every parameter trains, no adapter)
    world_size: int = 4
    ep: int | None = None
    # --- model shapes (Qwen3 / Qwen3-MoE) ---
    hidden_size: int = 64
    intermediate_size: int = 162  # dense MLP; 162 rows split 41/41/41/39 over 4 ranks
    moe_intermediate_size: int = 32
    num_experts: int = 4
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    vocab_size: int = 1000
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 512
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    bos_token_id: int = 997
    eos_token_id: int = 999
    # --- LoRA (trainer's model.lora; the training scale is bf16(alpha / rank)) ---
    lora_rank: int = 8
    lora_alpha: float = 16.0
    targets: tuple[str, ...] | None = ATTN_TARGETS + DENSE_MLP_TARGETS
    # lora.modules_to_save: params kept fully trainable by prime-rl's rule (``keep_trainable``), e.g.
    # ("lm_head", "norm") trains lm_head.weight and model.norm.weight (not q_norm / input_layernorm)
    modules_to_save: tuple[str, ...] = ()
    # --- training ---
    max_steps: int = 3
    ckpt_interval: int | None = 2
    lr: float = 1e-2
    optimizer: str = "adamw"  # "adamw" | "sign_sgd" (optim.type; both inside prime-rl's CPUOffloadOptimizer)
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    max_norm: float | None = 1.0
    scheduler: str = "linear"
    warmup_steps: int = 1
    decay_steps: int = 0  # linear only: a WSD decay over the last decay_steps of max_steps
    min_lr: float = 0.0
    seq_len: int = 32
    micro_batches: int = 2  # per rank per step: progress adds world*seq_len*micro_batches tokens per step
    seed: int = 0
    conversion_dir: str | None = None  # MoE: where prime-rl writes prime/model.safetensors (None: the base dir)
    base_max_shard_size: str | int | None = None  # e.g. "200KB": a sharded base model + index

    def __post_init__(self) -> None:
        object.__setattr__(self, "betas", tuple(self.betas))
        if self.targets is not None:
            object.__setattr__(self, "targets", tuple(self.targets))
        object.__setattr__(self, "modules_to_save", tuple(self.modules_to_save))
        problems = self._problems()
        if problems:
            raise ValueError("invalid HeadSpec: " + "; ".join(problems))

    def _problems(self) -> list[str]:
        p = []
        if self.arch not in ARCHES:
            p.append(f"arch={self.arch!r} must be one of {ARCHES}")
        if self.world_size < 1:
            p.append(f"world_size={self.world_size} must be >= 1")
        if self.ep is not None and self.ep < 1:
            p.append(f"ep={self.ep} must be >= 1 (or None for prime-rl's auto rule)")
        if self.arch == "dense" and self.ep not in (None, 1):
            p.append(f"ep={self.ep}: expert parallelism needs arch='moe'")
        if self.arch == "moe" and self.world_size >= 1 and (self.ep is None or self.ep >= 1):
            ep = self.resolved_ep
            if self.world_size % ep:
                p.append(f"ep={ep} must divide world_size={self.world_size} (prime-rl's ParallelDims rule)")
            if ep > 1 and self.num_experts % ep:
                p.append(
                    f"num_experts={self.num_experts} must be a multiple of ep={ep} (each EP rank holds an equal "
                    "block of experts); set ep explicitly, e.g. ep=1 for plain FSDP sharding of the experts"
                )
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                p.append(f"num_experts_per_tok={self.num_experts_per_tok} must be in 1..num_experts")
        if self.num_heads % self.num_kv_heads:
            p.append(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.lora:
            if self.lora_rank < 1:
                p.append(f"lora_rank={self.lora_rank} must be >= 1")
            if self.arch in ARCHES and not self.lora_modules_suffixes():
                p.append(f"targets={self.targets!r} match no module of a {self.arch} model "
                         f"(choose from {ARCH_TARGETS[self.arch]})")
        if self.modules_to_save and not self.lora:
            p.append("modules_to_save is a LoRA setting (a full fine-tune trains every parameter)")
        if self.max_steps < 1:
            p.append(f"max_steps={self.max_steps} must be >= 1 (prime-rl saves only after a step)")
        if self.ckpt_interval is not None and self.ckpt_interval < 1:
            p.append(f"ckpt_interval={self.ckpt_interval} must be >= 1 or None")
        if self.optimizer not in OPTIMIZERS:
            p.append(f"optimizer={self.optimizer!r} must be one of {OPTIMIZERS}")
        if self.scheduler not in SCHEDULERS:
            p.append(f"scheduler={self.scheduler!r} must be one of {SCHEDULERS}")
        if self.scheduler == "linear":
            if self.warmup_steps < 1 and self.decay_steps < 1:
                p.append("scheduler='linear' needs warmup_steps >= 1 or decay_steps >= 1")
            if self.decay_steps > 0 and self.max_steps - self.decay_steps < self.warmup_steps:
                p.append(f"warmup_steps ({self.warmup_steps}) + decay_steps ({self.decay_steps}) must not exceed "
                         f"max_steps ({self.max_steps})")
            if self.decay_steps == 1:
                # prime-rl builds LinearLR(total_iters=decay_steps - 1) = 0, which divides by zero at the
                # start of the decay (primerl-head-format.md, "Two HEAD behaviours").
                p.append("decay_steps=1 crashes prime-rl's WSD scheduler (LinearLR total_iters=0); use >= 2")
        if self.scheduler == "cosine" and self.warmup_steps >= self.max_steps:
            p.append("a cosine schedule needs warmup_steps < max_steps (T_max = max_steps - warmup_steps)")
        if self.seq_len < 2 or self.micro_batches < 1:
            p.append("seq_len must be >= 2 and micro_batches >= 1")
        return p

    # ---- presets: the genuine fixtures' settings ----
    @classmethod
    def e_dense(cls, **overrides: Any) -> HeadSpec:
        """``E_head_dense``: Qwen3, 3 layers, 4 ranks, LoRA r8 a16 on all 7 projections, interval 2."""
        return cls(**overrides)

    @classmethod
    def f_moe(cls, **overrides: Any) -> HeadSpec:
        """``F_head_moe``: Qwen3-MoE (4 experts, top 2), 2 ranks, ep auto (=2), LoRA r8 a32, cosine."""
        kw: dict[str, Any] = dict(
            arch="moe", world_size=2, intermediate_size=128, num_layers=2, lora_alpha=32.0, targets=None,
            ckpt_interval=None, scheduler="cosine", conversion_dir="conversion",
        )
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def g_fullft(cls, **overrides: Any) -> HeadSpec:
        """``G_head_fullft``: Qwen3, 2 layers, 2 ranks, full fine-tune, lr 1e-3, constant schedule."""
        kw: dict[str, Any] = dict(
            lora=False, world_size=2, intermediate_size=128, num_layers=2, targets=None, lr=1e-3,
            scheduler="constant", ckpt_interval=None,
        )
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def e_mts(cls, **overrides: Any) -> HeadSpec:
        """Dense LoRA with ``modules_to_save = ["lm_head", "norm"]`` (untied): lm_head and model.norm train."""
        kw: dict[str, Any] = dict(
            world_size=2, intermediate_size=128, num_layers=2, modules_to_save=("lm_head", "norm"),
            ckpt_interval=None,
        )
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def g_fullft_tied(cls, **overrides: Any) -> HeadSpec:
        """``G_head_fullft`` with tied embeddings: lm_head is the embedding Parameter (one optimizer state)."""
        return cls.g_fullft(**{"tie_word_embeddings": True, **overrides})

    # ---- derived facts ----
    @property
    def kind(self) -> str:
        """``dense`` / ``moe`` for LoRA runs, ``fullft`` / ``moe-fullft`` for full fine-tunes."""
        return {("dense", True): "dense", ("moe", True): "moe", ("dense", False): "fullft",
                ("moe", False): "moe-fullft"}[(self.arch, self.lora)]

    @property
    def resolved_ep(self) -> int:
        """prime-rl's ``resolve_ep``: auto is ``min(world_size, 8)`` for MoE models, 1 otherwise."""
        if self.ep is not None:
            return self.ep
        return min(self.world_size, 8) if self.arch == "moe" else 1

    @property
    def dp_shard_mod_ep(self) -> int:
        return self.world_size // self.resolved_ep

    @property
    def scale(self) -> float:
        """The training-time LoRA scale: bf16(trainer alpha / rank) (prime-rl's LoRAState)."""
        return bf16_round(self.lora_alpha / self.lora_rank)

    @property
    def config_targets(self) -> tuple[str, ...]:
        """The target list trainer.json records (prime-rl's default when the run names none)."""
        return self.targets if self.targets is not None else PRIME_DEFAULT_TARGETS

    def lora_modules_suffixes(self) -> tuple[str, ...]:
        """Target names that match a module of this architecture, in prime-rl's module order."""
        wanted = set(self.config_targets)
        return tuple(t for t in ARCH_TARGETS[self.arch] if t in wanted)

    def lora_modules(self) -> list[str]:
        """FQNs of the LoRA-wrapped modules in ``named_parameters`` order (the optimizer's order)."""
        if not self.lora:
            return []
        out = []
        for layer in range(self.num_layers):
            for t in self.lora_modules_suffixes():
                part = "self_attn" if t in ATTN_TARGETS else "mlp"
                out.append(f"model.layers.{layer}.{part}.{t}")
        return out

    def linear_shape(self, suffix: str) -> tuple[int, int]:
        """``(out_features, in_features)`` of a dense projection."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
                "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}[suffix]

    def expert_shape(self, w: str) -> tuple[int, int]:
        """``(out, in)`` of one expert's ``w1``/``w3`` (gate/up: hid -> inter) or ``w2`` (down: inter -> hid)."""
        h, i = self.hidden_size, self.moe_intermediate_size
        return (h, i) if w == "w2" else (i, h)

    def checkpoint_steps(self) -> list[int]:
        """Steps with a DCP checkpoint: every interval step before the last (progress lags), then the last."""
        steps = []
        if self.ckpt_interval:
            steps = [s for s in range(1, self.max_steps) if s % self.ckpt_interval == 0]
        return steps + [self.max_steps]

    def kept_broadcast_steps(self) -> list[int]:
        """Broadcast dirs left after prime-rl's retention (``maybe_clean``: drop step-2 unless on the interval)."""
        kept = {0}
        for step in range(1, self.max_steps + 1):
            kept.add(step)
            candidate = max(step - 2, 0)
            if not (self.ckpt_interval and candidate % self.ckpt_interval == 0):
                kept.discard(candidate)
        return sorted(kept)

    def tokens_per_step(self) -> int:
        return self.world_size * self.seq_len * self.micro_batches

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["betas"] = list(self.betas)
        d["targets"] = None if self.targets is None else list(self.targets)
        d["modules_to_save"] = list(self.modules_to_save)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HeadSpec:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown HeadSpec fields {unknown}")
        return cls(**d)


def _has_regex_metacharacters(pattern: str) -> bool:
    return any(c in pattern for c in ".*+?^$[]{}|()\\")


def matches_pattern(name: str, pattern: str) -> bool:
    """prime-rl's ``trainer/lora.py: _matches_pattern`` (559b447), verbatim in effect.

    A simple name (no regex metacharacter) matches a whole dot-component of ``name`` ("norm" matches
    ``model.norm.weight``, not ``q_norm`` or ``input_layernorm``); a regex is ``re.search``-ed anywhere.
    """
    if _has_regex_metacharacters(pattern):
        return re.search(pattern, name) is not None
    return pattern in name.split(".")


def keep_trainable(param_name: str, patterns: tuple[str, ...] | list[str]) -> bool:
    """prime-rl's ``_should_keep_trainable``: the parameter name, then its module name, against each pattern."""
    if any(matches_pattern(param_name, p) for p in patterns):
        return True
    module_name = param_name.rsplit(".", 1)[0] if "." in param_name else param_name
    return any(matches_pattern(module_name, p) for p in patterns)


def lr_factor_floor(spec: HeadSpec) -> float:
    """prime-rl's warmup start factor: ``min_lr / lr`` or 1e-8 when min_lr is 0."""
    return spec.min_lr / spec.lr if spec.min_lr > 0 else 1e-8


@dataclass(frozen=True)
class HeadRunPaths:
    """Where ``make_head_run`` put things (all under ``root``; the run was "launched" from ``root``)."""

    root: Path
    base_model: Path
    trainer_config: Path  # configs/trainer.json (prime-rl's dump_resolved_config format)
    checkpoints: dict[int, Path]  # step -> outputs/checkpoints/step_<N>/trainer
    broadcasts: dict[int, Path]  # step -> outputs/broadcasts/step_<N> (after retention)
    reference: Path  # reference.safetensors (genuine fixtures' naming; metadata "info")
    expected_hf: Path  # expected_merged_hf/ (LoRA) or expected_trained_hf/ (full FT)
    conversion: Path | None  # MoE: <conversion_dir or base_model>/prime/model.safetensors

    @property
    def checkpoint(self) -> Path:
        """The final checkpoint's trainer dir."""
        return self.checkpoints[max(self.checkpoints)]

    @property
    def broadcast(self) -> Path:
        """The final step's broadcast dir."""
        return self.broadcasts[max(self.broadcasts)]

    @property
    def run_info(self) -> Path:
        return self.root / "run_info.json"


def head_paths(root: Path, spec: HeadSpec) -> HeadRunPaths:
    root = Path(root)
    conv = None
    if spec.arch == "moe":
        conv = (root / spec.conversion_dir if spec.conversion_dir else root / "base_model") / "prime" / "model.safetensors"
    return HeadRunPaths(
        root=root,
        base_model=root / "base_model",
        trainer_config=root / "configs" / "trainer.json",
        checkpoints={s: root / "outputs" / "checkpoints" / f"step_{s}" / "trainer" for s in spec.checkpoint_steps()},
        broadcasts={s: root / "outputs" / "broadcasts" / f"step_{s}" for s in spec.kept_broadcast_steps()},
        reference=root / "reference.safetensors",
        expected_hf=root / ("expected_merged_hf" if spec.lora else "expected_trained_hf"),
        conversion=conv,
    )
