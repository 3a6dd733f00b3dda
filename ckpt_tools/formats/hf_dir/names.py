"""The file names of an HF model dir, and the rule for which of its files are weights."""

from __future__ import annotations

__all__ = ["CONFIG_NAME", "INDEX_NAME", "WEIGHTS_NAME", "WEIGHT_SUFFIXES", "is_weight_like"]

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
# Files that hold weights in some format. Never "non-weight" files to carry into a merged model:
# a stale pickle or an extra safetensors file next to new weights would be loaded by someone.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")


def is_weight_like(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES) or name.endswith(".index.json")
