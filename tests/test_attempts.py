"""A prime-rl run launched more than once (after August 2026): one config dir per launch attempt.

The run is written for real by the factory (`tests/factory/head_attempts.py`): attempt 1 trains a dense LoRA
with alpha 16 and lr 1e-2 (checkpoints at steps 2 and 4), attempt 2 resumes from step 4 with alpha 32 and
lr 5e-3 (checkpoint at step 6). Each checkpoint merges with the alpha of the launch that wrote it: the bug
(main until #36) used the newest attempt's (`configs/latest`) for all of them, a silent wrong scale. The
same over `latest` as a plain dir, a dangling `latest`, no `latest`, a bare `--resume` (decided by time, or
refused when nothing tells and the alphas differ), `$PRL_ATTEMPT_CONFIG_DIR`, and over HTTP and S3.
"""

from __future__ import annotations

import json
import os
import shutil
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file

from ckpt_tools.cli import main
from ckpt_tools.formats.primerl.attempts import run_attempts, writer_of
from tests.factory.head_attempts import make_head_attempts
from tests.factory.head_spec import HeadSpec

from .conftest import FIXTURE

SHAPE = dict(world_size=2, num_layers=2, intermediate_size=128, ckpt_interval=2, scheduler="constant")
ALPHAS = {2: 16.0, 4: 16.0, 6: 32.0}


def run(*args, code=0, env=None):
    r = CliRunner().invoke(main, [str(a) for a in args], env=env)
    assert r.exit_code == code, (args, r.output)
    return r


def alpha_of(trainer: Path, *extra, env=None) -> dict:
    out = json.loads(run("inspect", trainer, "--json", *extra, env=env).stdout)["result"]
    return out["alpha"] or {"unresolved": out.get("alpha_unresolved")}


@pytest.fixture(scope="module")
def attempts(tmp_path_factory):
    first = HeadSpec.e_dense(**SHAPE, max_steps=4, lora_alpha=16.0, lr=1e-2)
    second = HeadSpec.e_dense(**SHAPE, max_steps=6, lora_alpha=32.0, lr=5e-3)
    return make_head_attempts(tmp_path_factory.mktemp("attempts") / "run", [first, second], [4])


def trainer(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step}" / "trainer"


def copy_run(src: Path, dst: Path) -> Path:
    """The run dir (configs, checkpoints) copied with its links as links; returns the copy's run dir."""
    shutil.copytree(src, dst / "outputs", symlinks=True, ignore=shutil.ignore_patterns("broadcasts"))
    return dst / "outputs"


# ------------------------------------------------------------------------------------------ local
def test_each_checkpoint_merges_with_the_alpha_of_the_launch_that_wrote_it(attempts, tmp_path):
    assert attempts.wrote == ((2, 4), (6,))
    for step, alpha in ALPHAS.items():
        got = alpha_of(trainer(attempts.run_dir, step))
        n = attempts.attempt_of(step)
        assert got["alpha"] == alpha, got
        assert f"configs/attempt_{n}/resolved/trainer.json" in got["source"] and "by step range" in got["source"]
    # the merge of step_4 (attempt 1) is the merge with --alpha 16, not 32; step_6's is the ground truth
    base = attempts.paths.base_model
    run("merge", base, trainer(attempts.run_dir, 4), tmp_path / "auto")
    run("merge", base, trainer(attempts.run_dir, 4), tmp_path / "a16", "--alpha", "16")
    run("merge", base, trainer(attempts.run_dir, 4), tmp_path / "a32", "--alpha", "32")
    auto, a16, a32 = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("auto", "a16", "a32"))
    assert all(auto[k].equal(a16[k]) for k in a16) and not all(auto[k].equal(a32[k]) for k in a32)
    run("merge", base, trainer(attempts.run_dir, 6), tmp_path / "last")
    last = load_file(str(tmp_path / "last" / "model.safetensors"))
    expected = load_file(str(attempts.paths.expected_hf / "model.safetensors"))
    assert last.keys() == expected.keys() and all(last[k].equal(expected[k]) for k in expected)


