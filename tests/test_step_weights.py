"""HF weights beside a checkpoint's trainer/ (prime-rl after August 2026: its converters write
`checkpoints/step_N/weights` (bf16) and `step_N/weights-FP8` (block FP8) from the step's DCP, full fine-tunes
only). The fixture is a factory full fine-tune whose step dirs get those dirs from our own `ckpt export`
(bf16 and `--dtype fp8`) under prime-rl's names. inspect lists them and says how to check them; diff-vs-base
proves `weights/` is (or is not) the step's trained weights; gc keeps them and counts their bytes; verify
checks them as the HF dirs they are, and calls an incomplete one out; a LoRA step's `weights` equal to the
base is called out by doctor. The same over HTTP and S3."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckpt_tools.cli import main
from tests.factory.head_factory import make_head_run
from tests.factory.head_spec import HeadSpec


def run(*args, code=0):
    r = CliRunner().invoke(main, [str(a) for a in args])
    assert r.exit_code == code, (args, r.output)
    return r


def result(*args, code=0) -> dict:
    return json.loads(run(*args, "--json", code=code).stdout)["result"]


def tree_digest(d: Path) -> dict:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    paths = make_head_run(tmp_path_factory.mktemp("weights") / "run", HeadSpec.g_fullft(ckpt_interval=2))
    for step in (2, 3):
        step_dir = paths.checkpoints[step].parent
        run("export", step_dir / "trainer", step_dir / "weights")
        run("export", step_dir / "trainer", step_dir / "weights-FP8", "--dtype", "fp8")
    return paths


def step_dir(paths, n: int) -> Path:
    return paths.checkpoints[n].parent


def test_inspect_lists_the_weights_beside_trainer_and_how_to_check_them(full):
    r = result("inspect", step_dir(full, 3))
    beside = {b["name"]: b for b in r["beside"]}
    assert beside.keys() == {"weights", "weights-FP8"}
    assert (beside["weights"]["kind"], beside["weights-FP8"]["kind"]) == ("bf16 HF weights", "block-FP8 HF weights")
    assert all(b["complete"] and b["bytes"] > 0 for b in beside.values())
    assert beside["weights"]["check"] == f"ckpt diff-vs-base {step_dir(full, 3) / 'weights'} {full.checkpoints[3]}"
    listing = {s["step"]: s for s in result("inspect", full.checkpoints[3].parents[1])["steps"]}
    assert {b["name"] for b in listing[2]["beside"]} == {"weights", "weights-FP8"}


def test_diff_vs_base_proves_whether_weights_is_the_steps_trained_weights(full, tmp_path):
    r = result("diff-vs-base", step_dir(full, 3) / "weights", full.checkpoints[3], code=3)
    assert r["verdict"] == "identical_rounded" and r["summary"].startswith("the same weights: 25 of 25")
    wrong = tmp_path / "wrong"   # another step's export put in its place
    shutil.copytree(step_dir(full, 2) / "weights", wrong)
    r = result("diff-vs-base", wrong, full.checkpoints[3], code=0)
    assert r["verdict"] == "differs"
    # the FP8 dir is this step's FP8 export
    run("export", full.checkpoints[3], tmp_path / "fp8", "--dtype", "fp8")
    assert result("diff-vs-base", step_dir(full, 3) / "weights-FP8", tmp_path / "fp8", code=3)["verdict"] == "identical"


def test_gc_keeps_the_weights_dirs_and_counts_their_bytes(full, tmp_path):
    ck = tmp_path / "checkpoints"
    shutil.copytree(full.checkpoints[3].parents[1], ck)
    before = {n: tree_digest(ck / f"step_{n}" / w) for n in (2, 3) for w in ("weights", "weights-FP8")}
    plan = json.loads(run("gc", ck, "--keep-full", "1", "--min-age", "0", "--json").stdout)["plan"]
    sizes = sum(f.stat().st_size for n in (2, 3) for w in ("weights", "weights-FP8")
                for f in (ck / f"step_{n}" / w).rglob("*") if f.is_file())
    assert plan["kept_beside_bytes"] == sizes and len(plan["kept_beside"]) == 4
    assert before == {n: tree_digest(ck / f"step_{n}" / w) for n in (2, 3) for w in ("weights", "weights-FP8")}


def test_verify_checks_the_weights_dirs_and_calls_an_incomplete_one_out(full, tmp_path):
    r = result("verify", step_dir(full, 3))
    assert r["ok"] and [b["name"] for b in r["checked"]["beside"]] == ["weights", "weights-FP8"]
    step = tmp_path / "step_3"
    shutil.copytree(step_dir(full, 3), step)
    (step / "weights" / "tmp-rank1-00001-of-00002.safetensors").write_bytes(b"\0" * 8)  # a converter killed
    r = result("verify", step, code=1)
    assert not r["ok"] and "a converter's temporary shards are still there" in r["problems"][0]["message"]


def test_a_lora_steps_weights_equal_to_the_base_are_called_out(tmp_path):
    paths = make_head_run(tmp_path / "lora", HeadSpec.e_dense(world_size=2, num_layers=2, intermediate_size=128,
                                                              ckpt_interval=None))
    weights = paths.checkpoint.parent / "weights"
    shutil.copytree(paths.base_model, weights)   # what an exporter that drops the LoRA writes
    r = result("inspect", paths.checkpoint)
    assert any("weights beside a LoRA checkpoint" in w for w in r["warnings"])
    assert result("diff-vs-base", weights, paths.base_model, code=3)["verdict"] == "identical"
    doc = result("doctor", paths.root, code=3)
    assert any(f["trap"] == "weights-are-base" and str(weights) in f["why"] for f in doc["findings"])


# ------------------------------------------------------------------------------------------ over URLs
pytest.importorskip("fsspec")
from ckpt_tools.io import remote  # noqa: E402

from .remote_servers import HttpServer  # noqa: E402
from .test_remote import fresh_remote_state, s3, s3_env  # noqa: E402,F401


def test_over_http_and_s3_the_weights_beside_trainer_are_listed_and_proven(full, s3_env, tmp_path):
    served = tmp_path / "served"
    shutil.copytree(step_dir(full, 3), served / "step_3")
    srv = HttpServer(served)
    try:
        for url in (f"{srv.url}/step_3", "s3://runs/w/step_3"):
            if url.startswith("s3://"):
                for p in sorted((served / "step_3").rglob("*")):
                    if p.is_file():
                        s3_env.client.upload_file(str(p), "runs", f"w/{p.relative_to(served).as_posix()}")
            r = result("inspect", url)
            assert {b["name"] for b in r["beside"]} == {"weights", "weights-FP8"}
            v = result("diff-vs-base", f"{url}/weights", f"{url}/trainer", code=3)
            assert v["verdict"] == "identical_rounded"
    finally:
        srv.close()
