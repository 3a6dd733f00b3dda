"""The HF dir invariants are checked once (`formats.hf_dir.checks.check_index`): `HFModelDir.open` refuses a
damaged sharded dir with the check's fatal finding, and `ckpt verify` lists every finding of the same check,
so the two never disagree about a dir (files written by huggingface_hub's sharded writer, then damaged)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from ckpt_tools.core.errors import CkptError
from ckpt_tools.formats.hf_dir.checks import check_index
from ckpt_tools.formats.hf_dir.model_dir import HFModelDir
from ckpt_tools import verify as verify_path

from .conftest import write_sharded_base

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return write_sharded_base(tmp_path_factory.mktemp("hf") / "model")


def _map(fn):
    def edit(d: Path) -> None:
        idx = json.loads((d / INDEX).read_text())
        fn(idx["weight_map"], sorted(idx["weight_map"]), sorted(set(idx["weight_map"].values())))
        (d / INDEX).write_text(json.dumps(idx))
    return edit


def _unlink(i: int):
    return lambda d: sorted(d.glob("model-*.safetensors"))[i].unlink()


def _truncate(i: int):
    return lambda d: os.truncate(sorted(d.glob("model-*.safetensors"))[i], 5)


def _fifo(d: Path) -> None:
    shard = sorted(d.glob("model-*.safetensors"))[1]
    shard.unlink()
    os.mkfifo(shard)


DAMAGE = {
    "unsafe name": _map(lambda wm, keys, files: wm.update({keys[0]: "../evil.safetensors", keys[1]: 7})),
    "missing shard": _unlink(0),
    "listed shard absent": _map(lambda wm, keys, files: wm.update({keys[3]: "model-00009-of-00003.safetensors"})),
    "truncated header": _truncate(2),
    "a FIFO shard": _fifo,
    "ghost key": _map(lambda wm, keys, files: wm.update({"model.ghost.weight": files[0]})),
    "unlisted tensor": _map(lambda wm, keys, files: wm.pop(keys[2])),
    "moved tensor": _map(lambda wm, keys, files: wm.update({k: files[0] for k in keys})),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_open_refuses_with_the_fatal_finding_and_verify_lists_every_finding(pristine, tmp_path, damage):
    d = tmp_path / "m"
    shutil.copytree(pristine, d)
    DAMAGE[damage](d)
    check = check_index(d, d / INDEX)
    fatal = check.fatal()
    assert fatal is not None and isinstance(fatal.error, CkptError)
    with pytest.raises(CkptError) as exc:
        HFModelDir.open(d)
    assert exc.value is fatal.error or str(exc.value) == str(fatal.error)
    assert type(exc.value) is type(fatal.error) and (exc.value.path, exc.value.key) == (fatal.file, fatal.key)
    rep = verify_path(d)
    listed = [(p.file, p.key, p.message) for p in rep.problems]
    found = [(f.file, f.key, f.message) for f in check.findings if f.severity == "problem"]
    assert not rep.ok and found and listed[:len(found)] == found


def test_a_clean_dir_has_no_findings_and_opens(pristine):
    check = check_index(pristine, pristine / INDEX)
    assert check.findings == [] and check.fatal() is None
    with HFModelDir.open(pristine) as m:
        assert m.headers.keys() == check.headers.keys() and m.keys() == list(check.tensors)


def test_warnings_do_not_refuse_and_metadata_loaders_ignore_is_refused_only_by_open(pristine, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(pristine, d)
    shutil.copy(sorted(d.glob("model-*.safetensors"))[0], d / "stray.safetensors")
    idx = json.loads((d / INDEX).read_text())
    idx["metadata"] = {"total_size": 12}
    (d / INDEX).write_text(json.dumps(idx))
    check = check_index(d, d / INDEX)
    assert [f.severity for f in check.findings] == ["warning", "warning"] and check.fatal() is None
    HFModelDir.open(d).close()
    idx["metadata"] = [1]
    (d / INDEX).write_text(json.dumps(idx))
    check = check_index(d, d / INDEX)
    assert check.fatal().message == "'metadata' is not an object"
    assert verify_path(d).ok           # loaders ignore the index's metadata; the library refuses it
