"""`ckpt merge --base-from-checkpoint` and `ckpt export` hold a bounded budget, not the checkpoint's largest
fp32 master (issue 22: every command's peak RSS bounded by a budget that does not grow with the largest
tensor: at 32B the fp32 embedding is 3.1 GB). Two genuine factory checkpoints (one FSDP2 rank, so a chunk is
the whole tensor) differ only in their vocabulary: their untied fp32 embedding and lm_head are 64 MiB and
256 MiB, both past the point where the merge's working budget is full (a smaller pair shows it filling:
32 -> 128 MiB measured 373 -> 550 MiB, then flat). Each command runs in its own process on both; the
kernel's peak RSS may differ by less than GROWTH_LIMIT, while a command that read a master whole (256 MiB
fp32, plus its 128 MiB bf16 cast) would grow by >= 288 MiB and fail."""
from __future__ import annotations

import pytest

from ckpt_tools.formats.dcp.reader import DcpCheckpoint

from .test_slim_memory import HIDDEN, peak_rss

SMALL_VOCAB, BIG_VOCAB = 1 << 18, 1 << 20           # 64 MiB and 256 MiB fp32 [vocab, 64] masters
GROWTH_LIMIT = 160 << 20                            # below a whole master held (>= 288 MiB more here)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from tests.factory.factory import FactorySpec, make_run

    root = tmp_path_factory.mktemp("export-memory")
    return {v: make_run(root / f"vocab{v}", FactorySpec.tiny(vocab_size=v, world_size=1, tie_word_embeddings=False,
                                                              steps=1))
            for v in (SMALL_VOCAB, BIG_VOCAB)}


@pytest.mark.parametrize("command", ["merge --base-from-checkpoint", "export"])
def test_peak_rss_stays_flat_as_the_largest_master_grows_4x(runs, tmp_path, command):
    peaks = {}
    for v, paths in runs.items():
        ck = DcpCheckpoint.open(paths.checkpoint)
        for key in ("app.model.model.embed_tokens.weight", "app.model.lm_head.weight"):
            e = ck.entries[key]
            assert e.nbytes == v * HIDDEN * 4 and len(e.chunks) == 1   # one chunk: the whole fp32 tensor
        ck.close()
        out = tmp_path / f"{command.split()[0]}{v}"
        if command == "export":
            args = ["export", paths.checkpoint, out, "--config-from", paths.base_model, "--alpha", "16",
                    "--allow-zero-delta"]
        else:
            args = ["merge", paths.checkpoint, out, "--base-from-checkpoint", "--config-from", paths.base_model,
                    "--alpha", "16", "--allow-zero-delta"]
        peaks[v] = peak_rss(*args, cwd=tmp_path)
        assert sum(f.stat().st_size for f in out.glob("*.safetensors")) > 2 * v * HIDDEN * 2   # embed + lm_head, bf16
    small, big = peaks[SMALL_VOCAB], peaks[BIG_VOCAB]
    print(f"{command}: {small / 2**20:.0f} MiB -> {big / 2**20:.0f} MiB")
    assert big - small < GROWTH_LIMIT, (f"{command}: peak RSS {big / 2**20:.0f} MiB with a 256 MiB master, "
                                        f"{small / 2**20:.0f} MiB with a 64 MiB one")
    assert big < 1 << 30, f"{command}: peak RSS {big / 2**20:.0f} MiB, over the 1 GiB budget"
