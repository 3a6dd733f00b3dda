"""torchtitan's DCP checkpoints (tests/fixtures/torchtitan-llama3-debug: written by torchtitan 0.3.0's own
CheckpointManager on its llama3 debugmodel, its README says how): detected, described, verified, and exported to
HF names equal to torchtitan's own `Llama3StateDictAdapter.to_hf` of the trained weights."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from ckpt_tools.core.errors import FormatError
from ckpt_tools.formats.torchtitan.keys import classify, require_known
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


HSDP_TP = FIXTURES / "torchtitan-llama3-hsdp-tp"
MOE = FIXTURES / "torchtitan-qwen3-moe-debug"


def test_an_hsdp_and_tensor_parallel_checkpoint_exports_torchtitans_own_to_hf(tmp_path):
    """8 ranks, dp_replicate 2 x dp_shard 2 x tp 2 (torchtitan's TP plan, then HSDP): DCP stores each tensor's
    global view in chunks of two dims (wo: Shard(1) over tp, rows over fsdp) and each replica once; the export is
    torchtitan's own `to_hf` of the gathered weights, bit for bit."""
    with TorchtitanCheckpoint.open(HSDP_TP) as ckpt:
        wo = ckpt.entries["layers.0.attention.wo.weight"]
        assert sorted(tuple(c.offsets) for c in wo.chunks) == [(0, 0), (0, 32), (32, 0), (32, 32)]
    r = run("verify", "--deep", HSDP_TP, "--json")
    assert r.exit_code == 0 and json_payload(r.output)["ok"], r.output
    r = run("export", HSDP_TP, tmp_path / "e", "--config-from", HSDP_TP / "hf_assets", "--dtype", "fp32")
    assert r.exit_code == 0, r.output
    got, want = load_file(tmp_path / "e" / "model.safetensors"), load_file(HSDP_TP / "truth_hf.safetensors")
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("cmd", ["inspect", "verify", "export"])
def test_a_mixture_of_experts_model_is_refused_by_name(cmd, tmp_path):
    """torchtitan's qwen3 MoE (its own builders and CheckpointManager): not read yet, and said so."""
    args = [cmd, MOE] + ([tmp_path / "e"] if cmd == "export" else []) + ["--json"]
    r = run(*args)
    doc = json.loads(r.stdout)
    # verify reports it as its problem; the others fail with it
    message = doc["result"]["problems"][0]["message"] if cmd == "verify" else doc["error"]["message"]
    assert r.exit_code == 1 and (cmd == "verify" or doc["error"]["type"] == "FormatError"), r.output
    assert "mixture-of-experts model: not read yet" in message and "layers.0.moe." in message
    assert not (tmp_path / "e").exists()


def test_torchtitans_lora_keys_are_refused_by_name():
    """`torchtitan/components/lora.py`: a LoRA linear holds `lora_a` / `lora_b` Linear modules beside its weight."""
    keys = ["layers.0.attention.wo.weight", "layers.0.attention.wo.lora_a.weight", "layers.0.attention.wo.lora_b.weight"]
    with pytest.raises(FormatError, match=r"torchtitan's LoRA: not read yet \(2 keys, e.g. layers.0.attention.wo.lora_a"):
        require_known([classify(k, (k,)) for k in keys], "x/.metadata")
    require_known([classify(k, (k,)) for k in keys[:1]], "x/.metadata")  # the plain weight is llama3's
