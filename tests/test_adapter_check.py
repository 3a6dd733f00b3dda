"""`diff-vs-base --adapter` checks merged values, not one kernel's bits: a merge made with another kernel
(a row-blocked product, PEFT's fp32 merge, fp64) passes; a one-ulp error outside a tie, an alpha off by 1%
and another step's adapter fail. On the genuine prime-rl fixture (r=8, alpha 16)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpt_tools.core.tensor_math import check_merged_values, lora_factors_fp64

from .conftest import BASE, FIXTURE, REPO, TRAINER

STEP2_BROADCAST = FIXTURE / "outputs/run_default/broadcasts/step_2"
SCALE = 16.0 / 8


def ckpt(*args):
    return subprocess.run([sys.executable, "-m", "ckpt_tools", *map(str, args)], capture_output=True, text=True,
                          cwd=REPO, timeout=600)


def check(merged, adapter=TRAINER, base=BASE):
    r = ckpt("diff-vs-base", merged, base, "--adapter", adapter, "--json")
    return r.returncode, json.loads(r.stdout)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapter-check")
    assert ckpt("merge", BASE, TRAINER, root / "merged").returncode == 0
    assert ckpt("extract-adapter", TRAINER, root / "adapter").returncode == 0
    return root


def _factors(adapter_dir):
    sd = load_file(adapter_dir / "adapter_model.safetensors")
    out = {}
    for k, v in sd.items():
        module = k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0]
        out.setdefault(module, {})[k.rsplit(".lora_", 1)[1][0]] = v
    return out


def _variant(made, name, merge_fn):
    """The merged dir with every targeted tensor recomputed by `merge_fn(W0_bf16, A, B, s)`."""
    out = made / name
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(made / "merged", out)
    base = load_file(BASE / "model.safetensors")
    tensors = load_file(out / "model.safetensors")
    for module, f in _factors(made / "adapter").items():
        tensors[f"{module}.weight"] = merge_fn(base[f"{module}.weight"], f["A"], f["B"], SCALE).contiguous()
    for extra in out.glob("SHA256SUMS*"):
        extra.unlink()   # the variant is not the tool's output: no digests of it
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _blocked(w0, a, b, s):   # rows of P in blocks of 7: another kernel shape, other low bits
    p = torch.cat([b[i:i + 7].float() @ a.float() for i in range(0, b.shape[0], 7)])
    return (w0.float() + s * p).to(torch.bfloat16)


def _fp64(w0, a, b, s):
    return (w0.double() + s * (b.double() @ a.double())).to(torch.bfloat16)


def test_the_tools_own_merge_passes_and_reports_its_ties(made):
    code, doc = check(made / "merged")
    assert code == 0, doc
    summary = doc["result"]["adapter_check"]
    assert summary["passed"] and summary["exact"] == summary["targeted"] == 21 and summary["ties"] >= 0


@pytest.mark.parametrize("kernel", [_blocked, _fp64], ids=["row-blocked", "fp64"])
def test_a_merge_made_with_another_kernel_passes(made, kernel):
    code, doc = check(_variant(made, kernel.__name__, kernel))
    assert code == 0, doc["result"]["adapter_check"]


def test_some_other_kernel_differs_in_bits_so_the_value_check_is_what_passes_it(made):
    ours = load_file(made / "merged" / "model.safetensors")
    differing = 0
    for kernel in (_blocked, _fp64):
        theirs = load_file(_variant(made, kernel.__name__ + "-bits", kernel) / "model.safetensors")
        differing += sum(int((ours[k].view(torch.int16) != theirs[k].view(torch.int16)).sum()) for k in ours)
    assert differing > 0   # a replay of ckpt's own bits would have refused these merges


def test_a_peft_merge_in_fp32_passes(made, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, made / "adapter").merge_and_unload()
    merged.to(torch.bfloat16).save_pretrained(tmp_path / "peft")
    code, doc = check(tmp_path / "peft")
    assert code == 0, doc["result"]["adapter_check"]


def test_one_ulp_off_outside_a_tie_fails(made):
    base = load_file(BASE / "model.safetensors")
    f = _factors(made / "adapter")
    module = "model.layers.0.self_attn.q_proj"
    name = f"{module}.weight"
    w = load_file(made / "merged" / "model.safetensors")[name].reshape(-1).clone()
    w0 = base[name].reshape(-1)
    factors = lora_factors_fp64(f[module]["A"], f[module]["B"])
    # the first element whose window holds one value only (not a tie)
    for i in range(w.numel()):
        one = check_merged_values(w[i:i + 1], w0[i:i + 1], factors, 0, i, SCALE)
        if one.ties == 0 and one.off == 0:
            break
    w.view(torch.int16)[i] += 1
    assert check_merged_values(w[i:i + 1], w0[i:i + 1], factors, 0, i, SCALE).off == 1
    variant = _variant(made, "one-ulp", _fp64)
    tensors = load_file(variant / "model.safetensors")
    tensors[name] = w.view(base[name].shape)
    save_file(tensors, variant / "model.safetensors", metadata={"format": "pt"})
    code, doc = check(variant)
    assert code == 4, doc
    off = doc["result"]["adapter_check"]["off"]
    assert [o["name"] for o in off] == [name] and off[0]["elements_off"] == 1 and off[0]["max_ulps"] == 1


def test_an_alpha_off_by_one_percent_fails(made, tmp_path):
    assert ckpt("merge", BASE, TRAINER, tmp_path / "m", "--alpha", "16.16").returncode == 0
    code, doc = check(tmp_path / "m")
    assert code == 4 and len(doc["result"]["adapter_check"]["off"]) == 21, doc["result"]["adapter_check"]


def test_another_steps_adapter_fails(made, tmp_path):
    assert ckpt("fix-adapter", STEP2_BROADCAST, tmp_path / "step2").returncode == 0
    code, doc = check(made / "merged", tmp_path / "step2")
    assert code == 4 and len(doc["result"]["adapter_check"]["off"]) == 21, doc["result"]["adapter_check"]


def test_against_the_checkpoints_fp32_base_weights_the_same_merges_pass_and_fail():
    """BASE = the DCP checkpoint: W0 is its fp32 copy of the base (bf16 values upcast), so the check
    runs on fp32 W0 beside bf16 W, and must give the bf16 base's verdicts."""
    code, doc = check(FIXTURE / "expected_merged_hf", base=TRAINER)
    summary = doc["result"]["adapter_check"]
    assert code == 0 and summary["passed"] and summary["exact"] == 21, summary
    assert summary["ties"] == check(FIXTURE / "expected_merged_hf")[1]["result"]["adapter_check"]["ties"]
    r = ckpt("diff-vs-base", FIXTURE / "expected_merged_hf", TRAINER, "--adapter", TRAINER, "--alpha", "16.16",
             "--json")   # the check's alpha 1% off the merge's
    assert r.returncode == 4 and len(json.loads(r.stdout)["result"]["adapter_check"]["off"]) == 21
