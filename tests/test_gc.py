"""ckpt gc on run dirs holding several genuine prime-rl checkpoints (HEAD E_head_dense's step_2 and
step_3, plus copies of them as step_1 and step_4): the older steps are slimmed in place, the newest N
are untouched, each slimmed step rehydrates bit-exactly, disk use drops by what is reported, a
SIGKILL at every kill point leaves each step full or slim and a rerun finishes, checkpoints being
written are left alone, --dry-run changes nothing."""
from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckpt_tools.io.lock import OutputLock
from ckpt_tools.cli import main
from ckpt_tools.ops import gc as gc_mod
from ckpt_tools.formats.primerl.run_dir import dir_bytes

from . import hardening_util as hu
from .conftest import FIXTURE, HEAD_FIXTURES
from .test_slim_rehydrate import assert_bit_equal_checkpoints

E = HEAD_FIXTURES / "E_head_dense"
OLD = time.time() - 3 * 3600


def _age(root: Path, t: float = OLD) -> None:
    for p in [root, *root.rglob("*")]:
        os.utime(p, (t, t), follow_symlinks=False)


def make_run(dst: Path, steps=(1, 2, 3, 4)) -> Path:
    """A HEAD run dir: E's config and base, checkpoints step_1..4 (1 and 4 copies of 2 and 3)."""
    shutil.copytree(E / "base_model", dst / "base_model")
    shutil.copytree(E / "configs", dst / "configs")
    ck = dst / "outputs" / "checkpoints"
    for n in steps:
        src = E / "outputs" / "checkpoints" / f"step_{2 if n <= 2 else 3}" / "trainer"
        shutil.copytree(src, ck / f"step_{n}" / "trainer")
    for p in dst.rglob("*"):
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    _age(dst)
    return ck


@pytest.fixture
def run_dir(tmp_path) -> Path:
    return make_run(tmp_path / "run")


def gc(*args):
    return CliRunner().invoke(main, ["gc", *map(str, args)])


def entries(step_dir: Path) -> list[str]:
    return sorted(os.listdir(step_dir))


def test_gc_slims_the_older_steps_in_place_and_each_rehydrates_bit_exactly(run_dir, tmp_path):
    originals = tmp_path / "originals"
    shutil.copytree(run_dir, originals)
    keep = hu.snapshot(run_dir / "step_3", run_dir / "step_4")
    before = dir_bytes(run_dir)
    dry = json.loads(gc(run_dir, "--keep-full", "2", "--dry-run", "--json").stdout)["plan"]
    r = gc(run_dir, "--keep-full", "2", "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)["result"]
    assert res["slimmed"] == [1, 2]
    assert hu.diff_snapshots(keep, hu.snapshot(run_dir / "step_3", run_dir / "step_4")) == []
    for n in (1, 2):
        step = run_dir / f"step_{n}"
        assert entries(step) == ["trainer"], entries(step)          # nothing left beside it
        assert (step / "trainer" / "ckpt-slim-manifest.json").is_file()
        out = tmp_path / "rehydrated" / f"step_{n}" / "trainer"
        rr = CliRunner().invoke(main, ["rehydrate", str(step / "trainer"), str(out), "--base", str(run_dir.parent.parent / "base_model")])
        assert rr.exit_code == 0, rr.output
        assert assert_bit_equal_checkpoints(originals / f"step_{n}" / "trainer", out) == 229   # E's key count
    # disk use drops by exactly what is reported, step by step and in total
    after = dir_bytes(run_dir)
    assert res["bytes_before"] == before and res["bytes_after"] == after and res["freed_bytes"] == before - after > 0
    per_step = {s["step"]: s for s in res["steps"]}
    assert sum(s["freed_bytes"] for s in res["steps"]) == before - after
    for n in (1, 2):
        assert per_step[n]["bytes_after"] == dir_bytes(run_dir / f"step_{n}")
        est = next(s for s in dry["steps"] if s["step"] == n)["bytes_to_free"]
        assert 0.9 * per_step[n]["freed_bytes"] <= est <= per_step[n]["freed_bytes"], (est, per_step[n])
    # a rerun finds nothing to do
    again = json.loads(gc(run_dir, "--keep-full", "2", "--json").stdout)["result"]
    assert again["slimmed"] == [] and again["freed_bytes"] == 0


def test_dry_run_changes_nothing_and_reports_bytes_to_free_per_step(run_dir):
    before = hu.snapshot(run_dir.parent.parent)
    r = gc(run_dir.parent, "--keep-full", "1", "--dry-run", "--json")   # the outputs dir works too
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)["plan"]
    assert [s["action"] for s in plan["steps"]] == ["slim", "slim", "slim", "keep"]
    assert all(s["bytes_to_free"] > 0 for s in plan["steps"][:3])
    assert plan["base"]["dir"].endswith("base_model") and "model.name" in plan["base"]["how"]
    assert hu.diff_snapshots(before, hu.snapshot(run_dir.parent.parent)) == []


