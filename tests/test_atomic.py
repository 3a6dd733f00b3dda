"""AtomicOutputDir and friends, including real processes killed mid-write."""
from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from collections import namedtuple
from pathlib import Path

import pytest

from ckpt_tools.io import files, inputs, staging
from ckpt_tools.io import lock as lock_mod
from ckpt_tools.io.owned import OUTPUT_MARKER
from ckpt_tools.io.staging import AtomicOutputDir, clean_stale_temps
from ckpt_tools.io.signals import Terminated
from ckpt_tools.io.files import atomic_write_bytes, atomic_write_text
from ckpt_tools.core.units import human_bytes
from ckpt_tools.core.errors import DiskSpaceError, LockedError, OutputExistsError, UsageError

REPO = Path(__file__).resolve().parents[1]


def siblings(out: Path) -> list[str]:
    """Everything beside OUT that belongs to it (OUT itself, temps, lock)."""
    return sorted(p.name for p in out.parent.iterdir() if p.name == out.name or p.name.startswith(f".{out.name}."))


def child(script: str, *args, stdin=subprocess.DEVNULL) -> subprocess.Popen:
    """A python child importing ckpt_tools from this checkout; its first stdout line is a handshake."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(script), *map(str, args)], env=env,
                            stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


HOLD = """
    import sys, time
    from pathlib import Path
    from ckpt_tools.io.signals import install_signal_handlers
    from ckpt_tools.io.staging import AtomicOutputDir
    install_signal_handlers()
    with AtomicOutputDir(sys.argv[1]) as tmp:
        (tmp / "part.bin").write_bytes(b"x" * 4096)
        print(tmp, flush=True)
        sys.stdin.readline() if sys.argv[2] == "stdin" else time.sleep(60)
        (tmp / "done").write_text("ok")
