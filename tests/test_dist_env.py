"""Multi-rank start-up (issue 27): a process that finds WORLD_SIZE/RANK/MASTER_* exported without its
peers (every process of a SLURM or PyTorchJob pod) gives up after the bounded rendezvous
(CKPT_TOOLS_DIST_RENDEZVOUS_S) with one line, and honours SIGTERM/SIGINT while it waits; a busy
MASTER_PORT and WORLD_SIZE without MASTER_ADDR are clean errors; ranks that resolve a hub id to two
different snapshots (each node's own HF cache) refuse before writing anything."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from . import hardening_util as hu
from .conftest import BASE, REPO, TRAINER
from .test_dist import free_port, torchrun_cmd

# every rank works (dist.RANKS_ENV=all): on one node `auto` runs one rank per 16 cores and these tests are of the split
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), CKPT_TOOLS_RANKS="all")


def lone_rank(port: int, **extra) -> dict:
    env = dict(ENV, WORLD_SIZE="2", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env.update(extra)
    return env


def ckpt(args, env) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ckpt_tools", *map(str, args)], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_a_rank_without_peers_gives_up_after_the_rendezvous_timeout():
    t0 = time.monotonic()
    p = ckpt(["verify", TRAINER], lone_rank(free_port(), CKPT_TOOLS_DIST_RENDEZVOUS_S="3"))
    so, se = p.communicate(timeout=90)
    lines = [ln for ln in se.splitlines() if ln.strip()]
    assert p.returncode == 1 and len(lines) == 1, se
    assert "only 1 of WORLD_SIZE=2 ranks joined" in se and "CKPT_TOOLS_DIST_RENDEZVOUS_S" in se, se
    assert time.monotonic() - t0 < 60
    hu.record("multirank", env_cases=1, clean_errors=1)


@pytest.mark.parametrize("sig,code,word", [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")])
def test_a_rank_waiting_for_its_peers_honours_signals(sig, code, word):
    port = free_port()
    p = ckpt(["verify", TRAINER], lone_rank(port))
    try:
        deadline = time.monotonic() + 90
        while not listening(port):       # rank 0 hosts the store: it is waiting for rank 1 now
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "rank 0 never listened"
            time.sleep(0.05)
        time.sleep(0.5)
        t0 = time.monotonic()
        p.send_signal(sig)
        so, se = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert time.monotonic() - t0 < 5, f"{sig.name} honoured after {time.monotonic() - t0:.1f} s"
    lines = [ln for ln in se.splitlines() if ln.strip()]
    assert p.returncode == code and len(lines) == 1 and lines[0].startswith(word), (p.returncode, se)
    hu.record("multirank", env_cases=1, signal_runs=1)


def test_a_busy_master_port_and_a_missing_master_addr_are_clean_errors():
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        busy = ckpt(["verify", TRAINER], lone_rank(s.getsockname()[1], CKPT_TOOLS_DIST_RENDEZVOUS_S="20"))
        so, se = busy.communicate(timeout=90)
    assert busy.returncode == 2 and "already in use" in se and len(se.strip().splitlines()) == 1, se
    env = lone_rank(free_port())
    env.pop("MASTER_ADDR")
    no_addr = ckpt(["verify", TRAINER], env)
    so, se2 = no_addr.communicate(timeout=90)
    assert no_addr.returncode == 2 and "MASTER_ADDR is not" in se2 and len(se2.strip().splitlines()) == 1, se2
    hu.record("multirank", env_cases=2, clean_errors=2)


def test_ranks_resolving_a_hub_id_to_two_snapshots_refuse_before_writing(tmp_path):
    """`torchrun -m ckpt_tools merge org/tiny ...` on two nodes (two torchrun agents on localhost), each
    with its own HF cache holding a different snapshot of org/tiny (the second: the base with its final
    norm changed, same shapes). Each rank merged from its own base: the output mixed two bases."""
    other = tmp_path / "base-v2"
    other.mkdir()
    for f in BASE.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    w = load_file(str(BASE / "model.safetensors"))
    w["model.norm.weight"] = (w["model.norm.weight"].float() * 1.5).to(w["model.norm.weight"].dtype)
    save_file(w, str(other / "model.safetensors"), metadata={"format": "pt"})
    hu.hf_cache(BASE, tmp_path / "cache0", "a" * 40)
    hu.hf_cache(other, tmp_path / "cache1", "b" * 40)
    out = tmp_path / "merged"
    port = free_port()
    agents = [subprocess.Popen(torchrun_cmd("merge", "org/tiny", TRAINER, out, "--max-shard-size", "100KB", nproc=1,
                                            rdzv=["--nnodes=2", f"--node-rank={k}", "--master-addr=127.0.0.1",
                                                  f"--master-port={port}"]),
                               env=dict(ENV, HF_HUB_CACHE=str(tmp_path / f"cache{k}"), HF_HUB_OFFLINE="1"),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
              for k in (0, 1)]
    outs = [a.communicate(timeout=240) for a in agents]
    assert all(a.returncode != 0 for a in agents), outs
    assert any("does not read the same inputs" in se for _, se in outs), outs
    assert not out.exists(), "an output was written from two different bases"
    hu.record("multirank", mixed_input_cases=1, clean_errors=1)
