from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import ckpt_tools.ops.inspect as inspect_mod
from ckpt_tools.cli import main
from ckpt_tools.formats.dcp.model import BytesEntry
from ckpt_tools.formats.dcp.reader import DcpCheckpoint

from .conftest import BASE, FIXTURE, TRAINER, json_payload


def run(*args):
    return CliRunner().invoke(main, list(map(str, args)))


def test_inspect_genuine_fixture_json():
    r = run("inspect", TRAINER, "--json")
    assert r.exit_code == 0, r.output
    rep = json_payload(r.stdout)
    assert rep["format"] == "dcp" and rep["keys"] == 229
    counts = {g: rep["groups"][g]["count"] for g in
              ("base", "lora", "optimizer_state", "param_groups", "scheduler", "progress", "other")}
    assert counts == {"base": 36, "lora": 42, "optimizer_state": 126, "param_groups": 13, "scheduler": 9,
                      "progress": 3, "other": 0}
    assert rep["lora"]["rank"] == 8 and rep["lora"]["modules"] == 21 and rep["lora"]["slots"] == [0]
    assert rep["lora"]["targets"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    assert rep["world_size"] == 4 and rep["step"] == 3 and rep["lr"] == 0.01
    assert rep["scheduler"]["type"] == "LinearLR"
    assert rep["frozen_bytes"] == rep["groups"]["base"]["bytes"]
    assert rep["frozen_bytes"] + rep["unique_bytes"] == sum(g["bytes"] for g in rep["groups"].values())
    assert 0 < rep["frozen_fraction"] < 1
    assert rep["alpha"]["alpha"] == 16.0 and rep["alpha"]["training_scale"] == 2.0


def test_inspect_human_output_and_step_dir():
    r = run("inspect", TRAINER.parent)
    assert r.exit_code == 0, r.output
    assert "world size 4" in r.output and "frozen" in r.output and "rank 8" in r.output


def test_inspect_lists_steps_of_a_checkpoints_dir():
    r = run("inspect", FIXTURE / "outputs" / "checkpoints", "--json")
    assert r.exit_code == 0, r.output
    rep = json_payload(r.stdout)
    assert [s["step"] for s in rep["steps"]] == [3] and rep["steps"][0]["complete"]


def test_inspect_reads_no_tensor_bytes(monkeypatch):
    opened = []
    real_open = DcpCheckpoint.open.__func__

    def spy(cls, *a, **kw):
        c = real_open(cls, *a, **kw)
        opened.append(c)
        return c

    monkeypatch.setattr(inspect_mod.DcpCheckpoint, "open", classmethod(spy))
    inspect_mod.inspect_dcp(TRAINER)
    (ckpt,) = opened
    byte_items = {(e.file, e.offset, e.length) for e in ckpt.entries.values() if isinstance(e, BytesEntry)}
    assert ckpt.stats.ranges
    assert all(r in byte_items for r in ckpt.stats.ranges)


def test_inspect_warns_when_run_config_alpha_disagrees_with_adapter_configs(fixture_copy):
    orch = fixture_copy / "outputs/run_default/configs/orch.toml"
    orch.write_text(orch.read_text().replace("alpha = 16.0", "alpha = 4.0"))
    r = run("inspect", fixture_copy / "outputs/checkpoints/step_3/trainer", "--json")
    rep = json_payload(r.stdout)
    assert rep["alpha"]["training_scale"] == 0.5
    assert any("wrong scale" in w for w in rep["warnings"])


def test_inspect_without_run_config_says_alpha_is_unknown(fixture_copy):
    import shutil
    shutil.rmtree(fixture_copy / "outputs/run_default")
    r = run("inspect", fixture_copy / "outputs/checkpoints/step_3/trainer", "--json")
    rep = json_payload(r.stdout)
    assert rep["alpha"] is None and "not stored" in rep["alpha_unresolved"]


def test_inspect_garbage_path_is_usage_error(tmp_path):
    r = run("inspect", tmp_path)
    assert r.exit_code == 2 and "cannot tell what this is" in r.output


def test_inspect_peft_dirs_flags_prime_rl_exports_that_apply_nothing():
    good = json_payload(run("inspect", FIXTURE / "reference_peft_adapter", "--json").stdout)
    assert good["format"] == "peft" and good["modules"] == 21 and good["rank"] == 8 and good["scale"] == 2.0
    assert good["warnings"] == []
    for broken in (FIXTURE / "outputs/weights/step_3/lora_adapters", FIXTURE / "outputs/run_default/broadcasts/step_3"):
        rep = json_payload(run("inspect", broken, "--json").stdout)
        assert rep["modules"] == 0 and rep["unrecognized_keys"] == 42
        assert any("fix-adapter" in w for w in rep["warnings"])


def test_inspect_hf_dir():
    rep = json_payload(run("inspect", BASE, "--json").stdout)
    assert rep["format"] == "hf" and rep["tensors"] == 36 and rep["dtypes"] == {"BF16": 36}


def test_inspect_keys_lists_every_key_with_its_group():
    rows = json_payload(run("inspect", TRAINER, "--keys", "--json").stdout)
    assert len(rows) == 229
    expected = [ln.split()[0] for ln in (FIXTURE / "dcp_keys.txt").read_text().splitlines()
                if ln.startswith("app.")]
    assert sorted(r["key"] for r in rows) == sorted(expected)
    by_key = {r["key"]: r for r in rows}
    assert by_key["app.model.model.layers.0.self_attn.q_proj.lora_A.0"]["group"] == "lora"
    assert by_key["app.scheduler._get_lr_called_within_step"]["group"] == "scheduler"
