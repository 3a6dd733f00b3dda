"""Build the benchmark's inputs, one kind per call, each in its own process (the harness calls these).

    python bench/prep.py base    OUT  --size 0.6b --shard-bytes N   # bf16 HF base (transformers)
    python bench/prep.py adapter BASE OUT                             # PEFT adapter r=32, 7 projections
    python bench/prep.py run     ROOT --size 0.6b --shard-bytes N    # factory run: base + DCP (gloo FSDP2)

- base: the factory's `write_base_model` (random-init Qwen3 of the size's shapes, `save_pretrained`),
  sharded at --shard-bytes.
- adapter: written by PEFT's `save_pretrained` from a `get_peft_model` of the base's config, built on
  the meta device (no base weights are materialised, so an 8B adapter takes seconds) and given random
  A ~ N(0, 1/in) and B ~ N(0, 0.005^2): a merge changes most bf16 weights.
- run: `tests.factory.factory.make_run` (4 gloo FSDP2 ranks, one AdamW step, `dcp.save`), whose
  base_model is sharded the same way. It needs about 4x the fp32 model in RAM across the ranks.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from sizes import LORA_ALPHA, LORA_RANK, PROJECTIONS, SIZES, factory_spec_kwargs

REPO = Path(__file__).resolve().parents[1]


def _factory():
    """The fixture factory (tests/factory/, outside the installed package: import it from the checkout)."""
    sys.path.insert(0, str(REPO))
    from tests.factory import factory

    return factory


def _spec(size_name: str, shard_bytes: int | None, **extra):
    FactorySpec = _factory().FactorySpec

    kw = factory_spec_kwargs(SIZES[size_name])
    kw.update(base_max_shard_size=shard_bytes, **extra)
    if size_name != "tiny":
        kw["seq_len"] = 4  # the factory's big presets: a training step only has to touch every LoRA param
    return FactorySpec(**kw)


def write_base(out: Path, size_name: str, shard_bytes: int | None) -> None:
    _factory().write_base_model(out, _spec(size_name, shard_bytes))


def write_run(root: Path, size_name: str, shard_bytes: int | None) -> None:
    _factory().make_run(root, _spec(size_name, shard_bytes, steps=1, world_size=4))


def write_adapter(base: Path, out: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(base))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    cfg = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=list(PROJECTIONS), lora_dropout=0.0,
                     bias="none", task_type="CAUSAL_LM", base_model_name_or_path=str(base))
    peft_model = get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(0)
    state = {}
    for name, p in peft_model.named_parameters():
        if ".lora_A." in name:
            state[name] = torch.randn(tuple(p.shape), generator=g) / math.sqrt(p.shape[1])
        elif ".lora_B." in name:
            state[name] = torch.randn(tuple(p.shape), generator=g) * 0.005
    if not state:
        raise SystemExit(f"no LoRA parameters were created for {PROJECTIONS} in {base}")
    peft_model.save_pretrained(str(out), state_dict=state)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", choices=["base", "adapter", "run"])
    ap.add_argument("paths", nargs="+", type=Path)
    ap.add_argument("--size", choices=sorted(SIZES))
    ap.add_argument("--shard-bytes", type=int)
    a = ap.parse_args(argv)
    sys.path.insert(0, str(REPO))
    t0 = time.perf_counter()
    if a.kind == "base":
        write_base(a.paths[0], a.size, a.shard_bytes)
    elif a.kind == "run":
        write_run(a.paths[0], a.size, a.shard_bytes)
    else:
        write_adapter(a.paths[0], a.paths[1])
    print(json.dumps({"kind": a.kind, "seconds": round(time.perf_counter() - t0, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
