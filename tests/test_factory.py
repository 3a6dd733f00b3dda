"""The fixture factory writes checkpoints shaped exactly like prime-rl's, and load_strict proves they resume.

The comparison target is the genuine prime-rl checkpoint in ``tests/fixtures/primerl-tiny`` (3 layers,
4 ranks); the factory's tiny run has the same shapes with 2 layers.
"""

from __future__ import annotations

import dataclasses
import io
import json
import pickle
import re
import shutil
import tomllib
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from tests.factory.factory import FactorySpec, build_scheduler, main, make_run
from tests.factory.fsdp_check import StrictLoadError, load_strict

GENUINE = Path(__file__).resolve().parent / "fixtures" / "primerl-tiny"
GENUINE_CKPT = GENUINE / "outputs" / "checkpoints" / "step_3" / "trainer"
GENUINE_LAYERS = 3


PROJ_ORDER = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
              "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


# ---------------------------------------------------------------------------------------------- helpers


def read_md(ckpt: Path):
    return FileSystemReader(str(ckpt)).read_metadata()


def group_of(key: str) -> str:
    if key.startswith("app.model."):
        return "lora_params" if (".lora_A." in key or ".lora_B." in key) else "model_weights"
    for prefix, name in [("app.optimizers.state.", "optimizer_state"), ("app.optimizers.param_groups.", "optimizer_param_groups"),
                         ("app.scheduler.", "scheduler"), ("app.progress.", "progress")]:
        if key.startswith(prefix):
            return name
    return "other"


def normalize(key: str) -> str:
    return re.sub(r"\.layers\.\d+\.", ".layers.N.", key)


def is_layer_key(key: str) -> bool:
    # param_groups.0.params is a bytes item whose *value* names layers, not its key
    return ".layers." in key


def torch_chunk_rows(n: int, world: int) -> list[tuple[int, int]]:
    """(offset, rows) of each chunk FSDP2 writes for an n-row tensor: the ``torch.chunk`` pieces, then one
    0-row chunk at offset n for each rank that ``torch.chunk`` left without rows."""
    out, off = [], 0
    for c in torch.chunk(torch.arange(n), world):
        out.append((off, len(c)))
        off += len(c)
    return out + [(n, 0)] * (world - len(out))


def chunk_layout(tmd: TensorStorageMetadata) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return [(tuple(c.offsets), tuple(c.sizes)) for c in tmd.chunks]


def expected_layout(size: tuple[int, ...], world: int):
    if len(size) == 0:
        return [((), ())]
    return [((off,) + (0,) * (len(size) - 1), (rows,) + tuple(size[1:])) for off, rows in torch_chunk_rows(size[0], world)]


def read_bytes_item(ckpt: Path, md, key: str):
    (info,) = [v for k, v in md.storage_data.items() if k.fqn == key]
    with open(ckpt / info.relative_path, "rb") as f:
        f.seek(info.offset)
        return torch.load(io.BytesIO(f.read(info.length)), weights_only=True)


def truth_to_load_keys(name: str) -> tuple[str, str]:
    """truth.safetensors name -> ('model'|'optim', key in load_strict's result)."""
    if name.startswith("lora."):
        module, slot, ab = name[len("lora."):].rsplit(".", 2)
        return "model", f"{module}.lora_{ab}.{slot[len('slot'):]}"
    assert name.startswith("optim."), name
    return "optim", name[len("optim."):]


def expected_param_order(spec: FactorySpec) -> list[str]:
    out = []
    for layer in range(spec.num_layers):
        for proj in PROJ_ORDER:
            for slot in range(spec.num_slots):
                out += [f"model.layers.{layer}.{proj}.lora_A.{slot}", f"model.layers.{layer}.{proj}.lora_B.{slot}"]
    return out


# ---------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("factory") / "tiny", FactorySpec.tiny())


@pytest.fixture(scope="module")
def tiny_loaded(tiny):
    return load_strict(tiny.checkpoint, tiny.base_model, tiny.truth_json, world_size=4, steps_after=2)


# ---------------------------------------------------------------------------------------------- fast tests


