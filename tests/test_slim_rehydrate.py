"""ckpt slim / ckpt rehydrate: slim keeps every unique item verbatim and proves what it dropped;
rehydrate rebuilds a checkpoint whose every item is bit-equal to the original's, loadable strictly
by a 4-rank FSDP2 model, and refuses (writing nothing) a base model that is not the run's."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ckpt_tools.cli import main
from ckpt_tools.formats.dcp.model import BytesEntry, TensorEntry
from ckpt_tools.formats.dcp.reader import DcpCheckpoint
from ckpt_tools.formats.dcp.item import parse_item
from ckpt_tools.core.keys import classify
from ckpt_tools.formats.slim.manifest import SLIM_MANIFEST

from .conftest import BASE, TRAINER, json_payload

# One factory run serves this module and test_set_lr (which imports `surgery_run`): tied
# embeddings (lm_head rebuilt from embed_tokens) and a warmup + cosine SequentialLR.
_RUNS: dict = {}


def surgery_run(tmp_path_factory):
    """The shared 4-rank factory run (made once per test session)."""
    if "run" not in _RUNS:
        from tests.factory.factory import FactorySpec, make_run

        spec = FactorySpec.tiny(tie_word_embeddings=True, scheduler="sequential", decay="cosine", steps=3)
        _RUNS["run"] = make_run(tmp_path_factory.mktemp("surgery-run") / "run", spec)
    return _RUNS["run"]


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def bits(t: torch.Tensor) -> torch.Tensor:
    """A view that compares bit patterns (-0.0 != 0.0, NaN == NaN)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_bit_equal_checkpoints(a_dir: Path, b_dir: Path, *, same_layout: bool = True) -> int:
    a, b = DcpCheckpoint.open(a_dir), DcpCheckpoint.open(b_dir)
    assert sorted(a.entries) == sorted(b.entries)
    for key, ea in a.entries.items():
        eb = b.entries[key]
        assert type(ea) is type(eb), key
        assert ea.path == eb.path, key
        if isinstance(ea, TensorEntry):
            x, y = a.read_tensor(key), b.read_tensor(key)
            assert x.dtype == y.dtype and x.shape == y.shape, key
            assert torch.equal(bits(x), bits(y)), key
            if same_layout:
                assert [(c.offsets, c.sizes, c.file) for c in ea.chunks] == \
                       [(c.offsets, c.sizes, c.file) for c in eb.chunks], key
        else:
            assert a.read_item_bytes(ea.file, ea.offset, ea.length, key) == \
                   b.read_item_bytes(eb.file, eb.offset, eb.length, key), key
    return len(a.entries)


def no_leftovers(parent: Path, name: str) -> bool:
    return not [p for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}.")]


