"""`ckpt diff-vs-base --adapter`'s peak RSS is bounded by its blocks, not by its largest tensor (issue 22:
flat as the largest tensor grows 4x), nor by its workers. Two models whose targeted q_proj weights are 16 MiB and
64 MiB (bf16) are merged by `ckpt merge` and checked in subprocesses; the kernel's peak RSS of each check
(`wait4`) may differ by less than half the larger tensor. A check that holds W, W0 or P = B@A whole grows by
>= 64 MiB (P in fp64: 256 MiB) and fails. The big model checked with 1 worker and with 16 (the child told it
has 16 cores): the workers' buffers come out of the one working budget, so the peak grows by less than it."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from ckpt_tools.ops.diff.run import WORKING_BUDGET_BYTES

HIDDEN, RANK, MiB = 2048, 8, 2**20
# Runs the command and prints its peak RSS (as test_merge_memory's launcher: Linux carries a process's peak
# RSS across exec, so a child forked from this pytest process would report pytest's size).
_LAUNCH = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL); "
           "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")
# `python -m ckpt_tools` on a machine that reports CORES cores (dist.local_workers sizes its workers by them)
_WITH_CORES = ("import os, runpy, sys; cores = int(sys.argv.pop(1)); os.sched_getaffinity = lambda pid: set(range(cores)); "
               "sys.argv[0] = 'ckpt'; runpy.run_module('ckpt_tools', run_name='__main__')")


def _write(root: Path, rows: int) -> tuple[Path, Path]:
    """A bf16 base with two [rows, HIDDEN] q_proj weights and a PEFT adapter (fp32 factors) on them."""
    base, adapter = root / "base", root / "adapter"
    base.mkdir(parents=True)
    adapter.mkdir()
    g = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(64, HIDDEN, generator=g).to(torch.bfloat16),
               "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16)}
    lora = {}
    for layer in range(2):
        module = f"model.layers.{layer}.self_attn.q_proj"
        tensors[module + ".weight"] = (torch.randn(rows, HIDDEN, generator=g) * 0.02).to(torch.bfloat16)
        lora[f"base_model.model.{module}.lora_A.weight"] = torch.randn(RANK, HIDDEN, generator=g) * 0.02
        lora[f"base_model.model.{module}.lora_B.weight"] = torch.randn(rows, RANK, generator=g) * 0.02
    save_file(tensors, str(base / "model.safetensors"), metadata={"format": "pt"})
    (base / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "tie_word_embeddings": True,
        "dtype": "bfloat16", "hidden_size": HIDDEN, "vocab_size": 64, "num_hidden_layers": 2}))
    save_file(lora, str(adapter / "adapter_model.safetensors"))
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": 16, "target_modules": ["q_proj"], "fan_in_fan_out": False,
        "base_model_name_or_path": str(base)}))
    return base, adapter


def _check_peak_rss(root: Path, rows: int, cores: tuple[int, ...] = (0,)) -> list[int]:
    """Peak RSS of the check, once per entry of `cores` (0: the machine's own; else the cores it is told)."""
    base, adapter = _write(root, rows)
    merged = root / "merged"
    r = subprocess.run([sys.executable, "-m", "ckpt_tools", "merge", str(base), str(adapter), str(merged)],
                       capture_output=True, text=True, cwd=root, timeout=300)
    assert r.returncode == 0, r.stderr
    peaks = []
    for n in cores:
        ckpt = [sys.executable, "-m", "ckpt_tools"] if not n else [sys.executable, "-c", _WITH_CORES, str(n)]
        cmd = [sys.executable, "-c", _LAUNCH, *ckpt, "diff-vs-base", str(merged), str(base), "--adapter", str(adapter),
               "--json"]
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=root, timeout=300, check=True)
        rc, kib = (int(x) for x in r.stdout.split())
        assert rc == 0, r.stderr   # (exit 0: differs, and the adapter check passed)
        peaks.append(kib * 1024)
    return peaks


def test_the_adapter_checks_peak_rss_is_flat_as_the_targeted_tensor_grows_4x_and_within_its_budget_at_16_workers(
        tmp_path):
    (small,) = _check_peak_rss(tmp_path / "small", 4096, (1,))    # q_proj 16 MiB, on 1 worker
    one, sixteen = _check_peak_rss(tmp_path / "big", 16384, (1, 16))   # q_proj 64 MiB, on 1 and 16 workers
    assert one - small < 32 * MiB, (small / MiB, one / MiB)
    assert sixteen - one < WORKING_BUDGET_BYTES, (one / MiB, sixteen / MiB)
