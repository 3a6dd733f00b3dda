"""rehydrate's parallel pipeline (ops/rehydrate: items registered in order, their bytes made by workers and
written at their place): its output does not depend on the number of workers or the block size (every
data file byte for byte), every streamed item is what torch.save writes for its chunk, a layout that is not
dim-0 row blocks (a column split) streams from row blocks without reading the tensor whole, and a failing
block (another base) still aborts the whole run."""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

import ckpt_tools
from ckpt_tools.formats.dcp.model import BytesEntry, TensorEntry
from ckpt_tools.formats.dcp.reader import DcpCheckpoint
from ckpt_tools.formats.dcp.writer import DcpWriter
from ckpt_tools.formats.slim.manifest import SLIM_MANIFEST
from ckpt_tools.core.errors import FormatError
import ckpt_tools.ops.rehydrate.pipeline as pipeline
import ckpt_tools.ops.rehydrate.rebuild as rebuild

from .conftest import BASE, TRAINER
from .test_slim_rehydrate import perturbed_base, assert_bit_equal_checkpoints

# A slot of 6 KiB: blocks of a few rows, so every chunk of the fixture is made of several blocks by several
# workers, and the blocks are cut where the original chunks end (the fixture's rows are 64 or 162 floats).
SMALL_SLOT = 6 << 10


@pytest.fixture(scope="module")
def slims(tmp_path_factory):
    """The genuine fixture slimmed with --base (sha256 and CRC-32s) and without (CRC-32s only)."""
    root = tmp_path_factory.mktemp("slims")
    for name, extra in (("sha", ["--base", str(BASE)]), ("crc", [])):
        ckpt_tools.slim(TRAINER, root / name, **({"base": BASE} if extra else {}))
    return root


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if p.name.endswith(".distcp")}


def _small_blocks(monkeypatch, slots: int = 4) -> None:
    monkeypatch.setattr(pipeline, "SLOT_BYTES", SMALL_SLOT)
    monkeypatch.setattr(pipeline, "BUDGET_BYTES", slots * SMALL_SLOT)


@pytest.mark.parametrize("slim,world_size", [("sha", None), ("crc", None), ("sha", 3), ("crc", 2)])
def test_the_data_files_do_not_depend_on_workers_or_block_size(slims, tmp_path, monkeypatch, slim, world_size):
    ref = tmp_path / "ref"
    r = ckpt_tools.rehydrate(slims / slim, ref, base=BASE, world_size=world_size, threads=1)
    assert r.result.verified_tensors == r.result.rebuilt_tensors == 36
    _small_blocks(monkeypatch)
    for threads in (1, 8):
        out = tmp_path / f"t{threads}"
        r = ckpt_tools.rehydrate(slims / slim, out, base=BASE, world_size=world_size, threads=threads)
        assert r.result.verified_tensors == 36 and r.result.threads == threads
        assert _files(out) == _files(ref), threads
    a, b = DcpCheckpoint.open(ref), DcpCheckpoint.open(tmp_path / "t8")   # .metadata by its content
    assert {k: (type(e), getattr(e, "chunks", None), getattr(e, "offset", None)) for k, e in a.entries.items()} == \
           {k: (type(e), getattr(e, "chunks", None), getattr(e, "offset", None)) for k, e in b.entries.items()}
    assert assert_bit_equal_checkpoints(TRAINER, tmp_path / "t8", same_layout=world_size is None) == 229


def test_every_rebuilt_item_is_what_torch_save_writes_for_its_chunk(slims, tmp_path, monkeypatch):
    _small_blocks(monkeypatch)
    out = tmp_path / "w3"
    ckpt_tools.rehydrate(slims / "sha", out, base=BASE, world_size=3, threads=4)
    ck = DcpCheckpoint.open(out)
    manifest = json.loads((slims / "sha" / SLIM_MANIFEST).read_text())
    for d in manifest["dropped"]:
        e = ck.entries[d["key"]]
        whole = ck.read_tensor(d["key"])
        for c in e.chunks:
            buf = io.BytesIO()
            torch.save(whole[c.offsets[0]:c.offsets[0] + c.sizes[0]].clone(), buf)
            assert ck.read_item_bytes(c.file, c.offset, c.length, d["key"]) == buf.getvalue(), (d["key"], c.offsets)


