"""Model sizes the benchmark runs at, and the bytes each input kind takes at a size (pure: no torch).

The byte formulas serve two ends: the disk check before each step, and the 32B projection, which
scales measured per-byte costs to the sizes these formulas give for Qwen3-32B. `report.py` prints the
formula next to the measured size for every size that was run, so a wrong formula shows.
"""
from __future__ import annotations

from dataclasses import dataclass

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_RANK = 32
LORA_ALPHA = 64.0  # scale 2, as in the seed run (r=32, alpha=64)


@dataclass(frozen=True)
class ModelSize:
    """Qwen3-style decoder shapes. `name` is what `--sizes` takes."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool

    # ---- parameter counts ----
    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(out_features, in_features) of each LoRA-targeted projection of one layer."""
        h, i = self.hidden_size, self.intermediate_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
                "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def params(self) -> int:
        """Distinct parameters of the HF model (a tied lm_head counted once)."""
        per_layer = sum(o * i for o, i in self.projection_shapes().values())
        per_layer += 2 * self.hidden_size + 2 * self.head_dim  # 2 layer norms, q_norm, k_norm
        head = 0 if self.tie_word_embeddings else self.embedding_params
        return self.embedding_params + head + self.num_layers * per_layer + self.hidden_size

    @property
    def lora_params(self) -> int:
        return self.lora_params_of_rank(LORA_RANK)

    def lora_params_of_rank(self, rank: int) -> int:
        """A/B parameters of a LoRA of this rank on all 7 projections of every layer."""
        return self.num_layers * sum(rank * (o + i) for o, i in self.projection_shapes().values())

    # ---- bytes of each input kind (tensor data; headers and configs are < 0.1% at 0.6B and up) ----
    @property
    def base_bytes(self) -> int:
        """The bf16 HF base (and a merged model of it)."""
        return 2 * self.params

    @property
    def adapter_bytes(self) -> int:
        """The PEFT adapter, fp32 (PEFT's default)."""
        return 4 * self.lora_params

    @property
    def dcp_bytes(self) -> int:
        """A prime-rl LoRA checkpoint: fp32 masters of the base (a tied embedding is stored twice, as
        embed_tokens and lm_head), the LoRA and its two AdamW moments."""
        base = self.params + (self.embedding_params if self.tie_word_embeddings else 0)
        return 4 * base + 3 * 4 * self.lora_params

    @property
    def slim_bytes(self) -> int:
        """A slim checkpoint: the LoRA and its AdamW moments."""
        return 3 * 4 * self.lora_params

    def bytes_of(self, kind: str) -> int:
        return {"base": self.base_bytes, "merged": self.base_bytes, "adapter": self.adapter_bytes,
                "dcp": self.dcp_bytes, "slim": self.slim_bytes}[kind]


# Shapes from each model's config.json on the hub (tiny is the factory's CI config).
SIZES: dict[str, ModelSize] = {s.name: s for s in [
    ModelSize("tiny", 64, 162, 2, 4, 2, 16, 1000, False),
    ModelSize("0.6b", 1024, 3072, 28, 16, 8, 128, 151936, True),
    ModelSize("1.7b", 2048, 6144, 28, 16, 8, 128, 151936, True),
    ModelSize("8b", 4096, 12288, 36, 32, 8, 128, 151936, False),
    ModelSize("14b", 5120, 17408, 40, 40, 8, 128, 151936, False),
    ModelSize("32b", 5120, 25600, 64, 64, 8, 128, 151936, False),
]}
PROJECTION_TARGET = "32b"


def factory_spec_kwargs(size: ModelSize) -> dict:
    """Keyword arguments of `tests.factory.factory.FactorySpec` for this size."""
    return dict(hidden_size=size.hidden_size, intermediate_size=size.intermediate_size,
                num_layers=size.num_layers, num_heads=size.num_heads, num_kv_heads=size.num_kv_heads,
                head_dim=size.head_dim, vocab_size=size.vocab_size, tie_word_embeddings=size.tie_word_embeddings,
                lora_rank=LORA_RANK, lora_alpha_orch=LORA_ALPHA,
                max_position_embeddings=512 if size.name == "tiny" else 40960,
                bos_token_id=997 if size.name == "tiny" else 151643,
                eos_token_id=999 if size.name == "tiny" else 151645)


def parse_sizes(text: str) -> list[ModelSize]:
    names = [s.strip().lower() for s in text.split(",") if s.strip()]
    unknown = [n for n in names if n not in SIZES or n == PROJECTION_TARGET]
    if unknown:
        runnable = [n for n in SIZES if n != PROJECTION_TARGET]
        raise ValueError(f"unknown size(s) {unknown}: choose from {runnable} "
                         f"({PROJECTION_TARGET} is projected, not run)")
    return [SIZES[n] for n in names]
