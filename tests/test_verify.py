"""`ckpt verify` on the genuine fixture and on corrupted copies of it. Each expected file/key is
derived independently (torch's own FileSystemReader metadata, raw safetensors headers), not from
our reader."""
from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader

from ckpt_tools.cli import main
from ckpt_tools import verify as verify_path

from .conftest import BASE, FIXTURE, TRAINER, json_payload, write_sharded_base

REL_TRAINER = TRAINER.relative_to(FIXTURE)
PEFT = FIXTURE / "reference_peft_adapter"


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def verify_json(*args):
    r = run("verify", *args, "--json")
    assert r.exit_code in (0, 1), r.output
    rep = json_payload(r.stdout)
    assert rep["ok"] == (r.exit_code == 0)
    return rep


def torch_items(trainer: Path) -> list[tuple[str, str, int, int]]:
    """(file, key, offset, length) of every storage item, from torch's own metadata reader."""
    md = FileSystemReader(str(trainer)).read_metadata()
    return sorted((info.relative_path, idx.fqn, info.offset, info.length) for idx, info in md.storage_data.items())


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """The base model in 3 shards + index, written by huggingface_hub's sharded writer (pristine)."""
    return write_sharded_base(tmp_path_factory.mktemp("sharded") / "model")


def copy_of(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / src.name
    shutil.copytree(src, dst)
    for p in dst.rglob("*"):
        os.chmod(p, 0o644 if p.is_file() else 0o755)
    return dst


# ------------------------------------------------------------------------------------ clean inputs
@pytest.mark.parametrize("path", [TRAINER, TRAINER.parent, BASE, FIXTURE / "expected_merged_hf"],
                         ids=["trainer", "step_dir", "base", "merged"])
def test_the_genuine_fixture_verifies_clean_even_deep(path):
    r = run("verify", path, "--deep")
    assert r.exit_code == 0, r.output
    assert "problem" not in r.stdout
    if path.is_relative_to(TRAINER.parent):     # every zip record's CRC-32 recomputed: proven
        assert r.stdout.startswith("OK: ")
    else:   # a shipped HF dir with no SHA256SUMS: well formed and finite, nothing proves its bytes
        assert r.stdout.startswith("STRUCTURE OK, INTEGRITY NOT PROVEN: ")


def test_dcp_verify_checks_every_item_and_deep_every_zip_record():
    rep = verify_json(TRAINER, "--deep")
    items = torch_items(TRAINER)
    assert rep["checked"]["storage_items"] == rep["checked"]["items_parsed"] == len(items) == 715
    assert rep["checked"]["keys"] == 229 and rep["checked"]["files"] == 4
    # every record of every item: count them with Python's zipfile on the raw item bytes
    n_records = 0
    for rel, _key, off, length in items:
        with open(TRAINER / rel, "rb") as f:
            f.seek(off)
            n_records += len(zipfile.ZipFile(io.BytesIO(f.read(length))).infolist())
    assert rep["checked"]["records_crc_checked"] == n_records
    assert rep["problems"] == [] and rep["warnings"] == []


def test_peft_adapter_fits_its_base_whether_hf_or_dcp():
    for base in (BASE, TRAINER):
        rep = verify_json(PEFT, "--base", base, "--deep")
        assert rep["ok"] and rep["checked"]["modules"] == 21, rep


# ------------------------------------------------------------------------------------ DCP damage
def test_truncated_distcp_names_the_file_and_the_first_item_past_the_end(fixture_copy):
    trainer = fixture_copy / REL_TRAINER
    f = trainer / "__2_0.distcp"
    new_size = f.stat().st_size - 1000
    os.truncate(f, new_size)
    past = [(off, key) for rel, key, off, length in torch_items(trainer) if rel == "__2_0.distcp" and off + length > new_size]
    assert past
    rep = verify_json(trainer)
    assert len(rep["problems"]) == 1
    p = rep["problems"][0]
    assert p["file"] == str(f) and p["key"] == min(past)[1] and "truncated" in p["message"]
    r = run("verify", trainer)
    assert r.exit_code == 1 and f"{f}, key '{min(past)[1]}'" in r.stdout and r.stdout.splitlines()[-1].startswith("FAILED")


def test_deleted_distcp_names_the_file_and_a_key_stored_in_it(fixture_copy):
    trainer = fixture_copy / REL_TRAINER
    (trainer / "__3_0.distcp").unlink()
    keys_in_3 = sorted(key for rel, key, _, _ in torch_items(trainer) if rel == "__3_0.distcp")
    rep = verify_json(trainer)
    assert [(p["file"], p["key"]) for p in rep["problems"]] == [(str(trainer / "__3_0.distcp"), keys_in_3[0])]
    assert "missing" in rep["problems"][0]["message"]


def _payload_of(trainer: Path, key: str) -> tuple[str, int, int]:
    """(file, absolute offset, size) of the data/0 payload of `key`'s first item, via zipfile."""
    rel, off, length = next((r, o, n) for r, k, o, n in torch_items(trainer) if k == key)
    with open(trainer / rel, "rb") as fh:
        fh.seek(off)
        raw = fh.read(length)
    zf = zipfile.ZipFile(io.BytesIO(raw))
    info = next(i for i in zf.infolist() if i.filename.endswith("/data/0"))
    name_len, extra_len = int.from_bytes(raw[info.header_offset + 26:info.header_offset + 28], "little"), \
        int.from_bytes(raw[info.header_offset + 28:info.header_offset + 30], "little")
    return rel, off + info.header_offset + 30 + name_len + extra_len, info.file_size


def test_a_flipped_payload_byte_is_refused_on_read_and_deep_verify_lists_it(fixture_copy):
    from ckpt_tools.core.errors import ChecksumError
    from ckpt_tools.formats.dcp.reader import DcpCheckpoint

    trainer = fixture_copy / REL_TRAINER
    key = "app.model.model.layers.1.mlp.up_proj.weight"
    before = DcpCheckpoint.open(trainer).read_tensor(key)
    rel, pos, size = _payload_of(trainer, key)
    with open(trainer / rel, "r+b") as fh:
        fh.seek(pos + size // 2)
        b = fh.read(1)
        fh.seek(pos + size // 2)
        fh.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(ChecksumError, match="CRC-32"):  # torch.load would load it silently; our reads check
        DcpCheckpoint.open(trainer).read_tensor(key)
    assert before.numel()
    assert verify_json(trainer)["ok"]                # structure is intact: only --deep can see it
    rep = verify_json(trainer, "--deep")
    assert [(p["file"], p["key"]) for p in rep["problems"]] == [(str(trainer / rel), key)]
    assert "CRC32 mismatch" in rep["problems"][0]["message"] and "data/0" in rep["problems"][0]["message"]


def _edit_metadata(trainer: Path, edit) -> None:
    meta = trainer / ".metadata"
    # A trusted fixture, loaded with pickle itself: the library's loader gives torch-free stand-ins
    # that refuse to be pickled again, and this test must write genuine DCP metadata back.
    md = pickle.loads(meta.read_bytes())
    edit(md)
    meta.write_bytes(pickle.dumps(md, protocol=4))


def test_a_chunk_dropped_from_the_metadata_is_a_coverage_hole(fixture_copy):
    trainer = fixture_copy / REL_TRAINER
    key = "app.model.model.layers.0.mlp.gate_proj.weight"     # [162, 64] in chunks 41/41/41/39

    def drop(md):
        chunks = md.state_dict_metadata[key].chunks
        assert [list(c.offsets) for c in chunks][1] == [41, 0]
        del chunks[1]

    _edit_metadata(trainer, drop)
    # the edited metadata is still a valid DCP metadata for torch
    assert len(FileSystemReader(str(trainer)).read_metadata().state_dict_metadata[key].chunks) == 3
    rep = verify_json(trainer)
    assert [(p["file"], p["key"]) for p in rep["problems"]] == [(str(trainer / ".metadata"), key)]
    assert f"cover {(162 - 41) * 64} of {162 * 64} elements" in rep["problems"][0]["message"]
    assert "rows [41, 82)" in rep["problems"][0]["message"]
    assert any(w["key"] == key and "orphaned" in w["message"] for w in rep["warnings"])


def test_metadata_disagreeing_with_the_item_and_overlapping_chunks(fixture_copy):
    trainer = fixture_copy / REL_TRAINER
    k1 = "app.model.model.norm.weight"
    k2 = "app.model.model.layers.2.self_attn.o_proj.weight"

    def edit(md):
        md.state_dict_metadata[k1].properties.dtype = torch.bfloat16
        ch = md.state_dict_metadata[k2].chunks
        ch[1].offsets = torch.Size([ch[1].offsets[0] - 1, 0])

    _edit_metadata(trainer, edit)
    rep = verify_json(trainer)
    by_key = {}
    for p in rep["problems"]:
        by_key.setdefault(p["key"], []).append(p["message"])
    assert any("dtype torch.float32 (metadata: torch.bfloat16)" in m for m in by_key[k1]), by_key
    assert any("overlap" in m for m in by_key[k2]), by_key


def test_garbage_metadata_and_a_damaged_item_are_problems_not_tracebacks(fixture_copy):
    trainer = fixture_copy / REL_TRAINER
    rel, key, off, _ = next(i for i in torch_items(trainer) if i[1] == "app.optimizers.param_groups.0.lr")
    with open(trainer / rel, "r+b") as fh:            # zip signature of the lr item
        fh.seek(off)
        fh.write(b"\0\0\0\0")
    # the item's central directory is at its tail: also damage that to make it unparseable
    length = next(i[3] for i in torch_items(trainer) if i[1] == key)
    with open(trainer / rel, "r+b") as fh:
        fh.seek(off + length - 22)
        fh.write(b"XXXX")
    rep = verify_json(trainer)
    assert [(p["file"], p["key"]) for p in rep["problems"]] == [(str(trainer / rel), key)]
    assert "not a valid torch.save archive" in rep["problems"][0]["message"]
    (trainer / ".metadata").write_bytes(b"\x80\x04garbage")
    r = run("verify", trainer)
    assert r.exit_code == 1 and "Traceback" not in r.output and ".metadata" in r.stdout


# ------------------------------------------------------------------------------------ HF damage
def test_sharded_hf_dir_verifies_clean(sharded):
    rep = verify_json(sharded, "--deep")
    assert rep["ok"] and rep["checked"]["files"] == 3 and rep["checked"]["tensors"] == 36 and not rep["warnings"]


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        h = json.loads(f.read(n))
    h.pop("__metadata__", None)
    return {k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1]) for k, v in h.items()}


def test_truncated_safetensors_shard_names_the_shard_and_first_tensor_past_the_end(sharded, tmp_path):
    d = copy_of(sharded, tmp_path)
    shard = d / "model-00002-of-00003.safetensors"
    new_size = shard.stat().st_size - 300
    ranges = _header(shard)
    os.truncate(shard, new_size)
    first_past = min((end, k) for k, (_, end) in ranges.items() if end > new_size)[1]
    rep = verify_json(d)
    assert (str(shard), first_past) in [(p["file"], p["key"]) for p in rep["problems"]], rep["problems"]
    assert any("truncated" in p["message"] for p in rep["problems"])


def test_index_pointing_at_a_missing_shard(sharded, tmp_path):
    d = copy_of(sharded, tmp_path)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    key = "model.layers.1.mlp.down_proj.weight"
    index["weight_map"][key] = "model-00004-of-00003.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    rep = verify_json(d)
    pairs = [(p["file"], p["key"]) for p in rep["problems"]]
    assert (str(d / "model-00004-of-00003.safetensors"), key) in pairs
    assert any(p["key"] == key and "maps it to model-00004-of-00003" in p["message"] for p in rep["problems"])
    # a deleted shard: every problem names it
    (d / "model-00001-of-00003.safetensors").unlink()
    rep = verify_json(d)
    first_in_1 = sorted(k for k, f in index["weight_map"].items() if f == "model-00001-of-00003.safetensors")[0]
    assert (str(d / "model-00001-of-00003.safetensors"), first_in_1) in [(p["file"], p["key"]) for p in rep["problems"]]


def test_shapes_are_checked_against_config_and_deep_finds_nans(tmp_path):
    d = copy_of(BASE, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 160
    (d / "config.json").write_text(json.dumps(cfg))
    rep = verify_json(d)
    bad = sorted(p["key"] for p in rep["problems"])
    assert bad == sorted(f"model.layers.{i}.mlp.{m}_proj.weight" for i in range(3) for m in ("down", "gate", "up"))
    assert all("config.json implies" in p["message"] for p in rep["problems"])

    t = load_file(str(BASE / "model.safetensors"))
    w = t["model.layers.0.self_attn.k_proj.weight"].clone()
    w[1, 2] = float("nan")
    w[3, 4] = float("inf")
    t["model.layers.0.self_attn.k_proj.weight"] = w
    n = tmp_path / "nan"
    n.mkdir()
    shutil.copy(BASE / "config.json", n / "config.json")
    save_file(t, str(n / "model.safetensors"))
    assert verify_json(n)["ok"]
    rep = verify_json(n, "--deep")
    assert [(p["key"], p["message"]) for p in rep["problems"]] == \
        [("model.layers.0.self_attn.k_proj.weight", "2 non-finite value(s) (inf/nan)")]


def test_prime_rl_export_config_dtype_is_a_warning_not_a_problem():
    rep = verify_json(FIXTURE / "outputs" / "weights" / "step_3")
    assert rep["ok"] and any("float32" in w["message"] and "BF16" in w["message"] for w in rep["warnings"])


# ------------------------------------------------------------------------------------ PEFT damage
def test_prime_rl_broadcast_keys_are_each_reported_with_the_fix():
    bdir = FIXTURE / "outputs" / "run_default" / "broadcasts" / "step_3"
    rep = verify_json(bdir)
    from safetensors import safe_open

    with safe_open(str(bdir / "adapter_model.safetensors"), "pt") as f:
        keys = sorted(f.keys())
    flagged = sorted(p["key"] for p in rep["problems"] if p["key"])
    assert flagged == keys and all("fix-adapter" in p["message"] for p in rep["problems"] if p["key"])
    assert any("changes nothing" in p["message"] for p in rep["problems"])


def test_adapter_against_a_base_missing_a_module_or_with_other_shapes(tmp_path):
    t = load_file(str(BASE / "model.safetensors"))
    t.pop("model.layers.1.self_attn.q_proj.weight")
    t["model.layers.2.mlp.down_proj.weight"] = torch.zeros(64, 100, dtype=torch.bfloat16)
    b = tmp_path / "other_base"
    b.mkdir()
    shutil.copy(BASE / "config.json", b / "config.json")
    save_file(t, str(b / "model.safetensors"))
    rep = verify_json(PEFT, "--base", b)
    got = {p["key"]: p["message"] for p in rep["problems"]}
    assert set(got) == {"base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight",
                        "base_model.model.model.layers.2.mlp.down_proj.lora_A.weight"}
    assert "does not exist in the base" in got["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]
    assert "[64, 100]" in got["base_model.model.model.layers.2.mlp.down_proj.lora_A.weight"]


def test_invalid_peft_config_and_base_on_a_non_peft_path(tmp_path):
    d = copy_of(PEFT, tmp_path)
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    rep = verify_json(d)
    assert rep["problems"][0]["file"] == str(d / "adapter_config.json") and "use_dora" in rep["problems"][0]["message"]
    r = run("verify", TRAINER, "--base", BASE)
    assert r.exit_code == 2 and "--base applies to PEFT" in r.output


def test_library_report_matches_cli(fixture_copy):
    trainer = fixture_copy / REL_TRAINER
    (trainer / "__1_0.distcp").unlink()
    rep = verify_path(trainer)
    assert not rep.ok and rep.problems[0].file == str(trainer / "__1_0.distcp")
