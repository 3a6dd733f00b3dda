"""hf_dir against directories written by transformers' save_pretrained (and damaged copies)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from huggingface_hub import split_state_dict_into_shards_factory
from huggingface_hub.file_download import repo_folder_name
from safetensors import safe_open

from ckpt_tools.core.errors import FormatError, MissingFileError, MissingPathError, TruncatedFileError, UsageError
from ckpt_tools.formats.hf_dir.names import INDEX_NAME, WEIGHTS_NAME
from ckpt_tools.formats.hf_dir.model_dir import HFModelDir
from ckpt_tools.core.units import parse_size
from ckpt_tools.formats.hf_dir.shards import plan_shards, write_index
from ckpt_tools.formats.hf_dir.hub import resolve_model_dir
from ckpt_tools.formats.safetensors.header import ByteCounter
from ckpt_tools.formats.safetensors.writer import StreamingSafetensorsWriter, safetensors_save_order
from ckpt_tools.formats.safetensors.read import copy_raw

SHARD = "20KB"  # splits the tiny model below into 3 shards


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                      tie_word_embeddings=False)
    return Qwen3ForCausalLM(cfg).to(torch.bfloat16)


@pytest.fixture(scope="module")
def saved(model, tmp_path_factory):
    """save_pretrained outputs: `sharded` (3 shards + index) and `single` (model.safetensors)."""
    root = tmp_path_factory.mktemp("hf")
    model.save_pretrained(root / "sharded", max_shard_size=SHARD)
    model.save_pretrained(root / "single")
    for d in ("sharded", "single"):
        (root / d / "chat_template.jinja").write_text("{{ messages }}")
    return root


@pytest.fixture
def sharded(saved, tmp_path):
    """A private copy of the sharded save, free to damage."""
    d = tmp_path / "m"
    shutil.copytree(saved / "sharded", d)
    return d


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.state_dict().items()}


def edit_index(d, fn) -> None:
    idx = json.loads((d / INDEX_NAME).read_text())
    fn(idx)
    (d / INDEX_NAME).write_text(json.dumps(idx))


# ------------------------------------------------------------------------------------ opening

def test_sharded_dir_opens_and_reads_every_tensor_bit_identically(saved, model):
    d = saved / "sharded"
    with HFModelDir.open(d) as m:
        ref = state(model)
        assert sorted(m.keys()) == sorted(ref)
        assert len(m.headers) == 3 and m.config["model_type"] == "qwen3"
        index = json.loads((d / INDEX_NAME).read_text())
        assert m.total_bytes == index["metadata"]["total_size"]
        for k in m.keys():
            info = m.info(k)
            assert info.path == d / index["weight_map"][k]
            t = m.read_stored(k)
            assert t.dtype == torch.bfloat16 and torch.equal(t, ref[k])
            with safe_open(info.path, "pt") as f:
                assert bytes(m.read_raw(k)) == bytes(f.get_tensor(k).view(torch.uint8).reshape(-1).tolist())


def test_keys_are_in_disk_order_shard_by_shard(saved):
    m = HFModelDir.open(saved / "sharded")
    pos = [(m.info(k).path.name, m.info(k).begin) for k in m.keys()]
    assert pos == sorted(pos)


def test_single_file_dir_opens_without_an_index(saved, model):
    m = HFModelDir.open(saved / "single")
    assert [p.name for p in m.weight_files] == [WEIGHTS_NAME] and m.index_metadata is None
    assert torch.equal(m.read_stored("lm_head.weight"), state(model)["lm_head.weight"])


def test_opening_reads_headers_only(saved, monkeypatch):
    asked = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: asked.append(sum(map(len, bufs))) or real(fd, bufs, off))
    m = HFModelDir.open(saved / "sharded")
    assert sum(asked) == sum(h.data_start for h in m.headers.values())
    c = ByteCounter()
    m.read_stored("model.norm.weight", counter=c)
    assert c.bytes_read == 64


def test_non_weight_files_are_the_config_tokenizer_and_template_files(sharded):
    (sharded / "pytorch_model.bin").write_bytes(b"stale pickle")
    (sharded / "adapter_model.safetensors").write_bytes(b"x")
    (sharded / ".gitattributes").write_text("*.bin lfs")
    (sharded / "original").mkdir()
    (sharded / "tokenizer.json").write_text("{}")
    m = HFModelDir.open(sharded)
    assert [p.name for p in m.non_weight_files()] == [
        "chat_template.jinja", "config.json", "generation_config.json", "tokenizer.json"]
    assert m.skipped_entries() == [".gitattributes", "adapter_model.safetensors", "original", "pytorch_model.bin"]


def test_unknown_tensor_name_is_an_error_naming_it(saved):
    with pytest.raises(FormatError, match="key 'nope': no such tensor"):
        HFModelDir.open(saved / "single").info("nope")


# ------------------------------------------------------------------------------ damaged dirs

@pytest.mark.parametrize("target", ["../model-00001-of-00003.safetensors", "/etc/passwd", "sub/x.safetensors", ""])
def test_index_pointing_outside_the_directory_is_refused_before_opening_anything(sharded, target):
    edit_index(sharded, lambda i: i["weight_map"].__setitem__("lm_head.weight", target))
    with pytest.raises(FormatError, match="points outside the model directory") as ei:
        HFModelDir.open(sharded)
    assert repr(target) in str(ei.value) and INDEX_NAME in str(ei.value)


def test_missing_shard_is_named(sharded):
    (sharded / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(MissingFileError, match="1 shard.* missing: model-00002-of-00003.safetensors"):
        HFModelDir.open(sharded)


def test_index_and_headers_must_agree_both_ways_and_all_problems_are_reported(sharded):
    def damage(i):
        wm = i["weight_map"]
        wm["model.ghost.weight"] = "model-00001-of-00003.safetensors"       # indexed, not in the shard
        del wm["model.norm.weight"]                                        # in a shard, not indexed
        wm["lm_head.weight"] = "model-00001-of-00003.safetensors"          # mapped to the wrong shard
    edit_index(sharded, damage)
    with pytest.raises(FormatError) as ei:
        HFModelDir.open(sharded)
    msg = str(ei.value)
    assert "index maps 'model.ghost.weight' to model-00001-of-00003.safetensors, which has no such tensor" in msg
    assert "holds 'model.norm.weight', which the index does not list" in msg
    assert ("model-00003-of-00003.safetensors holds 'lm_head.weight', which the index maps to "
            "model-00001-of-00003.safetensors") in msg


def test_truncated_shard_fails_at_open(sharded):
    shard = sharded / "model-00003-of-00003.safetensors"
    os.truncate(shard, shard.stat().st_size - 100)
    with pytest.raises(TruncatedFileError, match="header promises"):
        HFModelDir.open(sharded)


def test_index_without_weight_map_is_malformed(sharded):
    (sharded / INDEX_NAME).write_text('{"metadata": {}}')
    with pytest.raises(FormatError, match="no non-empty 'weight_map'"):
        HFModelDir.open(sharded)
    (sharded / INDEX_NAME).write_text("{not json")
    with pytest.raises(FormatError, match="not valid JSON"):
        HFModelDir.open(sharded)


def test_both_single_file_and_index_is_ambiguous(sharded, saved):
    shutil.copy(saved / "single" / WEIGHTS_NAME, sharded / WEIGHTS_NAME)
    with pytest.raises(FormatError, match="has both model.safetensors and model.safetensors.index.json"):
        HFModelDir.open(sharded)


def test_dir_with_only_pickle_weights_says_so(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(MissingFileError, match="only has pickle weights"):
        HFModelDir.open(tmp_path)


# ---------------------------------------------------------------------------------- resolving

def make_cache(cache, repo_id: str, src) -> str:
    """The HF hub cache layout (blobs + snapshot symlinks + refs/main), as hf download leaves it."""
    repo = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    sha = hashlib.sha1(repo_id.encode()).hexdigest()
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(sha)
    snap = repo / "snapshots" / sha
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for f in sorted(src.iterdir()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    return sha


def test_hub_id_resolves_from_the_local_cache_offline(saved, tmp_path):
    sha = make_cache(tmp_path / "cache", "org/tiny", saved / "sharded")
    d = resolve_model_dir("org/tiny", cache_dir=tmp_path / "cache")
    assert d.name == sha
    m = HFModelDir.open(d)
    assert len(m.headers) == 3
    assert [p.name for p in m.non_weight_files()] == ["chat_template.jinja", "config.json", "generation_config.json"]


def test_hub_id_absent_from_the_cache_says_how_to_download_it(tmp_path):
    with pytest.raises(MissingFileError) as ei:
        resolve_model_dir("org/absent", cache_dir=tmp_path)
    msg = str(ei.value)
    assert "not in the local HF cache" in msg and "hf download org/absent" in msg and str(tmp_path) in msg


def test_local_directory_is_returned_as_is_and_missing_paths_are_errors(saved, tmp_path):
    assert resolve_model_dir(saved / "single") == saved / "single"
    with pytest.raises(MissingPathError, match="no such file or directory: "):
        resolve_model_dir(str(tmp_path / "nope"))
    with pytest.raises(UsageError, match="is a file"):
        resolve_model_dir(saved / "single" / "config.json")


# ---------------------------------------------------------------------------------- sharding

def hub_split(sizes: dict[str, int], max_bytes: int):
    return split_state_dict_into_shards_factory(
        sizes, get_storage_size=lambda n: n, filename_pattern="model{suffix}.safetensors",
        max_shard_size=max_bytes)


@settings(max_examples=100, deadline=None)
@given(sizes=st.lists(st.integers(0, 100), min_size=1, max_size=30), max_bytes=st.integers(1, 150))
def test_plan_shards_splits_exactly_like_huggingface_hub(sizes, max_bytes):
    entries = [(f"t{i}", n) for i, n in enumerate(sizes)]
    ours = plan_shards(entries, max_bytes)
    ref = hub_split(dict(entries), max_bytes)
    assert {s.file_name: list(s.tensor_names) for s in ours.shards} == ref.filename_to_tensors
    assert list(ours.weight_map.items()) == list(ref.tensor_to_filename.items())
    assert ours.metadata() == ref.metadata
    assert ours.is_sharded == ref.is_sharded


def test_oversized_tensor_gets_its_own_shard_ahead_of_the_open_one():
    plan = plan_shards([("a", 1), ("big", 10), ("c", 1)], 5)
    assert [(s.file_name, s.tensor_names, s.nbytes) for s in plan.shards] == [
        ("model-00001-of-00002.safetensors", ("big",), 10),
        ("model-00002-of-00002.safetensors", ("a", "c"), 2)]
    assert plan_shards([("a", 1)], 5).shards[0].file_name == "model.safetensors"


def test_plan_shards_rejects_nonsense():
    with pytest.raises(UsageError, match="positive"):
        plan_shards([("a", 1)], 0)
    with pytest.raises(UsageError, match="appears twice"):
        plan_shards([("a", 1), ("a", 2)], 5)
    with pytest.raises(UsageError, match="no tensors"):
        plan_shards([], 5)


@pytest.mark.parametrize("text,expected", [
    ("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("5GiB", 5 * 2**30), ("1.5GB", 1_500_000_000),
    ("20kb", 20_000), (" 7 KiB ", 7168), ("123", 123), (123, 123), ("2TB", 2 * 10**12), ("64B", 64)])
def test_parse_size_follows_the_hf_convention(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GB", "5 XB", "-5GB", "5GB5", "1e9"])
def test_parse_size_rejects_garbage_with_a_usage_error(text):
    with pytest.raises(UsageError, match="cannot parse size"):
        parse_size(text)


def test_rewriting_a_model_with_our_planner_and_writer_reproduces_save_pretrained_byte_for_byte(saved, model, tmp_path):
    """plan_shards + safetensors_save_order + StreamingSafetensorsWriter + copy_raw + write_index
    produce the very files transformers wrote: shards, names, order, header, index."""
    src = HFModelDir.open(saved / "sharded")
    entries = [(k, src.info(k).nbytes) for k in state(model)]  # save_pretrained walks state_dict order
    plan = plan_shards(entries, parse_size(SHARD))
    out = tmp_path / "out"
    out.mkdir()
    for shard in plan.shards:
        decl = safetensors_save_order([(n, src.info(n).dtype, src.info(n).shape) for n in shard.tensor_names])
        with StreamingSafetensorsWriter(out / shard.file_name, decl, {"format": "pt"}) as w:
            for name, _, _ in decl:
                copy_raw(src.info(name), src.fd(name), w, block_bytes=1000)
    write_index(out, plan, total_parameters=model.num_parameters())
    src.close()
    written = sorted(p.name for p in out.iterdir())
    assert written == sorted(p.name for p in (saved / "sharded").iterdir() if p.name.endswith((".safetensors", ".json"))
                             and p.name not in ("config.json", "generation_config.json"))
    for name in written:
        assert (out / name).read_bytes() == (saved / "sharded" / name).read_bytes(), name


def test_write_index_writes_nothing_for_a_single_shard(tmp_path):
    assert write_index(tmp_path, plan_shards([("a", 4)], 100)) is None
    assert list(tmp_path.iterdir()) == []
