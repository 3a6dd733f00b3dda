"""The streaming DCP reader against torch's own DCP loader, on real DCP files."""
from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

from ckpt_tools.formats.dcp.model import BytesEntry, TensorEntry
from ckpt_tools.formats.dcp.reader import DcpCheckpoint
from ckpt_tools.formats.dcp.writer import DcpWriter
from ckpt_tools.formats.dcp.layout import row_chunks
from ckpt_tools.core.errors import FormatError, MissingFileError, TruncatedFileError
from ckpt_tools.core.keys import classify

from .conftest import TRAINER


def torch_reference(path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flat, _ = flatten_state_dict(_load_state_dict_from_keys(checkpoint_id=str(path)))
    return flat


def test_every_item_of_the_genuine_fixture_equals_torch_dcp_loader():
    ref = torch_reference(TRAINER)
    ckpt = DcpCheckpoint.open(TRAINER)
    assert set(ckpt.keys()) == set(ref)
    n_tensors = 0
    for key, e in ckpt.entries.items():
        if isinstance(e, TensorEntry):
            t = ckpt.read_tensor(key)
            assert t.dtype == ref[key].dtype and t.shape == ref[key].shape, key
            assert torch.equal(t.view(torch.uint8) if t.dim() else t, ref[key].view(torch.uint8) if t.dim() else ref[key]), key
            n_tensors += 1
        else:
            assert ckpt.read_object(key) == ref[key], key
    assert n_tensors == 204


def test_uneven_empty_and_non_row_chunks_round_trip_through_torch_loader(tmp_path):
    """Layouts the fast path does not take (column splits) and empty chunks, written by our writer
    and cross-checked with torch's loader."""
    out = tmp_path / "c"
    w = DcpWriter(out, files=3)
    tensors = {
        "app.model.uneven.weight": torch.randn(162, 5),
        "app.model.tiny.weight": torch.randn(2, 8),       # fewer rows than ranks
        "app.model.bf.weight": torch.randn(7, 3).to(torch.bfloat16),
        "app.model.cols.weight": torch.randn(6, 9),
    }
    w.write_tensor("app.model.uneven.weight", ("app", "model", "uneven.weight"), tensors["app.model.uneven.weight"], world_size=4)
    w.write_tensor("app.model.tiny.weight", ("app", "model", "tiny.weight"), tensors["app.model.tiny.weight"],
                   chunks=[((0, 0), (1, 8)), ((1, 0), (1, 8)), ((2, 0), (0, 8))])
    w.write_tensor("app.model.bf.weight", ("app", "model", "bf.weight"), tensors["app.model.bf.weight"], world_size=3)
    w.write_tensor("app.model.cols.weight", ("app", "model", "cols.weight"), tensors["app.model.cols.weight"],
                   chunks=[((0, 0), (6, 4)), ((0, 4), (6, 5))])
    w.finish()
    ref = torch_reference(out)
    ckpt = DcpCheckpoint.open(out)
    for k, t in tensors.items():
        got = ckpt.read_tensor(k)
        assert torch.equal(got, t) and torch.equal(got, ref[k]), k


def test_row_chunks_follow_torch_chunk():
    for rows in (1, 2, 3, 8, 162, 1001):
        for w in (1, 2, 3, 4, 8):
            expect = [(int(c[0]), len(c)) for c in torch.arange(rows).chunk(w)]
            assert row_chunks(rows, w) == expect


def test_large_items_use_the_preadv_path_and_match(tmp_path, monkeypatch):
    import ckpt_tools.formats.dcp.item as item

    monkeypatch.setattr(item, "SMALL_ITEM_BYTES", 0)  # force the header-then-preadv path
    ref = torch_reference(TRAINER)
    ckpt = DcpCheckpoint.open(TRAINER)
    for key, e in ckpt.entries.items():
        if isinstance(e, TensorEntry):
            assert torch.equal(ckpt.read_tensor(key), ref[key]), key


def test_lora_reads_touch_only_lora_items():
    src = DcpCheckpoint.open(TRAINER).lora(alpha=16.0, run_config=None)
    for m in src.modules:
        src.read_pair(m)
    ckpt = src.ckpt
    lora_items = set()
    lora_bytes = 0
    for k, e in ckpt.entries.items():
        if classify(k, e.path).group == "lora":
            for c in e.chunks:
                lora_items.add((c.file, c.offset, c.length))
                lora_bytes += c.length
    assert ckpt.stats.ranges, "nothing was read"
    for f, off, n in ckpt.stats.ranges:
        assert any(f == lf and lo <= off and off + n <= lo + ln for lf, lo, ln in lora_items), (f, off, n)
    assert ckpt.stats.bytes_read <= 1.05 * lora_bytes


def test_truncated_data_file_names_file_and_key(fixture_copy):
    trainer = fixture_copy / "outputs/checkpoints/step_3/trainer"
    f = trainer / "__2_0.distcp"
    os.truncate(f, f.stat().st_size - 1000)
    ckpt = DcpCheckpoint.open(trainer)
    with pytest.raises(TruncatedFileError) as ei:
        for k, e in ckpt.entries.items():
            ckpt.read_tensor(k) if isinstance(e, TensorEntry) else ckpt.read_object(k)
    msg = str(ei.value)
    assert "__2_0.distcp" in msg and "key 'app." in msg and "truncated" in msg


def test_missing_data_file_names_file_and_key(fixture_copy):
    trainer = fixture_copy / "outputs/checkpoints/step_3/trainer"
    (trainer / "__3_0.distcp").unlink()
    ckpt = DcpCheckpoint.open(trainer)
    with pytest.raises(MissingFileError) as ei:
        ckpt.read_tensor("app.model.lm_head.weight")
    assert "__3_0.distcp" in str(ei.value) and "app.model.lm_head.weight" in str(ei.value)


def test_unknown_key_is_a_clear_error():
    ckpt = DcpCheckpoint.open(TRAINER)
    with pytest.raises(FormatError, match="no such item.*ckpt inspect"):
        ckpt.read_tensor("app.model.nope")


def test_byte_items_live_in_any_rank_file():
    ckpt = DcpCheckpoint.open(TRAINER)
    files = {e.file for e in ckpt.entries.values() if isinstance(e, BytesEntry)}
    assert "__0_0.distcp" not in files and len(files) >= 2  # dedup planner spread them over ranks 1-3
    assert ckpt.read_object("app.optimizers.param_groups.0.lr") == 0.01
