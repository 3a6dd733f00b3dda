"""Multi-rank execution (`ckpt_tools.dist`): `torchrun --nproc-per-node 2 -m ckpt_tools <command>` on gloo
writes byte-identical outputs to one process on the genuine fixtures; a rank killed midway leaves nothing
that looks complete and the rerun succeeds; `--nnodes 2` on localhost (two torchrun agents) works."""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckpt_tools.core.parts import Part, assign_units

from .conftest import BASE, REPO, TRAINER

WEIGHTS = BASE.parents[0] / "outputs" / "weights" / "step_3"
REF_ADAPTER = BASE.parents[0] / "reference_peft_adapter"
SHARD = ["--max-shard-size", "100KB"]   # 5 output shards from the tiny base: both ranks have work
# every rank works (dist.RANKS_ENV=all): on one node `auto` runs one rank per 16 cores and these tests are of the split
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), CKPT_TOOLS_RANKS="all")


def digest(root: Path) -> dict[str, str]:
    """sha256 of every file under `root`, by relative path (hidden entries included). A DCP `.metadata`
    carries a random save id (and pickle's memo makes equal content differ in bytes): it is compared by
    its content in order, save id left out (our own output, unpickled here by the test)."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file():
            data = p.read_bytes()
            if p.name == ".metadata":
                md = pickle.loads(data)
                data = repr([list(md.state_dict_metadata.items()), list(md.planner_data.items()),
                             list(md.storage_data.items()), md.version]).encode()
            out[p.relative_to(root).as_posix()] = hashlib.sha256(data).hexdigest()
    return out


def solo(*args, env=ENV) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckpt_tools", *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=120)


def torchrun_cmd(*args, nproc: int = 2, rdzv: list[str] | None = None) -> list[str]:
    # --standalone picks a free port: tests (and other users of this machine) never collide on 29500
    return [sys.executable, "-m", "torch.distributed.run", *(rdzv or ["--standalone"]),
            f"--nproc-per-node={nproc}", "-m", "ckpt_tools", *map(str, args)]


def torchrun(*args, nproc: int = 2, env=ENV) -> subprocess.CompletedProcess:
    return subprocess.run(torchrun_cmd(*args, nproc=nproc), env=env, capture_output=True, text=True, timeout=180)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def only_visible(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if not p.name.startswith("."))


MERGES = {
    "merge HF base": ["merge", BASE, TRAINER, "{out}", *SHARD],
    "merge --base-from-checkpoint": ["merge", "--base-from-checkpoint", TRAINER, "{out}", "--config-from", WEIGHTS,
                                     *SHARD],
    "merge --dtype fp8": ["merge", BASE, TRAINER, "{out}", "--dtype", "fp8", "--max-shard-size", "60KB"],  # 5 shards
    "export --dtype fp8": ["export", TRAINER, "{out}", "--config-from", WEIGHTS, "--dtype", "fp8", "--max-shard-size",
                           "60KB"],
}


DCP_WRITERS = {
    "slim --base": ["slim", TRAINER, "{out}", "--base", BASE],
    "slim (no base: the items' stored CRC-32s)": ["slim", TRAINER, "{out}"],
    "rehydrate (original layout)": ["rehydrate", "{slim}", "{out}", "--base", BASE],
    "adapter-to-dcp": ["adapter-to-dcp", REF_ADAPTER, "{out}", "--base", BASE, "--lr", "1e-4", "--step", "3"],
}


def fill(args, out, slim=None):
    return [str(out) if a == "{out}" else str(slim) if a == "{slim}" else a for a in args]


@pytest.fixture(scope="module")
def slim_ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist") / "slim"
    r = solo("slim", TRAINER, out, "--base", BASE)
    assert r.returncode == 0, r.stderr
    return out


def test_units_go_largest_first_to_the_least_loaded_rank_and_every_unit_has_one_owner():
    # 5 -> r0, 4 -> r1, 3 -> r1 (4 < 5), 2 -> r0 (5 < 7), 1 -> r0 (7 = 7: the lower rank): loads 8 and 7
    assert assign_units([5, 1, 4, 2, 3], 2) == (0, 0, 1, 0, 1)
    assert assign_units([], 3) == ()
    weights = [7, 7, 7, 1, 0, 3]
    parts = [Part(r, 3).mine(weights) for r in range(3)]
    assert sorted(i for p in parts for i in p) == list(range(len(weights)))
    assert Part(0, 1).mine(weights) == tuple(range(6))
    with pytest.raises(ValueError):
        Part(2, 2)


@pytest.mark.parametrize("case", sorted(MERGES))
def test_two_gloo_ranks_write_the_same_bytes_as_one_process(tmp_path, case):
    one, two = tmp_path / "one", tmp_path / "two"
    r = solo(*fill(MERGES[case], one))
    assert r.returncode == 0, r.stderr
    r = torchrun(*fill(MERGES[case], two))
    assert r.returncode == 0, r.stderr
    assert len([n for n in digest(two) if n.endswith(".safetensors")]) == 5
    assert digest(two) == digest(one)
    assert only_visible(tmp_path) == ["one", "two"] and sorted(os.listdir(tmp_path)) == ["one", "two"]
    assert r.stdout.count("wrote ") == 1          # rank 0 alone reports


@pytest.mark.parametrize("case", sorted(DCP_WRITERS))
def test_two_gloo_ranks_write_the_same_checkpoint_as_one_process(tmp_path, case, slim_ckpt):
    one, two = tmp_path / "one", tmp_path / "two"
    r = solo(*fill(DCP_WRITERS[case], one, slim_ckpt))
    assert r.returncode == 0, r.stderr
    r = torchrun(*fill(DCP_WRITERS[case], two, slim_ckpt))
    assert r.returncode == 0, r.stderr
    assert len([n for n in digest(two) if n.endswith(".distcp")]) >= 3   # both ranks wrote rank files
    assert digest(two) == digest(one)
    assert sorted(os.listdir(tmp_path)) == ["one", "two"]


@pytest.mark.parametrize("layout", [[], ["--world-size", "2"]], ids=["original layout", "world size 2"])
def test_two_gloo_ranks_rehydrate_a_slim_identified_by_crc32_only_as_one_process(tmp_path, layout):
    """No sha256 in the manifest: in the original layout each chunk's writer checks its CRC-32 (no rank reads
    another's rows); in another layout one rank per tensor reads it whole to check every original chunk."""
    slim = tmp_path / "slim"
    r = solo("slim", TRAINER, slim)
    assert r.returncode == 0, r.stderr
    one, two = tmp_path / "one", tmp_path / "two"
    r = solo("rehydrate", slim, one, "--base", BASE, *layout)
    assert r.returncode == 0, r.stderr
    r = torchrun("rehydrate", slim, two, "--base", BASE, *layout)
    assert r.returncode == 0, r.stderr
    assert "36/36 rebuilt tensors match" in r.stdout
    assert digest(two) == digest(one)


