"""Ranks that never make read-only work slower: below `dist.DEFAULT_MIN_BYTES_PER_RANK` of work per rank the
extra ranks of a torchrun launch take no unit and the working ones take the node's cores
(`core.parts.working_ranks`, `dist.working`, `dist.local_workers`); two gloo ranks on the tiny fixture give
one process's report, in no more time than one process plus the collectives."""
from __future__ import annotations

import json

import pytest

from ckpt_tools import dist
from ckpt_tools.core.errors import UsageError
from ckpt_tools.core.parts import Part, working_ranks

from .conftest import BASE
from .test_dist import ENV, REF_ADAPTER, digest, free_port, solo, torchrun

MiB = 2**20


def test_work_is_split_only_where_each_rank_gets_its_minimum():
    assert working_ranks([10, 20, 30], 4, 256 * MiB) == 1           # tiny: rank 0 alone
    assert working_ranks([300 * MiB, 300 * MiB], 4, 256 * MiB) == 2  # 600 MiB: two ranks' worth
    assert working_ranks([100 * MiB] * 40, 8, 256 * MiB) == 8        # 4 GB: every rank
    assert working_ranks([4000 * MiB], 8, 256 * MiB) == 1            # one unit: one rank however big
    assert working_ranks([10, 20, 30], 8, 0) == 3                    # 0: always split (one unit per rank at most)
    assert working_ranks([], 2, 256 * MiB) == 1 and working_ranks([10**12], 1, 1) == 1


class _TwoRanks(dist.Group):
    """Rank `rank` of 2 without a process group: rank 1's results, for the leader's gather, are given."""

    def __init__(self, rank: int, rank1_results=()):
        self.part = Part(rank, 2)
        self._rank1 = list(rank1_results)

    def gather(self, value, what):
        return [value, self._rank1] if self.part.leader else None

    def broadcast(self, value, what):
        return value


def _map(group, weights):
    ran = []
    out = dist.map_units(lambda i: ran.append(i) or i * 10, weights, group, threads=1, everywhere=True)
    return ran, out


def test_below_the_minimum_rank_1_runs_no_unit_and_rank_0_runs_them_all(monkeypatch):
    monkeypatch.delenv(dist.MIN_BYTES_PER_RANK_ENV, raising=False)
    tiny = [100, 200, 300]
    assert _map(_TwoRanks(1), tiny)[0] == []
    ran, out = _map(_TwoRanks(0), tiny)
    assert ran == [0, 1, 2] and out == [0, 10, 20]
    big = [300 * MiB, 200 * MiB, 100 * MiB]   # 600 MiB: split, largest first to the least loaded rank
    assert _map(_TwoRanks(1), big)[0] == [1, 2]
    assert _map(_TwoRanks(0, [[1, 10], [2, 20]]), big) == ([0], [0, 10, 20])
    monkeypatch.setenv(dist.MIN_BYTES_PER_RANK_ENV, "0")
    assert _map(_TwoRanks(1), tiny)[0] == [0, 1]   # (300 to rank 0; 200, 100 to rank 1)


