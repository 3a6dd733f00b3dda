"""`ckpt slim --base` and `ckpt rehydrate` hold a bounded budget, not their largest tensor (issue 22: <= 1 GiB
for every command at any size). Two genuine factory checkpoints (one FSDP2 rank, so a chunk is the whole
tensor) that differ only in their vocabulary, so their largest tensors (the fp32 embedding and lm_head) are
64 MiB and 256 MiB, are slimmed and rehydrated in subprocesses; the kernel's peak RSS of each (`wait4`,
as tests/test_merge_memory.py measures it) may differ by less than two base blocks (`BASE_BLOCK_BYTES`: the
big tensor streams block by block, the small one fits a few blocks). A slim that reads the dropped tensors
whole, or a rehydrate that builds a chunk (here: a tensor) before writing it, grows by >= 192 MiB and fails.

Nor does rehydrate's memory grow with its workers: the blocks in flight share one budget
(`ops/rehydrate/pipeline.BUDGET_BYTES`, 16 slots of `SLOT_BYTES`), so 32 workers hold less than that budget
more than 2 do; one block per worker (no budget) would hold 30 slots (360 MiB) more and fail."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_tools.formats.dcp.reader import DcpCheckpoint
from ckpt_tools.ops.rehydrate.pipeline import BUDGET_BYTES, SLOT_BYTES
from ckpt_tools.sources.hashing import BASE_BLOCK_BYTES

HIDDEN = 64
SMALL_VOCAB, BIG_VOCAB = 1 << 18, 1 << 20           # 64 MiB and 256 MiB fp32 [vocab, 64] embeddings

# Runs a command and prints its peak RSS. A small launcher, since Linux carries a process's peak RSS across
# exec: a child forked from this pytest process (torch loaded) would report pytest's size.
_LAUNCH = ("import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL); "
           "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)")


def peak_rss(*args, cwd: Path) -> int:
    """Peak RSS in bytes of `ckpt ARGS` in its own process (the kernel's, for that process alone)."""
    cmd = [sys.executable, "-c", _LAUNCH, sys.executable, "-m", "ckpt_tools", *map(str, args)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, check=True)
    rc, kib = (int(x) for x in r.stdout.split())
    assert rc == 0, r.stderr
    return kib * 1024


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.factory.factory import FactorySpec, make_run

    root = tmp_path_factory.mktemp("slim-memory")
    return {v: make_run(root / f"vocab{v}", FactorySpec.tiny(vocab_size=v, world_size=1, tie_word_embeddings=True,
                                                              steps=1))
            for v in (SMALL_VOCAB, BIG_VOCAB)}


def test_slim_and_rehydrate_peak_rss_stay_flat_as_the_largest_tensor_grows_4x(runs, tmp_path):
    largest = BIG_VOCAB * HIDDEN * 4
    peaks = {}
    for v, paths in runs.items():
        ck = DcpCheckpoint.open(paths.checkpoint)
        e = ck.entries["app.model.model.embed_tokens.weight"]
        assert e.nbytes == v * HIDDEN * 4 and len(e.chunks) == 1   # one chunk: the whole tensor
        ck.close()
        slim, full = tmp_path / f"slim{v}", tmp_path / f"full{v}"
        peaks[v] = (peak_rss("slim", paths.checkpoint, slim, "--base", paths.base_model, cwd=tmp_path),
                    peak_rss("rehydrate", slim, full, "--base", paths.base_model, cwd=tmp_path))
        assert sum(f.stat().st_size for f in full.iterdir()) > 2 * v * HIDDEN * 4   # embed_tokens + lm_head
    for what, small, big in zip(("slim --base", "rehydrate"), peaks[SMALL_VOCAB], peaks[BIG_VOCAB]):
        # the small tensor fits one base block; the big one streams block by block with the next one read
        # ahead: up to two blocks more, never the tensor (a whole-tensor hold adds 192 MiB of fp32 here)
        assert big - small < 2 * BASE_BLOCK_BYTES, (f"{what}: peak RSS {big / 2**20:.0f} MiB with a {largest >> 20} MiB "
                                            f"tensor, {small / 2**20:.0f} MiB with a {largest >> 22} MiB one")
        assert big < 1 << 30, f"{what}: peak RSS {big / 2**20:.0f} MiB, over the 1 GiB budget"


def test_rehydrate_peak_rss_does_not_grow_with_its_workers(runs, tmp_path):
    import ckpt_tools

    paths = runs[BIG_VOCAB]
    slim = tmp_path / "slim"
    ckpt_tools.slim(paths.checkpoint, slim, base=paths.base_model)
    peaks = {n: peak_rss("rehydrate", slim, tmp_path / f"full{n}", "--base", paths.base_model, "--threads", n,
                         cwd=tmp_path) for n in (2, 32)}
    grew = peaks[32] - peaks[2]
    assert 32 * SLOT_BYTES - 2 * SLOT_BYTES > BUDGET_BYTES   # (what one block per worker would hold more)
    assert grew < BUDGET_BYTES, (f"peak RSS {peaks[32] / 2**20:.0f} MiB with 32 workers, {peaks[2] / 2**20:.0f} MiB "
                                 f"with 2: +{grew / 2**20:.0f} MiB, over the {BUDGET_BYTES >> 20} MiB budget")
    assert peaks[32] < 1 << 30