def test_a_failing_block_aborts_the_run_with_many_workers(slims, tmp_path, monkeypatch):
    _small_blocks(monkeypatch)
    other = perturbed_base(tmp_path, "model.layers.1.mlp.up_proj.weight")
    for slim in ("sha", "crc"):
        out = tmp_path / f"bad-{slim}"
        with pytest.raises(FormatError) as exc:
            ckpt_tools.rehydrate(slims / slim, out, base=other, threads=8)
        assert exc.value.key == "app.model.model.layers.1.mlp.up_proj.weight"
        assert "does not match the original" in str(exc.value) and not out.exists()
        assert not [p for p in tmp_path.iterdir() if p.name.startswith(f".{out.name}.")]


# ------------------------------------------------------------------------------- a layout of columns
COLS_KEY = "app.model.model.layers.0.mlp.down_proj.weight"    # [64, 162]: a column split, then rows of it
COLS = [((0, 0), (64, 100), 0), ((0, 100), (30, 62), 1), ((30, 100), (34, 62), 2)]


def _with_columns(dst: Path) -> Path:
    """The genuine fixture rewritten item by item (verbatim), but for one frozen tensor stored as a column
    split (tensor parallel's layout, not FSDP's row blocks), each chunk through torch.save (`write_tensor`)."""
    ck = DcpCheckpoint.open(TRAINER)
    w = DcpWriter(dst, files=4)
    for key, e in ck.entries.items():
        if isinstance(e, BytesEntry):
            w.copy_bytes_item(key, e.path, ck.read_item_bytes(e.file, e.offset, e.length, key), rel=e.file)
        elif key == COLS_KEY:
            t = ck.read_tensor(key)
            for offsets, sizes, fi in COLS:
                w.write_tensor(key, e.path, t, chunks=[(offsets, sizes)], file_index=fi)
        else:
            assert isinstance(e, TensorEntry)
            for c in e.chunks:
                w.copy_tensor_chunk(key, e.path, e.dtype, e.shape, c.offsets, c.sizes,
                                    ck.read_item_bytes(c.file, c.offset, c.length, key), file_index=int(c.file[2]))
    w.finish()
    return dst


def test_a_column_split_tensor_streams_from_row_blocks_to_torch_saves_bytes(tmp_path, monkeypatch):
    src = _with_columns(tmp_path / "cols")
    slim = tmp_path / "slim"
    ckpt_tools.slim(src, slim, base=BASE)
    d = next(d for d in json.loads((slim / SLIM_MANIFEST).read_text())["dropped"] if d["key"] == COLS_KEY)
    assert d.get("sha256") and [c["sizes"] for c in d["chunks"]] == [list(s) for _o, s, _f in COLS]
    _small_blocks(monkeypatch)

    def whole(*a, **k):
        raise AssertionError("a column split was read whole")
    monkeypatch.setattr(rebuild, "read_as", whole)   # the path that reads the tensor whole is never taken
    out = tmp_path / "full"
    r = ckpt_tools.rehydrate(slim, out, base=BASE, threads=4)
    assert r.result.verified_tensors == 36
    assert assert_bit_equal_checkpoints(src, out) == 229
    a, b = DcpCheckpoint.open(src), DcpCheckpoint.open(out)
    for c, e in zip(a.entries[COLS_KEY].chunks, b.entries[COLS_KEY].chunks):
        assert (c.offsets, c.sizes, c.file) == (e.offsets, e.sizes, e.file)
        assert a.read_item_bytes(c.file, c.offset, c.length, COLS_KEY) == \
               b.read_item_bytes(e.file, e.offset, e.length, COLS_KEY)
    other = perturbed_base(tmp_path, "model.layers.0.mlp.down_proj.weight")
    with pytest.raises(FormatError) as exc:
        ckpt_tools.rehydrate(slim, tmp_path / "bad", base=other, threads=4)
    assert exc.value.key == COLS_KEY and "sha256" in str(exc.value) and not (tmp_path / "bad").exists()