@pytest.fixture(scope="module")
def fixture_slim(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("slim") / "slim"
    r = run("slim", TRAINER, out, "--base", BASE)
    assert r.exit_code == 0, r.output
    return out


# ------------------------------------------------------------------------------------------ slim
def test_slim_keeps_every_unique_item_byte_for_byte_and_drops_only_frozen_base(fixture_slim):
    src, slim = DcpCheckpoint.open(TRAINER), DcpCheckpoint.open(fixture_slim)
    groups = {k: classify(k, e.path).group for k, e in src.entries.items()}
    assert sorted(slim.entries) == sorted(k for k, g in groups.items() if g != "base")
    assert {g for k, g in groups.items() if k not in slim.entries} == {"base"}
    for key, e in slim.entries.items():
        o = src.entries[key]
        if isinstance(e, BytesEntry):
            assert slim.read_item_bytes(e.file, e.offset, e.length, key) == \
                   src.read_item_bytes(o.file, o.offset, o.length, key)
        else:   # verbatim: the whole torch.save item, zip records and CRCs included
            assert [(c.offsets, c.sizes) for c in e.chunks] == [(c.offsets, c.sizes) for c in o.chunks]
            for c, d in zip(e.chunks, o.chunks):
                assert slim.read_item_bytes(c.file, c.offset, c.length, key) == \
                       src.read_item_bytes(d.file, d.offset, d.length, key)
            assert e.chunks[0].file == o.chunks[0].file   # rank files stay rank files
    slim_bytes = sum(p.stat().st_size for p in fixture_slim.iterdir())
    src_bytes = sum(p.stat().st_size for p in TRAINER.iterdir())
    assert slim_bytes < 0.55 * src_bytes


def test_slim_manifest_hashes_equal_the_base_weights_upcast_from_safetensors(fixture_slim):
    m = json.loads((fixture_slim / SLIM_MANIFEST).read_text())
    src = DcpCheckpoint.open(TRAINER)
    base_keys = sorted(k for k, e in src.entries.items() if classify(k, e.path).group == "base")
    assert [d["key"] for d in m["dropped"]] == base_keys
    with safe_open(str(BASE / "model.safetensors"), "pt") as f:
        for d in m["dropped"]:
            e = src.entries[d["key"]]
            assert d["shape"] == list(e.shape) and d["dtype"] == "float32" and d["path"] == list(e.path)
            assert [(tuple(c["offsets"]), tuple(c["sizes"]), c["file"]) for c in d["chunks"]] == \
                   [(c.offsets, c.sizes, c.file) for c in e.chunks]
            upcast = f.get_tensor(d["hf_name"]).to(torch.float32).contiguous()
            assert d["sha256"] == hashlib.sha256(upcast.numpy().tobytes()).hexdigest(), d["key"]
    assert m["base"]["verified"] is True and m["base"]["config_sha256"] == \
        hashlib.sha256((BASE / "config.json").read_bytes()).hexdigest()
    assert m["world_size"] == 4 and m["source"]["data_files"] == [f"__{i}_0.distcp" for i in range(4)]


def test_slim_checkpoint_says_it_is_not_loadable_in_manifest_and_inspect(fixture_slim):
    m = json.loads((fixture_slim / SLIM_MANIFEST).read_text())
    assert m["loadable_by_prime_rl"] is False and "NOT loadable by prime-rl's strict loader" in m["note"]
    r = run("inspect", fixture_slim, "--json")
    assert r.exit_code == 0, r.output
    rep = json_payload(r.stdout)
    assert rep["slim"] is True and any("rehydrate" in w for w in rep["warnings"])
    assert rep["groups"]["base"]["count"] == 0 and rep["groups"]["lora"]["count"] == 42


def test_slim_dry_run_json_plans_without_writing(tmp_path):
    out = tmp_path / "slim"
    r = run("slim", TRAINER, out, "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)["plan"]
    assert plan["dropped_keys"] == 36 and plan["kept_keys"] == 229 - 36
    assert plan["kept_bytes"] + plan["dropped_bytes"] < plan["source_bytes"]
    assert not out.exists() and no_leftovers(tmp_path, "slim")


def test_slim_refuses_a_slim_checkpoint(fixture_slim, tmp_path):
    r = run("slim", fixture_slim, tmp_path / "again")
    assert r.exit_code == 2 and "already a slim checkpoint" in r.output


def _frozen_item(trainer: Path, key: str, chunk: int = 1):
    ck = DcpCheckpoint.open(trainer)
    c = ck.entries[key].chunks[chunk]
    with open(trainer / c.file, "rb") as f:
        f.seek(c.offset)
        raw = f.read(c.length)
    return c, raw


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 1]))


