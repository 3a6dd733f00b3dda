"""`ckpt merge`'s peak RSS is bounded by its blocks, not by its largest tensor (issue 14: under 1 GiB
at any model size). Two models that differ only in the size of their untouched embedding and lm_head
(16 KiB against 64 MiB each) are merged in subprocesses; the kernel's peak RSS of each (`wait4`) may
differ by less than half the largest tensor. A merge that holds that tensor, or passes it through one
64 MiB buffer, grows by >= 64 MiB and fails."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

HIDDEN, ROWS, RANK = 2048, 256, 8


def write_model(root: Path, vocab: int, rows: int = ROWS) -> tuple[Path, Path]:
    """A bf16 base with an untied [vocab, HIDDEN] embedding and lm_head, two small q_proj weights, and a
    PEFT adapter on them. Returns (base, adapter)."""
    base, adapter = root / "base", root / "adapter"
    base.mkdir(parents=True)
    adapter.mkdir()
    g = torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(vocab, HIDDEN, generator=g).to(torch.bfloat16),
               "lm_head.weight": torch.randn(vocab, HIDDEN, generator=g).to(torch.bfloat16),
               "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16)}
    lora = {}
    for layer in range(2):
        module = f"model.layers.{layer}.self_attn.q_proj"
        tensors[module + ".weight"] = torch.randn(rows, HIDDEN, generator=g).to(torch.bfloat16)
        lora[f"base_model.model.{module}.lora_A.weight"] = torch.randn(RANK, HIDDEN, generator=g)
        lora[f"base_model.model.{module}.lora_B.weight"] = torch.randn(rows, RANK, generator=g)
    save_file(tensors, str(base / "model.safetensors"), metadata={"format": "pt"})
    (base / "config.json").write_text(json.dumps({
        "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "tie_word_embeddings": False,
        "dtype": "bfloat16", "hidden_size": HIDDEN, "vocab_size": vocab, "num_hidden_layers": 2}))
    save_file(lora, str(adapter / "adapter_model.safetensors"))
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": 16, "target_modules": ["q_proj"], "fan_in_fan_out": False,
        "base_model_name_or_path": str(base)}))
    return base, adapter


# Runs the merge and prints its peak RSS. A small launcher, since Linux carries a process's peak RSS
# across exec: a child forked from this pytest process (torch loaded) would report pytest's size.
_LAUNCH = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL); "
           "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def merge_peak_rss(base: Path, adapter: Path, out: Path, *extra: str) -> int:
    """Peak RSS in bytes of `ckpt merge` in its own process (the kernel's, for that process alone)."""
    cmd = [sys.executable, "-c", _LAUNCH, sys.executable, "-m", "ckpt_tools", "merge", str(base), str(adapter),
           str(out), "--threads", "2", *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=out.parent, check=True)
    rc, kib = (int(x) for x in r.stdout.split())
    assert rc == 0, r.stderr
    return kib * 1024


def test_peak_rss_does_not_grow_with_the_largest_untouched_tensor(tmp_path):
    small_vocab, big_vocab = 4, 16384
    small = write_model(tmp_path / "small", small_vocab)
    big = write_model(tmp_path / "big", big_vocab)
    largest = big_vocab * HIDDEN * 2                                   # 64 MiB: the embedding, lm_head
    baseline = merge_peak_rss(*small, tmp_path / "out-small")          # interpreter + torch + ckpt itself
    peak = merge_peak_rss(*big, tmp_path / "out-big")
    assert (tmp_path / "out-big" / "model.safetensors").stat().st_size > 2 * largest
    assert peak - baseline < largest // 2, (f"peak RSS {peak / 2**20:.0f} MiB, {(peak - baseline) / 2**20:.0f} MiB "
                                            f"over the small model's {baseline / 2**20:.0f} MiB")


def test_fp8_peak_rss_does_not_grow_with_the_largest_quantized_tensor(tmp_path):
    """`--dtype fp8` streams each quantized weight in 128-row blocks: two q_proj of 256 MiB (bf16) each cost
    less than half of one over two of 1 MiB (the workers' blocks, 2M elements each: ~22 MiB a worker)."""
    small = write_model(tmp_path / "small", 4, rows=256)
    big = write_model(tmp_path / "big", 4, rows=65536)
    largest = 65536 * HIDDEN * 2
    baseline = merge_peak_rss(*small, tmp_path / "out-small", "--dtype", "fp8")
    peak = merge_peak_rss(*big, tmp_path / "out-big", "--dtype", "fp8")
    assert (tmp_path / "out-big" / "model.safetensors").stat().st_size > largest  # two fp8 halves of it
    assert peak - baseline < largest // 2, (f"peak RSS {peak / 2**20:.0f} MiB, {(peak - baseline) / 2**20:.0f} MiB "
                                            f"over the small model's {baseline / 2**20:.0f} MiB")
