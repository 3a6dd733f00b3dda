"""Issue 35's docs figure: `merge --dtype fp8` (quantized from the exact fp32 W32) against quantizing the bf16
merge (W32 rounded to bf16 first, then the same rule), on a factory run (4 gloo FSDP2 ranks, `dcp.save`).

    .venv/bin/python bench/fp8_vs_bf16.py [WORKDIR]

Prints, over the merged projections: the codes that differ between the two, the scales that differ, and each
path's quantization error against W32 (||deq - W32|| / ||W32||, and the largest per-element error in units of
the block's code step). Plain torch and safetensors on the outputs; the merges are `ckpt merge`'s.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.factory.factory import FactorySpec, make_run  # noqa: E402


def load_dir(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def rule(w32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w32.shape
    codes = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scales = torch.empty(-(-rows // 128), -(-cols // 128))
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            blk = w32[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            s = blk.abs().max() / 448.0
            s = torch.ones_like(s) if s == 0 else s
            scales[i, j] = s
            codes[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (blk / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return codes, scales


def deq(codes, scales):
    rows, cols = codes.shape
    return codes.float() * scales.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]


def main() -> None:
    work = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="fp8-vs-bf16-"))
    spec = FactorySpec.tiny()
    paths = make_run(work / "run", spec)
    out = work / "fp8"
    subprocess.run([sys.executable, "-m", "ckpt_tools", "merge", str(paths.base_model), str(paths.checkpoint),
                    str(out), "--dtype", "fp8"], check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    got, base, truth = load_dir(out), load_dir(paths.base_model), load_file(str(paths.truth))
    n = codes_differ = scales_differ = 0
    err = {"exact": [0.0, 0.0], "via bf16": [0.0, 0.0]}
    for m in spec.target_modules():
        name = m + ".weight"
        a, b = truth[f"lora.{m}.slot0.A"].float(), truth[f"lora.{m}.slot0.B"].float()
        w32 = base[name].float() + spec.scale * (b @ a)
        ours = (got[name], got[name + "_scale_inv"])
        via = rule(w32.to(torch.bfloat16).float())
        n += w32.numel()
        codes_differ += int((ours[0].view(torch.uint8) != via[0].view(torch.uint8)).sum())
        scales_differ += int((ours[1] != via[1]).sum())
        for key, (c, s) in (("exact", ours), ("via bf16", via)):
            err[key][0] += float(((deq(c, s) - w32).double() ** 2).sum())
            err[key][1] += float((w32.double() ** 2).sum())
    print(f"factory run: {len(spec.target_modules())} merged projections, {n} elements")
    print(f"codes that differ (exact vs via bf16): {codes_differ} ({100 * codes_differ / n:.2f}%)")
    print(f"scales that differ: {scales_differ}")
    for key, (e, w) in err.items():
        print(f"{key:9s} ||deq - W32|| / ||W32|| = {(e / w) ** 0.5:.6f}")


if __name__ == "__main__":
    main()