def test_spec_rejects_impossible_configs_with_all_problems_named():
    with pytest.raises(ValueError) as e:
        FactorySpec(scheduler="bogus", steps=0, num_heads=3)
    msg = str(e.value)
    assert "scheduler='bogus'" in msg and "steps=0" in msg and "num_heads=3" in msg


def test_presets_have_the_published_qwen3_shapes():
    s = FactorySpec.qwen3_8b()
    assert (s.hidden_size, s.intermediate_size, s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim) == (
        4096, 12288, 36, 32, 8, 128)
    assert (s.vocab_size, s.tie_word_embeddings, s.lora_rank) == (151936, False, 32)
    s = FactorySpec.qwen3_1_7b(world_size=8)
    assert (s.hidden_size, s.intermediate_size, s.num_layers, s.num_heads, s.num_kv_heads) == (2048, 6144, 28, 16, 8)
    assert s.tie_word_embeddings and s.world_size == 8
    assert FactorySpec.tiny() == FactorySpec()


def test_scale_comes_from_the_orchestrator_alpha_not_the_trainer_alpha():
    s = FactorySpec(lora_rank=32, lora_alpha_orch=16.0, trainer_alpha=64.0)
    assert s.scale == 0.5 and s.adapter_config_alpha == 64.0
    assert FactorySpec().adapter_config_alpha == 16.0


def test_spec_round_trips_through_its_dict():
    s = FactorySpec(targets=("q_proj", "v_proj"), num_slots=2, scheduler="sequential", warmup_steps=1)
    assert FactorySpec.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    assert s.target_modules() == ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj",
                                  "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"]


def test_make_run_refuses_a_non_empty_directory(tmp_path):
    (tmp_path / "x").write_text("keep me")
    with pytest.raises(FileExistsError, match="not empty"):
        make_run(tmp_path, FactorySpec())
    assert (tmp_path / "x").read_text() == "keep me"


def test_cli_reports_a_bad_spec_as_a_usage_error(tmp_path, capsys):
    assert main([str(tmp_path / "out"), "--steps", "0"]) == 2
    assert "steps=0" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------- the tiny run