def test_slim_never_reads_a_frozen_payload_so_a_damaged_one_still_rehydrates_to_the_original(fixture_copy, tmp_path):
    """A dropped tensor is identified by the CRC-32 its item stored when torch.save wrote it (read from the
    zip central directory): damage to its payload after the save is not copied, not recorded, and the
    rehydrated checkpoint is the original one."""
    import io
    trainer = fixture_copy / TRAINER.relative_to(TRAINER.parents[3])
    key = "app.model.model.layers.1.mlp.up_proj.weight"
    c, raw = _frozen_item(trainer, key)
    _flip(trainer / c.file, c.offset + parse_item(io.BytesIO(raw)).data_offset + 40)   # one bit of the payload
    out = tmp_path / "slim"
    r = run("slim", trainer, out, "--json")
    assert r.exit_code == 0, r.output
    m = json.loads((out / SLIM_MANIFEST).read_text())
    d = next(d for d in m["dropped"] if d["key"] == key)
    assert "sha256" not in d and m["version"] == 2
    assert d["crc32"][1] == parse_item(io.BytesIO(raw)).data_crc
    full = tmp_path / "full"
    r = run("rehydrate", out, full, "--base", BASE)
    assert r.exit_code == 0, r.output
    assert assert_bit_equal_checkpoints(TRAINER, full) == 229   # the original, not the damaged copy


def _central_crc_at(raw: bytes) -> int:
    """Offset in the item of the CRC field of data/0's central directory entry."""
    at = raw.index(b"PK\x01\x02", raw.index(b"PK\x01\x02"))
    while True:
        name_len = int.from_bytes(raw[at + 28:at + 30], "little")
        if raw[at + 46:at + 46 + name_len].endswith(b"/data/0"):
            return at + 16
        at = raw.index(b"PK\x01\x02", at + 46)


def test_a_frozen_item_that_stores_no_crc_is_read_and_identified_by_its_sha256(fixture_copy, tmp_path):
    """torch.save writes CRC 0 when told not to compute CRCs: such an item cannot be identified by its
    headers, so slim reads it and records its sha256 (the rest keep their CRC-32s)."""
    trainer = fixture_copy / TRAINER.relative_to(TRAINER.parents[3])
    key = "app.model.model.layers.1.mlp.up_proj.weight"
    c, raw = _frozen_item(trainer, key)
    at = c.offset + _central_crc_at(raw)
    with open(trainer / c.file, "r+b") as f:
        f.seek(at)
        f.write(b"\0\0\0\0")
    r = run("slim", trainer, tmp_path / "slim")
    assert r.exit_code == 0, r.output
    m = json.loads((tmp_path / "slim" / SLIM_MANIFEST).read_text())
    d = next(d for d in m["dropped"] if d["key"] == key)
    assert "crc32" not in d and len(d["sha256"]) == 64
    assert all("crc32" in x for x in m["dropped"] if x["key"] != key)
    r = run("rehydrate", tmp_path / "slim", tmp_path / "full", "--base", BASE)
    assert r.exit_code == 0, r.output
    assert assert_bit_equal_checkpoints(TRAINER, tmp_path / "full") == 229


def test_a_frozen_item_whose_stored_crc_is_wrong_is_refused_by_slim_base_and_by_rehydrate(fixture_copy, tmp_path):
    """The one thing slim trusts of a dropped item, its stored CRC-32: wrong, `slim --base` refuses it against
    the base, and a slim without a base records it and rehydrate refuses the rebuilt rows, naming the key."""
    trainer = fixture_copy / TRAINER.relative_to(TRAINER.parents[3])
    key = "app.model.model.layers.1.mlp.up_proj.weight"
    c, raw = _frozen_item(trainer, key)
    _flip(trainer / c.file, c.offset + _central_crc_at(raw))
    r = run("slim", trainer, tmp_path / "checked", "--base", BASE)
    assert r.exit_code == 1 and f"key '{key}'" in r.output and "CRC-32" in r.output, r.output
    assert not (tmp_path / "checked").exists() and no_leftovers(tmp_path, "checked")
    r = run("slim", trainer, tmp_path / "slim")
    assert r.exit_code == 0, r.output
    out = tmp_path / "full"
    r = run("rehydrate", tmp_path / "slim", out, "--base", BASE)
    assert r.exit_code == 1 and f"key '{key}'" in r.output and "CRC-32" in r.output, r.output
    assert "does not match the original" in r.output
    assert not out.exists() and no_leftovers(tmp_path, "full")


