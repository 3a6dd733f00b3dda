"""slim --base's base check (sources/hashing.py) reads the base's bytes by range and upcasts them with numpy:
its sha256 and per-row-block CRC-32s are those of torch's upcast of the whole tensor, whatever the read
blocks and cast pieces, whether one thread computes them or the CRC-32s are split over several and joined
(`crc32_combine`), for plain tensors, stacked experts, a same-dtype base and a pair only torch casts."""
from __future__ import annotations

import hashlib
import json
import zlib

import pytest
import torch
from safetensors.torch import save_file

from ckpt_tools.formats.hf_dir.model_dir import HFModelDir
from ckpt_tools.sources import hashing
from ckpt_tools.sources.hashing import upcast_sha256, upcast_sha256_crc32s

EXPERTS = "model.layers.0.mlp.experts.*.gate_proj.weight"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    d = tmp_path_factory.mktemp("base")
    g = torch.Generator().manual_seed(22)
    w = torch.randn(300, 70, generator=g).to(torch.bfloat16)
    w.view(torch.int16)[0, :4] = torch.tensor([0x7F80, -128, 0x7FC1, -1], dtype=torch.int16)   # inf, -inf, NaNs
    tensors = {"w": w, "f32": torch.randn(10, 4, generator=g), "h": torch.randn(9, 3, generator=g).half(),
               "scalar": torch.tensor(1.5, dtype=torch.bfloat16)}
    for e in range(4):
        tensors[EXPERTS.replace("*", str(e))] = torch.randn(5, 7, generator=g).to(torch.bfloat16)
    save_file(tensors, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    with HFModelDir.open(d) as src:
        yield src, tensors


def reference(tensors, name, dtype, row_blocks):
    """torch's upcast of the whole tensor: its sha256 and the CRC-32 of each row block."""
    t = torch.stack([tensors[EXPERTS.replace("*", str(e))] for e in range(4)]) if name == EXPERTS else tensors[name]
    up = t.to(dtype).contiguous()
    flat = up.reshape(-1).view(torch.uint8).numpy().tobytes()
    row = len(flat) // max(1, up.shape[0]) if up.dim() else len(flat)
    return hashlib.sha256(flat).hexdigest(), [zlib.crc32(flat[s * row:(s + n) * row]) for s, n in row_blocks]


CASES = [("w", torch.float32, [(0, 100), (100, 150), (250, 50)]),
         (EXPERTS, torch.float32, [(0, 1), (1, 3)]),
         ("f32", torch.float32, [(0, 3), (3, 7)]),        # the same dtype: hashed as stored
         ("h", torch.float32, [(0, 9)]),                  # fp16 -> fp32: through torch's cast
         ("w", torch.bfloat16, [(0, 300)])]


@pytest.mark.parametrize("small", [False, True], ids=["default blocks", "tiny blocks and pieces"])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("name,dtype,row_blocks", CASES, ids=[f"{c[0][:8]}->{c[1]}" for c in CASES])
def test_the_base_check_is_torchs_upcast_hashed_and_crcd_by_row_block(base, monkeypatch, name, dtype, row_blocks,
                                                                       threads, small):
    src, tensors = base
    if small:   # many reads per block, many cast pieces per read, many CRC ranges per block
        monkeypatch.setattr(hashing, "READ_BLOCK_BYTES", 1000)
        monkeypatch.setattr(hashing, "PIECE_VALUES", 64)
    shape = (4, 5, 7) if name == EXPERTS else tuple(tensors[name].shape)
    got = upcast_sha256_crc32s(src, name, str(dtype).removeprefix("torch."), row_blocks, shape, threads=threads)
    assert got == reference(tensors, name, dtype, row_blocks)
    assert upcast_sha256(src, name, dtype) == got[0]


def test_a_scalar_and_an_empty_row_range(base):
    src, tensors = base
    sha, crcs = upcast_sha256_crc32s(src, "scalar", "float32", [(0, 1)], ())
    flat = tensors["scalar"].float().numpy().tobytes()
    assert (sha, crcs) == (hashlib.sha256(flat).hexdigest(), [zlib.crc32(flat)])


def test_the_base_check_imports_no_torch_for_a_bf16_base(base, tmp_path):
    import subprocess
    import sys
    from .conftest import REPO
    src, _ = base
    code = ("import sys\nfrom ckpt_tools.formats.hf_dir.model_dir import HFModelDir\n"
            "from ckpt_tools.sources.hashing import upcast_sha256_crc32s\n"
            f"src = HFModelDir.open({str(src.path)!r})\n"
            "print(upcast_sha256_crc32s(src, 'w', 'float32', [(0, 300)], threads=2))\n"
            "assert 'torch' not in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