def test_the_working_ranks_take_the_cores_of_the_idle_ones(monkeypatch):
    monkeypatch.setattr(dist.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    env = {"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4", "RANK": "1", "LOCAL_RANK": "1", dist.RANKS_ENV: "all"}
    assert dist.local_workers(environ=env) == 4                  # 4 working ranks on the node: 16 / 4
    assert dist.local_workers(environ=env, n_working=2) == 8     # ranks 0, 1 work: 16 / 2
    assert dist.local_workers(environ=env, n_working=1) == 16    # (rank 1 then has no unit to run)
    second_node = {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4", "RANK": "5", "LOCAL_RANK": "1", dist.RANKS_ENV: "all"}
    assert dist.local_workers(environ=second_node, n_working=6) == 8   # ranks 4, 5 of node 1 work


def test_a_minimum_that_is_not_a_byte_count_is_a_usage_error():
    with pytest.raises(UsageError, match="CKPT_TOOLS_MIN_BYTES_PER_RANK='-1'"):
        dist.min_bytes_per_rank({dist.MIN_BYTES_PER_RANK_ENV: "-1"})
    assert dist.min_bytes_per_rank({}) == dist.DEFAULT_MIN_BYTES_PER_RANK
    assert dist.min_bytes_per_rank({dist.MIN_BYTES_PER_RANK_ENV: "0"}) == 0


def test_two_ranks_on_a_tiny_diff_report_what_one_process_reports_in_no_more_time():
    """The fixture (a few MB) is below the minimum: rank 0 compares every pair with the node's cores, rank
    1 waits at the gather. The command's own time (`seconds`: from the plan to the verdict, start-up and
    imports excluded) is one process's plus the collectives, not more."""
    args = ["diff-vs-base", BASE.parents[0] / "expected_merged_hf", BASE, "--adapter", REF_ADAPTER, "--json"]
    env = {k: v for k, v in ENV.items() if k != dist.MIN_BYTES_PER_RANK_ENV}
    one, two = solo(*args, env=env), torchrun(*args, env=env)
    assert one.returncode == 0 and two.returncode == 0, (one.stderr, two.stderr)
    a, b = json.loads(one.stdout)["result"], json.loads(two.stdout)["result"]
    s1, s2 = a.pop("seconds"), b.pop("seconds")
    a.pop("bytes_read"), b.pop("bytes_read")   # (read-ahead cut short is not deterministic: test_dist.py)
    assert a == b and a["adapter_check"]["passed"]
    assert s2 <= s1 + 1.0, (s1, s2)


# ---------------------------------------------------------------- how many ranks of a node work (RANKS_ENV)
def _launch(world: int, local: int, rank: int, **extra) -> dict:
    return {"WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_WORLD_SIZE": str(local),
            "LOCAL_RANK": str(rank % local), **extra}


def test_one_rank_per_16_cores_of_a_node_works_unless_every_rank_is_asked_to():
    one_node = _launch(8, 8, 0)
    assert dist.working_per_node(one_node, cores=16) == 1          # 16 cores: one process uses the node
    assert dist.working_per_node(one_node, cores=2) == 1
    assert dist.working_per_node(one_node, cores=64) == 4          # 64 cores: four processes of 16 threads
    assert dist.working_per_node(one_node, cores=1024) == 8        # never more than the node's ranks
    assert dist.working_per_node({**one_node, dist.RANKS_ENV: "all"}, cores=16) is None
    assert dist.working_per_node({"WORLD_SIZE": "2", "RANK": "1"}, cores=16) is None   # no node layout: all work
    with pytest.raises(UsageError, match="CKPT_TOOLS_RANKS='some'"):
        dist.working_per_node({**one_node, dist.RANKS_ENV: "some"})


def test_the_working_ranks_are_numbered_node_by_node_and_the_others_idle(monkeypatch):
    monkeypatch.setattr(dist.os, "sched_getaffinity", lambda pid: set(range(32)), raising=False)
    two_nodes = [_launch(16, 8, r) for r in range(16)]           # 2 nodes x 8 ranks, 32 cores each: 2 work per node
    working = {r: dist.env_part(e) for r, e in enumerate(two_nodes) if not dist.idle_rank(e)}
    assert sorted(working) == [0, 1, 8, 9]
    assert [working[r] for r in (0, 1, 8, 9)] == [Part(0, 4), Part(1, 4), Part(2, 4), Part(3, 4)]
    with pytest.raises(UsageError, match="idles"):
        dist.env_part(two_nodes[5])
    assert dist.local_workers(environ=two_nodes[9]) == 16         # the node's 32 cores over its 2 working ranks
    assert dist.env_part(dict(two_nodes[5], CKPT_TOOLS_RANKS="all")) == Part(5, 16)


def _alone(tmp_path, rank: int, port: int):
    """Rank `rank` of a 2-rank, one-node launch, started without its peer (and nothing listening at
    MASTER_PORT): a working rank that needed a rendezvous would wait for it until the time-out."""
    import socket
    import subprocess
    import sys
    env = dict(ENV, **_launch(2, 2, rank, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
               CKPT_TOOLS_RANKS="auto", CKPT_TOOLS_DIST_RENDEZVOUS_S="60")
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0
    out = tmp_path / f"merged{rank}"
    return subprocess.run([sys.executable, "-X", "importtime", "-m", "ckpt_tools", "merge", BASE, REF_ADAPTER, out,
                           "--json"], env=env, capture_output=True, text=True, timeout=50), out


def test_on_a_node_of_few_cores_rank_1_ends_at_once_and_rank_0_runs_as_one_process(tmp_path):
    port = free_port()
    idle, idle_out = _alone(tmp_path, 1, port)
    assert idle.returncode == 0 and idle.stdout == "" and not idle_out.exists(), idle.stderr[-2000:]
    assert "| torch" not in idle.stderr and "ckpt_tools.api" not in idle.stderr   # nothing imported or opened
    lead, lead_out = _alone(tmp_path, 0, port)       # no peer, no rendezvous: the whole merge, exit 0
    assert lead.returncode == 0, lead.stderr[-2000:]
    solo_out = tmp_path / "solo"
    assert solo("merge", BASE, REF_ADAPTER, solo_out).returncode == 0
    assert digest(lead_out) == digest(solo_out)
