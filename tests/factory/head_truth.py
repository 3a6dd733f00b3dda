"""Ground truth of a HEAD-style run, in the genuine fixtures' ``reference.safetensors`` naming.

The training child's rank 0 leaves the live state gathered just after the final save
(``get_model_state_dict`` / ``get_optimizer_state_dict`` with ``full_state_dict=True``) and the adapter
its last broadcast wrote; ``write_truth`` turns them into:

- ``reference.safetensors`` (metadata ``info`` documents every name, as in the genuine fixtures):
  ``live_fp32.<fqn>`` every non-LoRA tensor (the fp32 masters), ``optim.<fqn>.<exp_avg|exp_avg_sq|step>``;
  LoRA runs: ``lora.<hf module>.A|B``, ``lora.<experts>.<e>.<gate|up|down>_proj.A|B`` and
  ``lora_stacked.<experts>.<w1|w2|w3>_lora_<A|B>``, ``adapter_export.<key>``, ``delta_fp32.<hf weight>``
  (scale * B @ A) and ``merged_bf16.<hf weight>`` (bf16(W + delta), per expert for MoE), and for
  ``modules_to_save`` (the non-LoRA params with optimizer state) ``trained_bf16.<hf weight>``, which
  ``expected_merged_hf`` holds in place of the base's; full fine-tunes: ``trained_bf16.<hf weight>``;
- ``expected_merged_hf/`` (LoRA) or ``expected_trained_hf/`` (full FT): the base dir with those weights;
- ``run_info.json``: the spec, parallel layout, the facts of every save (progress, lr, scheduler) and step.

The merge here is plain torch on purpose: it is the reference the toolkit's own merge is tested against.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tests.factory.head_files import hf_tensors, make_world_readable, prime_to_hf
from tests.factory.head_spec import EXPERT_PROJ, HeadRunPaths, HeadSpec

NAMES = {
    "live_fp32.<fqn>": "every non-LoRA tensor of the live model (fp32 master), DCP/prime naming without app.model.",
    "optim.<param fqn>.<exp_avg|exp_avg_sq|step>": "full AdamW state (get_optimizer_state_dict full_state_dict=True)",
    "lora.<hf module>.A / .B": "dense LoRA A [r,in] / B [out,r] (HF module names)",
    "lora.<experts module>.<e>.<gate|up|down>_proj.A / .B": "per-expert slices of the stacked expert LoRA (w1=gate, w3=up, w2=down)",
    "lora_stacked.<experts module>.<w1|w2|w3>_lora_<A|B>": "stacked expert LoRA [E,r,in] / [E,out,r] exactly as in the live model / DCP",
    "delta_fp32.<hf weight>": "scale * (B @ A) fp32",
    "merged_bf16.<hf weight>": "expected merged weight (bf16)",
    "adapter_export.<key>": "what the final step's filesystem broadcast wrote (LoRAState.adapter_state_dict())",
    "trained_bf16.<hf weight>": "bf16 cast of the trained fp32 masters in HF naming (full FT: every weight; "
                                "LoRA: the modules_to_save params, which replace the base's in the merge)",
}
MERGE_FORMULA = "merged = bf16(fp32(W_base) + scale * (B.float() @ A.float())) computed in fp32"


def _lora_pairs(live: dict[str, torch.Tensor], spec: HeadSpec) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF weight name -> (A, B) fp32, per module and per expert."""
    pairs = {}
    for module in spec.lora_modules():
        if module.endswith(".experts"):
            for w, proj in EXPERT_PROJ.items():
                a, b = live[f"{module}.{w}_lora_A.0"], live[f"{module}.{w}_lora_B.0"]
                for e in range(spec.num_experts):
                    pairs[f"{module}.{e}.{proj}.weight"] = (a[e], b[e])
        else:
            pairs[f"{module}.weight"] = (live[f"{module}.lora_A.0"], live[f"{module}.lora_B.0"])
    return pairs


def _lora_reference(live: dict[str, torch.Tensor], spec: HeadSpec) -> dict[str, torch.Tensor]:
    ref = {}
    for module in spec.lora_modules():
        if module.endswith(".experts"):
            for w, proj in EXPERT_PROJ.items():
                for ab in "AB":
                    stacked = live[f"{module}.{w}_lora_{ab}.0"]
                    ref[f"lora_stacked.{module}.{w}_lora_{ab}"] = stacked
                    for e in range(spec.num_experts):
                        ref[f"lora.{module}.{e}.{proj}.{ab}"] = stacked[e].clone()
        else:
            for ab in "AB":
                ref[f"lora.{module}.{ab}"] = live[f"{module}.lora_{ab}.0"]
    return ref


