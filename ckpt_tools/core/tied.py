"""Tied word embeddings: which tensors a `tie_word_embeddings` config makes one (pure).

A tied model's safetensors hold the input embedding once; FSDP's state dict (and so a prime-rl
checkpoint) lists the same parameter under both names. The name pairs are one table; each reader
of a config asks it the question it needs:

- `tie_flag(config)`: the config's own value (None when it does not say), what `ckpt merge` honours;
- `ties_by_default(config)`: transformers' reading (the flag, else `text_config`'s, else True), what a
  checkpoint's `lm_head.weight` is rebuilt from (`slim`, `rehydrate`);
- `tied_pair(config, names)`: the pair a model dir actually ties, for the merge plan;
- `tied_source(name, names, tied)`: the base tensor a checkpoint's tied alias is a copy of;
- `missing_aliases(config, names)`: aliases FSDP's state dict holds that the model dir omits.
"""

from __future__ import annotations

from collections.abc import Collection

__all__ = [
    "OUTPUT_EMBEDDING",
    "TIED_PAIRS",
    "missing_aliases",
    "tie_flag",
    "tied_pair",
    "tied_source",
    "ties_by_default",
]

OUTPUT_EMBEDDING = "lm_head.weight"
# (output embedding, input embedding), per architecture family.
TIED_PAIRS: tuple[tuple[str, str], ...] = (
    (OUTPUT_EMBEDDING, "model.embed_tokens.weight"),  # Llama, Qwen2/3, Mistral, Gemma, ...
    (OUTPUT_EMBEDDING, "transformer.wte.weight"),  # GPT-2 style
)


def tie_flag(config: dict | None):
    """The config's `tie_word_embeddings` as written (None when absent)."""
    return (config or {}).get("tie_word_embeddings")


def ties_by_default(config: dict | None) -> bool:
    """Whether transformers ties this config's embeddings: its flag, else its `text_config`'s, else
    PretrainedConfig's default (True). No config: not tied."""
    if not config:
        return False
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    text = config.get("text_config")
    if isinstance(text, dict) and "tie_word_embeddings" in text:
        return bool(text["tie_word_embeddings"])
    return True


def tied_pair(config: dict | None, names: Collection[str]) -> tuple[tuple[str, str] | None, object]:
    """(the tied pair present in this model or None, the config's tie_word_embeddings value): a pair
    whose input embedding is here is tied when the flag says so, or says nothing and the output
    embedding is absent."""
    flag = tie_flag(config)
    for out_name, in_name in TIED_PAIRS:
        if in_name in names:
            if flag is True or (flag is None and out_name not in names):
                return (out_name, in_name), flag
            return None, flag
    return None, flag


def tied_source(name: str, names: Collection[str], tied: bool) -> str | None:
    """The tensor of `names` that `name` is stored as: itself, or for the output embedding of a tied
    model (whose files omit it, under any prefix) the input embedding."""
    if name in names:
        return name
    if name.endswith(OUTPUT_EMBEDDING) and tied:
        prefix = name[: -len(OUTPUT_EMBEDDING)]
        for _out, in_name in TIED_PAIRS:
            for cand in (prefix + in_name, in_name):
                if cand in names:
                    return cand
    return None


def missing_aliases(config: dict | None, names: Collection[str]) -> dict[str, str]:
    """{alias: source} for a config whose flag ties the embeddings: the output embedding FSDP's state
    dict lists (a copy of the input embedding) when the model dir omits it."""
    if not tie_flag(config):
        return {}
    out = {}
    for alias, source in TIED_PAIRS:
        if alias not in names and alias not in out and source in names:
            out[alias] = source
    return out
