"""Checkpoints without optimizer moments: prime-rl's SignSGD (#3303) keeps no per-parameter state, so its DCP
holds no `app.optimizers.state.*` at all, only the param groups (`lr`, `weight_decay`, `initial_lr`, `params`).

Written for real by the factory (`HeadSpec(optimizer="sign_sgd")`): a dense LoRA run whose `modules_to_save`
(lm_head, norm) train whole, and a full fine-tune. Without moments the only mark of a trained base weight is
its FQN in the param group's `params`: main read the optimizer state alone, so it called the SignSGD full
fine-tune untrained (`export` refused it, `inspect` said "AdamW" with nothing trained, `slim` blamed the base)
and would merge a SignSGD LoRA run's modules_to_save from the base. Every command works on them and says
what is absent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from ckpt_tools.cli import main
from tests.factory.head_factory import make_head_run
from tests.factory.head_spec import HeadSpec

ABSENT = "no optimizer moments (exp_avg/exp_avg_sq/step): SignSGD keeps no optimizer state (prime-rl #3303)"


def run(*args, code=0):
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exit_code == code, (args, r.output)
    return r


def result(*args) -> dict:
    return json.loads(run(*args, "--json").stdout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    lora = HeadSpec.e_mts(optimizer="sign_sgd", lr=1e-3, max_steps=3, ckpt_interval=2)
    full = HeadSpec.g_fullft(optimizer="sign_sgd", lr=1e-3)
    return {"lora": make_head_run(tmp_path_factory.mktemp("sign-lora") / "run", lora),
            "full": make_head_run(tmp_path_factory.mktemp("sign-full") / "run", full)}


def state(ckpt: Path, tmp: Path) -> dict:
    """The checkpoint as torch's own DCP reader loads it."""
    dcp_to_torch_save(str(ckpt), str(tmp / "state.pt"))
    return torch.load(tmp / "state.pt", weights_only=False)


def same(a: dict, b: dict) -> bool:
    return load_file(a).keys() == load_file(b).keys() and all(
        load_file(a)[k].equal(load_file(b)[k]) for k in load_file(b))


def test_the_factorys_signsgd_checkpoints_hold_no_optimizer_state(runs):
    for paths in runs.values():
        keys = FileSystemReader(str(paths.checkpoint)).read_metadata().state_dict_metadata
        assert not [k for k in keys if k.startswith("app.optimizers.state.")]
        assert sorted(k for k in keys if k.startswith("app.optimizers.")) == [
            f"app.optimizers.param_groups.0.{f}" for f in ("initial_lr", "lr", "params", "weight_decay")]


def test_inspect_names_signsgd_says_what_is_absent_and_finds_what_was_trained(runs):
    full = result("inspect", runs["full"].checkpoint)["result"]
    assert full["optimizer"] == "SignSGD (stateless: no moments)" and full["training"] == "full fine-tune"
    assert full["optimizer_state"] == {"fields": [], "absent": ABSENT} and full["frozen_bytes"] == 0
    lora = result("inspect", runs["lora"].checkpoint)["result"]
    assert lora["modules_to_save"] == ["lm_head.weight", "model.norm.weight"]
    assert ABSENT in run("inspect", runs["lora"].checkpoint).stdout


def test_export_and_merge_equal_the_ground_truth(runs, tmp_path):
    full, lora = runs["full"], runs["lora"]
    run("export", full.checkpoint, tmp_path / "full")
    assert same(tmp_path / "full" / "model.safetensors", full.expected_hf / "model.safetensors")
    run("merge", lora.base_model, lora.checkpoint, tmp_path / "merged")   # modules_to_save: the trained ones
    assert same(tmp_path / "merged" / "model.safetensors", lora.expected_hf / "model.safetensors")