@pytest.mark.slow
def test_tiny_run_tree_has_prime_rl_layout(tiny):
    assert sorted(p.name for p in tiny.checkpoint.iterdir()) == [".metadata"] + [f"__{r}_0.distcp" for r in range(4)]
    assert tiny.checkpoint == tiny.root / "outputs" / "checkpoints" / "step_3" / "trainer"

    orch = tomllib.loads(tiny.orch_toml.read_text())
    assert orch["model"]["name"] == "base_model"
    assert orch["model"]["lora"] == {"name": "r8-a16.0", "alpha": 16.0}
    assert orch["optim"]["lr"] == 0.01

    cfg = json.loads((tiny.base_model / "config.json").read_text())
    assert cfg["dtype"] == "bfloat16" and cfg["num_hidden_layers"] == 2 and cfg["intermediate_size"] == 162
    with safe_open(str(tiny.base_model / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
        assert "lm_head.weight" in set(f.keys())
    assert (tiny.base_model / "generation_config.json").is_file()

    assert tiny.broadcast_dir == tiny.root / "outputs" / "run_default" / "broadcasts" / "step_3"
    assert (tiny.broadcast_dir / "STABLE").read_bytes() == b""
    ac = json.loads((tiny.broadcast_dir / "adapter_config.json").read_text())
    assert (ac["peft_type"], ac["task_type"], ac["r"], ac["lora_alpha"], ac["bias"]) == ("LORA", "CAUSAL_LM", 8, 16.0, "none")
    assert ac["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    with safe_open(str(tiny.broadcast_dir / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.metadata() == {"format": "pt"}
        assert {f.get_slice(k).get_dtype() for k in keys} == {"F32"}
    assert "model.layers.0.mlp.down_proj.lora_A.weight" in keys
    assert not any(k.startswith("base_model.model.") for k in keys)  # prime-rl's export bug, on purpose
    assert len(keys) == 2 * 7 * 2


@pytest.mark.slow
def test_broadcast_export_equals_the_gathered_truth(tiny):
    truth = load_file(str(tiny.truth))
    export = load_file(str(tiny.broadcast_dir / "adapter_model.safetensors"))
    for k, v in export.items():
        module, ab, _ = k.rsplit(".", 2)
        assert torch.equal(v, truth[f"lora.{module}.slot0.{ab[-1]}"]), k
    info = json.loads(tiny.truth_json.read_text())
    assert info["scale"] == 2.0 and info["step"] == 3 and info["lr"] == 0.01
    assert info["num_dcp_keys"] == len(read_md(tiny.checkpoint).state_dict_metadata)
    assert info["optimizer_param_order"] == expected_param_order(FactorySpec.tiny())


@pytest.mark.slow
def test_dcp_keys_groups_and_planner_paths_match_the_genuine_checkpoint(tiny):
    ours, genuine = read_md(tiny.checkpoint), read_md(GENUINE_CKPT)
    ok, gk = list(ours.state_dict_metadata), list(genuine.state_dict_metadata)

    # Same key patterns once the layer index is normalized, and nothing outside the known groups.
    assert {normalize(k) for k in ok} == {normalize(k) for k in gk}
    assert "other" not in {group_of(k) for k in ok + gk}

    # Per group: the same number of keys per layer and the same non-layer keys (3 layers vs 2).
    for grp in {group_of(k) for k in gk}:
        g_layer = [k for k in gk if group_of(k) == grp and is_layer_key(k)]
        o_layer = [k for k in ok if group_of(k) == grp and is_layer_key(k)]
        assert len(g_layer) % GENUINE_LAYERS == 0
        assert len(o_layer) == len(g_layer) // GENUINE_LAYERS * 2, grp
        assert {k for k in ok if group_of(k) == grp and not is_layer_key(k)} == {
            k for k in gk if group_of(k) == grp and not is_layer_key(k)}, grp
    counts = Counter(group_of(k) for k in ok)
    assert counts == {"model_weights": 2 * 11 + 3, "lora_params": 2 * 14, "optimizer_state": 2 * 42,
                      "optimizer_param_groups": 13, "scheduler": 9, "progress": 3}

    # Every key the two share (layers 0-1 and the globals) has identical metadata and planner path.
    for k in ok:
        assert k in genuine.state_dict_metadata, k
        assert ours.state_dict_metadata[k] == genuine.state_dict_metadata[k], k
        assert ours.planner_data[k] == genuine.planner_data[k], k
    assert ours.version == genuine.version


@pytest.mark.slow
def test_dtypes_and_chunking_follow_the_fsdp2_rule_in_both_checkpoints(tiny):
    for ckpt in (GENUINE_CKPT, tiny.checkpoint):
        md = read_md(ckpt)
        per_key = Counter(idx.fqn for idx in md.storage_data)
        for k, v in md.state_dict_metadata.items():
            if isinstance(v, BytesStorageMetadata):
                assert group_of(k) in ("optimizer_param_groups", "scheduler", "progress"), k
                assert per_key[k] == 1, f"{ckpt}: bytes item {k} stored {per_key[k]} times"
                continue
            assert isinstance(v, TensorStorageMetadata)
            assert v.properties.dtype == torch.float32, k
            assert chunk_layout(v) == expected_layout(tuple(v.size), 4), (ckpt, k)
            assert per_key[k] == len(v.chunks), k
            if len(v.size) == 0:
                assert k.endswith(".step"), k


@pytest.mark.slow
def test_bytes_items_hold_the_same_values_as_the_genuine_checkpoint(tiny):
    ours, genuine = read_md(tiny.checkpoint), read_md(GENUINE_CKPT)
    spec = FactorySpec.tiny()
    for k, v in ours.state_dict_metadata.items():
        if not isinstance(v, BytesStorageMetadata):
            continue
        mine, theirs = read_bytes_item(tiny.checkpoint, ours, k), read_bytes_item(GENUINE_CKPT, genuine, k)
        if k == "app.optimizers.param_groups.0.params":
            assert mine == expected_param_order(spec)
            assert mine == [p for p in theirs if int(p.split(".")[2]) < spec.num_layers]
        elif k in ("app.progress.total_tokens", "app.progress.total_samples"):
            assert isinstance(mine, int) and mine > 0  # batch sizes differ from the genuine run
        else:
            assert mine == theirs and type(mine) is type(theirs), k


@pytest.mark.slow
def test_load_strict_restores_exactly_the_live_state(tiny, tiny_loaded):
    truth = load_file(str(tiny.truth))
    info = json.loads(tiny.truth_json.read_text())
    assert len(truth) == 2 * 14 + 3 * 2 * 14
    for name, value in truth.items():
        where, key = truth_to_load_keys(name)
        assert torch.equal(tiny_loaded[where][key], value), name
    assert len(tiny_loaded["optim"]) == 3 * 2 * 14
    # fp32 masters of the frozen base are exactly the bf16 hub weights upcast
    base = load_file(str(tiny.base_model / "model.safetensors"))
    for k, v in base.items():
        assert torch.equal(tiny_loaded["model"][k], v.float()), k
    assert set(tiny_loaded["model"]) == set(base) | {truth_to_load_keys(n)[1] for n in truth if n.startswith("lora.")}
    assert tiny_loaded["lr"] == info["lr"] == 0.01
    assert tiny_loaded["progress"] == info["progress"] == {"step": 3, "total_tokens": 3 * 4 * 16, "total_samples": 12}
    assert tiny_loaded["scheduler"] == info["scheduler"]
    assert tiny_loaded["scheduler"]["last_epoch"] == 3
    assert tiny_loaded["lr_trace"] == [0.01, 0.01]  # linear warmup of 2 steps is over


@pytest.mark.slow
def test_load_strict_raises_when_the_checkpoint_lacks_a_key(tiny, tmp_path):
    broken = tmp_path / "trainer"
    shutil.copytree(tiny.checkpoint, broken)
    with open(broken / ".metadata", "rb") as f:
        md = pickle.load(f)  # our own file: trusted
    key = "app.model.lm_head.weight"
    del md.state_dict_metadata[key]
    md.planner_data.pop(key, None)
    md.storage_data = {k: v for k, v in md.storage_data.items() if k.fqn != key}
    with open(broken / ".metadata", "wb") as f:
        pickle.dump(md, f)
    with pytest.raises(StrictLoadError, match=re.escape("Missing key in checkpoint state_dict: " + key)):
        load_strict(broken, tiny.base_model, FactorySpec.tiny(), world_size=1)


# ---------------------------------------------------------------------------------------------- odd shapes


@pytest.mark.slow
def test_three_ranks_with_empty_shards_tied_slots_and_sequential_lr_reshard_to_two(tmp_path):
    # lora_A has 2 rows on 3 ranks: rank 2 holds an empty shard. Tied embeddings, 2 adapter slots,
    # a WSD SequentialLR and a sharded base model ride along.
    spec = FactorySpec(num_layers=1, world_size=3, lora_rank=2, tie_word_embeddings=True, num_slots=2,
                       scheduler="sequential", warmup_steps=1, max_steps=10, decay_steps=5, steps=2,
                       trainer_alpha=32.0, base_max_shard_size="100KB")
    run = make_run(tmp_path / "odd", spec)
    assert (run.base_model / "model.safetensors.index.json").is_file()
    md = read_md(run.checkpoint)
    a = md.state_dict_metadata["app.model.model.layers.0.self_attn.q_proj.lora_A.1"]
    assert chunk_layout(a) == [((0, 0), (1, 64)), ((1, 0), (1, 64)), ((2, 0), (0, 64))]
    for k, v in md.state_dict_metadata.items():
        if isinstance(v, TensorStorageMetadata):
            assert chunk_layout(v) == expected_layout(tuple(v.size), 3), k
    # torch saves a tied weight under both names
    assert {"app.model.lm_head.weight", "app.model.model.embed_tokens.weight"} <= set(md.state_dict_metadata)
    sched_keys = {k for k in md.state_dict_metadata if k.startswith("app.scheduler.")}
    assert len(sched_keys) == 3 + 3 * 9 and "app.scheduler._milestones" in sched_keys
    ac = json.loads((run.broadcast_dir / "adapter_config.json").read_text())
    assert ac["lora_alpha"] == 32.0 and ac["r"] == 2  # what prime-rl would claim; training used 16/2
    assert json.loads(run.truth_json.read_text())["scale"] == 8.0

    loaded = load_strict(run.checkpoint, run.base_model, run.truth_json, world_size=2, steps_after=4)
    truth = load_file(str(run.truth))
    assert any(".slot1." in n for n in truth)
    for name, value in truth.items():
        where, key = truth_to_load_keys(name)
        assert torch.equal(loaded[where][key], value), name
    assert torch.equal(loaded["model"]["lm_head.weight"], loaded["model"]["model.embed_tokens.weight"])

    # The lr continues exactly as an uninterrupted scheduler of the same kind would.
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=spec.lr)
    sched = build_scheduler(opt, spec)
    lrs = []
    for _ in range(spec.steps + 4):
        opt.step()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    assert loaded["lr"] == lrs[spec.steps - 1]
    assert loaded["lr_trace"] == lrs[spec.steps:]
    assert loaded["progress"] == {"step": 2, "total_tokens": 2 * 3 * 16, "total_samples": 6}
    assert dataclasses.asdict(spec) == dataclasses.asdict(FactorySpec.from_dict(json.loads(run.truth_json.read_text())["spec"]))


def assert_reader_matches_torch_loader(ckpt_dir: Path) -> int:
    """Every item our streaming reader returns equals torch's own DCP loader's, bit for bit."""
    import warnings

    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from ckpt_tools.formats.dcp.reader import DcpCheckpoint
    from ckpt_tools.formats.dcp.model import TensorEntry

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref, _ = flatten_state_dict(_load_state_dict_from_keys(checkpoint_id=str(ckpt_dir)))
    ckpt = DcpCheckpoint.open(ckpt_dir)
    assert set(ckpt.keys()) == set(ref)
    for key, e in ckpt.entries.items():
        if isinstance(e, TensorEntry):
            got = ckpt.read_tensor(key)
            assert got.dtype == ref[key].dtype and torch.equal(got, ref[key]), key
        else:
            assert ckpt.read_object(key) == ref[key], key
    return len(ref)


def inspect_json(path: Path) -> dict:
    from click.testing import CliRunner

    from ckpt_tools.cli import main

    r = CliRunner().invoke(main, ["inspect", str(path), "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)["result"]


def test_reader_and_inspect_on_the_tiny_factory_checkpoint(tiny):
    n = assert_reader_matches_torch_loader(tiny.checkpoint)
    rep = inspect_json(tiny.checkpoint)
    layers = 2
    assert rep["keys"] == n
    assert {g: rep["groups"][g]["count"] for g in ("base", "lora", "optimizer_state", "param_groups",
                                                    "scheduler", "progress", "other")} == \
        {"base": 11 * layers + 3, "lora": 14 * layers, "optimizer_state": 42 * layers, "param_groups": 13,
         "scheduler": 9, "progress": 3, "other": 0}
    assert rep["world_size"] == 4 and rep["lora"]["rank"] == 8 and rep["lora"]["modules"] == 7 * layers
    assert rep["step"] == 3 and rep["lr"] == pytest.approx(1e-2)
    assert rep["alpha"]["training_scale"] == 2.0


def test_reader_and_inspect_on_three_ranks_with_empty_shards_and_two_slots(tmp_path):
    spec = FactorySpec(num_layers=1, world_size=3, lora_rank=2, num_slots=2, scheduler="sequential",
                       warmup_steps=1, max_steps=10, decay_steps=5, steps=2)
    run = make_run(tmp_path / "odd3", spec)
    assert_reader_matches_torch_loader(run.checkpoint)
    rep = inspect_json(run.checkpoint)
    assert rep["world_size"] == 3 and rep["lora"]["slots"] == [0, 1] and rep["lora"]["rank"] == 2
    assert rep["scheduler"]["type"] == "SequentialLR" and rep["scheduler"]["schedulers"][0] == "LinearLR"