READERS = {
    "diff-vs-base --adapter": ["diff-vs-base", BASE.parents[0] / "expected_merged_hf", BASE, "--adapter", REF_ADAPTER,
                               "--json"],
    "verify --deep DCP": ["verify", TRAINER, "--deep", "--json"],
    "verify --deep HF dir": ["verify", BASE, "--deep", "--json"],
}


@pytest.mark.parametrize("case", sorted(READERS))
def test_two_gloo_ranks_report_what_one_process_reports(case):
    """The read-only commands split their units over the ranks; rank 0 prints the one report."""
    # (the fixtures are far below dist.DEFAULT_MIN_BYTES_PER_RANK: 0 makes both ranks take units)
    one, two = solo(*READERS[case]), torchrun(*READERS[case], env=dict(ENV, CKPT_TOOLS_MIN_BYTES_PER_RANK="0"))
    assert one.returncode == 0 and two.returncode == 0, (one.stderr, two.stderr)
    a, b = json.loads(one.stdout), json.loads(two.stdout)   # one JSON envelope: rank 0's
    for timing in ("seconds", "bytes_read"):   # (bytes_read counts read-ahead cut short: not deterministic)
        a["result"].pop(timing, None), b["result"].pop(timing, None)
    assert a == b and a["ok"] is True


