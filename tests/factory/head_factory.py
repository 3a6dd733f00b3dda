"""Write prime-rl HEAD-style runs (Aug 2026, 559b447) for real: dense LoRA, MoE LoRA with EP, full fine-tune.

``make_head_run(out_dir, HeadSpec(...)) -> HeadRunPaths`` builds the tree a run of today's prime-rl leaves,
launched from ``out_dir`` with ``model.name = "base_model"``::

    base_model/                         HF Qwen3ForCausalLM / Qwen3MoeForCausalLM (bf16, save_pretrained)
    configs/trainer.json                prime-rl's resolved TrainerConfig dump (model.lora rank/alpha/targets)
    conversion/prime/model.safetensors  MoE only: the HF -> prime conversion of the first load
                                        (<base_model>/prime/ when spec.conversion_dir is None)
    outputs/checkpoints/step_<N>/trainer/   DCP (.metadata + __<rank>_0.distcp): interval steps, then the last
    outputs/broadcasts/step_<N>/        LoRA: adapter_model.safetensors + adapter_config.json + STABLE;
                                        full FT: model[-0000k-of-0000n].safetensors (+ index) + STABLE;
                                        step_0 is the startup broadcast; retention as prime-rl's maybe_clean
    outputs/metrics.jsonl               the per-step optim/lr and optim/grad_norm lines
    reference.safetensors               ground truth, the genuine fixtures' naming (see head_truth)
    expected_merged_hf/ | expected_trained_hf/   the base dir with the merged / trained bf16 weights
    run_info.json                       spec, parallel layout, facts of every save and step

The checkpoints come from ``spec.world_size`` gloo processes running FSDP2 (and expert parallelism) and
torch's ``dcp.save`` (``head_train``); at the genuine fixtures' settings (``HeadSpec.e_dense()``,
``f_moe()``, ``g_fullft()``; ``e_mts()`` adds ``modules_to_save``, ``g_fullft_tied()`` ties) their ``.metadata`` equal the genuine E, F and G checkpoints' in keys, dtypes,
shapes, chunks, the rank file of every chunk and the byte items. Nothing here is used by the toolkit at
runtime; it makes test and benchmark inputs.

CLI: ``python -m tests.factory.head_factory OUT --kind moe --world-size 3 --experts 8 --ep 1``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from tests.factory.factory import FactoryError, run_distributed
from tests.factory.head_files import trainer_config, write_base_model, write_json, write_prime_conversion
from tests.factory.head_spec import HeadRunPaths, HeadSpec, head_paths
from tests.factory.head_train import RAW_FACTS, RAW_TRUTH
from tests.factory.head_truth import write_truth

logger = logging.getLogger(__name__)

__all__ = ["HeadSpec", "HeadRunPaths", "FactoryError", "make_head_run", "main"]


def make_head_run(out_dir: str | os.PathLike, spec: HeadSpec | None = None) -> HeadRunPaths:
    """Write a whole HEAD-style run under ``out_dir`` (created; must be empty or absent).

    Raises ``FileExistsError`` for a non-empty ``out_dir`` and ``FactoryError`` (with the failing rank's
    traceback) when a training process fails.
    """
    spec = spec or HeadSpec.e_dense()
    root = Path(out_dir).resolve()
    if root.exists() and any(root.iterdir()):
        raise FileExistsError(f"{root} is not empty; make_head_run writes a fresh tree (pick a new directory)")
    root.mkdir(parents=True, exist_ok=True)
    paths = head_paths(root, spec)
    t0 = time.perf_counter()
    write_base_model(paths.base_model, spec)
    if paths.conversion is not None:
        write_prime_conversion(paths.base_model, paths.conversion, spec)
    write_json(paths.trainer_config, trainer_config(spec))
    t_base = time.perf_counter()
    run_distributed("tests.factory.head_train:train_child", spec.world_size, (spec.to_dict(), str(root)))
    t_train = time.perf_counter()
    seconds = {"base_model": round(t_base - t0, 2), "train_and_save": round(t_train - t_base, 2)}
    write_truth(paths, spec, root / RAW_TRUTH, root / RAW_FACTS, seconds)
    missing = [p for p in [*paths.checkpoints.values(), *paths.broadcasts.values()] if not p.is_dir()]
    if missing:
        raise FactoryError(f"the run is missing {[str(p) for p in missing]}: the trainer's layout changed")
    logger.info("wrote %s in %.1fs", root, time.perf_counter() - t0)
    return paths


# --------------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------------

_PRESETS = {
    "dense": HeadSpec.e_dense,
    "moe": HeadSpec.f_moe,
    "fullft": HeadSpec.g_fullft,
    "moe-fullft": lambda **kw: HeadSpec.f_moe(**{"lora": False, **kw}),
    "dense-mts": HeadSpec.e_mts,
    "fullft-tied": HeadSpec.g_fullft_tied,
}

# CLI flag -> HeadSpec field (value types come from argparse)
_FLAGS = {
    "world_size": "world_size", "layers": "num_layers", "experts": "num_experts", "top_k": "num_experts_per_tok",
    "hidden_size": "hidden_size", "intermediate_size": "intermediate_size",
    "moe_intermediate_size": "moe_intermediate_size", "vocab_size": "vocab_size", "rank": "lora_rank",
    "alpha": "lora_alpha", "max_steps": "max_steps", "lr": "lr", "scheduler": "scheduler",
    "warmup_steps": "warmup_steps", "decay_steps": "decay_steps", "min_lr": "min_lr", "seed": "seed",
    "base_max_shard_size": "base_max_shard_size",
}


def _optional_int(text: str) -> int | None:
    return None if text in ("auto", "none", "None") else int(text)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m tests.factory.head_factory",
        description="Write a prime-rl HEAD-style run (base model, trainer.json, DCP checkpoints, broadcasts, "
                    "ground truth) from real FSDP2 gloo processes.",
        epilog="Example: python -m tests.factory.head_factory runs/moe8 --kind moe --world-size 3 "
               "--experts 8 --ep 1 --tied",
    )
    p.add_argument("out", type=Path)
    p.add_argument("--kind", choices=sorted(_PRESETS), default="dense",
                   help="preset: dense = genuine E, moe = genuine F, fullft = genuine G, moe-fullft, "
                        "dense-mts = dense LoRA with modules_to_save lm_head,norm, fullft-tied = G tied")
    for flag in ("world_size", "layers", "experts", "top_k", "hidden_size", "intermediate_size",
                 "moe_intermediate_size", "vocab_size", "rank", "max_steps", "warmup_steps", "decay_steps", "seed"):
        p.add_argument("--" + flag.replace("_", "-"), type=int)
    for flag in ("alpha", "lr", "min_lr"):
        p.add_argument("--" + flag.replace("_", "-"), type=float)
    p.add_argument("--scheduler", choices=["constant", "linear", "cosine"])
    p.add_argument("--ep", type=_optional_int, default=argparse.SUPPRESS, help="expert-parallel degree, or 'auto' (1 = off)")
    p.add_argument("--ckpt-interval", type=_optional_int, default=argparse.SUPPRESS, help="steps between checkpoints, or 'none'")
    p.add_argument("--targets", help="comma-separated LoRA target names, e.g. q_proj,v_proj,experts")
    p.add_argument("--tied", action="store_true", help="tie word embeddings")
    p.add_argument("--modules-to-save", help="comma-separated lora.modules_to_save, e.g. lm_head,norm")
    p.add_argument("--base-max-shard-size", help="e.g. 200KB: write a sharded base model")
    return p


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    overrides: dict[str, Any] = {field: getattr(a, flag) for flag, field in _FLAGS.items() if getattr(a, flag) is not None}
    for field in ("ep", "ckpt_interval"):  # absent flags keep the preset's value; "auto"/"none" mean None
        if hasattr(a, field):
            overrides[field] = getattr(a, field)
    if a.targets is not None:
        overrides["targets"] = tuple(t for t in a.targets.split(",") if t)
    if a.modules_to_save is not None:
        overrides["modules_to_save"] = tuple(t for t in a.modules_to_save.split(",") if t)
    if a.tied:
        overrides["tie_word_embeddings"] = True
    try:
        spec = _PRESETS[a.kind](**overrides)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    try:
        paths = make_head_run(a.out, spec)
    except (FactoryError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {paths.root} ({spec.kind}, world {spec.world_size}, ep {spec.resolved_ep}) "
          f"in {time.perf_counter() - t0:.1f}s")
    for k, v in dataclasses.asdict(paths).items():
        if k != "root":
            print(f"  {k:15s} {json.dumps(v, default=str) if isinstance(v, dict) else v}")
    return 0


if __name__ == "__main__":
    # Re-import under the package name so spawned ranks unpickle from tests.factory, not __main__.
    from tests.factory.head_factory import main as _main

    sys.exit(_main())
