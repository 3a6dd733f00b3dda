"""The read paths' parallelism changes no result: the byte budget never admits more than its limit,
and diff-vs-base (plain and --adapter) and verify --deep give the same report on 1 worker as on 4,
with blocks small enough that every tensor spans many chunks."""
from __future__ import annotations

import random
import shutil
import threading
import time

import pytest

from ckpt_tools import dist
from ckpt_tools.core.budget import ByteBudget
from ckpt_tools.ops.diff import run as diff_run
from ckpt_tools.ops.diff.run import diff_vs_base
from ckpt_tools.ops.verify import hf as verify_hf
from ckpt_tools import verify as verify_path

from .conftest import BASE, FIXTURE, TRAINER

MERGED = FIXTURE / "expected_merged_hf"


def test_the_byte_budget_never_holds_more_than_its_limit_and_admits_an_oversized_unit_alone():
    budget = ByteBudget(100)
    rng = random.Random(0)
    sizes = [rng.choice([1, 5, 30, 60, 99]) for _ in range(200)] + [250, 3]   # 250: larger than the budget
    lock = threading.Lock()
    live: list[int] = []
    seen = {"over": 0, "max": 0, "alone": None}

    def unit(n: int) -> None:
        with budget.hold(n):
            with lock:
                live.append(n)
                total = sum(live)
                seen["max"] = max(seen["max"], total)
                if total > 100 and not (n > 100 and live == [n]):
                    seen["over"] += 1
                if n > 100:
                    seen["alone"] = list(live)
            time.sleep(0.0005)
            with lock:
                live.remove(n)

    threads = [threading.Thread(target=unit, args=(n,)) for n in sizes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a unit never got its bytes (deadlock)"
    assert seen["over"] == 0 and seen["max"] <= 250
    assert seen["alone"] == [250]                     # the oversized unit ran with nothing else admitted
    assert budget.held == 0 and 60 < budget.peak <= 250
    with pytest.raises(ValueError):
        ByteBudget(0)


def _report(monkeypatch, workers: int, **kw) -> dict:
    monkeypatch.setattr(diff_run, "local_workers", lambda **kw: workers)
    d = diff_vs_base(MERGED, BASE, block_bytes=4096, **kw).to_json()
    d.pop("seconds")
    return d


@pytest.mark.parametrize("adapter", [None, TRAINER])
def test_diff_on_4_workers_and_small_chunks_equals_1_worker(monkeypatch, adapter):
    one = _report(monkeypatch, 1, adapter=adapter)
    four = _report(monkeypatch, 4, adapter=adapter)
    assert one == four
    assert one["verdict"] == "differs" and one["counts"]["differs"] == 21
    if adapter is not None:
        assert one["adapter_check"]["passed"] and one["adapter_check"]["exact"] == 21
    # other blocks fold the float sums in other chunks (their low bits may move): the exact fields agree
    default = diff_vs_base(MERGED, BASE, adapter=adapter).to_json()
    for a, b in zip(one["tensors"], default["tensors"]):
        assert (a["status"], a["changed_elements"], a["max_abs_delta"], a["adapter_check"]) == \
            (b["status"], b["changed_elements"], b["max_abs_delta"], b["adapter_check"])


def test_the_adapter_check_holds_only_p_and_small_chunks_from_the_budget(monkeypatch):
    held = []
    real = ByteBudget.acquire

    def spy(self, n):
        held.append(n)
        real(self, n)

    monkeypatch.setattr(ByteBudget, "acquire", spy)
    rep = diff_vs_base(MERGED, BASE, adapter=TRAINER)
    assert rep.adapter_summary["passed"]
    targeted = [t for t in rep.tensors if t.role == "targeted"]
    assert len(held) == len(targeted) == 21
    # P (fp32) and the factors: far less than the whole-tensor check's W, W0, P and the merge
    assert max(held) < 5 * max(4 * t.numel for t in targeted)
    assert sum(held) < sum(4 * t.numel for t in targeted) * 2


def test_verify_deep_in_small_pieces_on_4_workers_counts_what_one_whole_pass_counts(monkeypatch, tmp_path):
    import torch
    from safetensors.torch import load_file, save_file
    shutil.copytree(BASE, tmp_path / "m")
    f = tmp_path / "m" / "model.safetensors"
    sd = load_file(str(f))
    big = max(sd, key=lambda k: sd[k].numel())
    sd[big].view(-1)[[3, 7777, -1]] = torch.tensor([float("inf"), float("nan"), -float("inf")], dtype=sd[big].dtype)
    sd["extra.f32"] = torch.tensor([1.0, float("nan"), 2.0])
    sd["extra.f64"] = torch.tensor([float("-inf")] * 3, dtype=torch.float64)
    sd["extra.i64"] = torch.arange(5)
    save_file(sd, str(f), metadata={"format": "pt"})
    whole = verify_path(tmp_path / "m", deep=True).to_json()
    monkeypatch.setattr(verify_hf, "FINITE_BLOCK_BYTES", 4096)
    monkeypatch.setattr(verify_hf, "PIECE_BYTES", 3 * 4096)
    monkeypatch.setattr(dist, "local_workers", lambda *a, **k: 4)
    pieces = verify_path(tmp_path / "m", deep=True).to_json()
    assert pieces == whole
    found = {p["key"]: p["message"] for p in whole["problems"]}
    assert found[big] == "3 non-finite value(s) (inf/nan)"
    assert found["extra.f32"].startswith("1 ") and found["extra.f64"].startswith("3 ") and "extra.i64" not in found
