"""Merges that would succeed and be wrong, refused before (or, atomically, instead of) writing.

A merged model that equals its base, or a LoRA merged into another model of the same shapes, is
the silent failure ckpt-tools exists to catch. `plan_merge` and `run_merge` call these:

- `check_target_modules`: a PEFT adapter whose `target_modules` does not select every LoRA module
  in its weights: PEFT and vLLM would create no layer for those weights and apply nothing of them;
- `check_masters_match_base`: a DCP checkpoint carries the fp32 master of every frozen base weight
  (an exact upcast of the bf16 base it trained on); a few rows of a few of them must equal the
  base's, or the base is another model or revision (names and shapes agree across finetunes);
- `default_out_dtype`: the output dtype when `--dtype` is not given, said with its reason: an fp16
  base stays fp16 (never silently bf16); bf16 otherwise (prime-rl's fp32 masters, bf16 bases);
- `ZeroDelta`: counts merged tensors that round back to their base values; when every one does
  (alpha tiny, lora_B all zero, ...) the merge is refused before OUT appears, unless the caller
  passed `allow_zero_delta` (`--allow-zero-delta`) for a legitimately zero update.
"""

from __future__ import annotations

import threading

import torch

from ...core.errors import FormatError
from ...formats.handle import Source
from ...formats.peft.adapter import PeftAdapter
from ...formats.peft.config import matches_target_modules
from ...formats.primerl.optimizers import trained_params
from .facts import AdapterFacts, BaseFacts

__all__ = [
    "MASTER_MISMATCH_FRACTION",
    "MASTER_SAMPLE_ROW_ELEMS",
    "MASTER_SAMPLE_TENSORS",
    "ZeroDelta",
    "check_masters_match_base",
    "check_target_modules",
    "default_out_dtype",
]

MASTER_SAMPLE_TENSORS = 4  # 2-D frozen weights spread over the model
MASTER_SAMPLE_ROW_ELEMS = 1 << 16  # first and last row of each, at most this many elements each
MASTER_MISMATCH_FRACTION = 0.01  # bf16-rounded values may differ in at most 1% of the sample


def check_target_modules(adapter: PeftAdapter) -> None:
    """Refuse an adapter whose config's target_modules leaves any LoRA module of its weights
    unselected (PEFT's rule, `formats.peft.config.matches_target_modules`). A fused expert LoRA's
    projections are selected by target_parameters instead (`formats.peft.experts`)."""
    targets = adapter.config.target_modules
    if targets is None or not adapter.modules:
        return
    unmatched = sorted(
        m
        for m, spec in adapter.modules.items()
        if spec.view is None and matches_target_modules(m, targets) is False
    )
    if not unmatched:
        return
    n = len(adapter.modules)
    what = (
        f"matches none of the adapter's {n} LoRA modules"
        if len(unmatched) == n
        else f"does not match {len(unmatched)} of its {n} LoRA modules ({', '.join(unmatched[:4])}"
        + (", ..." if len(unmatched) > 4 else "")
        + ")"
    )
    raise FormatError(
        f"target_modules {targets!r} {what}: PEFT and vLLM create no LoRA layer for those weights "
        "and apply nothing of them, so merging them would ship a model no loader of this adapter "
        "produces",
        path=adapter.config.path,
        hint="fix target_modules in adapter_config.json (`ckpt verify` lists the modules)",
    )


def _sample_names(dcp, hf, trained: set[str]) -> list[str]:
    names = sorted(
        n
        for n in dcp.names()
        if n in hf
        and n not in trained
        and len(dcp.facts(n).shape) == 2
        and tuple(hf.facts(n).shape) == tuple(dcp.facts(n).shape)
        and dcp.facts(n).numel
    )
    if len(names) <= MASTER_SAMPLE_TENSORS:
        return names
    step = (len(names) - 1) / (MASTER_SAMPLE_TENSORS - 1)
    return sorted({names[round(i * step)] for i in range(MASTER_SAMPLE_TENSORS)})