@pytest.mark.parametrize("latest", ["copy", "dangling", "absent"])
def test_latest_copied_as_a_dir_dangling_or_gone_changes_nothing(attempts, tmp_path, latest):
    run_dir = copy_run(attempts.run_dir, tmp_path)
    link = run_dir / "configs" / "latest"
    link.unlink()
    if latest == "copy":
        shutil.copytree(run_dir / "configs" / "attempt_2", link)
    elif latest == "dangling":
        os.symlink("attempt_9", link)
    found = run_attempts(run_dir)
    assert [a.label for a in found.attempts] == ["attempt_1", "attempt_2"]
    assert found.latest.startswith({"copy": "a plain dir, a copy of attempt_2", "dangling": "a dangling link",
                                    "absent": "absent"}[latest])
    for step, alpha in ALPHAS.items():
        assert alpha_of(trainer(run_dir, step))["alpha"] == alpha


def test_a_latest_dir_unlike_every_attempt_is_the_newest_launch(attempts, tmp_path):
    """An object store's copy of `latest` whose attempt dir was not copied: the newest launch, by its own
    resume step (step 6 is its; steps 2 and 4 stay attempt 1's)."""
    run_dir = copy_run(attempts.run_dir, tmp_path)
    (run_dir / "configs" / "latest").unlink()
    shutil.move(run_dir / "configs" / "attempt_2", run_dir / "configs" / "latest")
    assert [a.label for a in run_attempts(run_dir).attempts] == ["attempt_1", "configs/latest (a plain dir)"]
    for step, alpha in ALPHAS.items():
        assert alpha_of(trainer(run_dir, step))["alpha"] == alpha


def bare_resume(run_dir: Path) -> None:
    """Attempt 2 as launched with a bare `--resume` (the latest checkpoint; no step in its configs)."""
    for name in ("trainer.json", "rl.json"):
        f = run_dir / "configs" / "attempt_2" / "resolved" / name
        t = f.stat().st_mtime
        data = json.loads(f.read_text())
        data["resume"] = {"step": None, "dir": None}
        f.write_text(json.dumps(data, indent=2))
        os.utime(f, (t, t))


def test_a_bare_resume_is_decided_by_time_and_refused_when_nothing_tells(attempts, tmp_path):
    run_dir = tmp_path / "outputs"
    shutil.copytree(attempts.run_dir, run_dir, symlinks=True, ignore=shutil.ignore_patterns("broadcasts"),
                    copy_function=shutil.copy2)  # times kept
    bare_resume(run_dir)
    for step, alpha in ALPHAS.items():
        got = alpha_of(trainer(run_dir, step))
        assert got["alpha"] == alpha, got
    assert "by time" in alpha_of(trainer(run_dir, 4))["source"]
    assert "only launch that can have run step 6" in alpha_of(trainer(run_dir, 6))["source"]
    # a copy that reset every time (all files now): steps up to 4 may be either launch's, alphas 16 and 32
    now = os.path.getmtime(run_dir)
    for f in run_dir.rglob("*"):
        os.utime(f, (now, now), follow_symlinks=False)
    got = alpha_of(trainer(run_dir, 4))
    assert got["unresolved"].startswith("LoRA alpha is not stored in the checkpoint, and the launches of its run "
                                        "that may have written it disagree: attempt_1 (fresh, max_steps 4): "
                                        "alpha 16; attempt_2 (resumed from the latest step, max_steps 6): alpha 32")
    r = run("extract-adapter", trainer(run_dir, 4), tmp_path / "ad", code=1)
    assert "configs/attempt_<n>/resolved/trainer.json" in r.output and not (tmp_path / "ad").exists()
    named = run_dir / "configs" / "attempt_1" / "resolved" / "trainer.json"
    assert alpha_of(trainer(run_dir, 4), "--run-config", named)["alpha"] == 16.0
    assert alpha_of(trainer(run_dir, 4), "--alpha", "16")["alpha"] == 16.0


