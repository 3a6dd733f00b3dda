"""Crafted .metadata pickles are refused before anything runs."""
from __future__ import annotations

import os
import pickle
import shutil

import pytest
from click.testing import CliRunner

from ckpt_tools.cli import main
from ckpt_tools.formats.dcp.reader import DcpCheckpoint
from ckpt_tools.core.errors import UnsafePickleError

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
    md = pickle.loads((TRAINER / ".metadata").read_bytes())   # genuine torch metadata (trusted fixture)
    md.storage_meta.modules = [_Evil(canary)]
    (d / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UnsafePickleError):
        DcpCheckpoint.open(d)
    assert not canary.exists()


def test_genuine_metadata_needs_nothing_outside_the_allow_list():
    md = DcpCheckpoint.open(TRAINER).metadata
    assert isinstance(md.storage_meta.checkpoint_id, str)  # Path replaced by str on load


# ------------------------------------------------------------------------------------------ bounds
def test_bounds_refuse_what_would_cost_more_than_the_pickle_is_worth():
    """check_pickle_bounds replays opcodes without building anything: shared-reference DAGs,
    tuple-DAG dict keys (2^N to hash inside the C unpickler), deep nesting and cycles are refused
    in time linear in the pickle; a genuine metadata passes."""
    import time

    from ckpt_tools.io.safe_pickle import MAX_PICKLE_DEPTH, check_pickle_bounds

    x = ["s"]
    for _ in range(40):
        x = [x, x]
    dag = pickle.dumps(x, protocol=4)                                  # 2^40 strings when walked
    tuple_key = b"\x80\x04}" + b")" + b"2\x86" * 60 + b"K\x01s."      # {(((),()),...): 1}, 60 levels
    deep = b"\x80\x02" + b"(" * 200_000 + b"]" + b"l" * 200_000 + b"."
    cyclic = b"\x80\x02]q\x00h\x00a."                                  # L = []; L.append(L)
    for name, data, why in (("dag", dag, "expand"), ("tuple key", tuple_key, "expand"),
                            ("deep", deep, f"more than {MAX_PICKLE_DEPTH} levels"), ("cycle", cyclic, "shared")):
        t0 = time.perf_counter()
        with pytest.raises(UnsafePickleError, match=why):
            check_pickle_bounds(data, name)
        assert time.perf_counter() - t0 < 2, name
    ok = pickle.dumps({"a": [1, 2, (3, 4)], "b": "x" * 100}, protocol=4)
    assert check_pickle_bounds(ok, "ok") == (10, 3)
    md = (TRAINER / ".metadata").read_bytes()
    size, depth = check_pickle_bounds(md, "genuine")
    assert depth < MAX_PICKLE_DEPTH / 4 and size < len(md)


def test_bounds_refuse_memo_bombs_and_huge_ints_and_garbage():
    from ckpt_tools.io.safe_pickle import check_pickle_bounds

    with pytest.raises(UnsafePickleError, match="memo index"):
        check_pickle_bounds(b"\x80\x02N" + b"r" + (0x21682B68).to_bytes(4, "little") + b".", "memo")
    with pytest.raises(UnsafePickleError, match="bits"):
        check_pickle_bounds(b"\x80\x02\x8b" + (4096).to_bytes(4, "little") + b"\x01" * 4096 + b".", "long")
    with pytest.raises(UnsafePickleError, match="cannot parse"):
        check_pickle_bounds(b"\x80\x02\xff\xfe", "garbage")
