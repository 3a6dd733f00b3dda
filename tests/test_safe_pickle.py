"""Crafted .metadata pickles are refused before anything runs."""
from __future__ import annotations

import os
import pickle
import shutil

import pytest
from click.testing import CliRunner

from ckpt_tools.cli import main
from ckpt_tools.dcp.reader import DcpCheckpoint
from ckpt_tools.errors import UnsafePickleError

from .conftest import TRAINER


class _Evil:
    def __init__(self, canary):
        self.canary = str(canary)

    def __reduce__(self):
        return (os.system, (f"touch {self.canary}",))


def _trainer_copy(tmp_path):
    d = tmp_path / "trainer"
    shutil.copytree(TRAINER, d)
    for p in d.iterdir():
        os.chmod(p, 0o644)
    return d


def test_metadata_payload_is_refused_and_does_not_run(tmp_path):
    d = _trainer_copy(tmp_path)
    canary = tmp_path / "pwned"
    (d / ".metadata").write_bytes(pickle.dumps(_Evil(canary)))
    with pytest.raises(UnsafePickleError, match="posix.system|os.system|nt.system"):
        DcpCheckpoint.open(d)
    assert not canary.exists()
    r = CliRunner().invoke(main, ["inspect", str(d)])
    assert r.exit_code == 1 and "refusing to unpickle" in r.output and not canary.exists()


def test_payload_nested_inside_valid_metadata_is_refused(tmp_path):
    d = _trainer_copy(tmp_path)
    canary = tmp_path / "pwned2"
    md = DcpCheckpoint.open(TRAINER).metadata
    md.storage_meta.modules = [_Evil(canary)]
    (d / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UnsafePickleError):
        DcpCheckpoint.open(d)
    assert not canary.exists()


def test_genuine_metadata_needs_nothing_outside_the_allow_list():
    md = DcpCheckpoint.open(TRAINER).metadata
    assert isinstance(md.storage_meta.checkpoint_id, str)  # Path replaced by str on load