def test_attempts_that_agree_on_alpha_need_no_decision(attempts, tmp_path):
    run_dir = copy_run(attempts.run_dir, tmp_path)
    bare_resume(run_dir)
    f = run_dir / "configs" / "attempt_2" / "resolved" / "trainer.json"
    data = json.loads(f.read_text())
    data["model"]["lora"]["alpha"] = 16.0
    f.write_text(json.dumps(data))
    now = os.path.getmtime(run_dir)
    for p in run_dir.rglob("*"):
        os.utime(p, (now, now), follow_symlinks=False)
    assert writer_of(run_attempts(run_dir), 4).attempt is None
    got = alpha_of(trainer(run_dir, 4))
    assert got["alpha"] == 16.0 and "attempt_1, attempt_2 may have written it and all say alpha 16" in got["source"]


def test_prl_attempt_config_dir_is_the_config_dir_of_a_run_without_its_own(attempts, tmp_path):
    run_dir = copy_run(attempts.run_dir, tmp_path)
    elsewhere = tmp_path / "pinned"
    shutil.move(run_dir / "configs" / "attempt_1" / "resolved", elsewhere)
    shutil.rmtree(run_dir / "configs")
    assert alpha_of(trainer(run_dir, 4))["unresolved"].startswith("LoRA alpha is not stored in a DCP checkpoint")
    got = alpha_of(trainer(run_dir, 4), env={"PRL_ATTEMPT_CONFIG_DIR": str(elsewhere)})
    assert got["alpha"] == 16.0 and str(elsewhere / "trainer.json") in got["source"]
    # a run with its own config dirs keeps deciding by them; the variable naming another dir is said ignored
    found = run_attempts(attempts.run_dir, env={"PRL_ATTEMPT_CONFIG_DIR": str(elsewhere)})
    assert [a.label for a in found.attempts] == ["attempt_1", "attempt_2"]
    assert found.notes == (f"$PRL_ATTEMPT_CONFIG_DIR={elsewhere} is not one of this run's config dirs: ignored",)


def test_inspect_and_doctor_list_the_launches_and_their_alphas_and_lrs(attempts):
    got = json.loads(run("inspect", trainer(attempts.run_dir, 4), "--json").stdout)["result"]
    assert [(a["attempt"], a["alpha"], a["lr"], a["resume_step"]) for a in got["attempts"]] == [
        ("attempt_1", 16.0, 0.01, None), ("attempt_2", 32.0, 0.005, 4)]
    assert got["written_by"]["attempt"] == "attempt_1"
    doc = json.loads(run("doctor", attempts.paths.root, "--json", code=3).stdout)["result"]
    assert [a["attempt"] for a in doc["attempts"]] == ["attempt_1", "attempt_2"]
    found = {f["trap"]: f for f in doc["findings"]}
    assert "attempt_1: alpha 16.0, wrote steps 2, 4; attempt_2: alpha 32.0, wrote step 6" in found["attempts-alpha"]["why"]
    assert found["attempts-lr"]["severity"] == "info"


def test_resume_instructions_take_the_runs_generations_form(attempts, tmp_path):
    """HEAD (the run's resolved JSON): --resume.step N with the run's --run.name, also patched into a config;
    16e747c (the genuine tiny run's orch.toml): ckpt.resume_step."""
    name = "reverse-text--base-model--h36"
    doc = json.loads(run("doctor", attempts.paths.root, "--json", code=3).stdout)["result"]
    assert f"to resume at step 6: relaunch with --resume.step 6 --run.name {name}" in " ".join(doc["notes"])
    rp = json.loads(run("restart-prep", trainer(attempts.run_dir, 6), tmp_path / "o", "--base",
                        attempts.paths.base_model, "--lr", "1e-3", "--mode", "adapter", "--json").stdout)["result"]
    assert rp["generation"] == "head" and rp["next"][0].startswith(f"relaunch with --resume.step 6 --run.name {name}")
    cfg = tmp_path / "rl.toml"
    cfg.write_text('[model]\nname = "base_model"\n\n[trainer.optim]\nlr = 5e-3\n\n[ckpt]\nresume_step = 4\n')
    run("restart-prep", trainer(attempts.run_dir, 6), tmp_path / "o2", "--base", attempts.paths.base_model, "--lr",
        "1e-3", "--mode", "adapter", "--config", cfg, "--config-out", tmp_path / "new.toml")
    new = tomllib.loads((tmp_path / "new.toml").read_text())
    assert new["resume"] == {"step": 6} and new["run"] == {"name": name} and "resume_step" not in new["ckpt"]
    tiny = FIXTURE / "outputs" / "checkpoints" / "step_3" / "trainer"
    rp = json.loads(run("restart-prep", tiny, tmp_path / "t", "--base", FIXTURE / "base_model", "--lr", "1e-3",
                        "--mode", "adapter", "--json").stdout)["result"]
    assert rp["generation"] == "16e747c" and rp["next"][0].startswith("resume with ckpt.resume_step = 3")
    assert "resume with ckpt.resume_step = 3" in run("inspect", FIXTURE / "outputs" / "checkpoints").stdout


