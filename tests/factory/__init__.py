"""The fixture factory (test tooling, outside the runtime package): real prime-rl-layout checkpoints
written by FSDP2 + DCP on CPU (gloo), for tests, the demo and the benchmarks.

- ``factory.make_run(out_dir, FactorySpec(...)) -> RunPaths``: base model, DCP checkpoint, orch.toml,
  adapter broadcast and ground truth.
- ``fsdp_check.load_strict(ckpt_dir, base_model_dir, spec, world_size=4)``: load a checkpoint the way
  prime-rl resumes (FSDP2, default strict planner) and return the restored full state.

Names are resolved lazily so that ``python -m tests.factory.factory`` does not import the module twice
(and importing the package stays cheap). ``python -m tests.factory OUT`` runs the factory's CLI.
"""

from __future__ import annotations

from typing import Any

__all__ = ["FactoryError", "FactorySpec", "RunPaths", "make_run", "load_strict", "StrictLoadError"]

_WHERE = {
    "FactoryError": "factory",
    "FactorySpec": "factory",
    "RunPaths": "factory",
    "make_run": "factory",
    "load_strict": "fsdp_check",
    "StrictLoadError": "fsdp_check",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
