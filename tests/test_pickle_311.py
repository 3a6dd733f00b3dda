"""A `.metadata` written by CPython 3.11.0-3.11.4 (Debian's 3.11.2) pickles DCP's
`_MEM_FORMAT_ENCODING` members as `getattr(<enum class>, <member name>)`: read it; refuse every other
`builtins.getattr`."""
from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING, StorageMeta

from ckpt_tools.cli import main
from ckpt_tools.core.errors import UnsafePickleError
from ckpt_tools.formats.dcp.metadata import load_metadata


def _save_as_311(path, monkeypatch):
    """dcp.save with the enum pickled the 3.11.2 way (its `__reduce_ex__` patched before pickling)."""
    monkeypatch.setattr(_MEM_FORMAT_ENCODING, "__reduce_ex__", lambda self, proto: (getattr, (type(self), self.name)))
    sd = {"app": {"model": {"model.norm.weight": torch.arange(4.0), "model.layers.0.mlp.up_proj.weight": torch.ones(3, 4)},
                  "progress": {"step": 1}}}
    dcp.save(sd, checkpoint_id=str(path), no_dist=True)
    monkeypatch.undo()


def test_a_311_metadata_is_read_by_torch_and_by_us(tmp_path, monkeypatch):
    ck = tmp_path / "trainer"
    _save_as_311(ck, monkeypatch)
    raw = (ck / ".metadata").read_bytes()
    assert b"builtins" in raw and b"getattr" in raw          # the 3.11.2 form, really
    md = dcp.FileSystemReader(str(ck)).read_metadata()      # stock torch reads it
    assert md.state_dict_metadata["app.model.model.norm.weight"].properties.memory_format == torch.contiguous_format
    ours = load_metadata(raw, str(ck / ".metadata"))
    plain = tmp_path / "plain"           # the same state saved the usual way (pickled by value)
    dcp.save({"app": {"model": {"model.norm.weight": torch.arange(4.0)}}}, checkpoint_id=str(plain), no_dist=True)
    assert b"getattr" not in (plain / ".metadata").read_bytes()
    usual = load_metadata((plain / ".metadata").read_bytes(), "plain")
    key = "app.model.model.norm.weight"
    assert ours.state_dict_metadata[key].properties.memory_format == \
        usual.state_dict_metadata[key].properties.memory_format
    r = CliRunner().invoke(main, ["inspect", str(ck)])
    assert r.exit_code == 0, r.output


class _Reduce:
    def __init__(self, *args):
        self.args = args

    def __reduce__(self):
        return getattr, self.args


@pytest.mark.parametrize("args", [
    (_MEM_FORMAT_ENCODING, "__class__"),          # an allowed Enum, not a member name
    (_MEM_FORMAT_ENCODING, "_member_map_"),
    (StorageMeta, "__init__"),                    # an allowed class that is no Enum
    (_MEM_FORMAT_ENCODING, 0),                    # a name that is no string
], ids=["dunder", "private", "not-an-enum", "not-a-name"])
def test_every_other_getattr_is_refused(args):
    data = pickle.dumps(_Reduce(*args), protocol=2)
    with pytest.raises(UnsafePickleError, match="getattr|refusing"):
        load_metadata(data, "crafted.metadata")
