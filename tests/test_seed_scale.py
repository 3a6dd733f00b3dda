"""bench/seed_scale.py, the seed-scale run of issue 23, at the `tiny` size on 2 gloo CPU ranks: the generator
writes a checkpoint the way prime-rl's trainer does (FSDP2, DCP save of the AppState) and `measure` runs every
command on it, checking each output against the generator's truth. The 32B run itself needs the 4-GPU host
(bench/seed_scale.sh); this proves the script works before it is lent."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from .conftest import REPO

sys.path[:0] = [str(REPO / "bench")]
import seed_scale  # noqa: E402


@pytest.fixture(scope="module")
def seed_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("seed") / "run"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(REPO / "bench" / "seed_scale.py"), "generate", "--size", "tiny", "--root", str(root),
                        "--device", "cpu"], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    return root


def test_the_generator_writes_a_prime_rl_checkpoint_with_its_truth(seed_run):
    info = json.loads((seed_run / "seed_scale.json").read_text())
    assert info["world_size"] == 2 and info["backend"] == "gloo" and info["step"] == 2
    r = subprocess.run([sys.executable, "-m", "ckpt_tools", "inspect", str(seed_run / info["checkpoint"]), "--json"],
                       capture_output=True, text=True, cwd=REPO)
    got = json.loads(r.stdout)["result"]
    assert got["step"] == 2 and got["world_size"] == 2 and got["lora"]["rank"] == 32


def test_every_command_runs_and_matches_the_truth(seed_run, tmp_path):
    results = tmp_path / "seed.json"
    r = subprocess.run([sys.executable, str(REPO / "bench" / "seed_scale.py"), "measure", "--root", str(seed_run),
                        "--ranks", "1", "--workdir", str(tmp_path / "work"), "--results", str(results)],
                       capture_output=True, text=True, timeout=900, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(results.read_text())
    checked = {row["command"] for row in res["rows"] if row.get("matched_truth")}
    assert checked == set(seed_scale.FLOORS), checked ^ set(seed_scale.FLOORS)
    table = seed_scale.report(str(results))
    assert all(f"| `{c}` | 1 |" in table for c in seed_scale.FLOORS) and "MISMATCH" not in table


def test_the_item_comparison_sees_a_changed_item(seed_run, tmp_path):
    info = json.loads((seed_run / "seed_scale.json").read_text())
    ckpt = seed_run / info["checkpoint"]
    assert seed_scale._same_checkpoint(ckpt, ckpt)
    r = subprocess.run([sys.executable, "-m", "ckpt_tools", "set-lr", str(ckpt), str(tmp_path / "lr"), "--lr", "1e-3"],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert not seed_scale._same_checkpoint(ckpt, tmp_path / "lr")