def check_masters_match_base(hf: Source, ckpt) -> dict:
    """Compare the first and last row of a few of the checkpoint's frozen fp32 masters with the HF
    base's, both rounded to bf16 (so an fp16 or fp32 export of the same weights agrees). Raises a
    FormatError naming the first tensor that disagrees in more than MASTER_MISMATCH_FRACTION of its
    sample. Cheap: a few KB read from each side. Returns what was compared (for the plan)."""
    base_path = hf.path
    dcp = ckpt.base_weights()
    try:
        names = _sample_names(dcp, hf, trained_params(ckpt))
        compared = 0
        for name in names:
            rows, cols = dcp.facts(name).shape
            n = min(cols, MASTER_SAMPLE_ROW_ELEMS)
            diff = total = 0
            for r in sorted({0, rows - 1}):
                m = dcp.read_elems(name, r * cols, n).to(torch.bfloat16)
                b = hf.read_elems(name, r * cols, n).to(torch.bfloat16)
                diff += int((m != b).sum())
                total += n
            compared += total
            if diff > MASTER_MISMATCH_FRACTION * total:
                raise FormatError(
                    f"this is not the base the checkpoint trained on: its fp32 master of {name} differs from "
                    f"the base's in {diff} of {total} sampled values ({100 * diff / total:.0f}%; rows 0 and "
                    f"{rows - 1}, rounded to bf16); merging would pair the LoRA with another model of the "
                    f"same "
                    "shapes",
                    path=base_path,
                    key=name,
                    hint="merge into the base the run trained on (prime-rl's [model] name), or use "
                    "--base-from-checkpoint to merge into the checkpoint's own masters",
                )
        return {"tensors": names, "values": compared}
    finally:
        dcp.close()


def default_out_dtype(base: BaseFacts, adapter: AdapterFacts) -> tuple[str, str]:
    """(dtype name, why) for a merge without --dtype: fp16 when every base weight the LoRA targets is
    fp16 (it stays fp16), bf16 otherwise."""
    by_name = {t.name: t for t in base.tensors}
    targets = [
        by_name[m.module + ".weight"].dtype for m in adapter.modules if m.module + ".weight" in by_name
    ]
    if targets and all(d == "float16" for d in targets):
        return "float16", "the base's weights are fp16, so the output stays fp16; --dtype changes it"
    if base.kind == "dcp":
        return "bfloat16", "from the checkpoint's fp32 masters, as prime-rl exports; --dtype changes it"
    if (base.config or {}).get("quantization_config") is not None:
        return (
            "bfloat16",
            "a block-FP8 base, dequantized exactly, written bf16; --dtype fp8 quantizes it again",
        )
    return "bfloat16", "the default; --dtype changes it"


class ZeroDelta:
    """Thread-safe tally of merged tensors that came out equal to their base (worker threads add)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.merged = 0
        self.unchanged = 0
        self.zero_factor = 0  # of those, how many had an all-zero lora_A or lora_B

    def add(self, unchanged: bool, zero_factor: bool) -> None:
        with self._lock:
            self.merged += 1
            self.unchanged += bool(unchanged)
            self.zero_factor += bool(unchanged and zero_factor)

    def check(self, plan) -> None:
        """Raise when every merged tensor equals its base (and the plan does not allow it)."""
        if self.merged == 0 or self.unchanged < self.merged or getattr(plan, "allow_zero_delta", False):
            return
        a = plan.adapter or {}
        why = (
            f"{self.zero_factor} of them have an all-zero lora_A or lora_B"
            if self.zero_factor
            else f"scale {a.get('scale')} (alpha {a.get('alpha')} from {a.get('alpha_source')}) is too small "
            f"to "
            f"change any {plan.out_dtype} value"
        )
        raise FormatError(
            f"the merge would write a model equal to its base: all {self.merged} merged weights round "
            f"back to the base's values ({why}); nothing was written",
            path=plan.adapter_path,
            hint="check that this is the trained adapter and its alpha; pass --allow-zero-delta if a "
            "zero update is really what you mean",
        )
