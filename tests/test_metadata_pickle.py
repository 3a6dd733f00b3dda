"""`.metadata` written without torch (formats/dcp/metadata_pickle.py) is the pickle of torch's own `Metadata`:
byte for byte what Python's reference pickler writes for torch's objects holding the same records, and
what torch's loader and ours read back as the same checkpoint."""
from __future__ import annotations

import pickle
import pickletools
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties,
    TensorStorageMetadata,
)

from ckpt_tools.formats.dcp.metadata import load_metadata
from ckpt_tools.formats.dcp.metadata_pickle import DCP_VERSION
from ckpt_tools.formats.dcp.model import parse_metadata
from ckpt_tools.formats.dcp.writer import DcpWriter

from .conftest import REPO

SAVE_ID = "5c6b1f53-0b3c-4a3e-9f43-3f2d1c1e4d2a"


def torchs_metadata(w: DcpWriter) -> Metadata:
    """What the writer's records are as torch's classes (the old writer built exactly this), sharing the
    writer's string objects as the old writer's Metadata did."""
    sdm = {}
    for key in sorted(w.keys()):
        if key in w._bytes:
            sdm[key] = BytesStorageMetadata()
        else:
            d = w._tensors[key]
            sdm[key] = TensorStorageMetadata(
                properties=TensorProperties(dtype=getattr(torch, d.dtype)), size=torch.Size(d.size),
                chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in d.chunks])
    storage = {}
    for r in w._storage.values():
        idx = MetadataIndex(r.fqn) if r.chunk_offsets is None else MetadataIndex(r.fqn, torch.Size(r.chunk_offsets),
                                                                                  r.index)
        storage[idx] = _StorageInfo(r.relative_path, r.offset, r.length)
    return Metadata(state_dict_metadata=sdm, planner_data=dict(w._planner), storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=None, save_id=SAVE_ID, load_id=None), version=DCP_VERSION)


def assert_is_torchs_pickle(w: DcpWriter) -> bytes:
    ours = w.metadata_bytes(save_id=SAVE_ID)
    md = torchs_metadata(w)
    assert ours == pickle._dumps(md, protocol=4)     # the reference pickler, over torch's own objects
    back = pickle.loads(ours)                       # torch's classes, as prime-rl's loader unpickles it
    assert back == md
    assert list(back.storage_data) == list(md.storage_data)
    assert [k.index for k in back.storage_data] == [k.index for k in md.storage_data]   # (not in MetadataIndex ==)
    assert list(back.planner_data.items()) == list(md.planner_data.items())
    pickletools.dis(ours, out=open("/dev/null", "w"))
    return ours


def test_a_small_checkpoints_metadata_is_byte_for_byte_torchs(tmp_path):
    w = DcpWriter(tmp_path / "a", files=2)
    w.write_tensor("app.model.w", ("app", "model", "w"), torch.zeros(4, 3), world_size=2)
    w.write_tensor("app.model.rows", ("app", "model", "rows"), torch.zeros(1, 3), world_size=4)   # empty chunks
    w.write_object("app.progress", ("app", "progress"), {"step": 1})
    w.write_tensor("app.model.bf", ("app", "model", "bf"), torch.zeros(4, 3, dtype=torch.bfloat16))
    w.write_tensor("app.scalar", ("app", "scalar"), torch.tensor(3.0))
    w.write_tensor("app.model.deep", ("app", "model", "deep"), torch.zeros(2, 1, 1, 1, 1, dtype=torch.int64))
    assert_is_torchs_pickle(w)


def test_a_big_one_is_byte_for_byte_torchs_across_frames_batches_and_long_values(tmp_path):
    """> 1000 entries per dict (SETITEMS batches), > 64 KiB (frames), > 256 memo entries (LONG_BINGET), ints
    past 2^31 and 2^63 (LONG1), keys past 255 bytes, non-ASCII, and one past a frame (unframed BINUNICODE)."""
    w = DcpWriter(tmp_path / "b", files=4)
    for i in range(1100):
        key = f"app.model.layers.{i}.mlp.weight"
        for r in range(4):
            w.register_existing_chunk(key, ("app", "model", f"layers.{i}.mlp.weight"), "float32", (4096, 1024),
                                      (r * 1024, 0), (1024, 1024), f"__{r}_0.distcp", r * 3_000_000_000 + 2**63 * (i == 7),
                                      1000)
    w.register_existing_bytes("app.x" + "é" * 300, ("app", "x" + "é" * 300), "__0_0.distcp", 5, 6)
    w.register_existing_bytes("app.big" + "y" * 70_000, ("app", "big" + "y" * 70_000), "__0_0.distcp", 5, 6)
    w.register_existing_chunk("app.model.f16", ("app", "model", "f16"), "float16", (3,), (0,), (3,), "__1_0.distcp", 0, 9)
    data = assert_is_torchs_pickle(w)
    assert len(data) > 4 * 65536


def test_a_repeated_chunk_index_keeps_its_first_place_and_index_as_torchs_dict_does(tmp_path):
    w = DcpWriter(tmp_path / "c", files=1)
    for length in (10, 20):
        w.register_existing_chunk("app.t", ("app", "t"), "float32", (2,), (0,), (2,), "__0_0.distcp", 0, length)
    w.register_existing_bytes("app.b", ("app", "b"), "__0_0.distcp", 1, 2)
    ours = assert_is_torchs_pickle(w)
    got = pickle.loads(ours)
    assert [(k.fqn, k.index, v.length) for k, v in got.storage_data.items()] == [("app.t", 0, 20), ("app.b", None, 2)]


def test_an_unknown_dtype_is_refused_before_anything_is_written(tmp_path):
    w = DcpWriter(tmp_path / "d", files=1)
    with pytest.raises(Exception, match="unknown dtype"):
        w.register_existing_chunk("app.t", ("app", "t"), "float33", (2,), (0,), (2,), "__0_0.distcp", 0, 8)


def test_torchs_dcp_loader_and_ours_read_a_checkpoint_written_without_torch(tmp_path):
    """A checkpoint whose items are torch.save'd by the writer and whose `.metadata` is ours: torch's own
    `dcp.load` restores the tensors, our reader parses the same entries."""
    out = tmp_path / "ck"
    w = DcpWriter(out, files=2)
    a, b = torch.arange(12, dtype=torch.float32).reshape(4, 3), torch.arange(6, dtype=torch.bfloat16)
    w.write_tensor("a", ("a",), a, world_size=2)
    w.write_tensor("b", ("b",), b, world_size=2)
    w.finish()
    sd = {"a": torch.zeros(4, 3), "b": torch.zeros(6, dtype=torch.bfloat16)}
    dcp.load(sd, checkpoint_id=str(out))
    assert torch.equal(sd["a"], a) and torch.equal(sd["b"], b)
    parsed = parse_metadata(load_metadata((out / ".metadata").read_bytes(), "test"))
    assert sorted(parsed.entries) == ["a", "b"] and parsed.fatal() is None


def test_the_writer_imports_no_torch_to_write_metadata(tmp_path):
    code = ("import sys\nfrom ckpt_tools.formats.dcp.writer import DcpWriter\n"
            f"w = DcpWriter({str(tmp_path / 'e')!r}, files=1)\n"
            "w.register_existing_chunk('app.t', ('app', 't'), 'float32', (2,), (0,), (2,), '__0_0.distcp', 0, 8)\n"
            "w.finish()\nassert 'torch' not in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert pickle.loads((tmp_path / "e" / ".metadata").read_bytes()).state_dict_metadata["app.t"].size == (2,)
