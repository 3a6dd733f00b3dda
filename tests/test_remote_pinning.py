"""One version of every object a command reads, and a read that ends (docs/remote.md): an HTTP server
without ETags is pinned by size and Last-Modified, and one that sends neither may serve each object to one
request only (a second could mix versions: refused in one line); a server that drips a byte at a time ends
the read at the throughput floor (CKPT_REMOTE_MIN_RATE), naming the URL; Ctrl-C during a stalled read is the
usual one-line interrupt, at once. Stock servers: tests/test_remote_nginx.py."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

from .remote_servers import HttpServer  # noqa: E402
from .test_remote import (  # noqa: E402,F401
    REPO, TRAINER, assert_one_interrupt_line, ckpt, digest, fresh_remote_state, local)


@pytest.fixture()
def served(tmp_path):
    root = tmp_path / "served"
    shutil.copytree(TRAINER, root / "trainer")
    srv = HttpServer(root)
    yield srv, root / "trainer"
    srv.close()


def test_a_server_without_etag_or_last_modified_may_not_serve_an_object_twice(served, tmp_path):
    srv, _ = served
    srv.faults["no_etag"] = True
    r = ckpt("extract-adapter", f"{srv.url}/trainer", tmp_path / "a", "--alpha", "16", code=1)
    (line,) = r.output.strip().splitlines()
    assert line.startswith(f"error: {srv.url}/trainer/") and "neither an ETag nor a Last-Modified" in line, line
    assert "refusing to mix versions" in line and not (tmp_path / "a").exists()


def test_a_server_with_last_modified_only_is_pinned_by_it(served, local, tmp_path):
    """No ETag, Last-Modified sent (and If-Unmodified-Since ignored, as a naive server does): the adapter is
    the local one; a data file swapped mid-read (the issue's 6 tensors of one step, 34 of another) is an error
    naming it, and no OUT."""
    srv, trainer = served
    srv.faults.update(no_etag=True, last_modified=True)
    ckpt("extract-adapter", f"{srv.url}/trainer", tmp_path / "a", "--alpha", "16")
    assert digest(tmp_path / "a") == digest(local["dir"] / "adapter")

    victim = trainer / "__2_0.distcp"
    data = victim.read_bytes()

    def swap(path):
        if path.endswith("__0_0.distcp"):
            srv.faults.pop("after_get")
            victim.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))   # another step's file: another mtime
            os.utime(victim, (time.time() + 10, time.time() + 10))
    srv.faults["after_get"] = swap
    r = ckpt("extract-adapter", f"{srv.url}/trainer", tmp_path / "b", "--alpha", "16", code=1)
    (line,) = r.output.strip().splitlines()
    assert f"{srv.url}/trainer/__2_0.distcp" in line and "changed while" in line, line
    assert not (tmp_path / "b").exists()


def test_a_dripping_server_ends_at_the_throughput_floor_naming_the_url(served, tmp_path, monkeypatch):
    """A byte every 0.2 s never stalls past the 1 s timeout; the floor (100 KB/s after 1 s) ends it."""
    srv, _ = served
    monkeypatch.setenv("CKPT_REMOTE_TIMEOUT", "1")
    monkeypatch.setenv("CKPT_REMOTE_MIN_RATE", "100000")
    srv.faults["drip_s"] = 0.2
    t0 = time.monotonic()
    r = ckpt("inspect", f"{srv.url}/trainer", code=1)
    took = time.monotonic() - t0
    srv.faults.clear()
    (line,) = r.output.strip().splitlines()
    assert line.startswith(f"error: {srv.url}/trainer/.metadata") and "the server has stalled" in line, line
    assert "CKPT_REMOTE_MIN_RATE" in line and took < 30, (took, line)


def test_ctrl_c_during_a_stalled_read_is_one_line_at_once(served, tmp_path):
    srv, _ = served
    srv.faults.update(stall_s=120, stalls=10 ** 6)
    env = dict(os.environ, PYTHONPATH=str(REPO), CKPT_REMOTE_TIMEOUT="100")
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_tools", "extract-adapter", f"{srv.url}/trainer",
                             str(tmp_path / "a"), "--alpha", "16"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not srv.counter.requests and srv.faults["stalls"] == 10 ** 6 and time.monotonic() < deadline:
        time.sleep(0.1)   # the first body has begun stalling
    time.sleep(1.0)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert time.monotonic() - t0 < 15
    assert proc.returncode == 130, out
    assert_one_interrupt_line(out)
    assert not (tmp_path / "a").exists()