# ------------------------------------------------------------------------------------------ rehydrate
def test_rehydrate_rebuilds_every_item_bit_equal_in_the_original_layout(fixture_slim, tmp_path):
    out = tmp_path / "full"
    r = run("rehydrate", fixture_slim, out, "--base", BASE)
    assert r.exit_code == 0, r.output
    assert "36/36 rebuilt tensors match" in r.output
    assert assert_bit_equal_checkpoints(TRAINER, out) == 229
    a, b = DcpCheckpoint.open(TRAINER), DcpCheckpoint.open(out)   # streamed items: torch.save's bytes exactly
    for key, e in a.entries.items():
        if isinstance(e, TensorEntry):
            for c, d in zip(e.chunks, b.entries[key].chunks):
                assert a.read_item_bytes(c.file, c.offset, c.length, key) == \
                       b.read_item_bytes(d.file, d.offset, d.length, key), key
    assert not (out / SLIM_MANIFEST).exists()
    assert sorted(p.name for p in out.iterdir()) == sorted([*(p.name for p in TRAINER.iterdir()), ".ckpt-tools-output"])


def test_rehydrate_for_another_world_size_writes_row_chunks_for_it(fixture_slim, tmp_path):
    out = tmp_path / "full2"
    r = run("rehydrate", fixture_slim, out, "--base", BASE, "--world-size", "2", "--json")
    assert r.exit_code == 0, r.output
    assert assert_bit_equal_checkpoints(TRAINER, out, same_layout=False) == 229
    ck = DcpCheckpoint.open(out)
    gate = ck.entries["app.model.model.layers.0.mlp.gate_proj.weight"]
    assert [(c.offsets, c.sizes, c.file) for c in gate.chunks] == [
        ((0, 0), (81, 64), "__0_0.distcp"), ((81, 0), (81, 64), "__1_0.distcp")]


def test_a_slim_without_base_rehydrates_bit_equal_for_another_world_size_checked_by_its_chunks_crc32(tmp_path):
    """No sha256 (version 2): the rebuilt rows are checked against the CRC-32 of every original chunk, though
    the new chunks straddle them; another base revision is refused."""
    slim = tmp_path / "slim"
    r = run("slim", TRAINER, slim)
    assert r.exit_code == 0, r.output
    m = json.loads((slim / SLIM_MANIFEST).read_text())
    assert m["version"] == 2 and m["base"]["verified"] is False
    assert all("sha256" not in d and len(d["crc32"]) == len(d["chunks"]) for d in m["dropped"])
    r = run("rehydrate", slim, tmp_path / "full", "--base", BASE, "--world-size", "3")
    assert r.exit_code == 0, r.output
    assert "36/36 rebuilt tensors match" in r.output
    assert assert_bit_equal_checkpoints(TRAINER, tmp_path / "full", same_layout=False) == 229
    other = perturbed_base(tmp_path, "model.layers.2.self_attn.o_proj.weight")
    r = run("rehydrate", slim, tmp_path / "bad", "--base", other, "--world-size", "3")
    assert r.exit_code == 1 and "key 'app.model.model.layers.2.self_attn.o_proj.weight'" in r.output, r.output
    assert "CRC-32" in r.output and not (tmp_path / "bad").exists()


def perturbed_base(tmp_path: Path, name: str) -> Path:
    """A real copy of the base saved by safetensors with one weight changed by one bf16 ulp: the
    "same model, another revision" trap."""
    d = tmp_path / "other-revision"
    shutil.copytree(BASE, d)
    for p in d.iterdir():
        os.chmod(p, 0o644)
    tensors = load_file(str(BASE / "model.safetensors"))
    t = tensors[name].clone()
    flat = t.view(-1).view(torch.int16)
    flat[7] += 1
    tensors[name] = t
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


