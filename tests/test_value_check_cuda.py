"""`diff-vs-base --adapter --device cuda`: the value check on a GPU gives the CPU's verdicts and counts exactly
(same ties, same elements off, same max_ulps) and the same statistics, on the genuine prime-rl fixture (a pass,
an alpha 1% off, the checkpoint's fp32 base) and on random merges with planted errors and values at a rounding
boundary of the window, where two kernels' products differ in their last bit.

The CUDA tests are skipped without a GPU (saying why); the lead runs this file on the GPU host
(`DEVICE_TESTS=tests/test_value_check_cuda.py bash bench/device_run.sh`: Python 3.12, torch 2.11 CUDA, nothing
beyond torch, numpy and pytest). Everywhere: without a GPU `--device cuda` is a usage error (exit 2) naming
torch.cuda.is_available(), and the device path itself (units of blocks in slots, P and the check in torch) run
with the CPU as its "device" gives the CPU path's report."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from ckpt_tools.core.errors import UsageError
from ckpt_tools.core.tensor_math import check_merged_values, check_merged_values_bounded, lora_factors_fp64, \
    lora_product_rows_fp64
from ckpt_tools.ops.diff import device as device_mod
from ckpt_tools.ops.diff import plan as diff_plan
from ckpt_tools.ops.diff import run as diff_run
from ckpt_tools.ops.diff.run import diff_vs_base
from ckpt_tools.sources.compare import value_check_chunk

from .conftest import BASE, FIXTURE, REPO, TRAINER
from .test_value_check_c import BOUNDARY_CASES, boundary_pair, one_by_one_factors, window_lower_end

MERGED = FIXTURE / "expected_merged_hf"
needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device here (torch.cuda.is_available() is False): the lead runs this file on the GPU host, "
           "DEVICE_TESTS=tests/test_value_check_cuda.py bash bench/device_run.sh")
CASES = [dict(), dict(alpha=16.16), dict(base=TRAINER)]   # a pass; alpha 1% off (21 tensors off); fp32 W0
CASE_IDS = ["pass", "alpha-1%-off", "fp32-base"]


def _report(case: dict, **kw) -> dict:
    kw = dict(case, **kw)
    base = kw.pop("base", BASE)
    d = diff_vs_base(MERGED, base, adapter=TRAINER, **kw).to_json()
    d.pop("seconds")
    return d


def test_device_cuda_without_an_adapter_or_an_unknown_device_is_a_usage_error():
    with pytest.raises(UsageError, match="only applies with --adapter"):
        diff_vs_base(MERGED, BASE, device="cuda")
    with pytest.raises(UsageError, match="not a device the check runs on"):
        diff_vs_base(MERGED, BASE, adapter=TRAINER, device="tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_a_gpu_device_cuda_exits_2_naming_torch_cuda_is_available_and_the_fix():
    r = subprocess.run([sys.executable, "-m", "ckpt_tools", "diff-vs-base", MERGED, BASE, "--adapter", TRAINER,
                        "--device", "cuda", "--json"], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 2, r.stderr
    error = json.loads(r.stdout)["error"]
    assert error["type"] == "UsageError" and "torch.cuda.is_available() is False" in error["message"]
    assert "leave out --device" in error["hint"]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_the_device_path_with_the_cpu_as_its_device_gives_the_cpu_report(monkeypatch, case):
    """Units of several blocks (small blocks, a unit of 3 KiB a side), each read into a slot, its statistics
    chunks on the CPU and its P and check in torch: the report (ties, off, max_ulps, every statistic) is the
    CPU path's, bit for bit."""
    cpu = _report(case, block_bytes=4096)
    monkeypatch.setattr(device_mod, "UNIT_BYTES", 3 * 1024)
    for module in (diff_plan, diff_run):
        monkeypatch.setattr(module, "resolve_device", lambda d: None if d is None else torch.device("cpu"))
    on_device = _report(case, block_bytes=4096, device="cuda")
    assert on_device == cpu
    summary = cpu["adapter_check"]
    assert summary["passed"] == (case.get("alpha") is None) and summary["targeted"] == 21
    if not summary["passed"]:
        assert len(summary["off"]) == 21


@needs_cuda
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_on_the_gpu_the_report_is_the_cpus(case):
    assert _report(case, device="cuda") == _report(case)


@needs_cuda
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("w0_dtype", [torch.bfloat16, torch.float32, torch.float16, torch.float64])
def test_on_the_gpu_random_merges_with_planted_errors_count_as_the_c_kernel_and_the_definition(w0_dtype, out_dtype):
    g = torch.Generator().manual_seed(7)
    rows, cols, rank = 257, 1031, 16
    a = (torch.randn(rank, cols, generator=g) * 0.05).to(torch.bfloat16).float()
    b = (torch.randn(rows, rank, generator=g) * 0.05).to(torch.bfloat16).float()
    w0 = (torch.randn(rows, cols, generator=g, dtype=torch.float64) * 0.1).to(w0_dtype)
    merged = (w0.to(torch.float32) + 1.7 * (b @ a)).to(out_dtype).reshape(-1)
    ints = merged.view({torch.bfloat16: torch.int16, torch.float32: torch.int32}[out_dtype])
    at = torch.randperm(merged.numel(), generator=g)[:60]
    ints[at[:30]] += 1
    ints[at[30:50]] -= 5
    merged[at[50:55]] = -merged[at[50:55]]
    f = lora_factors_fp64(a, b)
    prod = lora_product_rows_fp64(f, 0, rows)
    w0f = w0.reshape(-1)
    on_cpu = value_check_chunk(merged, w0f, prod, f, 0, 0, 1.7)
    assert on_cpu == check_merged_values(merged, w0f, f, 0, 0, 1.7)
    cuda = torch.device("cuda")
    fd = f.to(cuda)
    prod_gpu = (fd.left @ fd.right).reshape(-1)   # cuBLAS: other kernels, other last bits
    assert check_merged_values_bounded(merged.to(cuda), w0f.to(cuda), prod_gpu, fd, 0, 0, 1.7) == on_cpu
    # (an fp32 window holds a few fp32 values: there only the sign flips are off)
    assert on_cpu.off >= (20 if out_dtype == torch.bfloat16 else 5) and on_cpu.max_ulps >= 5


@needs_cuda
@pytest.mark.parametrize("lo, hi, w0, scale", BOUNDARY_CASES)
def test_on_the_gpu_a_value_at_a_rounding_boundary_counts_as_on_the_cpu(lo, hi, w0, scale):
    pa, pb = boundary_pair(lo, hi, w0, scale)
    base = torch.tensor([w0], dtype=torch.float32)
    cuda = torch.device("cuda")
    for truth in (pa, pb):
        f = one_by_one_factors(truth)
        for w in (window_lower_end(pa, w0, scale), window_lower_end(pb, w0, scale)):
            merged = torch.tensor([w], dtype=torch.bfloat16)
            want = value_check_chunk(merged, base, torch.tensor([truth], dtype=torch.float64), f, 0, 0, scale)
            for given in (pa, pb):
                got = check_merged_values_bounded(merged.to(cuda), base.to(cuda),
                                                  torch.tensor([given], dtype=torch.float64, device=cuda), f.to(cuda),
                                                  0, 0, scale)
                assert got == want, (truth, w, given)