def test_checkpoints_being_written_are_left_alone(run_dir):
    (run_dir / "step_5" / "trainer").mkdir(parents=True)            # a save in progress: no .metadata yet
    shutil.copy(run_dir / "step_4/trainer/__0_0.distcp", run_dir / "step_5/trainer/__0_0.distcp")
    now = time.time()
    for p in [run_dir / "step_2", *(run_dir / "step_2").rglob("*")]:   # written a minute ago
        os.utime(p, (now - 60, now - 60))
    (run_dir / "step_3" / "trainer" / "writer.lock").write_text("")    # someone else's lock file
    lock = OutputLock(run_dir / "step_1" / ".trainer.lock", run_dir / "step_1" / "trainer")
    lock.acquire()                                                       # another ckpt command on step_1
    try:
        before = hu.snapshot(*(run_dir / f"step_{n}" / "trainer" for n in (1, 2, 3, 5)))
        r = gc(run_dir, "--keep-full", "1", "--json")
        assert r.exit_code == 0, r.output
        steps = {s["step"]: s for s in json.loads(r.stdout)["result"]["steps"]}
    finally:
        lock.release()
    assert {n: s["result"] for n, s in steps.items()} == {1: "skipped", 2: "skipped", 3: "skipped", 4: "kept",
                                                          5: "skipped"}
    assert "locked by another ckpt command" in steps[1]["reason"]
    assert "modified 60 s ago" in steps[2]["reason"] and "writer.lock" in steps[3]["reason"]
    assert "no .metadata" in steps[5]["reason"]
    assert hu.diff_snapshots(before, hu.snapshot(*(run_dir / f"step_{n}" / "trainer" for n in (1, 2, 3, 5)))) == []


def test_refuses_when_free_disk_is_too_low_for_one_slim(run_dir, monkeypatch):
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=4096))
    before = hu.snapshot(run_dir)
    r = gc(run_dir, "--keep-full", "2")
    hu.assert_clean_error(hu.Result(r.exit_code, r.stdout, r.stderr), expect="need .* free for the largest slim")
    assert hu.diff_snapshots(before, hu.snapshot(run_dir)) == []


def test_without_a_base_it_refuses_before_writing(tmp_path):
    ck = make_run(tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "base_model")
    r = gc(ck, "--keep-full", "2", "--json")
    assert r.exit_code == 2 and "no base model" in json.loads(r.stdout)["error"]["message"]
    assert not (ck / "step_1" / "trainer" / "ckpt-slim-manifest.json").exists()


