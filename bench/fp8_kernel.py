#!/usr/bin/env python3
"""Issue 35: what an FP8 output's row block costs per element, stage by stage, on one core (docs/merge.md's
"Cost" figures). No process start, no I/O: the stages of `ops/merge/quantize.py: write_quantized` on one
bf16 base block and a rank-32 LoRA, beside the bf16 merge of the same block.

    .venv/bin/python bench/fp8_kernel.py [--rows 512] [--cols 4096] [--repeat 7]

Prints the median ns per element (min-max over the repetitions) of: the bf16 merge (`merge_weight_into` a bf16
out), the fp32 merge (W32 made in place of the product, as an FP8 merge does), that merge and the quantization
(block amax, scales, division, clamp, e4m3 cast), the error figures by the C kernel (each vector path this CPU has) and by
the reference (`reference_error_sq`, what runs without the kernel or under CKPT_TOOLS_PURE_PYTHON=1).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckpt_tools.core import fp8  # noqa: E402
from ckpt_tools.core.tensor_math import merge_weight_into  # noqa: E402

BF16_MERGE = "merge, bf16 out (a bf16 merge's block)"
FP8_MERGE = "merge, W32 in place (an FP8 merge's)"


def timed(fn, repeat: int, elems: int) -> tuple[float, float, float]:
    fn()  # warm: page faults, BLAS set-up
    got = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        got.append((time.perf_counter() - t) * 1e9 / elems)
    return statistics.median(got), min(got), max(got)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=7)
    a = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    n, c, elems = a.rows, a.cols, a.rows * a.cols
    w = (torch.randn(n, c, generator=g) * 0.02).to(torch.bfloat16)
    lora_a = torch.randn(a.rank, c, generator=g) * 0.01
    lora_b = torch.randn(n, a.rank, generator=g) * 0.01
    prod = torch.empty(n, c)
    out16 = torch.empty(n, c, dtype=torch.bfloat16)
    codes = torch.empty(n, c, dtype=torch.float8_e4m3fn)
    scales = torch.empty(fp8.grid_shape((n, c)))
    ref_scratch = torch.empty(elems)

    def merge32():
        merge_weight_into(prod, w, lora_a, lora_b, 2.0, scratch=prod)

    def quantize():
        merge32()
        fp8.quantize_rows_into(prod, codes, scales)

    rows = {
        BF16_MERGE: timed(
            lambda: merge_weight_into(out16, w, lora_a, lora_b, 2.0, scratch=prod), a.repeat, elems),
        FP8_MERGE: timed(merge32, a.repeat, elems),
    }
    rows["merge and quantization (amax, scales, divide, clamp, e4m3 cast)"] = timed(quantize, a.repeat, elems)
    quantize()  # prod now holds the scaled values the codes were cast from
    u8 = codes.view(torch.uint8).numpy()
    if fp8.accelerator is not None:
        for path in range(fp8.accelerator.best_path() + 1):
            name = ("scalar", "SSE2", "AVX2")[path]
            rows[f"error figures, C kernel ({name})"] = timed(
                lambda p=path: fp8.accelerator.error_sq(prod.numpy(), u8, scales.numpy(), n, c, p), a.repeat, elems)
    rows["error figures, reference (numpy table, torch, fp32 dot)"] = timed(
        lambda: fp8.reference_error_sq(prod, codes, scales, ref_scratch), a.repeat, elems)
    print(f"{n} x {c} block, rank {a.rank}, one thread, {a.repeat} repetitions; ns per element, median (min-max)")
    for k, (med, lo, hi) in rows.items():
        print(f"  {k:64s} {med:6.2f} ({lo:.2f}-{hi:.2f})")
    mq = rows["merge and quantization (amax, scales, divide, clamp, e4m3 cast)"][0]
    figures = [v[0] for k, v in rows.items() if k.startswith("error figures")]  # the kernel's paths, then the reference
    best = figures[-2] if fp8.accelerator is not None else figures[-1]
    print(f"  quantization alone (difference of medians): {mq - rows[FP8_MERGE][0]:.2f}")
    print(f"  an FP8 block in all (merge, quantization, figures by what runs here): {mq + best:.2f}, against the "
          f"bf16 merge's {rows[BF16_MERGE][0]:.2f}")

if __name__ == "__main__":
    main()
