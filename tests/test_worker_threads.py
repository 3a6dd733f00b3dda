"""A pool worker of merge, rehydrate or diff runs torch with one intra-op thread of its own.

`torch.set_num_threads(1)` in the main thread does not reach other threads: OpenMP's thread count is a
per-thread setting (its `nthreads-var`; a new thread starts from OMP_NUM_THREADS, else every core), so a
worker's matmul or cast would start a team of every core's threads, each worker its own (16 teams of 16
spinning threads on the 16-core host). `torch.get_num_threads()` does not show it (it answers the main
thread's setting in every thread); OpenMP's own `omp_get_max_threads()`, asked in the worker through the
libgomp torch loaded, does. The tests set OMP_NUM_THREADS=1 for themselves (conftest), which hides it, so
this runs in a child without it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

_PROBE = r"""
import ctypes, json, threading
from concurrent.futures import ThreadPoolExecutor
import torch
from ckpt_tools.core.pool import DaemonPool, one_intra_op_thread
from ckpt_tools.dist import map_units

paths = {ln.split()[-1] for ln in open("/proc/self/maps") if "libgomp" in ln or "libiomp" in ln}
if not paths:
    print(json.dumps({"skip": "this torch is not built with OpenMP"}))
    raise SystemExit(0)
lib = ctypes.CDLL(sorted(paths)[0])
torch.set_num_threads(1)                 # the main thread's own, as the commands set it

got = []
t = threading.Thread(target=lambda: got.append(lib.omp_get_max_threads()))
t.start(); t.join()
pool = DaemonPool(3, "probe", initializer=one_intra_op_thread)
daemon = [pool.submit(lib.omp_get_max_threads).result() for _ in range(6)]
pool.shutdown(wait=True)
with ThreadPoolExecutor(2, initializer=one_intra_op_thread) as ex:      # diff's chunk pool
    chunks = list(ex.map(lambda _: lib.omp_get_max_threads(), range(4)))
units = map_units(lambda i: lib.omp_get_max_threads(), [1] * 8, threads=4)
print(json.dumps({"plain": got[0], "daemon": daemon, "chunks": chunks, "units": units}))
"""


@pytest.fixture(scope="module")
def probe():
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    env["PYTHONPATH"] = str(REPO)
    r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if "skip" in out:
        pytest.skip(out["skip"])
    if out["plain"] == 1:
        pytest.skip("OpenMP gives a new thread one thread here (one core): nothing to show")
    return out


def test_a_plain_new_thread_would_start_a_team_of_many(probe):
    """The premise: with the main thread at one, a new thread's OpenMP team is still every core's."""
    assert probe["plain"] > 1


def test_the_merge_and_rehydrate_pools_and_the_diff_chunk_pool_run_one_thread_a_worker(probe):
    assert probe["daemon"] == [1] * 6
    assert probe["chunks"] == [1] * 4


def test_the_units_map_runs_one_thread_a_worker(probe):
    assert probe["units"] == [1] * 8


def test_each_torch_pipelines_pool_is_made_with_the_initializer():
    """(What the initializer does is shown above; this holds each pool of merge, rehydrate, diff and the
    units map to it.)"""
    root = REPO / "ckpt_tools"
    for rel in ("ops/merge/pipeline.py", "ops/rehydrate/pipeline.py", "ops/diff/run.py", "dist.py"):
        assert "initializer=one_intra_op_thread" in (root / rel).read_text(), rel