def _rank_pids(agent: subprocess.Popen) -> dict[int, int]:
    """{rank: pid} of torchrun's workers (children of the agent, found by their RANK variable)."""
    pids = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != agent.pid:
                continue
            env = dict(kv.split("=", 1) for kv in (d / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in kv)
            pids[int(env["RANK"])] = int(d.name)
        except (OSError, KeyError, ValueError, IndexError):
            continue
    return pids


def test_a_rank_killed_midway_leaves_nothing_that_looks_complete_and_the_rerun_succeeds(tmp_path):
    out = tmp_path / "merged"
    env = dict(ENV, CKPT_TOOLS_TEST_SLOW_WRITE="0.3")
    agent = subprocess.Popen(torchrun_cmd(*fill(MERGES["merge HF base"], out)), env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    victim = None
    while time.monotonic() < deadline and victim is None:
        # rank 1 is killed once both ranks are writing into the shared staging directory
        tmps = list(tmp_path.glob(".merged.tmp-*"))
        if tmps and len(list(tmps[0].glob("model-*.safetensors"))) >= 2:
            victim = _rank_pids(agent).get(1)
        assert agent.poll() is None, agent.communicate()
        time.sleep(0.05)
    assert victim is not None, "the ranks never started writing"
    os.kill(victim, signal.SIGKILL)
    _stdout, stderr = agent.communicate(timeout=120)
    assert agent.returncode != 0
    assert not out.exists() and only_visible(tmp_path) == []     # nothing that looks complete
    r = torchrun(*fill(MERGES["merge HF base"], out))
    assert r.returncode == 0, r.stderr
    clean = tmp_path / "clean"
    assert solo(*fill(MERGES["merge HF base"], clean)).returncode == 0
    assert digest(out) == digest(clean)
    assert sorted(os.listdir(tmp_path)) == ["clean", "merged"]   # the dead run's staging dir is gone too


def test_two_nodes_on_localhost_write_the_same_bytes_as_one_process(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    assert solo(*fill(MERGES["merge HF base"], one)).returncode == 0
    port = free_port()
    agents = [subprocess.Popen(torchrun_cmd(*fill(MERGES["merge HF base"], two), nproc=1,
                                            rdzv=["--nnodes=2", f"--node-rank={k}", "--master-addr=127.0.0.1",
                                                  f"--master-port={port}"]),
                               env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for k in (0, 1)]
    outs = [a.communicate(timeout=180) for a in agents]
    assert [a.returncode for a in agents] == [0, 0], outs
    assert digest(two) == digest(one)


def test_a_command_that_does_not_split_its_work_refuses_two_ranks(tmp_path):
    r = torchrun("set-lr", TRAINER, tmp_path / "o", "--lr", "1e-5")
    assert r.returncode != 0
    assert "runs in one process, not under torchrun (2 ranks)" in r.stderr
    assert only_visible(tmp_path) == []


def test_a_rank_that_fails_midway_makes_every_rank_stop_and_commits_nothing(tmp_path, slim_ckpt):
    """rehydrate from a base with one changed value: the rank that verifies that tensor fails after the
    ranks have written their files; no rank commits, the staging directory is removed, the exit is non-zero."""
    import shutil

    from safetensors.torch import load_file, save_file

    base = tmp_path / "base"
    shutil.copytree(BASE, base)
    tensors = load_file(base / "model.safetensors")
    name = "model.layers.2.mlp.down_proj.weight"
    tensors[name][0, 0] += 1
    (base / "model.safetensors").unlink()
    save_file(tensors, base / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "full"
    r = torchrun("rehydrate", slim_ckpt, out, "--base", base)
    assert r.returncode != 0
    assert "rebuilt tensor does not match the original" in r.stderr and name in r.stderr
    assert sorted(os.listdir(tmp_path)) == ["base"]   # no OUT, no staging dir, no lock
