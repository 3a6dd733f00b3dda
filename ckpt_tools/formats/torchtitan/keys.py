"""torchtitan's key model (a table, pure): what every DCP key of its checkpoint is, and the HF name of each
model weight.

`CheckpointManager._flattened_model_states_sd` saves the model's state dict flat at the top level (keys of one
path element: the model's canonical FQNs, `ModelWrapper`), beside `optimizer`
(`OptimizersContainer.state_dict`:
`state.<fqn>.<field>` and `param_groups.<fqn>.<field>`, torchtitan/components/optimizer/utils.py
`get_flat_optim_state_dict`), `lr_scheduler` (`{"last_epoch"}`, `LRSchedulersContainer.state_dict`),
`train_state` (the trainer's `{step, ntokens_seen}`) and `dataloader`.

HF names follow each model's `StateDictAdapter.from_hf_map` (torchtitan/models/<model>/state_dict_adapter.py):
llama3 and qwen3 share the rows below (qwen3 adds q_norm / k_norm). Llama3's adapter also permutes the rows of
wq and wk (`Llama3StateDictAdapter.to_hf` -> `_permute`: torchtitan's ComplexRoPE pairs adjacent features,
HF's
rotate_half pairs the two halves of each head); qwen3's (CosSinRoPE, HF's layout) does not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ...core.errors import FormatError

__all__ = ["FAMILIES", "MODEL_RULES", "NOT_READ", "TitanKey", "classify", "family_of", "require_known"]

# (torchtitan FQN pattern, HF name template, permuted by heads: None | "q" | "kv")
MODEL_RULES: tuple[tuple[re.Pattern, str, str | None], ...] = (
    (re.compile(r"tok_embeddings\.weight"), "model.embed_tokens.weight", None),
    (
        re.compile(r"layers\.(\d+)\.attention\.qkv_linear\.wq\.weight"),
        "model.layers.{0}.self_attn.q_proj.weight",
        "q",
    ),
    (
        re.compile(r"layers\.(\d+)\.attention\.qkv_linear\.wk\.weight"),
        "model.layers.{0}.self_attn.k_proj.weight",
        "kv",
    ),
    (
        re.compile(r"layers\.(\d+)\.attention\.qkv_linear\.wv\.weight"),
        "model.layers.{0}.self_attn.v_proj.weight",
        None,
    ),
    (re.compile(r"layers\.(\d+)\.attention\.wo\.weight"), "model.layers.{0}.self_attn.o_proj.weight", None),
    (
        re.compile(r"layers\.(\d+)\.attention\.q_norm\.weight"),
        "model.layers.{0}.self_attn.q_norm.weight",
        None,
    ),
    (
        re.compile(r"layers\.(\d+)\.attention\.k_norm\.weight"),
        "model.layers.{0}.self_attn.k_norm.weight",
        None,
    ),
    (re.compile(r"layers\.(\d+)\.feed_forward\.w1\.weight"), "model.layers.{0}.mlp.gate_proj.weight", None),
    (re.compile(r"layers\.(\d+)\.feed_forward\.w3\.weight"), "model.layers.{0}.mlp.up_proj.weight", None),
    (re.compile(r"layers\.(\d+)\.feed_forward\.w2\.weight"), "model.layers.{0}.mlp.down_proj.weight", None),
    (re.compile(r"layers\.(\d+)\.attention_norm\.weight"), "model.layers.{0}.input_layernorm.weight", None),
    (
        re.compile(r"layers\.(\d+)\.ffn_norm\.weight"),
        "model.layers.{0}.post_attention_layernorm.weight",
        None,
    ),
    (re.compile(r"norm\.weight"), "model.norm.weight", None),
    (re.compile(r"lm_head\.weight"), "lm_head.weight", None),
)

# family -> (its marker FQN pattern, whether wq/wk are permuted to HF's layout)
FAMILIES = {"qwen3": (re.compile(r"layers\.\d+\.attention\.q_norm\.weight"), False), "llama3": (None, True)}
_TRAINING = {"optimizer", "lr_scheduler", "train_state", "dataloader"}

# Models and layers this tool does not read yet, refused by name (torchtitan 0.3.0's module names): (a model
# key's pattern, what it is, where torchtitan defines it). A tensor-parallel or HSDP layout is no such thing:
# DCP stores each tensor's global view (chunks by offset, whatever the mesh), which `formats.dcp` assembles.
NOT_READ: tuple[tuple[re.Pattern, str, str], ...] = (
    (
        re.compile(r"layers\.\d+\.moe\..+"),
        "a mixture-of-experts model",
        "qwen3 MoE, deepseek_v3, gpt_oss: torchtitan/models/common/moe.py's `layers.N.moe.router.gate`, "
        "`moe.routed_experts.inner_experts.w{1,2,3}_E..`, `moe.shared_experts`, `moe.expert_bias_E`",
    ),
    (
        re.compile(r"(.+\.)?lora_[ab]\.weight"),
        "torchtitan's LoRA",
        "torchtitan/components/lora.py: `<module>.lora_a.weight` / `lora_b.weight`",
    ),
)


@dataclass(frozen=True)
class TitanKey:
    key: str
    group: str  # model | optimizer_state | param_groups | scheduler | train_state | dataloader | other
    hf_name: str | None = None
    permute: str | None = None  # "q" | "kv": rows permuted by heads (llama3 only)
    param: str | None = None  # optimizer: the parameter FQN
    field: str | None = None


def _training(key: str, path: tuple) -> TitanKey | None:
    head = path[0]
    rest = ".".join(str(p) for p in path[1:])
    if head == "optimizer":
        for prefix, group in (("state.", "optimizer_state"), ("param_groups.", "param_groups")):
            if rest.startswith(prefix):
                param, _, field = rest[len(prefix) :].rpartition(".")
                return TitanKey(key, group, param=param, field=field) if param else None
        return None
    group = {"lr_scheduler": "scheduler", "train_state": "train_state", "dataloader": "dataloader"}[head]
    return TitanKey(key, group, field=rest or None)


def classify(key: str, path: tuple) -> TitanKey:
    path = tuple(path)
    if path and path[0] in _TRAINING and (len(path) > 1 or path[0] == "dataloader"):
        return _training(key, path) or TitanKey(key, "other")
    if len(path) == 1:
        for pattern, hf, permute in MODEL_RULES:
            m = pattern.fullmatch(key)
            if m:
                return TitanKey(key, "model", hf.format(*m.groups()), permute)
    return TitanKey(key, "other")


def _refuse_not_read(bad: list[str], path) -> None:
    """A FormatError naming the first model or layer of `NOT_READ` that holds one of the `bad` keys."""
    for pattern, what, where in NOT_READ:
        hits = [k for k in bad if pattern.fullmatch(k)]
        if hits:
            raise FormatError(
                f"{what}: not read yet ({len(hits)} keys, e.g. {hits[0]}; {where})",
                path=path,
                hint="ckpt-tools reads torchtitan's llama3 and qwen3 dense models (FSDP, HSDP, tensor "
                "parallel): please report the model you need",
            )


def require_known(infos, path) -> None:
    bad = sorted(i.key for i in infos if i.group == "other")
    if bad:
        _refuse_not_read(bad, path)
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise FormatError(
            f"{len(bad)} key(s) match no rule of torchtitan's key model (llama3 / qwen3 dense): {shown}",
            path=path,
            hint="this model or layout is not supported yet; `ckpt inspect --keys` lists the keys: "
            "please report it",
        )


def family_of(infos) -> tuple[str, bool]:
    """(model family, whether wq/wk rows are permuted for HF) from the model keys."""
    fqns = [i.key for i in infos if i.group == "model"]
    for name, (marker, permuted) in FAMILIES.items():
        if marker is None or any(marker.fullmatch(k) for k in fqns):
            return name, permuted
    raise AssertionError("the last family has no marker")
