"""Full disks: refused up front when the estimate does not fit, and a clean failure when the disk
fills up anyway (another process, a bad estimate): one `error:` line, exit 1, no OUT, no temp
dir, no lock left, inputs unchanged.

The small disks are tmpfs mounts made by the test (root only; skipped with the reason
otherwise, CI runs as root). The real-ENOSPC case stops the command at its first write (the
forked-child hook of test_faults), fills the filesystem to the last few KB with a ballast file,
and lets the command go on into the full disk."""
from __future__ import annotations

import errno
import os
import signal
from pathlib import Path

import pytest

from . import hardening_util as hu
from .test_faults import writing_commands


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return hu.fixture_and_slim(tmp_path_factory.mktemp("fulldisk"))


COMMANDS = [c for c in writing_commands(Path("f"), Path("s"), Path("o"))]


def test_preflight_refuses_before_writing_and_says_need_vs_free(inputs, tmp_path):
    """A 64 KiB filesystem: every writing command refuses at once with need vs free."""
    fx, slim = inputs
    before = hu.snapshot(fx, slim)
    with hu.small_filesystem(tmp_path / "tiny", 64 * 1024) as mnt:
        tried = 0
        for cmd, args in writing_commands(fx, slim, mnt / "OUT").items():
            if args[0] not in hu.commands():
                continue
            r = hu.invoke(args)
            line = hu.assert_clean_error(r, expect=r"need .+ free")
            assert "OUT" in line or str(mnt) in line, line
            assert os.listdir(mnt) == [], f"{cmd} left {os.listdir(mnt)} after refusing"
            tried += 1
        assert tried >= 8
    assert hu.diff_snapshots(before, hu.snapshot(fx, slim)) == []
    hu.record("full_disk", preflight_refusals=tried)


def _fill(mnt: Path, leave: int) -> None:
    """Fill `mnt` so that about `leave` bytes remain."""
    free = os.statvfs(mnt).f_bavail * os.statvfs(mnt).f_frsize
    with open(mnt / "ballast", "wb") as f:
        block = b"\0" * (1 << 20)
        todo = max(0, free - leave)
        try:
            while todo > 0:
                n = f.write(block[:min(len(block), todo)])
                todo -= n
            f.flush()
            os.fsync(f.fileno())
        except OSError as e:
            assert e.errno == errno.ENOSPC


@pytest.mark.parametrize("cmd", COMMANDS)
def test_disk_filling_up_mid_write_is_a_clean_error(cmd, inputs, tmp_path):
    fx, slim = inputs
    before = hu.snapshot(fx, slim)
    with hu.small_filesystem(tmp_path / "disk", 24 * 2**20) as mnt:
        out = mnt / "OUT"
        args = writing_commands(fx, slim, out)[cmd]
        if args[0] not in hu.commands():
            pytest.skip(f"{args[0]} not built yet")
        f = hu.Forked(args, tmp_path / "work", stop_at=1)
        ev = f.wait_stopped()
        assert ev is not None, f.result().output
        _fill(mnt, leave=4096)
        f.resume()
        r = f.result()
        if r.exit_code == 0:  # what was left to write fitted in the last 4 KB: then OUT is complete
            assert out.exists()
            pytest.skip(f"{cmd}: the rest of its output fitted in 4 KB")
        hu.assert_clean_error(r, expect=r"[Nn]o space|disk|full|need")
        assert not out.exists(), f"{cmd}: a partial OUT after ENOSPC"
        assert sorted(os.listdir(mnt)) == ["ballast"], f"{cmd} left {os.listdir(mnt)}"
    assert hu.diff_snapshots(before, hu.snapshot(fx, slim)) == []
    hu.record("full_disk", enospc_runs=1, partial_outputs=0)


def test_output_on_another_filesystem_works_without_hard_links(inputs, tmp_path):
    """set-lr / set hard-link unchanged data files; across filesystems that is impossible (EXDEV)
    and they must still produce a complete output (or say why not), never a broken one."""
    fx, slim = inputs
    with hu.small_filesystem(tmp_path / "other", 32 * 2**20) as mnt:
        for cmd in ("set-lr", "set"):
            args = writing_commands(fx, slim, mnt / cmd)[cmd]
            r = hu.invoke(args)
            if r.exit_code == 0:
                v = hu.invoke(["verify", mnt / cmd])
                assert v.exit_code == 0, v.output
            else:
                hu.assert_clean_error(r)
                assert not (mnt / cmd).exists()
