"""ckpt restart-prep: merge mode gives a merged model diff-vs-base confirms (and bit-equal to the
fixture's expected merge) plus a config whose only changes are the intended ones; adapter mode
gives a checkpoint a 4-rank FSDP2 model loads strictly, with the adapter, a fresh AdamW, lr X and
the step kept."""
from __future__ import annotations

import difflib
import json
import tomllib
import warnings

import pytest
import torch
from click.testing import CliRunner

from ckpt_tools.cli import main

from .conftest import BASE, FIXTURE, TRAINER, json_payload
from .test_slim_rehydrate import bits, surgery_run

RL_TOML = """\
# fresh-LR restart test config (prime-rl `rl` layout)
max_steps = 20
seq_len = 2048

[model]
name = "Qwen/Qwen3-0.6B"  # the hub model

[model.lora]
rank = 8
alpha = 16.0

[orchestrator]
batch_size = 128

[trainer.optim]
lr = 1e-2  # was too high
weight_decay = 0.01

[ckpt] # checkpoint every 5 steps
interval = 5
resume_step = 3

[inference]
"""

TRAINER_TOML = """\
[model]
name = "Qwen/Qwen3-0.6B"

[optim]
lr = 1e-2

[ckpt]
resume_step = 3
"""


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def changed_lines(old: str, new: str) -> list[str]:
    return [ln for ln in difflib.unified_diff(old.splitlines(), new.splitlines(), lineterm="", n=0)
            if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    d = tmp_path_factory.mktemp("restart")
    cfg = d / "rl.toml"
    cfg.write_text(RL_TOML)
    out = d / "merged-step3"
    r = run("restart-prep", TRAINER, out, "--base", BASE, "--lr", "5e-3", "--config", cfg)
    assert r.exit_code == 0, r.output
    return d, out, cfg, r.output


def test_merge_mode_writes_a_merged_model_diff_vs_base_confirms(merged):
    _, out, _, _ = merged
    r = run("diff-vs-base", out, BASE, "--adapter", TRAINER, "--json")
    rep = json_payload(r.stdout)
    assert rep["adapter_check"]["passed"] and rep["adapter_check"]["exact"] == 21
    assert rep["counts"] == {"identical": 15, "differs": 21}
    r = run("diff-vs-base", out, FIXTURE / "expected_merged_hf")   # the fixture's ground-truth merge
    assert r.exit_code == 3 and "36 identical" in r.output


def test_merge_mode_config_changes_only_model_name_lr_and_resume(merged):
    d, out, cfg, output = merged
    new = (d / "merged-step3.rl.toml").read_text()
    assert cfg.read_text() == RL_TOML   # the source config is untouched
    assert changed_lines(RL_TOML, new) == [
        '-name = "Qwen/Qwen3-0.6B"  # the hub model', f'+name = "{out.resolve()}"  # the hub model',
        "-lr = 1e-2  # was too high", "+lr = 0.005  # was too high",
        "-resume_step = 3",
    ]
    want = tomllib.loads(RL_TOML)
    want["model"]["name"] = str(out.resolve())
    want["trainer"]["optim"]["lr"] = 5e-3
    del want["ckpt"]["resume_step"]
    assert tomllib.loads(new) == want
    assert f"uv run rl @ {d / 'merged-step3.rl.toml'}" in output


def test_trainer_config_keys_and_relative_includes_are_patched(tmp_path):
    (tmp_path / "cfg").mkdir()
    cfg = tmp_path / "cfg" / "train.toml"
    cfg.write_text('toml_files = ["base.toml"]\n' + TRAINER_TOML)
    r = run("restart-prep", FIXTURE / "outputs", tmp_path / "m", "--base", BASE, "--lr", "1e-4", "--config", cfg,
            "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    rep = json_payload(r.stdout)
    assert rep["checkpoint"] == str(TRAINER)   # the run's latest checkpoint
    assert {c["key"]: c["after"] for c in rep["config"]["changes"]} == {
        "toml_files": [str((tmp_path / "cfg" / "base.toml").resolve())], "model.name": str((tmp_path / "m").resolve()),
        "optim.lr": 1e-4, "ckpt.resume_step": None}
    assert rep["next"] == [f"uv run trainer @ {tmp_path / 'm.train.toml'}"]
    assert not (tmp_path / "m").exists() and not (tmp_path / "m.train.toml").exists()


def test_a_config_without_an_lr_key_is_refused_before_merging(tmp_path):
    cfg = tmp_path / "rl.toml"
    cfg.write_text(RL_TOML.replace("lr = 1e-2  # was too high\n", ""))
    r = run("restart-prep", TRAINER, tmp_path / "m", "--base", BASE, "--lr", "5e-3", "--config", cfg)
    assert r.exit_code == 1
    assert "no learning rate key found: looked for optim.lr, trainer.optim.lr" in r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rl.toml"]


@pytest.mark.slow
def test_adapter_mode_checkpoint_loads_strictly_with_adapter_fresh_adamw_new_lr_and_step(tmp_path_factory):
    from safetensors.torch import load_file

    from tests.factory.factory import FactorySpec, build_scheduler
    from tests.factory.fsdp_check import load_strict

    paths = surgery_run(tmp_path_factory)
    truth_json = json.loads(paths.truth_json.read_text())
    spec = FactorySpec.from_dict(truth_json["spec"])   # warmup 2 + cosine to max_steps 10
    d = tmp_path_factory.mktemp("restart-adapter")
    cfg = d / "rl.toml"
    cfg.write_text(f"max_steps = {spec.max_steps}\n\n[model]\nname = \"base_model\"\n\n[trainer.optim]\nlr = 0.01\n\n"
                   f"[scheduler]\ntype = \"cosine\"\nwarmup_steps = {spec.warmup_steps}\n")
    out = d / "outputs" / "checkpoints" / f"step_{spec.steps}" / "trainer"
    r = run("restart-prep", paths.root, out, "--mode", "adapter", "--base", paths.base_model, "--lr", "4e-3",
            "--config", cfg, "--json")
    assert r.exit_code == 0, r.output
    rep = json_payload(r.stdout)
    assert rep["step"] == spec.steps and rep["world_size"] == 4
    patched = (d / "rl.restart.toml").read_text()
    assert changed_lines(cfg.read_text(), patched) == ["-lr = 0.01", "+lr = 0.004", "+", "+[ckpt]",
                                                      f"+resume_step = {spec.steps}"]

    got = load_strict(out, paths.base_model, spec, world_size=4, steps_after=4)
    truth = load_file(str(paths.truth))
    for name, t in got["model"].items():
        if ".lora_" in name:
            module, ab, slot = name.rsplit(".", 2)
            assert torch.equal(bits(t), bits(truth[f"lora.{module}.slot{slot}.{ab[-1]}"])), name
    assert got["optim"] and all(not v.any() for v in got["optim"].values())   # fresh: zero moments, step 0
    assert got["progress"]["step"] == spec.steps
    # The restarted schedule: prime-rl's warmup + cosine for lr 4e-3, from position 0.
    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=4e-3)
    sched = build_scheduler(fresh, FactorySpec.from_dict({**truth_json["spec"], "lr": 4e-3}))
    want = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(4):
            sched.step()
            want.append(fresh.param_groups[0]["lr"])
    assert got["lr_trace"] == pytest.approx(want, rel=1e-12)
    assert max(got["lr_trace"]) == pytest.approx(4e-3, rel=1e-12)
