"""Two commands writing the same OUT at once: one wins, the other fails at once with one clear
line naming the holder's pid (the `.OUT.lock` flock), and the winner's OUT is complete.

The first command runs in a forked child stopped at its first write (so it holds the lock,
deterministically); the second is then run; then the first is let go. A free-running race of two
identical commands (no hooks) must also end with exactly one success. `set-lr --in-place` twice
at once must change the lr once, not twice."""
from __future__ import annotations

from pathlib import Path

import pytest

from ckpt_tools.formats.dcp.reader import DcpCheckpoint

from . import hardening_util as hu
from .conftest import FIXTURE
from .test_faults import writing_commands

LOCKED = r"another ckpt command \(pid \d+\) is writing"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    return hu.fixture_and_slim(tmp_path_factory.mktemp("concurrency"))


COMMANDS = list(writing_commands(Path("f"), Path("s"), Path("o")))


@pytest.mark.parametrize("cmd", COMMANDS)
def test_second_writer_of_the_same_out_fails_clearly_and_the_first_completes(cmd, inputs, tmp_path):
    fx, slim = inputs
    out = tmp_path / "OUT"
    args = writing_commands(fx, slim, out)[cmd]
    if args[0] not in hu.commands():
        pytest.skip(f"{args[0]} not built yet")
    lock = out.parent / f".{out.name}.lock"
    first = hu.Forked(args, tmp_path / "work", stop_when=lambda label: lock.exists())
    assert first.wait_stopped() is not None, first.result().output
    try:
        if lock.exists():
            second = hu.invoke(args)
            line = hu.assert_clean_error(second, expect=LOCKED)
            assert str(first.pid) in line, line
            other = hu.invoke(writing_commands(fx, slim, out)["slim"])   # a different command, same OUT
            hu.assert_clean_error(other, expect=LOCKED)
            locked = True
        else:
            locked = False  # no write event while it held the lock
    finally:
        first.resume()
    r = first.result()
    assert r.exit_code == 0, r.output
    assert out.exists() and hu.sidecars(out) == []
    if not locked:
        pytest.fail(f"{cmd}: never wrote while holding the OUT lock")
    if (out / ".metadata").exists() or (out / "model.safetensors").exists() or (out / "adapter_model.safetensors").exists():
        v = hu.invoke(["verify", out])
        assert v.exit_code == 0, v.output
    hu.record("concurrency", contested_writes=2, clean_refusals=2, winners_complete=1)


@pytest.mark.parametrize("cmd", ["merge", "slim"])
def test_a_free_running_race_has_exactly_one_winner(cmd, inputs, tmp_path):
    fx, slim = inputs
    for i in range(2):
        out = tmp_path / f"OUT{i}"
        args = writing_commands(fx, slim, out)[cmd]
        a = hu.Forked(args, tmp_path / "work")
        b = hu.Forked(args, tmp_path / "work")
        ra, rb = a.result(), b.result()
        codes = sorted([ra.exit_code, rb.exit_code])
        assert codes == [0, 1], (ra.output, rb.output)
        loser = ra if ra.exit_code else rb
        hu.assert_clean_error(loser, expect=LOCKED + "|already exists")
        assert hu.invoke(["verify", out]).exit_code == 0
        assert hu.sidecars(out) == []
        hu.record("concurrency", races=1, winners_complete=1)


def test_two_in_place_lr_changes_at_once_apply_once(tmp_path):
    trainer = hu.writable_copy(FIXTURE / "outputs/checkpoints/step_3/trainer", tmp_path / "trainer")
    with DcpCheckpoint.open(trainer) as ck:
        lr0 = float(ck.read_object("app.optimizers.param_groups.0.lr"))
    args = ["set-lr", trainer, "--scale", "0.5", "--in-place"]
    first = hu.Forked(args, tmp_path / "work", stop_at=1)
    assert first.wait_stopped() is not None, first.result().output
    try:
        second = hu.invoke(args)
        hu.assert_clean_error(second, expect=LOCKED)
    finally:
        first.resume()
    assert first.result().exit_code == 0
    with DcpCheckpoint.open(trainer) as ck:
        lr1 = float(ck.read_object("app.optimizers.param_groups.0.lr"))
    assert lr1 == pytest.approx(lr0 * 0.5, rel=1e-12)
    hu.record("concurrency", contested_writes=2, clean_refusals=1, winners_complete=1)
