"""Ctrl-C while the merge pipeline's workers are inside torch (issue 27): `merge BASE CKPT` or `export`
of a 400M-parameter factory run (Qwen3-1.7B shapes, 2 layers) aborted with SIGABRT ("terminate called
without an active exception") in 9 of 10 tries instead of exiting 130: the workers are daemon threads
by design (an interrupted command does not wait for them), and the interpreter's finalization tore
down torch's native state under them. Here the same moment is made certain on the genuine fixture: a
`sitecustomize` hook makes every merge job first do a second of matmuls (BLAS work, as a large tensor
does), and SIGINT lands once a worker is in it. Each try is a real `python -m ckpt_tools` process."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from . import hardening_util as hu
from .conftest import FIXTURE, REPO

TRIES = 3   # per command; the unfixed code aborted in most tries (the hook makes the window certain)

HOOK = """
import os
if os.environ.get("CKPT_TEST_BUSY_MARK"):
    import time
    from ckpt_tools.ops.merge import produce

    _run = produce.JobRunner.run

    def run(self, job, writer):
        import torch
        a = torch.randn(384, 384)
        open(os.environ["CKPT_TEST_BUSY_MARK"], "a").close()
        t = time.monotonic()
        while time.monotonic() - t < 1.5:
            a = torch.tanh(a @ a)
        return _run(self, job, writer)

    produce.JobRunner.run = run
"""


@pytest.fixture(scope="module")
def hook(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("busy-hook")
    (d / "sitecustomize.py").write_text(HOOK)
    return d


@pytest.mark.parametrize("cmd", ["merge", "export"])
def test_ctrl_c_while_workers_are_in_torch_exits_130_every_time(hook, tmp_path, cmd):
    trainer = FIXTURE / "outputs/checkpoints/step_3/trainer"
    codes = []
    for i in range(TRIES):
        out = tmp_path / f"out{i}"
        mark = tmp_path / f"busy{i}"
        args = ["merge", FIXTURE / "base_model", trainer, out] if cmd == "merge" else ["export", trainer, out]
        env = dict(os.environ, PYTHONPATH=f"{hook}:{REPO}", CKPT_TEST_BUSY_MARK=str(mark))
        env.pop("OMP_NUM_THREADS", None)   # torch's own intra-op threads, as a user's run has them
        p = subprocess.Popen([sys.executable, "-m", "ckpt_tools", *map(str, args)], env=env, cwd=tmp_path,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 120
            while not mark.exists():
                assert p.poll() is None, p.communicate()
                assert time.monotonic() < deadline, "no merge job started"
                time.sleep(0.02)
            time.sleep(0.3 + 0.2 * i)
            p.send_signal(signal.SIGINT)
            so, se = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
        codes.append(p.returncode)
        lines = [ln for ln in se.splitlines() if ln.strip()]
        assert p.returncode == 130, f"try {i}: exit {p.returncode}: {se[-2000:]}"
        assert len(lines) == 1 and lines[0].startswith("interrupted"), se
        assert not out.exists() and hu.sidecars(out) == [], hu.sidecars(out)
    hu.record("faults", sigint=len(codes), sigint_with_busy_workers=len(codes))
