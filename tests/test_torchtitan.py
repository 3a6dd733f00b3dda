"""torchtitan's DCP checkpoints (tests/fixtures/torchtitan-llama3-debug: written by torchtitan 0.3.0's own
CheckpointManager on its llama3 debugmodel, its README says how): detected, described, verified, and exported to
HF names equal to torchtitan's own `Llama3StateDictAdapter.to_hf` of the trained weights."""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from ckpt_tools.formats.torchtitan.reader import TorchtitanCheckpoint, hf_row_source

from .conftest import FIXTURES, json_payload
from .test_head_fixtures import run

TT = FIXTURES / "torchtitan-llama3-debug"
STEP = TT / "checkpoint" / "step-3"
HF_ASSETS = TT / "hf_assets"


@pytest.mark.parametrize("where", [TT, TT / "checkpoint", STEP], ids=["dump", "folder", "step"])
def test_inspect_names_a_torchtitan_checkpoint_and_what_it_holds(where):
    r = run("inspect", where, "--json")
    assert r.exit_code == 0, r.output
    rep = json_payload(r.output)
    assert rep["format"] == "torchtitan" and rep["model_family"] == "llama3" and rep["hf_rows_permuted"]
    assert rep["step"] == 3 and rep["lr_scheduler_last_epoch"] == 3 and rep["model_tensors"] == 21
    assert rep["groups"]["optimizer_state"] == 51 and not rep["model_only"]


def test_inspect_keys_give_each_model_key_its_hf_name():
    rows = json_payload(run("inspect", STEP, "--keys", "--json").output)
    by_key = {r["key"]: r for r in rows}
    assert by_key["layers.1.attention.qkv_linear.wk.weight"]["hf_name"] == "model.layers.1.self_attn.k_proj.weight"
    assert by_key["tok_embeddings.weight"]["hf_name"] == "model.embed_tokens.weight"
    assert by_key["lr_scheduler.last_epoch"]["group"] == "scheduler"


def test_verify_deep_is_dcps_with_torchtitans_key_model():
    r = run("verify", "--deep", TT, "--json")
    assert r.exit_code == 0, r.output
    rep = json_payload(r.output)
    assert rep["ok"] and rep["format"] == "torchtitan" and rep["warnings"] == []


def test_the_hf_view_is_torchtitans_own_to_hf_bit_for_bit():
    truth = load_file(TT / "truth_hf.safetensors")
    config = {"num_attention_heads": 4, "num_key_value_heads": 2}
    with TorchtitanCheckpoint.open(TT) as ckpt:
        src = ckpt.base_weights(config=config)
        assert sorted(src.names()) == sorted(truth)
        for name in src.names():
            assert torch.equal(src.read_tensor(name), truth[name]), name
        assert src.extents("model.layers.0.self_attn.q_proj.weight") is not None  # per-row ranges, no copy


@pytest.mark.parametrize("dtype, cast", [(None, torch.bfloat16), ("fp32", torch.float32)])
def test_export_writes_the_trained_weights_under_hf_names(dtype, cast, tmp_path):
    args = ["--dtype", dtype] if dtype else []
    r = run("export", TT, tmp_path / "e", "--config-from", HF_ASSETS, *args)
    assert r.exit_code == 0, r.output
    got = load_file(tmp_path / "e" / "model.safetensors")
    want = {k: v.to(cast) for k, v in load_file(TT / "truth_hf.safetensors").items()}
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def test_export_needs_the_hf_config_for_the_head_counts(tmp_path):
    r = run("export", TT, tmp_path / "e")
    assert r.exit_code != 0 and "--config-from" in r.output and not (tmp_path / "e").exists()


def test_the_row_permutation_is_the_adapters():
    """`Llama3StateDictAdapter._permute`: w.view(n, hd/2, 2, dim).transpose(1, 2).reshape(rows, dim)."""
    for rows, heads in ((64, 4), (32, 2), (16, 1)):
        w = torch.arange(rows).reshape(rows, 1).float()
        want = w.view(heads, rows // heads // 2, 2, 1).transpose(1, 2).reshape(rows, 1)
        assert [hf_row_source(r, rows, heads) for r in range(rows)] == want.flatten().long().tolist()


def test_an_unknown_key_layout_is_an_error_naming_the_key(tmp_path):
    step = tmp_path / "checkpoint" / "step-1"
    dcp.save({"tok_embeddings.weight": torch.zeros(4, 2), "mystery.scale": torch.ones(2)}, checkpoint_id=step,
             no_dist=True)
    r = run("inspect", tmp_path)
    assert r.exit_code != 0 and "mystery.scale" in r.output and "torchtitan's key model" in r.output
