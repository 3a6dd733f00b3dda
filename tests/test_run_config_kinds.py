"""`--run-config` takes every prime-rl config that says the training alpha (#32, item 3): the `rl` entrypoint's
combined config (the seed's download layout: `checkpoint_step_N/` beside `code/rl_32b.toml`), the
orchestrator's, HEAD's trainer config and resolved JSON, with one provenance rule per generation: at
16e747c the orchestrator's alpha is what training applied (default 16.0, whatever the trainer's says), so a
16e747c trainer config alone cannot tell and is refused, naming the files that can.

On the genuine 16e747c fixture (`primerl-tiny`: orchestrator alpha 16, rank 8) laid out as the download."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file

from ckpt_tools.cli import main

from .conftest import BASE, FIXTURE, TRAINER

RL_TOML = """[model]
name = "Qwen/Qwen3-32B"

[trainer.model.lora]
rank = 8
alpha = 64.0
target_modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

[trainer.optim]
lr = 1e-2
{orch}"""
ORCH_LORA = "\n[orchestrator.model.lora]\nalpha = 16.0\n"
TRAINER_TOML = """[model.lora]
rank = 8
alpha = 64.0
target_modules = ["q_proj", "v_proj"]

[optim]
lr = 1e-2
"""


def run(*args, code=0):
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exit_code == code, (args, r.output)
    return r


@pytest.fixture()
def download(tmp_path) -> Path:
    """The seed's download layout: the checkpoint dir and the code/ dir with the run's rl config."""
    shutil.copytree(TRAINER, tmp_path / "checkpoint_step_3")
    (tmp_path / "code").mkdir()
    return tmp_path


def weights(d: Path) -> dict:
    return load_file(str(d / "adapter_model.safetensors"))


def test_the_combined_rl_config_gives_the_orchestrators_alpha(download):
    cfg = download / "code" / "rl_32b.toml"
    cfg.write_text(RL_TOML.format(orch=ORCH_LORA))
    r = json.loads(run("extract-adapter", download / "checkpoint_step_3", download / "ad", "--run-config", cfg,
                       "--json").stdout)["result"]
    assert r["alpha"] == 16.0 and r["alpha_source"] == f"--run-config {cfg} ([orchestrator.model.lora] alpha)"
    run("extract-adapter", download / "checkpoint_step_3", download / "ref", "--alpha", "16")
    assert weights(download / "ad").keys() == weights(download / "ref").keys()
    assert json.loads((download / "ad" / "adapter_config.json").read_text())["lora_alpha"] == 16.0


def test_a_combined_config_without_an_orchestrator_alpha_takes_its_default_and_says_so(download):
    cfg = download / "code" / "rl.toml"
    cfg.write_text(RL_TOML.format(orch=""))
    r = run("inspect", download / "checkpoint_step_3", "--run-config", cfg, "--json")
    out = json.loads(r.stdout)
    assert out["result"]["alpha"]["alpha"] == 16.0
    assert (f"{cfg} has no [orchestrator.model.lora] alpha; prime-rl's orchestrator default 16 applies "
            "(not [trainer.model.lora] alpha 64)") in out["warnings"]


@pytest.mark.parametrize("command", ["merge", "export", "restart-prep", "diff-vs-base"])
def test_every_command_taking_run_config_reads_the_combined_config(download, command, tmp_path):
    cfg = download / "code" / "rl.toml"
    cfg.write_text(RL_TOML.format(orch=ORCH_LORA))
    ck, out = download / "checkpoint_step_3", tmp_path / "out"
    argv = {"merge": ["merge", BASE, ck, out],
            "export": ["export", ck, out, "--config-from", BASE],
            "restart-prep": ["restart-prep", ck, out, "--base", BASE, "--lr", "1e-3", "--dry-run"],
            "diff-vs-base": ["diff-vs-base", FIXTURE / "expected_merged_hf", BASE, "--adapter", ck]}[command]
    r = run(*argv, "--run-config", cfg, "--json")
    assert "[orchestrator.model.lora] alpha" in r.stdout and '"ok": true' in r.stdout, r.stdout


def test_an_orchestrator_config_works_as_before(download):
    orch = FIXTURE / "outputs" / "run_default" / "configs" / "orch.toml"
    r = json.loads(run("inspect", download / "checkpoint_step_3", "--run-config", orch, "--json").stdout)
    assert r["result"]["alpha"]["alpha"] == 16.0 and r["result"]["alpha"]["source"] == f"--run-config {orch}"


def test_a_16e747c_trainer_config_is_refused_naming_what_does_say(download):
    cfg = download / "code" / "train.toml"
    cfg.write_text(TRAINER_TOML)
    r = run("extract-adapter", download / "checkpoint_step_3", download / "ad", "--run-config", cfg, code=1)
    assert ("a trainer config (trainer [model.lora] keys (target_modules)) says alpha 64.0: the file does not say "
            "which prime-rl wrote it; at 16e747c training applied the orchestrator's [model.lora] alpha (default 16)"
            ) in " ".join(r.output.split())
    assert "outputs/run_*/configs/orch.toml" in r.output and not (download / "ad").exists()


def test_a_head_trainer_config_gives_the_trainers_alpha(download):
    cfg = download / "code" / "train.toml"
    cfg.write_text(TRAINER_TOML + "\n[resume]\nstep = 3\n")   # [resume]: a key only HEAD's trainer config has
    r = json.loads(run("inspect", download / "checkpoint_step_3", "--run-config", cfg, "--json").stdout)
    assert r["result"]["alpha"]["alpha"] == 64.0
    assert r["result"]["alpha"]["source"] == f"--run-config {cfg} ([model.lora] alpha)"
    assert r["result"]["alpha"]["rule"].startswith("HEAD: scale = trainer model.lora.alpha / rank")


def test_a_launch_attempts_rl_toml_is_heads_rule(download):
    d = download / "outputs" / "configs" / "attempt_1"
    d.mkdir(parents=True)
    (d / "rl.toml").write_text(RL_TOML.format(orch=""))
    r = json.loads(run("inspect", download / "checkpoint_step_3", "--run-config", d / "rl.toml", "--json").stdout)
    assert r["result"]["alpha"]["alpha"] == 64.0 and "[trainer.model.lora] alpha" in r["result"]["alpha"]["source"]
