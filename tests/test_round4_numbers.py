"""Round 4 (issue 32), item 4: numbers from strangers in `ckpt average` and `ckpt resize-adapter`.

The inputs are HEAD's genuine fixtures: F_head_moe's step_3 (grouped-expert LoRA with EP) extracted by
`ckpt extract-adapter --layout vllm`, E_head_dense's step_2 extracted, and E's checkpoint itself; each
damage is made with safetensors (or, for the checkpoint, torch.distributed.checkpoint.save). A NaN or inf
in an input, a weighted sum or factors past float32's range, and an SVD that cannot converge are each
one line naming the file and the key, nothing written; `--weights 1e308,1e308` is the plain mean; one
expert spelled `experts.3` and `experts.03` is refused naming both keys.

Figures for docs/reliability.md: `hu.record("round4", tried=, fixed=, held=)` (fixed: failed before).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from . import hardening_util as hu
from .conftest import HEAD_FIXTURES

MOE = HEAD_FIXTURES / "F_head_moe" / "outputs" / "checkpoints" / "step_3" / "trainer"
DENSE = HEAD_FIXTURES / "E_head_dense" / "outputs" / "checkpoints" / "step_2" / "trainer"
WEIGHTS = "adapter_model.safetensors"
Q_B = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"


def ok(*args) -> hu.Result:
    r = hu.invoke([str(a) for a in args])
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    return r


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("r4-numbers")
    ok("extract-adapter", MOE, root / "moe", "--layout", "vllm")
    ok("extract-adapter", DENSE, root / "dense")
    return root


def damaged(src: Path, dst: Path, change) -> Path:
    """A copy of adapter `src` at `dst`, its tensors passed through `change(dict)` and saved by safetensors."""
    shutil.copytree(src, dst)
    sd = load_file(str(dst / WEIGHTS))
    change(sd)
    save_file(sd, str(dst / WEIGHTS), metadata={"format": "pt"})
    return dst


def refused(r: hu.Result, out: Path, *names: str) -> str:
    line = hu.assert_clean_error(r, code=(1, 2))
    for n in names:
        assert n in line, (n, line)
    assert not out.exists() and not hu.temp_dirs(out), sorted(p.name for p in out.parent.iterdir())
    return line


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_average_refuses_a_non_finite_factor_naming_the_file_and_key(adapters, tmp_path, value):
    def poison(sd):
        sd[Q_B][3, 1] = value

    bad = damaged(adapters / "dense", tmp_path / "bad", poison)
    out = tmp_path / "avg"
    line = refused(hu.invoke(["average", adapters / "dense", bad, out]), out, f"bad/{WEIGHTS}", Q_B, "non-finite")
    assert "1 non-finite" in line
    hu.record("round4", tried=1, fixed=1)


def test_resize_refuses_a_nan_factor_naming_the_file_and_key_not_an_internal_error(adapters, tmp_path):
    key = "base_model.model.model.layers.0.mlp.experts.2.up_proj.lora_A.weight"

    def poison(sd):
        sd[key][0, 0] = math.nan

    bad = damaged(adapters / "moe", tmp_path / "bad", poison)
    out = tmp_path / "small"
    refused(hu.invoke(["resize-adapter", bad, out, "--rank", "4"]), out, f"bad/{WEIGHTS}", key)
    refused(hu.invoke(["resize-adapter", bad, out, "--energy", "0.9", "--layout", "peft"]), out, key)
    hu.record("round4", tried=2, fixed=2)


def test_average_refuses_a_checkpoint_whose_lora_holds_an_inf(tmp_path):
    """A checkpoint written by torch.distributed.checkpoint.save (E's step, one LoRA element set to inf)."""
    key = "app.model.model.layers.0.self_attn.v_proj.lora_B.0"

    def poison(sd):
        sd["app"]["model"][key[len("app.model.") :]][1, 2] = math.inf

    bad = hu.resave_dcp(DENSE, tmp_path / "outputs" / "checkpoints" / "step_9" / "trainer", poison)
    out = tmp_path / "avg"
    r = hu.invoke(["average", DENSE, bad, out, "--alpha", "16"])
    refused(r, out, str(bad), key, "non-finite")
    hu.record("round4", tried=1, fixed=1)


def test_huge_weights_are_their_ratio_not_an_overflow(adapters, tmp_path):
    other = damaged(adapters / "dense", tmp_path / "other", lambda sd: sd.update({Q_B: sd[Q_B] * 3}))
    ok("average", adapters / "dense", other, tmp_path / "huge", "--weights", "1e308,1e308")
    ok("average", adapters / "dense", other, tmp_path / "plain", "--weights", "1,1")
    assert (tmp_path / "huge" / WEIGHTS).read_bytes() == (tmp_path / "plain" / WEIGHTS).read_bytes()
    hu.record("round4", tried=1, fixed=1)


def test_a_result_past_float32s_range_is_refused_naming_the_module(adapters, tmp_path):
    """Finite inputs (3e38, float32's edge) whose weighted sum (weights 1, -0.5) leaves float32's range."""
    a_key = Q_B.replace("lora_B", "lora_A")

    def edge(sd):
        sd[Q_B][:] = 3e38
        sd[a_key][:] = 3e38

    big = damaged(adapters / "dense", tmp_path / "big", edge)
    out = tmp_path / "avg"
    line = refused(hu.invoke(["average", adapters / "dense", big, out, "--weights", "1,-0.5"]), out,
                   "model.layers.1.self_attn.q_proj.lora_", "float32")
    assert "non-finite" in line
    refused(hu.invoke(["resize-adapter", big, out, "--rank", "4"]), out, "model.layers.1.self_attn.q_proj.lora_")
    hu.record("round4", tried=2, fixed=2)


def test_an_svd_that_cannot_converge_is_one_line_naming_the_module(adapters, tmp_path):
    """Float64 factors of 1e200 (finite): their delta is past float64's range, the SVD fails."""
    a_key = Q_B.replace("lora_B", "lora_A")

    def f64(sd):
        for k in list(sd):
            sd[k] = sd[k].to(torch.float64)
        sd[Q_B][:] = 1e200
        sd[a_key][:] = 1e200

    big = damaged(adapters / "dense", tmp_path / "big", f64)
    out = tmp_path / "small"
    refused(hu.invoke(["resize-adapter", big, out, "--rank", "4"]), out, "model.layers.1.self_attn.q_proj", "SVD")
    hu.record("round4", tried=1, fixed=1)


def test_one_expert_spelled_two_ways_is_refused_naming_both_keys(adapters, tmp_path):
    def respell(sd):
        for k in [k for k in sd if ".experts.3." in k]:
            sd[k.replace(".experts.3.", ".experts.03.")] = sd[k] * 2

    bad = damaged(adapters / "moe", tmp_path / "bad", respell)
    out = tmp_path / "out"
    both = ("model.layers.0.mlp.experts.03.down_proj.lora_A.weight", "model.layers.0.mlp.experts.3.down_proj.lora_A")
    for args in (["resize-adapter", bad, out, "--rank", "4"], ["resize-adapter", bad, out, "--rank", "4",
                                                               "--layout", "vllm"],
                 ["average", bad, adapters / "moe", out]):
        refused(hu.invoke(args), out, *both, "ambiguous")
    doc = json.loads(hu.invoke(["inspect", bad, "--json"]).stdout)
    assert any("ambiguous" in p for p in json.dumps(doc).split('"')), doc
    hu.record("round4", tried=3, fixed=3)