# ------------------------------------------------------------------------------------------ over URLs
# (the remote layer's own fixtures: fresh URL state per test, the moto S3 server)
pytest.importorskip("fsspec")

from .remote_servers import HttpServer  # noqa: E402
from .test_remote import fresh_remote_state, s3, s3_env  # noqa: E402,F401


def url_alpha(url: str, *extra, code=0) -> dict:
    """The alpha `inspect` finds for `url` (each command its own remote session: nothing to forget after)."""
    return alpha_of(url, *extra) if code == 0 else {"output": run("inspect", url, *extra, code=code).output}


def test_over_http_each_checkpoint_takes_its_launchs_alpha(attempts, tmp_path):
    """An HTTP server lists `latest` as a dir (a copy, as an object store has it): the same alphas, from the
    attempt dirs at the URL, and the adapter of step 4 equals the local one."""
    copy = copy_run(attempts.run_dir, tmp_path / "served")
    srv = HttpServer(tmp_path / "served")
    try:
        for step, alpha in ALPHAS.items():
            got = url_alpha(f"{srv.url}/outputs/checkpoints/step_{step}/trainer")
            assert got["alpha"] == alpha and f"{srv.url}/outputs/configs/attempt_" in got["source"], got
        run("extract-adapter", f"{srv.url}/outputs/checkpoints/step_4/trainer", tmp_path / "url-ad")
    finally:
        srv.close()
    run("extract-adapter", trainer(copy, 4), tmp_path / "local-ad")
    assert (tmp_path / "url-ad" / "adapter_model.safetensors").read_bytes() == \
        (tmp_path / "local-ad" / "adapter_model.safetensors").read_bytes()
    assert json.loads((tmp_path / "url-ad" / "adapter_config.json").read_text())["lora_alpha"] == 16.0


def test_over_s3_each_checkpoint_takes_its_launchs_alpha(attempts, s3_env, tmp_path):
    """In a bucket (no symlinks: `latest` uploaded as a copy of attempt 2), a bare resume decided by the
    step ranges alone (no file times over a URL), and the disagreement refused."""
    for p in sorted(attempts.run_dir.rglob("*")):
        if p.is_file() and "broadcasts" not in p.parts:
            s3_env.client.upload_file(str(p), "runs", f"att/outputs/{p.relative_to(attempts.run_dir).as_posix()}")
    for step, alpha in ALPHAS.items():
        got = url_alpha(f"s3://runs/att/outputs/checkpoints/step_{step}/trainer")
        assert got["alpha"] == alpha and "s3://runs/att/outputs/configs/attempt_" in got["source"], got
    bare = tmp_path / "bare"
    copy_run(attempts.run_dir, bare)
    bare_resume(bare / "outputs")
    for name in ("trainer.json", "rl.json"):
        s3_env.client.upload_file(str(bare / "outputs" / "configs" / "attempt_2" / "resolved" / name), "runs",
                                  f"att/outputs/configs/attempt_2/resolved/{name}")
    assert url_alpha("s3://runs/att/outputs/checkpoints/step_6/trainer")["alpha"] == 32.0
    got = url_alpha("s3://runs/att/outputs/checkpoints/step_2/trainer")
    assert "the launches of its run that may have written it disagree" in got["unresolved"], got
