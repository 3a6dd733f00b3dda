"""What an HF `config.json` says, read and checked: the config of a model dir, the shapes it implies,
whether it describes a given set of tensors, and the changes a derived model's config gets."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Literal, overload

from ...core.dtypes import config_dtype_code
from ...core.errors import FormatError, MissingFileError
from ...core.keys import HF_DECODER_LAYER, layer_of
from ...core.tied import TIED_PAIRS
from ...io.inputs import as_input, lexists, read_json
from .names import CONFIG_NAME

__all__ = [
    "SHAPE_RULES",
    "config_dims",
    "config_mismatches",
    "dtype_disagreement",
    "load_config",
    "output_config_changes",
    "rewrite_config",
    "shape_problems",
]


@overload
def load_config(d: Path, *, required: Literal[True], hint: str | None = None) -> tuple[dict, str]: ...
@overload
def load_config(d: Path, *, required: bool, hint: str | None = None) -> tuple[dict | None, str | None]: ...
def load_config(d: Path, *, required: bool, hint: str | None = None) -> tuple[dict | None, str | None]:
    """(config.json of dir `d`, its path), (None, None) when absent and not `required`. lexists, not
    is_file: a config that is a FIFO or a symlink out of the dir is refused by name when read."""
    p = as_input(d) / CONFIG_NAME
    if not lexists(p):
        if required:
            raise MissingFileError("no config.json here", path=d, hint=hint)
        return None, None
    cfg = read_json(p, root=d, what=CONFIG_NAME)
    if not isinstance(cfg, dict):
        raise FormatError("config.json is not a JSON object", path=p)
    return cfg, str(p)


# Expected shapes of common decoder weights (Llama / Qwen / Mistral naming) from config.json. A dim
# the config does not state makes the rule not apply.
SHAPE_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (r"model\.embed_tokens\.weight", ("vocab_size", "hidden_size")),
    (r"lm_head\.weight", ("vocab_size", "hidden_size")),
    (r"model\.norm\.weight", ("hidden_size",)),
    (r"model\.layers\.\d+\.(input|post_attention)_layernorm\.weight", ("hidden_size",)),
    (r"model\.layers\.\d+\.self_attn\.q_proj\.weight", ("q_dim", "hidden_size")),
    (r"model\.layers\.\d+\.self_attn\.[kv]_proj\.weight", ("kv_dim", "hidden_size")),
    (r"model\.layers\.\d+\.self_attn\.o_proj\.weight", ("hidden_size", "q_dim")),
    (r"model\.layers\.\d+\.self_attn\.[qk]_norm\.weight", ("head_dim",)),
    (r"model\.layers\.\d+\.mlp\.(gate|up)_proj\.weight", ("intermediate_size", "hidden_size")),
    (r"model\.layers\.\d+\.mlp\.down_proj\.weight", ("hidden_size", "intermediate_size")),
)


def config_dims(cfg: dict) -> dict[str, int]:
    c = cfg if "hidden_size" in cfg else (cfg.get("text_config") or {})

    def num(name):
        v = c.get(name)
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    dims = {k: num(k) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")}
    heads, kv = num("num_attention_heads"), num("num_key_value_heads") or num("num_attention_heads")
    head_dim = num("head_dim") or (
        dims["hidden_size"] // heads
        if heads and dims["hidden_size"] and dims["hidden_size"] % heads == 0
        else None
    )
    dims["head_dim"] = head_dim
    dims["q_dim"] = heads * head_dim if heads and head_dim else None
    dims["kv_dim"] = kv * head_dim if kv and head_dim else None
    return {k: v for k, v in dims.items() if v is not None}


def shape_problems(config: dict, shapes: Mapping[str, tuple]) -> Iterator[tuple[str, str]]:
    """(tensor name, problem) for every tensor whose layer index or shape the config contradicts."""
    dims = config_dims(config)
    layers = dims.get("num_hidden_layers")
    for name in sorted(shapes):
        shape = tuple(shapes[name])
        m = HF_DECODER_LAYER.match(name)
        if m and layers is not None and int(m.group(1)) >= layers:
            yield name, f"layer {m.group(1)} but config.json says num_hidden_layers={layers}"
        for pattern, want in SHAPE_RULES:
            if re.fullmatch(pattern, name):
                if all(w in dims for w in want):
                    expected = tuple(dims[w] for w in want)
                    if shape != expected:
                        yield (
                            name,
                            (
                                f"shape {list(shape)} but config.json implies {list(expected)} "
                                f"({' x '.join(want)})"
                            ),
                        )
                break


def dtype_disagreement(config: dict, codes) -> str | None:
    """A warning when config.json's dtype is not the weights' float dtype (safetensors `codes`)."""
    cfg_dtype = config.get("dtype") or config.get("torch_dtype")
    code = config_dtype_code(cfg_dtype)
    floats = sorted({c for c in codes if c.startswith(("F", "BF"))})
    if code and floats and code not in floats:
        return (
            f"config.json says dtype {cfg_dtype} but the weights are {'/'.join(floats)}; a loader using "
            "dtype='auto' converts them"
        )
    return None


def config_mismatches(config: dict, shapes: Mapping[str, tuple]) -> list[str]:
    """Where `config` does not describe a model with these tensors (vocab and hidden size from the
    input embedding, the layer count): a config of another model gives a directory transformers loads
    wrongly or not at all."""
    problems = []
    for _out_name, in_name in TIED_PAIRS:
        emb = shapes.get(in_name)
        if emb is None or len(emb) != 2:
            continue
        if "vocab_size" in config and config["vocab_size"] != emb[0]:
            problems.append(f"vocab_size {config['vocab_size']} but {in_name} has {emb[0]} rows")
        if "hidden_size" in config and config["hidden_size"] != emb[1]:
            problems.append(f"hidden_size {config['hidden_size']} but {in_name} has {emb[1]} columns")
        break
    layers = {n for n in map(layer_of, shapes) if n is not None}
    if layers and "num_hidden_layers" in config and config["num_hidden_layers"] != max(layers) + 1:
        problems.append(
            f"num_hidden_layers {config['num_hidden_layers']} but the checkpoint has {max(layers) + 1} layers"
        )
    return problems


def output_config_changes(
    config: dict, out_dtype: str, tie_out, *, quantization: dict | None = None
) -> list[tuple[str, object, object]]:
    """(field, old, new) for a derived model's config: its dtype, untied embeddings when they diverge, and its
    `quantization_config`: `quantization` (an FP8 output's), or removed (new None) when the base had one
    and the output is not quantized. transformers >= 4.56 writes "dtype", older versions "torch_dtype":
    whichever is
    there is kept."""
    changes: list[tuple[str, object, object]] = []
    if config.get("quantization_config") != quantization:
        changes.append(("quantization_config", config.get("quantization_config"), quantization))
    fields = [f for f in ("dtype", "torch_dtype") if f in config] or ["dtype"]
    for f in fields:
        if config.get(f) != out_dtype:
            changes.append((f, config.get(f), out_dtype))
    if tie_out is False and config.get("tie_word_embeddings") is not False:
        changes.append(("tie_word_embeddings", config.get("tie_word_embeddings"), False))
    return changes


def rewrite_config(config: dict, changes) -> str:
    """config.json text with `changes` applied (transformers' layout: indent 2, a newline); a change to None
    removes the field."""
    new = dict(config)
    for f, _old, value in changes:
        if value is None:  # removed (a quantization_config the output does not have)
            new.pop(f, None)
        else:
            new[f] = value
    return json.dumps(new, indent=2, ensure_ascii=False) + "\n"