def test_slim_then_rehydrate_is_the_checkpoint_again(runs, tmp_path):
    lora = runs["lora"]
    r = result("slim", lora.checkpoint, tmp_path / "slim", "--base", lora.base_model)
    assert any(ABSENT in w for w in r["warnings"])
    r = result("rehydrate", tmp_path / "slim", tmp_path / "full", "--base", lora.base_model)
    assert any(ABSENT in w for w in r["warnings"])
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    before, after = state(lora.checkpoint, tmp_path / "a"), state(tmp_path / "full", tmp_path / "b")
    flat = lambda d, p="": {f"{p}{k}": v for k, v in d.items()} if not any(isinstance(v, dict) for v in d.values()) \
        else {k2: v2 for k, v in d.items() for k2, v2 in (flat(v, f"{p}{k}.") if isinstance(v, dict) else {f"{p}{k}": v}).items()}  # noqa: E731
    b, a = flat(before), flat(after)
    assert b.keys() == a.keys()
    assert all(torch.equal(b[k], a[k]) if isinstance(b[k], torch.Tensor) else b[k] == a[k] for k in b)
    # the trained modules_to_save stay in the slim (not dropped as frozen base weights)
    kept = json.loads((tmp_path / "slim" / "ckpt-slim-manifest.json").read_text())
    assert not {d["key"] for d in kept["dropped"]} & {"app.model.lm_head.weight", "app.model.model.norm.weight"}


def test_set_lr_changes_a_signsgd_checkpoints_lr_the_same_way(runs, tmp_path):
    ck = runs["lora"].checkpoint
    r = result("set-lr", ck, tmp_path / "lr", "--lr", "5e-4")
    assert any(ABSENT in w for w in r["warnings"])
    (tmp_path / "x").mkdir()
    st = state(tmp_path / "lr", tmp_path / "x")
    group = st["app"]["optimizers"]["param_groups"][0]
    assert group["lr"] == 5e-4 and group["initial_lr"] == 5e-4 and set(group) == {"lr", "weight_decay", "initial_lr",
                                                                                    "params"}
    assert st["app"]["optimizers"].get("state", {}) == {}


def test_report_average_and_restart_prep_work_and_say_what_is_absent(runs, tmp_path):
    lora = runs["lora"]
    rep = result("report", lora.checkpoint.parents[1], "--out", tmp_path / "r.html", "--base", lora.base_model)
    assert any(ABSENT in w for w in rep["warnings"]) and rep["ok"]
    avg = result("average", lora.checkpoints[2], lora.checkpoints[3], tmp_path / "avg", "--ema", "0.5")
    assert avg["ok"] and (tmp_path / "avg" / "adapter_model.safetensors").is_file()
    assert any(ABSENT in w for w in avg["warnings"])
    rp = result("restart-prep", lora.checkpoint, tmp_path / "rp", "--base", lora.base_model, "--lr", "5e-4",
                "--mode", "adapter")
    assert ABSENT in " ".join(rp["warnings"]) and rp["ok"]


# ------------------------------------------------------------------------------------------ over URLs
pytest.importorskip("fsspec")
from ckpt_tools.io import remote  # noqa: E402

from .remote_servers import HttpServer  # noqa: E402
from .test_remote import fresh_remote_state, s3, s3_env  # noqa: E402,F401


def test_over_http_and_s3_a_signsgd_full_fine_tune_reads_as_trained(runs, s3_env, tmp_path):
    full = runs["full"]
    trainer = full.checkpoint
    for p in sorted(trainer.iterdir()):
        s3_env.client.upload_file(str(p), "runs", f"sign/step_3/trainer/{p.name}")
    srv = HttpServer(trainer.parent)
    try:
        for i, url in enumerate((f"{srv.url}/trainer", "s3://runs/sign/step_3/trainer")):
            r = result("inspect", url)["result"]
            assert r["training"] == "full fine-tune" and r["optimizer_state"]["absent"] == ABSENT
            run("export", url, tmp_path / f"out{i}", "--config-from", full.base_model)
            assert same(tmp_path / f"out{i}" / "model.safetensors", full.expected_hf / "model.safetensors")
    finally:
        srv.close()