def write_truth(paths: HeadRunPaths, spec: HeadSpec, raw_tensors: Path, raw_facts: Path,
                seconds: dict[str, float]) -> dict[str, Any]:
    """Write reference.safetensors, the expected HF dir and run_info.json; remove the raw files."""
    raw = load_file(str(raw_tensors))
    facts = json.loads(raw_facts.read_text())
    live = {k[len("model."):]: v for k, v in raw.items() if k.startswith("model.")}
    base = dict(hf_tensors(paths.base_model))
    ref: dict[str, torch.Tensor] = {}
    for k, v in live.items():
        if "lora_A" not in k and "lora_B" not in k:
            ref[f"live_fp32.{k}"] = v
    ref.update({k: v for k, v in raw.items() if k.startswith(("optim.", "adapter_export."))})
    expected = dict(base)
    checks: dict[str, Any] = {}
    if spec.lora:
        ref.update(_lora_reference(live, spec))
        frozen_ok, changed = True, 0
        # modules_to_save: the non-LoRA params the optimizer trained (its state or param group: the only mark)
        # (a stateless optimizer, SignSGD, leaves no state: its param group's FQNs say what it trained)
        listed = {p for g in facts["param_groups"] for p in g.get("params", []) if isinstance(p, str)}
        saved = sorted((({k[len("optim."):].rsplit(".", 1)[0] for k in raw if k.startswith("optim.")} | listed)
                        & set(live)) - {k for k in live if "lora_A" in k or "lora_B" in k})
        saved_changed = 0
        for k, v in live.items():
            if "lora_A" not in k and "lora_B" not in k and k not in saved:
                # (a tied lm_head.weight has no key of its own in the HF file)
                frozen_ok &= all(torch.equal(t, base[h].float()) for h, t in prime_to_hf(k, v, spec) if h in base)
        for k in saved:
            for hf_name, t in prime_to_hf(k, live[k], spec):
                trained = t.to(torch.bfloat16)
                ref[f"trained_bf16.{hf_name}"] = trained
                if hf_name in expected:
                    saved_changed += int(not torch.equal(trained, base[hf_name]))
                    expected[hf_name] = trained
        for hf_name, (a, b) in _lora_pairs(live, spec).items():
            delta = spec.scale * (b.float() @ a.float())
            merged = (base[hf_name].float() + delta).to(torch.bfloat16)
            ref[f"delta_fp32.{hf_name}"], ref[f"merged_bf16.{hf_name}"] = delta, merged
            changed += int(not torch.equal(merged, base[hf_name]))
            expected[hf_name] = merged
        checks = {"frozen_base_equals_bf16_upcast": bool(frozen_ok), "n_merged_tensors_changed": changed,
                  "modules_to_save_params": saved, "n_modules_to_save_changed": saved_changed}
    else:
        changed = 0
        for k, v in live.items():
            for hf_name, t in prime_to_hf(k, v, spec):
                trained = t.to(torch.bfloat16)
                ref[f"trained_bf16.{hf_name}"] = trained
                if hf_name in expected:
                    changed += int(not torch.equal(trained, base[hf_name]))
                    expected[hf_name] = trained
        checks = {"n_params_changed_vs_base": changed}

    final = facts["saves"][-1]
    info = {
        "variant": f"tests.factory.head_factory:{spec.kind}", "torch": torch.__version__, "names": NAMES,
        "progress": final["progress"], "checks": checks,
    }
    if spec.lora:
        info.update(scale=spec.scale, rank=spec.lora_rank, alpha=float(spec.lora_alpha),
                    scale_source="bf16(trainer model.lora.alpha / rank), as prime-rl's LoRAState.scaling_factors",
                    merge_formula=MERGE_FORMULA, lora_targets=spec.lora_modules(),
                    modules_to_save=list(spec.modules_to_save), modules_to_save_params=checks["modules_to_save_params"])
    save_file({k: v.contiguous() for k, v in sorted(ref.items())}, str(paths.reference),
              metadata={"info": json.dumps(info)})
    _write_expected_dir(paths, expected)

    run_info = {
        "factory": "tests.factory.head_factory", "kind": spec.kind, "spec": spec.to_dict(),
        "torch": torch.__version__, "world_size": spec.world_size, "ep_resolved": spec.resolved_ep,
        "dp_shard_mod_ep": spec.dp_shard_mod_ep, "max_steps": spec.max_steps, "final_step": final["step"],
        "progress_at_final_save": final["progress"], "lr_at_final_save": [final["lr"]],
        "optimizer_class": ("SignSGD (stateless)" if spec.optimizer == "sign_sgd" else "torch.optim.AdamW(fused=False)")
        + ", as inside prime-rl's CPUOffloadOptimizer",
        "param_group_fused": facts["param_groups"][0].get("fused"), "param_groups": facts["param_groups"],
        "saves": {str(s["step"]): s for s in facts["saves"]}, "per_step": facts["steps"],
        "dtensor_layout_sample": facts["dtensor_layout_sample"],
        "lora": {"rank": spec.lora_rank, "alpha": float(spec.lora_alpha), "scale": spec.scale,
                 "modules": spec.lora_modules()} if spec.lora else None,
        "checkpoints": {str(s): str(p.relative_to(paths.root)) for s, p in paths.checkpoints.items()},
        "broadcasts": {str(s): str(p.relative_to(paths.root)) for s, p in paths.broadcasts.items()},
        "reference_names": NAMES, "groundtruth_checks": checks, "n_reference_tensors": len(ref),
        "seconds": seconds,
    }
    paths.run_info.write_text(json.dumps(run_info, indent=2) + "\n")
    raw_tensors.unlink()
    raw_facts.unlink()
    make_world_readable(paths.root)
    return run_info


def _write_expected_dir(paths: HeadRunPaths, tensors: dict[str, torch.Tensor]) -> None:
    out = paths.expected_hf
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(paths.base_model.iterdir()):
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copyfile(f, out / f.name)
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