def test_a_16e747c_run_takes_its_base_from_orch_toml_and_a_full_finetune_has_nothing_to_drop(tmp_path):
    run = tmp_path / "tiny"
    shutil.copytree(FIXTURE, run)
    shutil.copytree(run / "outputs/checkpoints/step_3", run / "outputs/checkpoints/step_2")
    _age(run)
    r = gc(run / "outputs/checkpoints", "--keep-full", "1", "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["result"]["slimmed"] == [2] and rep["plan"]["base"]["dir"] == str(run / "base_model")
    g = tmp_path / "g"
    shutil.copytree(HEAD_FIXTURES / "G_head_fullft" / "outputs", g / "outputs")
    shutil.copytree(g / "outputs/checkpoints/step_3", g / "outputs/checkpoints/step_2")
    _age(g)
    plan = json.loads(gc(g / "outputs/checkpoints", "--keep-full", "1", "--dry-run", "--json").stdout)["plan"]
    assert plan["steps"][0]["action"] == "skip" and "no frozen base weights" in plan["steps"][0]["reason"]


# ------------------------------------------------------------------------------------------ kills
GC_EVENTS = (("ckpt_tools.ops.gc.swap", None, "swap_in_slim"), ("ckpt_tools.io.files", None, "exchange_paths"),
             ("ckpt_tools.ops.gc.swap", None, "set_aside"), ("ckpt_tools.ops.gc.swap", None, "remove_file"))
LEFTOVER_NAMES = ("trainer", ".trainer.gc-slim", ".trainer.gc-old", ".trainer.lock", "..trainer.gc-slim.lock",
                  "..trainer.gc-slim.tmp-")


SLIM_FILES = [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp", "ckpt-slim-manifest.json"]


def _full_or_slim(step: Path, original: Path) -> str:
    trainer = step / "trainer"
    assert trainer.is_dir() and (trainer / ".metadata").is_file(), f"{step}: neither full nor slim: {entries(step)}"
    assert all(n.startswith(LEFTOVER_NAMES) for n in entries(step)), entries(step)
    if (trainer / "ckpt-slim-manifest.json").is_file():
        gc_mod.verify_slim_against(original, trainer)
        return "slim"
    assert _same_files(original, trainer), f"{trainer}: a full checkpoint whose files differ from the original"
    return "full"


def _same_files(a: Path, b: Path) -> bool:
    names = sorted(os.listdir(a))
    return names == sorted(os.listdir(b)) and all((a / n).read_bytes() == (b / n).read_bytes() for n in names)


def test_sigkill_at_every_kill_point_leaves_each_step_full_or_slim_and_a_rerun_finishes(tmp_path, monkeypatch):
    monkeypatch.setattr(hu, "WRITE_EVENTS", hu.WRITE_EVENTS + GC_EVENTS)
    pristine = tmp_path / "pristine"
    make_run(pristine)
    originals = pristine / "outputs" / "checkpoints"
    work = tmp_path / "work"
    run = tmp_path / "run"

    def fresh() -> Path:
        if run.exists():
            shutil.rmtree(run)
        shutil.copytree(pristine, run, symlinks=True)
        _age(run)
        return run / "outputs" / "checkpoints"

    ck = fresh()
    args = ["gc", ck, "--keep-full", "2"]
    clean = hu.Forked(args, work)
    assert clean.result().exit_code == 0
    events = clean.events()
    assert {"swap_in_slim", "exchange_paths", "set_aside", "remove_file", "AtomicOutputDir._commit"} <= set(events)
    # Every kind of kill point of step_1's slim-verify-swap-free sequence (first and last item written,
    # the slim's commit, before and after the exchange, the first and last file freed), and step_2's
    # swap while step_1 is already slim. (A kill between two items of the slim leaves what a kill at
    # the first item leaves: a temp dir beside the full checkpoint.)
    first_swap = events.index("swap_in_slim")
    step1, step2 = list(enumerate(events[:first_swap + 8], 1)), list(enumerate(events, 1))[first_swap + 8:]
    appends = [i for i, e in step1 if e == "DcpWriter._append"]
    frees = [i for i, e in step1 if e == "remove_file"]
    points = sorted({appends[0], appends[-1], frees[0], frees[-1]}
                    | {i for i, e in step1 if e in ("AtomicOutputDir._commit", "swap_in_slim", "exchange_paths",
                                                      "set_aside")}
                    | {next(i for i, e in step2 if e == "swap_in_slim")})
    assert len(points) == 9
    states = {}
    for point in points:
        ck = fresh()
        f = hu.Forked(args, work, stop_at=point)
        ev = f.wait_stopped()
        assert ev is not None, f"exited before event {point}: {f.result().output}"
        f.kill(signal.SIGKILL)
        assert f.wait() == -signal.SIGKILL
        seen = tuple(_full_or_slim(ck / f"step_{n}", originals / f"step_{n}" / "trainer") for n in (1, 2, 3, 4))
        assert seen[2:] == ("full", "full")
        states[(point, ev)] = seen
        r = gc(*args[1:])                                         # the rerun finishes the job
        assert r.exit_code == 0, r.output
        for n in (1, 2):   # finished: slim (proved against the original by gc itself), nothing beside it
            assert entries(ck / f"step_{n}") == ["trainer"], (point, ev, entries(ck / f"step_{n}"))
            assert sorted(os.listdir(ck / f"step_{n}" / "trainer")) == SLIM_FILES, (point, ev)
    hu.record("faults", kill_points=len(points), complete_looking_partial_outputs=0, inputs_changed=0)
    # the kills hit both sides of the swap: before it every step was full, after it step_1 was slim
    assert ("full", "full", "full", "full") in states.values() and ("slim", "full", "full", "full") in states.values()
    out = tmp_path / "rehydrated" / "trainer"
    rr = CliRunner().invoke(main, ["rehydrate", str(ck / "step_1" / "trainer"), str(out), "--base", str(run / "base_model")])
    assert rr.exit_code == 0, rr.output
    assert_bit_equal_checkpoints(originals / "step_1" / "trainer", out)


def test_sigint_mid_slim_exits_130_and_leaves_every_step_full_or_slim(tmp_path):
    ck = make_run(tmp_path / "run")
    originals = tmp_path / "orig"
    shutil.copytree(ck, originals)
    f = hu.Forked(["gc", ck, "--keep-full", "2"], tmp_path / "work", stop_at=3)
    assert f.wait_stopped() is not None
    f.kill(signal.SIGINT)
    r = f.result()
    assert r.exit_code == 130 and "every step is full or slim" in r.stderr and "Traceback" not in r.stderr, r.output
    for n in (1, 2, 3, 4):
        _full_or_slim(ck / f"step_{n}", originals / f"step_{n}" / "trainer")


def test_without_an_atomic_exchange_gc_swaps_by_two_renames_and_a_kill_between_them_is_undone(run_dir, monkeypatch):
    """Filesystems without renameat2(RENAME_EXCHANGE): two renames with signals held. A SIGKILL between
    them leaves trainer/ absent and the full checkpoint at .trainer.gc-old, which the next run puts
    back and then slims."""
    import errno

    def no_exchange(a, b):
        raise OSError(errno.EINVAL, "no RENAME_EXCHANGE here")

    monkeypatch.setattr("ckpt_tools.ops.gc.swap.exchange_paths", no_exchange)
    r = gc(run_dir, "--keep-full", "3", "--json")
    assert r.exit_code == 0 and json.loads(r.stdout)["result"]["slimmed"] == [1], r.output
    assert entries(run_dir / "step_1") == ["trainer"]
    # the state a kill between the two renames leaves on step_2: the slim staged, the full set aside
    step = run_dir / "step_2"
    original = run_dir.parent / "step_2-original"
    shutil.copytree(step / "trainer", original)
    from ckpt_tools import slim

    slim(step / "trainer", step / ".trainer.gc-slim", base=run_dir.parent.parent / "base_model")
    os.rename(step / "trainer", step / ".trainer.gc-old")
    plan = json.loads(gc(run_dir, "--keep-full", "2", "--dry-run", "--json").stdout)["plan"]
    assert plan["steps"][1]["action"] == "restore" and plan["steps"][1]["then_slim"] is True
    res = json.loads(gc(run_dir, "--keep-full", "2", "--json").stdout)["result"]
    assert res["slimmed"] == [2] and entries(step) == ["trainer"]
    assert any("restored trainer" in n for n in res["steps"][1]["notes"])
    assert any("reused the verified" in n for n in res["steps"][1]["notes"])
    gc_mod.verify_slim_against(original, step / "trainer")


def test_a_symlinked_trainer_dir_is_left_alone(run_dir, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    shutil.move(run_dir / "step_1" / "trainer", elsewhere)
    os.symlink(elsewhere, run_dir / "step_1" / "trainer")
    before = hu.snapshot(elsewhere)
    steps = json.loads(gc(run_dir, "--keep-full", "2", "--json").stdout)["result"]["steps"]
    assert steps[0]["result"] == "skipped" and "symbolic link" in steps[0]["reason"]
    assert steps[1]["result"] == "slimmed"
    assert hu.diff_snapshots(before, hu.snapshot(elsewhere)) == [] and (run_dir / "step_1" / "trainer").is_symlink()
