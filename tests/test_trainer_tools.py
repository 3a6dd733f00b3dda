"""verl's own `model_merger` (verl 0.9.1, in the trainers' venv: `make test-trainers`) run beside ours on the
genuine verl fixtures, its result characterised. Skipped unless CKPT_TRAINERS_PYTHON names that venv's python.

What it shows: for a full fine-tune verl's merger and `ckpt export` write the same bf16 weights; for a LoRA
run verl's merger writes the base, byte for byte (verl #7285: the LoRA is split off into `lora_adapter/`, never
added), which `ckpt diff-vs-base` reports as identical (exit 3), while `ckpt merge` writes `bf16(W + s*B@A)`."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from .conftest import FIXTURES
from .test_head_fixtures import run

PY = os.environ.get("CKPT_TRAINERS_PYTHON")
pytestmark = pytest.mark.skipif(
    not PY or not Path(PY).exists(), reason="CKPT_TRAINERS_PYTHON is not a python with verl (`make test-trainers`)"
)
ACTOR = Path("checkpoints") / "global_step_2" / "actor"


def verl_merge(fixture: Path, out: Path) -> Path:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # verl's venv, not our tree
    p = subprocess.run(
        [PY, "-m", "verl.model_merger", "merge", "--backend", "fsdp", "--local_dir", str(fixture / ACTOR),
         "--target_dir", str(out)],
        env=env, capture_output=True, text=True, timeout=900, cwd=out.parent,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out


def sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_verls_merger_writes_the_base_for_a_lora_run_and_diff_vs_base_says_so(tmp_path):
    fixture = FIXTURES / "verl-fsdp2-lora"
    out = verl_merge(fixture, tmp_path / "verl")
    assert sha(out / "model.safetensors") == sha(fixture / "base" / "model.safetensors")
    assert sha(out / "model.safetensors") == sha(fixture / "verl_merged" / "model.safetensors")  # the committed run
    r = run("diff-vs-base", out, fixture / "base")
    assert r.exit_code == 3 and "LoRA was not merged" in r.output
    assert run("merge", fixture / "base", fixture / "checkpoints", tmp_path / "ours").exit_code == 0
    assert run("diff-vs-base", tmp_path / "ours", fixture / "base", "--adapter", fixture / "checkpoints").exit_code == 0


def test_verls_merger_writes_the_base_for_an_hsdp_lora_run_too(tmp_path):
    """verl's HSDP checkpoint (4 ranks, fsdp_size 2): its merger reads ranks 0 and 1 (`total_shards` =
    fsdp_size) and again writes the base byte for byte; `ckpt merge` of the same checkpoint passes the
    adapter check against it."""
    fixture = FIXTURES / "verl-fsdp2-hsdp-lora"
    out = verl_merge(fixture, tmp_path / "verl")
    assert sha(out / "model.safetensors") == sha(fixture / "base" / "model.safetensors")
    assert run("diff-vs-base", out, fixture / "base").exit_code == 3
    assert run("merge", fixture / "base", fixture / "checkpoints", tmp_path / "ours").exit_code == 0
    assert run("diff-vs-base", tmp_path / "ours", fixture / "base", "--adapter", fixture / "checkpoints").exit_code == 0


def test_verls_merger_and_export_agree_on_a_full_fine_tune(tmp_path):
    fixture = FIXTURES / "verl-fsdp2-full"
    out = verl_merge(fixture, tmp_path / "verl")
    assert run("export", fixture / "checkpoints", tmp_path / "ours").exit_code == 0
    theirs, ours = load_file(out / "model.safetensors"), load_file(tmp_path / "ours" / "model.safetensors")
    assert sorted(theirs) == sorted(ours)
    for k, v in ours.items():
        assert theirs[k].dtype == v.dtype and torch.equal(theirs[k], v), k


def probe(fixture: Path, actor: Path, out: Path) -> subprocess.Popen:
    """verl's FSDPCheckpointManager.load_checkpoint of `actor` in the fixture's 2-rank setting, its report per
    rank at `out`.rank<R>.json (tests/factory/verl_probe.py)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.Popen(
        [PY, "-m", "tests.factory.verl_probe", str(fixture), str(actor), str(out)],
        env=env, cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


@pytest.mark.parametrize("name", ["verl-fsdp2-lora", "verl-fsdp1-lora", "verl-fsdp2-full"])
def test_verl_resumes_a_set_lr_checkpoint_at_the_new_lr_with_everything_else_as_saved(tmp_path, name):
    """`ckpt set-lr --scale 2`, then verl's own loading code: lr, initial_lr, base_lrs and _last_lr doubled, the
    resumed schedule (verl's cosine lambda over the loaded base_lrs) exactly doubled, every optimizer-state and
    model tensor and the RNG state as loaded from the original, one training step's change doubled."""

    fixture = FIXTURES / name
    assert run("set-lr", fixture / "checkpoints", tmp_path / "global_step_2", "--scale", "2").exit_code == 0
    runs = [probe(fixture, fixture / ACTOR, tmp_path / "orig"),
            probe(fixture, tmp_path / "global_step_2" / "actor", tmp_path / "x2")]
    for p in runs:
        out, _ = p.communicate(timeout=900)
        assert p.returncode == 0, out[-3000:]
    for rank in (0, 1):
        a = json.loads((tmp_path / f"orig.rank{rank}.json").read_text())
        b = json.loads((tmp_path / f"x2.rank{rank}.json").read_text())
        assert (b["lr"], b["initial_lr"]) == (2 * a["lr"], 2 * a["initial_lr"])
        assert b["base_lrs"] == [2 * x for x in a["base_lrs"]] and b["last_lr"] == [2 * x for x in a["last_lr"]]
        assert b["last_epoch"] == a["last_epoch"] and b["weight_decay"] == a["weight_decay"]
        assert b["lr_trace"] == [2 * x for x in a["lr_trace"]]  # a power of two: exact
        assert a["optimizer_state"] and b["optimizer_state"] == a["optimizer_state"]
        assert b["model"] == a["model"] and b["rng_cpu"] == a["rng_cpu"]
        # a step at twice the lr moves each parameter twice as far, up to fp32's rounding of p - lr * u
        moved = [(x, y) for x, y in zip(a["step_deltas"], b["step_deltas"]) if x]
        assert moved and sum(abs(y - 2 * x) for x, y in moved) < 1e-5 * sum(abs(2 * x) for x, _y in moved)


def test_torchtitan_resumes_its_lr_from_the_config_which_is_why_set_lr_refuses_it(tmp_path):
    """torchtitan's CheckpointManager.load of the fixture under config lr 8e-4 (the run's) and 1.6e-3: the
    checkpoint's param-group lr serves the first resumed step in both, every later lr is the config's lr x
    lambda(step) (LRSchedulersContainer saves only last_epoch): the config is the setting, as `ckpt set-lr`
    says when it refuses."""
    fixture = FIXTURES / "torchtitan-llama3-debug"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    runs = {
        lr: subprocess.Popen([PY, "-m", "tests.factory.torchtitan_probe", str(fixture), lr, str(tmp_path / lr)],
                             env=env, cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        for lr in ("8e-4", "1.6e-3")
    }
    for p in runs.values():
        out, _ = p.communicate(timeout=900)
        assert p.returncode == 0, out[-3000:]
    a, b = (json.loads((tmp_path / lr).read_text()) for lr in runs)
    assert a["lr_now"] == b["lr_now"] and a["last_epoch"] == b["last_epoch"] == 3  # the checkpoint's, once
    assert a["base_lrs"] == [8e-4] and b["base_lrs"] == [1.6e-3]  # the config's
    assert b["trace"] == [2 * x for x in a["trace"]] and a["trace"][0] != a["lr_now"]
    r = run("set-lr", fixture / "checkpoint", tmp_path / "out", "--lr", "1.6e-3")
    assert r.exit_code == 2 and "config is the setting" in r.output and not (tmp_path / "out").exists()
