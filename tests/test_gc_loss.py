"""`ckpt gc` never loses a step: runs of genuine HEAD checkpoints (test_gc.make_run) where steps share
files (a `cp -s` copy, hard links, `step_3/trainer -> ../step_1/trainer`), the newest step is already
slim, a step holds entries a slim would not carry (hidden files, an unreferenced `.distcp`, the
`.metadata.bak-*` of a real `set-lr --in-place`), lock files a killed run left, a Ctrl-C after one
step, and steps gc cannot change (no inodes left on a real tmpfs, a step deleted mid-run, an immutable
or read-only or mounted trainer dir, a stale staged slim after an edit). After each: every step is
full or slim, a full checkpoint remains, the kept steps verify, and the messages are one line each.

Figures for docs/reliability.md: `hu.record("gc_loss")`.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckpt_tools.cli import main

from . import hardening_util as hu
from .test_gc import GC_EVENTS, OLD, entries, make_run

MANIFEST = "ckpt-slim-manifest.json"


def _age(root: Path) -> None:
    for p in [root, *root.rglob("*")]:
        os.utime(p, (OLD, OLD), follow_symlinks=False)


def gc(*args, json_out: bool = True):
    r = hu.invoke(["gc", *args, *(["--json"] if json_out else [])])
    return r, (json.loads(r.stdout) if json_out and r.stdout.strip() else None)


def steps_of(doc) -> dict[int, dict]:
    return {s["step"]: s for s in doc["result"]["steps"]}


def state(ck: Path, n: int) -> str:
    t = ck / f"step_{n}" / "trainer"
    assert (t / ".metadata").is_file(), f"step_{n}: neither full nor slim: {entries(t.parent)}"
    return "slim" if (t / MANIFEST).is_file() else "full"


def verify(trainer: Path, *flags) -> None:
    r = hu.invoke([*flags, "verify", trainer])
    assert r.exit_code == 0, r.output


def assert_one_full_remains(ck: Path) -> None:
    full = [d.name for d in sorted(ck.iterdir()) if (d / "trainer").is_dir() and not (d / "trainer").is_symlink()
            and (d / "trainer" / ".metadata").is_file() and not (d / "trainer" / MANIFEST).is_file()]
    assert full, f"no full checkpoint left in {ck}"


# ------------------------------------------------------------------------------------ shared files
@pytest.mark.parametrize("how", ["cp -s", "hard links"])
def test_a_step_sharing_files_with_a_kept_step_is_never_slimmed(tmp_path, how):
    ck = make_run(tmp_path / "run", steps=(1, 2, 3))
    src, dst = ck / "step_1" / "trainer", ck / "step_4" / "trainer"
    dst.parent.mkdir()
    flag = "-rs" if how == "cp -s" else "-al"
    subprocess.run(["cp", flag, str(src), str(dst)], check=True)   # step_4: step_1's files by link
    _age(ck.parent.parent)
    before = hu.snapshot(src)
    r, doc = gc(ck, "--keep-full", "1")
    assert r.exit_code == 0, r.output
    s = steps_of(doc)
    assert s[1]["result"] == "skipped" and "shares files with step_4" in s[1]["reason"], s[1]
    assert s[4]["result"] == "kept" and {s[2]["result"], s[3]["result"]} == {"slimmed"}
    assert hu.diff_snapshots(before, hu.snapshot(src)) == []
    verify(dst, *(["--follow-symlinks"] if how == "cp -s" else []))   # the kept step still loads
    hu.record("gc_loss", cases=1, steps_lost=0)


def test_a_linked_trainer_keeps_its_target_full_under_keep_full_1(tmp_path):
    ck = make_run(tmp_path / "run", steps=(1, 2))
    (ck / "step_3").mkdir()
    (ck / "step_3" / "trainer").symlink_to("../step_1/trainer")
    _age(ck.parent.parent)
    r, doc = gc(ck, "--keep-full", "1")
    assert r.exit_code == 0, r.output
    s = steps_of(doc)
    assert s[1]["result"] == "skipped" and "shares files with step_3" in s[1]["reason"]
    assert s[2]["result"] == "slimmed"
    assert_one_full_remains(ck)
    assert state(ck, 1) == "full"
    verify(ck / "step_3" / "trainer")
    hu.record("gc_loss", cases=1, steps_lost=0)


def test_keep_full_counts_full_steps_only(tmp_path):
    ck = make_run(tmp_path / "run")
    r, _ = gc(ck, "--keep-full", "3")             # step_1 slim
    assert r.exit_code == 0 and state(ck, 1) == "slim", r.output
    # the newest step slim too (slimmed by hand, as `ckpt slim` + a swap would leave it)
    slim4 = ck / "step_4" / "slim"
    assert hu.invoke(["slim", ck / "step_4" / "trainer", slim4, "--base", ck.parent.parent / "base_model"]).exit_code == 0
    shutil.rmtree(ck / "step_4" / "trainer")
    os.rename(slim4, ck / "step_4" / "trainer")
    _age(ck.parent.parent)
    r, doc = gc(ck, "--keep-full", "1")
    assert r.exit_code == 0, r.output
    s = steps_of(doc)
    assert s[3]["result"] == "kept" and s[2]["result"] == "slimmed", s
    assert [state(ck, n) for n in (1, 2, 3, 4)] == ["slim", "slim", "full", "slim"]
    hu.record("gc_loss", cases=1, steps_lost=0)


# -------------------------------------------------------------------------------- unknown entries
def test_entries_a_slim_would_not_carry_keep_their_step_full_and_are_named(tmp_path):
    ck = make_run(tmp_path / "run", steps=(1, 2, 3, 4))
    t1, t2, t3 = (ck / f"step_{n}" / "trainer" for n in (1, 2, 3))
    (t1 / ".notes").write_text("what I changed\n")
    shutil.copy(t2 / "__0_0.distcp", t2 / "__9_0.distcp")        # referenced by nothing
    r = hu.invoke(["set-lr", t3, "--scale", "0.5", "--in-place"])   # leaves its .metadata.bak-* undo file
    assert r.exit_code == 0, r.output
    bak = [n for n in os.listdir(t3) if n.startswith(".metadata.bak")]
    assert bak, os.listdir(t3)
    _age(ck.parent.parent)
    before = hu.snapshot(t1, t2, t3)
    r, doc = gc(ck, "--keep-full", "1")
    assert r.exit_code == 0, r.output
    s = steps_of(doc)
    for n, name in ((1, ".notes"), (2, "__9_0.distcp"), (3, bak[0])):
        assert s[n]["result"] == "skipped" and "holds entries a slim would not carry" in s[n]["reason"] \
            and name in s[n]["reason"], s[n]
    assert hu.diff_snapshots(before, hu.snapshot(t1, t2, t3)) == []
    text = hu.invoke(["gc", ck, "--keep-full", "1", "--dry-run"]).stdout
    assert sum("holds entries a slim would not carry" in ln for ln in text.splitlines()) == 3, text
    hu.record("gc_loss", cases=3, entries_deleted=0)


# --------------------------------------------------------------------------- leftovers, interrupts
def test_a_rerun_removes_stale_lock_files_a_killed_run_left(tmp_path):
    ck = make_run(tmp_path / "run", steps=(1, 2))
    r, _ = gc(ck, "--keep-full", "1")
    assert r.exit_code == 0 and state(ck, 1) == "slim"
    p = subprocess.Popen(["true"])
    p.wait()
    dead = p.pid                                            # a pid that is not running
    for n, name in ((1, ".trainer.lock"), (1, "..trainer.gc-slim.lock"), (2, ".trainer.lock")):
        (ck / f"step_{n}" / name).write_text(f"{dead}\n")    # what SIGKILL leaves: unheld lock files
    r, doc = gc(ck, "--keep-full", "1")
    assert r.exit_code == 0, r.output
    assert entries(ck / "step_1") == ["trainer"] and entries(ck / "step_2") == ["trainer"]
    assert any("stale lock" in n for n in steps_of(doc)[1]["notes"])
    hu.record("gc_loss", cases=1)


def test_ctrl_c_after_a_step_names_the_steps_done(tmp_path, monkeypatch):
    monkeypatch.setattr(hu, "WRITE_EVENTS", hu.WRITE_EVENTS + GC_EVENTS)
    ck = make_run(tmp_path / "run")
    scratch = make_run(tmp_path / "scratch")
    clean = hu.Forked(["gc", scratch, "--keep-full", "2"], tmp_path / "w")
    assert clean.result().exit_code == 0
    ev = clean.events()
    step2 = next(i for i, e in enumerate(ev) if i > ev.index("swap_in_slim") and e == "DcpWriter._append")
    f = hu.Forked(["gc", ck, "--keep-full", "2"], tmp_path / "w", stop_at=step2 + 1)
    assert f.wait_stopped() is not None
    f.kill(signal.SIGINT)
    r = f.result()
    assert r.exit_code == 130 and "Traceback" not in r.stderr, r.output
    last = r.stderr.strip().splitlines()[-1]
    assert last == ("interrupted: gc stopped after step_1 slimmed (done, kept); every step is full or slim; "
                    "rerun to finish"), last
    assert "nothing was written" not in r.stderr
    assert [state(ck, n) for n in (1, 2, 3, 4)] == ["slim", "full", "full", "full"]
    hu.record("gc_loss", cases=1)


# -------------------------------------------------------------------- steps gc cannot change
def _assert_clean_skip(r, doc, n: int, expect: str) -> None:
    assert "Traceback" not in r.output and "internal error" not in r.output, r.output
    s = steps_of(doc)[n]
    assert s["result"] == "skipped" and expect in s["reason"], s
    lines = [ln for ln in r.stderr.splitlines() if f"step_{n}: skipped" in ln]
    assert len(lines) <= 1, r.stderr


def test_no_inodes_left_skips_cleanly_on_a_real_tmpfs(tmp_path):
    mnt = tmp_path / "fs"
    with hu.small_filesystem(mnt, 64 << 20):
        ck = make_run(mnt / "run", steps=(1, 2))
        used = int(subprocess.run(["df", "--output=iused", str(mnt)], capture_output=True, text=True)
                   .stdout.split()[-1])
        p = subprocess.run(["mount", "-o", f"remount,nr_inodes={used + 2}", str(mnt)], capture_output=True, text=True)
        if p.returncode != 0:
            pytest.skip(f"cannot limit the tmpfs's inodes ({p.stderr.strip()})")
        before = hu.snapshot(ck)
        r = hu.invoke(["gc", ck, "--keep-full", "1", "--json"])
        doc = json.loads(r.stdout)
        assert r.exit_code == 1 and doc["result"]["failed"] == [1], r.output
        _assert_clean_skip(r, doc, 1, "no space or no inodes left")
        assert state(ck, 1) == "full" and hu.diff_snapshots(before, hu.snapshot(ck)) == []
        text = hu.invoke(["gc", ck, "--keep-full", "1"])
        assert text.exit_code == 1 and "step_1: skipped: no space or no inodes left" in text.stderr, text.output
    hu.record("gc_loss", clean_errors=1)


def test_a_step_deleted_mid_gc_is_skipped_and_the_others_done(tmp_path, monkeypatch):
    monkeypatch.setattr(hu, "WRITE_EVENTS", hu.WRITE_EVENTS + GC_EVENTS)
    ck = make_run(tmp_path / "run")
    scratch = make_run(tmp_path / "scratch")
    clean = hu.Forked(["gc", scratch, "--keep-full", "1", "--json"], tmp_path / "w")
    assert clean.result().exit_code == 0
    ev = clean.events()
    step2 = next(i for i, e in enumerate(ev) if i > ev.index("swap_in_slim") and e == "DcpWriter._append")
    f = hu.Forked(["gc", ck, "--keep-full", "1", "--json"], tmp_path / "w", stop_at=step2 + 1)
    assert f.wait_stopped() is not None
    shutil.rmtree(ck / "step_2")                    # prime-rl's keep_last, while gc slims it
    f.resume()
    r = f.result()
    doc = json.loads(r.stdout)
    assert r.exit_code == 1 and doc["result"]["failed"] == [2], r.output
    _assert_clean_skip(r, doc, 2, "")
    assert {n: s["result"] for n, s in steps_of(doc).items()} == {1: "slimmed", 2: "skipped", 3: "slimmed",
                                                                 4: "kept"}
    hu.record("gc_loss", clean_errors=1)


@contextlib.contextmanager
def _immutable(p: Path):
    r = subprocess.run(["chattr", "+i", str(p)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"chattr +i not supported here ({r.stderr.strip()})")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(p)], capture_output=True)


@contextlib.contextmanager
def _mounted(p: Path, *opts: str):
    r = subprocess.run(["mount", "--bind", str(p), str(p)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot bind-mount here ({r.stderr.strip()})")
    try:
        for o in opts:
            r = subprocess.run(["mount", "-o", o, str(p)], capture_output=True, text=True)
            if r.returncode != 0:
                pytest.skip(f"cannot remount {o} ({r.stderr.strip()})")
        yield
    finally:
        subprocess.run(["umount", "-l", str(p)], capture_output=True)


@pytest.mark.parametrize("case", ["immutable trainer", "read-only step", "mount-point trainer"])
def test_a_trainer_dir_gc_cannot_change_is_skipped_with_one_line(tmp_path, case):
    ck = make_run(tmp_path / "run", steps=(1, 2, 3))
    step = ck / "step_1"
    ctx, expect = {"immutable trainer": (lambda: _immutable(step / "trainer"), "cannot change step_1"),
                   "read-only step": (lambda: _mounted(step, "remount,ro,bind"), "cannot change step_1"),
                   "mount-point trainer": (lambda: _mounted(step / "trainer"), "mount point")}[case]
    before = hu.snapshot(step / "trainer")
    with ctx():
        r, doc = gc(ck, "--keep-full", "1")
        _assert_clean_skip(r, doc, 1, expect)
        assert steps_of(doc)[2]["result"] == "slimmed"
        assert state(ck, 1) == "full" and entries(step) == ["trainer"], entries(step)
    assert hu.diff_snapshots(before, hu.snapshot(step / "trainer")) == []
    hu.record("gc_loss", clean_errors=1)


def test_a_stale_staged_slim_after_an_edit_is_discarded_and_redone(tmp_path):
    ck = make_run(tmp_path / "run", steps=(1, 2))
    step = ck / "step_1"
    base = ck.parent.parent / "base_model"
    assert hu.invoke(["slim", step / "trainer", step / ".trainer.gc-slim", "--base", base]).exit_code == 0
    r = hu.invoke(["set-lr", step / "trainer", "--in-place", "--scale", "0.5"])   # edited after the kill
    assert r.exit_code == 0, r.output
    for n in os.listdir(step / "trainer"):
        if n.startswith(".metadata.bak"):
            os.unlink(step / "trainer" / n)          # the user dropped the undo file
    _age(ck.parent.parent)
    r, doc = gc(ck, "--keep-full", "1")
    assert r.exit_code == 0 and "Traceback" not in r.output, r.output
    s = steps_of(doc)[1]
    assert s["result"] == "slimmed" and any("discarded" in n for n in s["notes"]), s
    out = tmp_path / "re"
    rr = CliRunner().invoke(main, ["rehydrate", str(step / "trainer"), str(out), "--base", str(base)])
    assert rr.exit_code == 0, rr.output
    from ckpt_tools.formats.dcp.reader import DcpCheckpoint
    with DcpCheckpoint.open(out) as c, DcpCheckpoint.open(ck / "step_2" / "trainer") as orig:
        lr, was = (float(x.read_object("app.optimizers.param_groups.0.lr")) for x in (c, orig))
    assert lr == was * 0.5    # the edit survived: the stale slim was not used
    hu.record("gc_loss", clean_errors=1)


def test_inspect_after_gc_says_slim_steps_need_rehydrate(tmp_path):
    ck = make_run(tmp_path / "run", steps=(1, 2))
    assert gc(ck, "--keep-full", "1")[0].exit_code == 0
    doc = json.loads(hu.invoke(["inspect", ck, "--json"]).stdout)["result"]
    s = {x["step"]: x for x in doc["steps"]}
    assert s[1]["state"] == "slim" and s[1]["resumes_at_step"] is None and "ckpt rehydrate" in s[1]["to_resume"]
    assert s[2]["state"] == "full" and s[2]["resumes_at_step"] == 2
    lines = hu.invoke(["inspect", ck]).stdout.splitlines()
    one = next(ln for ln in lines if ln.strip().startswith("step_1 "))
    assert "slim" in one and "rehydrate" in one and "resumes at" not in one, one
    assert "resumes at step 2" in next(ln for ln in lines if ln.strip().startswith("step_2 "))
    hu.record("gc_loss", cases=1)