"""


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# ------------------------------------------------------------------------------ in-process

def test_success_renames_the_hidden_temp_dir_to_out_and_leaves_nothing_else(tmp_path):
    out = tmp_path / "merged"
    with AtomicOutputDir(out) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(f".merged.tmp-{os.getpid()}-")
        assert (tmp_path / ".merged.lock").read_text() == f"{os.getpid()}\n"
        (tmp / "sub").mkdir()
        (tmp / "sub" / "a.txt").write_text("hello")
        assert not out.exists()
    assert (out / "sub" / "a.txt").read_text() == "hello"
    assert siblings(out) == ["merged"]


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt(), Terminated()])
def test_any_exception_leaves_no_out_no_temp_and_no_lock_and_propagates(tmp_path, exc):
    out = tmp_path / "merged"
    with pytest.raises(type(exc)):
        with AtomicOutputDir(out) as tmp:
            (tmp / "half.bin").write_bytes(b"x" * 100)
            raise exc
    assert siblings(out) == []


def test_existing_out_is_refused_unless_overwrite(tmp_path):
    out = tmp_path / "merged"
    with AtomicOutputDir(out) as tmp:    # an earlier output: it carries the marker
        (tmp / "old.txt").write_text("old")
    assert sorted(p.name for p in out.iterdir()) == [OUTPUT_MARKER, "old.txt"]
    with pytest.raises(OutputExistsError, match="already exists") as ei:
        with AtomicOutputDir(out):
            pytest.fail("must not be entered")
    assert str(ei.value) == f"{out}: already exists (pass --overwrite to replace it, or another output path)"
    assert siblings(out) == ["merged"] and (out / "old.txt").read_text() == "old"

    with AtomicOutputDir(out, overwrite=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == [OUTPUT_MARKER, "new.txt"]
    assert siblings(out) == ["merged"]


def test_failed_overwrite_keeps_the_old_out(tmp_path):
    out = tmp_path / "merged"
    with AtomicOutputDir(out) as tmp:
        (tmp / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with AtomicOutputDir(out, overwrite=True):
            raise RuntimeError("boom")
    assert (out / "old.txt").read_text() == "old" and siblings(out) == ["merged"]


@pytest.mark.parametrize("rel_out,rel_input,expect", [
    ("base/merged", "base", "is inside input"),
    ("base", "base", "is inside input"),
    ("work", "work/base", "is inside output"),
])
def test_out_overlapping_an_input_is_a_usage_error(tmp_path, rel_out, rel_input, expect):
    (tmp_path / rel_input).mkdir(parents=True)
    with pytest.raises(UsageError, match=expect):
        with AtomicOutputDir(tmp_path / rel_out, inputs=[tmp_path / rel_input], overwrite=True):
            pytest.fail("must not be entered")
    assert (tmp_path / rel_input).is_dir()


def test_out_reached_through_a_symlink_into_an_input_is_refused(tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "base")
    with pytest.raises(UsageError, match="is inside input"):
        with AtomicOutputDir(tmp_path / "link" / "merged", inputs=[tmp_path / "base"]):
            pass


def test_disk_check_refuses_with_need_and_free_before_writing(tmp_path, monkeypatch):
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10**12, 10**12 - 3 * 2**30, 3 * 2**30))
    out = tmp_path / "merged"
    with pytest.raises(DiskSpaceError) as ei:
        with AtomicOutputDir(out, need_bytes=16 * 2**30):
            pytest.fail("must not be entered")
    assert f"need 16.00 GiB, 3.00 GiB free on {staging.mount_point(tmp_path)}" in str(ei.value)
    assert siblings(out) == []
    with AtomicOutputDir(out, need_bytes=2 * 2**30):
        pass
    assert out.is_dir()


def test_two_outputs_in_one_process_lock_each_other(tmp_path):
    out = tmp_path / "merged"
    with AtomicOutputDir(out):
        with pytest.raises(LockedError, match=f"pid {os.getpid()}"):
            with AtomicOutputDir(out):
                pass
    assert siblings(out) == ["merged"]


def test_stale_lock_file_of_a_dead_process_is_taken_over(tmp_path):
    out = tmp_path / "merged"
    (tmp_path / ".merged.lock").write_text(f"{dead_pid()}\n")
    with AtomicOutputDir(out):
        pass
    assert siblings(out) == ["merged"]


def test_without_flock_a_dead_pid_lock_is_taken_over_and_a_live_one_refused(tmp_path, monkeypatch):
    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(lock_mod.fcntl, "flock", no_flock)
    out = tmp_path / "merged"
    lock = tmp_path / ".merged.lock"
    lock.write_text(f"{dead_pid()}\n")
    with AtomicOutputDir(out):
        assert lock.read_text() == f"{os.getpid()}\n"
    assert siblings(out) == ["merged"]

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        lock.write_text(f"{live.pid}\n")
        with pytest.raises(LockedError, match=f"pid {live.pid}"):
            with AtomicOutputDir(out, overwrite=True):
                pass
        assert lock.read_text() == f"{live.pid}\n"
    finally:
        live.kill()
        live.wait()


def test_clean_stale_temps_removes_dead_temps_restores_a_dead_overwrites_old_out_and_spares_live_ones(tmp_path):
    out = tmp_path / "merged"
    dead = dead_pid()
    (tmp_path / f".merged.tmp-{dead}-ab12").mkdir()
    (tmp_path / f".merged.tmp-{os.getpid()}-cd34").mkdir()
    (tmp_path / f".merged.old-{dead}-ef56").mkdir()
    (tmp_path / f".merged.old-{dead}-ef56" / "w").write_text("old out")
    (tmp_path / ".other.tmp-1-aa").mkdir()
    clean_stale_temps(out)
    assert (out / "w").read_text() == "old out"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [".merged.tmp-%d-cd34" % os.getpid(), ".other.tmp-1-aa", "merged"])


# ----------------------------------------------------------------------------- real processes

def test_sigkill_mid_write_leaves_no_out_and_the_rerun_cleans_up_and_succeeds(tmp_path):
    out = tmp_path / "merged"
    p = child(HOLD, out, "sleep")
    tmp = Path(p.stdout.readline().strip())
    assert tmp.name.startswith(f".merged.tmp-{p.pid}-") and (tmp / "part.bin").exists()
    p.send_signal(signal.SIGKILL)
    p.wait()
    assert not out.exists() and tmp.exists()  # SIGKILL cannot be caught: the temp stays, OUT never appears

    with AtomicOutputDir(out) as tmp2:
        assert not tmp.exists()  # removed on entry: its pid is dead
        (tmp2 / "ok").write_text("1")
    assert (out / "ok").read_text() == "1" and siblings(out) == ["merged"]


def test_sigterm_runs_the_same_cleanup_as_an_exception(tmp_path):
    out = tmp_path / "merged"
    p = child(HOLD, out, "sleep")
    tmp = Path(p.stdout.readline().strip())
    assert tmp.exists()
    p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=20)
    assert p.returncode != 0 and "Terminated" in err
    assert siblings(out) == []


def test_a_second_process_is_refused_while_the_first_writes_and_the_first_still_completes(tmp_path):
    out = tmp_path / "merged"
    p = child(HOLD, out, "stdin", stdin=subprocess.PIPE)
    try:
        tmp = Path(p.stdout.readline().strip())
        with pytest.raises(LockedError) as ei:
            with AtomicOutputDir(out):
                pytest.fail("must not be entered")
        assert f"another ckpt command (pid {p.pid}) is writing {out}" in str(ei.value)
        assert tmp.exists()  # our refused attempt touched nothing of theirs
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.wait(timeout=20) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert (out / "done").read_text() == "ok" and siblings(out) == ["merged"]


# ----------------------------------------------------------------------------- small writes

def test_atomic_write_replaces_the_file_and_leaves_no_temp(tmp_path):
    p = tmp_path / "index.json"
    atomic_write_text(p, "one")
    atomic_write_bytes(p, b"two")
    assert p.read_bytes() == b"two" and os.listdir(tmp_path) == ["index.json"]


def test_a_failed_atomic_write_keeps_the_old_file(tmp_path, monkeypatch):
    p = tmp_path / ".metadata"
    p.write_bytes(b"old")

    def broken_fsync(fd):
        raise OSError(errno.EIO, "I/O error")
    monkeypatch.setattr(files.os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="I/O error"):
        atomic_write_bytes(p, b"new")
    assert p.read_bytes() == b"old" and os.listdir(tmp_path) == [".metadata"]


def test_human_bytes_is_the_package_wide_formatter():
    assert human_bytes(3 * 2**30) == "3.00 GiB" and human_bytes(512) == "512 B"


# ------------------------------------------------------------------------------------------ round 2
def test_new_files_are_never_written_through_a_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("mine")
    (tmp_path / "link").symlink_to(victim)
    os.link(victim, tmp_path / "hard")
    for name in ("link", "hard"):
        with pytest.raises(FileExistsError):
            files.create_new(tmp_path / name)
    files.write_new_file(tmp_path / "fresh", "new")
    assert victim.read_text() == "mine" and (tmp_path / "fresh").read_text() == "new"


def test_a_lock_path_that_is_a_link_is_refused_and_a_stale_lock_is_replaced(tmp_path):
    from ckpt_tools.core.errors import UnsafeInputError

    victim = tmp_path / "victim"
    victim.write_text("mine")
    out = tmp_path / "out"
    (tmp_path / ".out.lock").symlink_to(victim)
    with pytest.raises(UnsafeInputError, match="symlink"):
        with AtomicOutputDir(out):
            pass
    (tmp_path / ".out.lock").unlink()
    os.link(victim, tmp_path / ".out.lock")      # a leftover nobody holds, hard-linked to a victim
    with AtomicOutputDir(out) as tmp:
        (tmp / "f").write_text("x")
    assert victim.read_text() == "mine" and (out / "f").read_text() == "x"
    assert not (tmp_path / ".out.lock").exists()


def test_every_path_read_is_an_input_out_may_not_overlap(tmp_path):
    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_text("{}")
    with inputs.tracking():
        inputs.read_json(src / "config.json")
        with pytest.raises(UsageError, match="is inside input"):
            AtomicOutputDir(src / "config.json").__enter__()
        inputs.register(src)
        with pytest.raises(UsageError, match="is inside input"):
            with AtomicOutputDir(src / "out"):
                pass
        with pytest.raises(UsageError, match="does not exist"):
            staging.check_output_file(tmp_path / "nodir" / "x.toml")
    with AtomicOutputDir(src / "out"):   # outside a command's tracking, only explicit inputs count
        pass