def test_rehydrate_with_another_base_revision_fails_naming_the_key_and_writes_nothing(fixture_slim, tmp_path):
    other = perturbed_base(tmp_path, "model.layers.2.self_attn.o_proj.weight")
    out = tmp_path / "full"
    r = run("rehydrate", fixture_slim, out, "--base", other)
    assert r.exit_code == 1, r.output
    assert "key 'app.model.model.layers.2.self_attn.o_proj.weight'" in r.output
    assert "does not match the original" in r.output and "not the base model the run trained on" in r.output
    assert not out.exists() and no_leftovers(tmp_path, "full")


def test_rehydrate_with_another_architecture_lists_the_mismatches_before_reading(fixture_slim, tmp_path_factory):
    other = surgery_run(tmp_path_factory).base_model   # 2 layers, tied: not the fixture's base
    out = tmp_path_factory.mktemp("wrongarch") / "full"
    r = run("rehydrate", fixture_slim, out, "--base", other)
    assert r.exit_code == 1, r.output
    assert "does not match the checkpoint's frozen weights" in r.output
    assert "model.layers.2.mlp.up_proj.weight: not in the base model" in r.output
    assert not out.exists()


def test_rehydrate_refuses_a_manifest_whose_hash_was_tampered(fixture_slim, tmp_path):
    slim = tmp_path / "slim"
    shutil.copytree(fixture_slim, slim)
    m = json.loads((slim / SLIM_MANIFEST).read_text())
    d = next(d for d in m["dropped"] if d["key"].endswith("model.norm.weight"))
    d["sha256"] = "0" * 64
    (slim / SLIM_MANIFEST).write_text(json.dumps(m))
    r = run("rehydrate", slim, tmp_path / "full", "--base", BASE)
    assert r.exit_code == 1 and "key 'app.model.model.norm.weight'" in r.output
    assert not (tmp_path / "full").exists()


def test_slim_with_a_base_that_is_not_the_runs_refuses(tmp_path):
    other = perturbed_base(tmp_path, "model.embed_tokens.weight")
    r = run("slim", TRAINER, tmp_path / "slim", "--base", other)
    assert r.exit_code == 1 and "key 'app.model.model.embed_tokens.weight'" in r.output
    assert not (tmp_path / "slim").exists() and no_leftovers(tmp_path, "slim")


@pytest.mark.slow
def test_factory_checkpoint_slim_rehydrate_loads_strictly_into_4_rank_fsdp2(tmp_path_factory):
    from tests.factory.fsdp_check import load_strict

    paths = surgery_run(tmp_path_factory)
    tmp = tmp_path_factory.mktemp("factory-surgery")
    r = run("slim", paths.checkpoint, tmp / "slim")
    assert r.exit_code == 0, r.output
    m = json.loads((tmp / "slim" / SLIM_MANIFEST).read_text())
    assert m["base"]["name"] == "base_model" and m["base"].get("verified") is False   # from orch.toml
    r = run("rehydrate", tmp / "slim", tmp / "full", "--base", paths.base_model)
    assert r.exit_code == 0, r.output
    assert assert_bit_equal_checkpoints(paths.checkpoint, tmp / "full") == \
        json.loads(paths.truth_json.read_text())["num_dcp_keys"]

    got = load_strict(tmp / "full", paths.base_model, paths.truth_json, world_size=4)
    truth = load_file(str(paths.truth))
    base = load_file(str(paths.base_model / "model.safetensors"))
    assert "lm_head.weight" not in base   # tied: rebuilt from embed_tokens
    for name, t in got["model"].items():
        if ".lora_" in name:
            module, ab, slot = name.rsplit(".", 2)
            want = truth[f"lora.{module}.slot{slot}.{ab[-1]}"]
        else:
            want = base["model.embed_tokens.weight" if name == "lm_head.weight" else name].to(torch.float32)
        assert torch.equal(bits(t), bits(want)), name
    optim_truth = {k[len("optim."):]: v for k, v in truth.items() if k.startswith("optim.")}
    assert sorted(got["optim"]) == sorted(optim_truth)
    for k, v in got["optim"].items():
        assert torch.equal(bits(v), bits(optim_truth[k])), k
    assert got["progress"] == json.loads(paths.truth_json.read_text())["progress"]
