"""`ckpt fix-adapter`: repair prime-rl's adapter exports into PEFT adapter dirs that really apply.

prime-rl writes two adapter exports that PEFT "loads" without an error and then applies nothing
(every LoRA key is reported missing, B stays zero, logits equal the base; format §5):

- the filesystem broadcast (`outputs/<run>/broadcasts/step_N/adapter_model.safetensors`) has keys
  without the `base_model.model.` prefix: `model.layers.0.mlp.up_proj.lora_A.weight`;
- the weight export (`outputs/weights/step_N/lora_adapters/adapter_model.bin`, a torch pickle)
  keeps the adapter slot: `base_model.model.model.layers.0.mlp.up_proj.lora_A.0.weight`.

The repair is a key rename (values untouched, same dtype) into safetensors -- never a pickle --
with keys sorted, plus an adapter_config.json whose lora_alpha is the training alpha (prime-rl's
exports carry the *trainer's* alpha, training used the orchestrator's: format §6.1), and
`modules_to_save` made true, under exact module names (PEFT matches entries as name suffixes): listed but
absent tensors are filled from `--checkpoint` (prime-rl HEAD trains them and its broadcast lists them
without their tensors: they are found in the checkpoint by their optimizer state), refused without it for a
HEAD run, dropped with a warning otherwise (16e747c never updates them, §6.3); present ones are dropped
when they equal the base, kept otherwise. Against the base model, every LoRA module must match a
base weight of the right shape (zero matches is an error).

Every adapter layout is read (`core.keys.LAYOUTS`: per-expert MoE modules, or PEFT's fused expert LoRA through
`target_parameters`, `formats.peft.experts`) and `--layout` says which one is written (default `peft`; a
dense adapter is the same file in every layout).

Modules: `sources` (SRC's weights file and --checkpoint, opened), `plan` (SRC validated in named steps,
the output laid out by `formats.peft.layout`), `run` (written).
"""

from __future__ import annotations

from .plan import FixOptions, FixPlan, FixReads, plan_fix
from .run import FixReport, run_fix
from .sources import CKPT_REF, FixSources, open_fix_source

__all__ = [
    "CKPT_REF",
    "FixOptions",
    "FixPlan",
    "FixReads",
    "FixReport",
    "FixSources",
    "open_fix_source",
    "plan_fix",
    "run_fix",
]
