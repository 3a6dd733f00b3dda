"""The HEAD fixture factory writes checkpoints shaped exactly like today's prime-rl, with exact ground truth.

Comparison targets are the genuine prime-rl 559b447 runs in ``tests/fixtures/primerl-head/`` (E dense LoRA
world 4, F MoE LoRA world 2 with EP=2, G full fine-tune world 2): at their settings the factory's
``.metadata`` (read with torch's own ``FileSystemReader``) must match theirs key for key, chunk for chunk,
rank file for rank file. Every factory run is then read back with torch's own DCP loader and compared
with its ground truth, including shapes the genuine runs do not have (3 ranks, 8 experts, tied
embeddings, uneven shards, strided EP over 4 ranks, an MoE full fine-tune).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from tests.factory.head_factory import main, make_head_run
from tests.factory.head_spec import HeadSpec, head_paths

GENUINE = Path(__file__).resolve().parent / "fixtures" / "primerl-head"
GENUINE_DIRS = {"E": GENUINE / "E_head_dense", "F": GENUINE / "F_head_moe", "G": GENUINE / "G_head_fullft"}
PRESETS = {"E": HeadSpec.e_dense, "F": HeadSpec.f_moe, "G": HeadSpec.g_fullft}
# Files of the genuine fixtures written by their generator around prime-rl, not by prime-rl's trainer.
GENERATOR_ONLY = {"configs/run_spec.json", "dcp_keys.txt", "dcp_metadata.json", "verification.json"}

# Shapes the genuine runs do not cover. X5 is written through the CLI.
OTHER_SPECS = {
    # 3 ranks, 8 experts without EP (FSDP rows 3/3/2), tied embeddings, r4 a7 on q, v and the experts
    "X3": HeadSpec.f_moe(world_size=3, num_experts=8, ep=1, tie_word_embeddings=True, lora_rank=4,
                         lora_alpha=7.0, targets=("q_proj", "v_proj", "experts"), ckpt_interval=2),
    # 4 ranks, EP 2 x dp_shard_mod_ep 2 (strided expert shards), MoE full fine-tune, WSD schedule
    "X4": HeadSpec.f_moe(lora=False, world_size=4, ep=2, num_experts=8, scheduler="linear", warmup_steps=0,
                         decay_steps=2, lr=1e-3),
}
X5_ARGS = ["--kind", "dense", "--world-size", "3", "--tied", "--layers", "2", "--rank", "16", "--alpha", "24",
           "--targets", "q_proj,o_proj,down_proj", "--max-steps", "4", "--ckpt-interval", "2"]


# ---------------------------------------------------------------------------------------------- helpers


def layout(ckpt: Path) -> dict[str, object]:
    """Every key's dtype, shape and chunks, and which rank file holds each chunk, from torch's reader."""
    md = FileSystemReader(str(ckpt)).read_metadata()
    keys = {}
    for k, v in md.state_dict_metadata.items():
        if isinstance(v, TensorStorageMetadata):
            keys[k] = (str(v.properties.dtype), tuple(v.size),
                       sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks))
        else:
            assert isinstance(v, BytesStorageMetadata), k
            keys[k] = "bytes"
    files = {(i.fqn, None if i.offset is None else tuple(i.offset)): s.relative_path for i, s in md.storage_data.items()}
    return {"keys": keys, "files": files}


def load_dcp(ckpt: Path, tmp: Path) -> dict:
    """The whole checkpoint through torch's own DCP loader (``dcp_to_torch_save``)."""
    tmp.mkdir(parents=True, exist_ok=True)
    out = tmp / (ckpt.parent.name + ".pt")
    dcp_to_torch_save(str(ckpt), str(out))
    return torch.load(out, weights_only=False)["app"]


def run_tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def tensors_of(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    with safe_open(str(path), "pt") as f:
        return {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}


def hf_dir_tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def model_truth(ref: dict[str, torch.Tensor], key: str) -> torch.Tensor:
    """The ground truth of a DCP model key (``app.model.`` stripped) in reference.safetensors."""
    if ".lora_A." in key or ".lora_B." in key:
        module, ab, _slot = key.rsplit(".", 2)
        return ref[f"lora.{module}.{ab[-1]}"]
    if "_lora_A." in key or "_lora_B." in key:
        return ref["lora_stacked." + key.rsplit(".", 1)[0]]
    return ref[f"live_fp32.{key}"]


# ---------------------------------------------------------------------------------------------- runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Factory runs by name, made on first use (each is a few seconds of real gloo training)."""
    made = {}

    def get(name: str):
        if name not in made:
            root = tmp_path_factory.mktemp("head") / name
            if name == "X5":
                assert main([str(root), *X5_ARGS]) == 0
                spec = HeadSpec.from_dict(json.loads((root / "run_info.json").read_text())["spec"])
                made[name] = (spec, head_paths(root, spec))
            else:
                spec = PRESETS[name]() if name in PRESETS else OTHER_SPECS[name]
                made[name] = (spec, make_head_run(root, spec))
        return made[name]

    return get


# ---------------------------------------------------------------------------------------------- fast tests


def test_spec_rejects_impossible_runs_naming_every_problem():
    with pytest.raises(ValueError) as e:
        HeadSpec.f_moe(world_size=3, num_experts=8, scheduler="linear", warmup_steps=1, decay_steps=1)
    msg = str(e.value)
    assert "num_experts=8 must be a multiple of ep=3" in msg and "decay_steps=1 crashes" in msg
    with pytest.raises(ValueError, match="expert parallelism needs arch='moe'"):
        HeadSpec(ep=2)
    with pytest.raises(ValueError, match="match no module of a dense model"):
        HeadSpec(targets=("experts",))
    with pytest.raises(ValueError, match="unknown HeadSpec fields"):
        HeadSpec.from_dict({"arch": "dense", "num_slots": 2})


def test_spec_round_trips_and_resolves_ep_like_prime_rl():
    spec = HeadSpec.f_moe(world_size=4, num_experts=8)
    assert HeadSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert (spec.resolved_ep, spec.dp_shard_mod_ep) == (4, 1)  # auto: min(world, 8)
    assert HeadSpec.f_moe(world_size=4, ep=2).dp_shard_mod_ep == 2
    assert HeadSpec().resolved_ep == 1
    assert HeadSpec(lora_rank=3, lora_alpha=10.0).scale == 3.328125  # bf16(10/3), not 3.333...


def test_modules_to_save_follow_prime_rls_whole_component_freeze_rule():
    from tests.factory.head_files import saved_module_suffixes
    from tests.factory.head_spec import keep_trainable

    names = ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
             "model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.q_proj.base_layer.weight",
             "model.layers.0.self_attn.q_proj.lora_A.0", "model.norm.weight", "lm_head.weight"]
    kept = [n for n in names if keep_trainable(n, ["lm_head", "norm"])]
    assert kept == ["model.norm.weight", "lm_head.weight"]  # not q_norm, not input_layernorm
    assert [n for n in names if keep_trainable(n, [r"layers\.0\..*norm"])] == names[1:3]  # a regex searches
    assert saved_module_suffixes(kept + ["x.lora_A.0"]) == ["lm_head", "norm"]  # save_lora_config's list
    assert saved_module_suffixes(["x.lora_A.0"]) is None
    with pytest.raises(ValueError, match="modules_to_save is a LoRA setting"):
        HeadSpec.g_fullft(modules_to_save=("norm",))
    spec = HeadSpec.e_mts()
    assert HeadSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert spec.modules_to_save == ("lm_head", "norm") and not spec.tie_word_embeddings


@pytest.mark.parametrize("name", ["E", "F", "G"])
def test_checkpoint_and_broadcast_steps_are_the_genuine_runs(name):
    paths = head_paths(GENUINE_DIRS[name], PRESETS[name]())
    on_disk = {p.parent for p in (GENUINE_DIRS[name] / "outputs" / "checkpoints").glob("step_*/trainer/.metadata")}
    assert set(paths.checkpoints.values()) == on_disk
    assert set(paths.broadcasts.values()) == set((GENUINE_DIRS[name] / "outputs" / "broadcasts").glob("step_*"))


def test_scheduler_kinds_follow_prime_rl_heads_rules():
    from torch.optim.lr_scheduler import ConstantLR, CosineAnnealingLR, LinearLR, SequentialLR

    from tests.factory.head_train import build_scheduler

    def build(**kw):
        return build_scheduler(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.01),
                               HeadSpec(ckpt_interval=None, **kw))

    def parts(s):
        return [(type(x).__name__, x.start_factor, x.end_factor, x.total_iters) if isinstance(x, LinearLR)
                else (type(x).__name__, x.T_max, x.eta_min) for x in s._schedulers]

    assert type(build(scheduler="constant")) is ConstantLR
    warmup = build(scheduler="linear", warmup_steps=2)
    assert (type(warmup), warmup.start_factor, warmup.total_iters) == (LinearLR, 1e-8, 2)
    wsd = build(scheduler="linear", warmup_steps=2, decay_steps=3, max_steps=8)
    assert type(wsd) is SequentialLR and wsd._milestones == [2, 5]
    assert parts(wsd) == [("LinearLR", 1e-8, 1.0, 2), ("LinearLR", 1.0, 1.0, 3), ("LinearLR", 1.0, 1e-8, 2)]
    assert type(build(scheduler="cosine", warmup_steps=0, max_steps=4)) is CosineAnnealingLR
    cosine = build(scheduler="cosine", warmup_steps=1, min_lr=0.001, max_steps=4)
    assert parts(cosine) == [("LinearLR", 0.1, 1.0, 1), ("CosineAnnealingLR", 3, 0.001)]


def test_cli_reports_a_bad_spec_as_a_usage_error_and_a_used_dir_as_an_error(tmp_path, capsys):
    assert main([str(tmp_path / "x"), "--kind", "moe", "--world-size", "3", "--experts", "8"]) == 2
    assert "num_experts=8 must be a multiple of ep=3" in capsys.readouterr().err
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "f").write_text("x")
    assert main([str(tmp_path / "used")]) == 1
    assert "is not empty" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- genuine shapes


@pytest.mark.parametrize("name", ["E", "F", "G"])
def test_metadata_equals_the_genuine_checkpoint_key_chunk_and_rank_file(runs, name):
    spec, paths = runs(name)
    for step, ckpt in paths.checkpoints.items():
        genuine = GENUINE_DIRS[name] / "outputs" / "checkpoints" / f"step_{step}" / "trainer"
        ours, theirs = layout(ckpt), layout(genuine)
        assert sorted(ours["keys"]) == sorted(theirs["keys"])
        assert ours["keys"] == theirs["keys"]  # dtype, shape, chunk offsets and sizes, byte items
        assert ours["files"] == theirs["files"]  # which rank's __<r>_0.distcp holds each chunk and item


@pytest.mark.parametrize("name", ["E", "F", "G"])
def test_byte_items_hold_the_genuine_values(runs, name, tmp_path):
    spec, paths = runs(name)
    for step, ckpt in paths.checkpoints.items():
        genuine = GENUINE_DIRS[name] / "outputs" / "checkpoints" / f"step_{step}" / "trainer"
        ours, theirs = load_dcp(ckpt, tmp_path / "ours"), load_dcp(genuine, tmp_path / "theirs")
        assert ours["optimizers"]["param_groups"] == theirs["optimizers"]["param_groups"]  # fused False, FQN params
        assert ours["scheduler"] == theirs["scheduler"]
        assert ours["progress"] == theirs["progress"]  # the interval checkpoint's lag included


@pytest.mark.parametrize("name", ["E", "F", "G"])
def test_run_files_are_the_genuine_runs_files(runs, name):
    spec, paths = runs(name)
    genuine = GENUINE_DIRS[name]
    expected = {f for f in run_tree(genuine) if f not in GENERATOR_ONLY and not f.startswith("resume_checks/")}
    assert run_tree(paths.root) == expected
    assert paths.trainer_config.read_bytes() == (genuine / "configs" / "trainer.json").read_bytes()
    for rel in ["base_model/model.safetensors", "reference.safetensors", "expected_merged_hf/model.safetensors",
                "expected_trained_hf/model.safetensors", "conversion/prime/model.safetensors"]:
        if (genuine / rel).exists():
            assert tensors_of(paths.root / rel) == tensors_of(genuine / rel), rel
    for step, d in paths.broadcasts.items():
        g = genuine / "outputs" / "broadcasts" / f"step_{step}"
        for f in sorted(g.iterdir()):
            if f.suffix == ".safetensors":
                assert tensors_of(d / f.name) == tensors_of(f), f
            elif f.suffix == ".json":
                assert (d / f.name).read_text() == f.read_text(), f


def test_expert_dtensors_have_the_genuine_mesh_and_placements(runs):
    _, paths = runs("F")
    ours = json.loads(paths.run_info.read_text())["dtensor_layout_sample"]
    theirs = json.loads((GENUINE_DIRS["F"] / "run_info.json").read_text())["dtensor_layout_sample"]
    shared = sorted(set(ours) & set(theirs))
    assert any(".mlp.experts.w1" in k for k in shared) and any("q_proj.lora_A" in k for k in shared)
    for k in shared:
        assert {f: ours[k][f] for f in ("global", "local", "mesh", "placements")} == \
            {f: theirs[k][f] for f in ("global", "local", "mesh", "placements")}, k
    assert ours["model.layers.0.mlp.experts.w1"]["placements"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"


# ---------------------------------------------------------------------------------------------- every run


ALL_RUNS = ["E", "F", "G", "X3", "X4", "X5"]


@pytest.mark.parametrize("name", ALL_RUNS)
def test_torch_dcp_load_of_the_final_checkpoint_equals_the_ground_truth(runs, name, tmp_path):
    spec, paths = runs(name)
    app = load_dcp(paths.checkpoint, tmp_path)
    ref = load_file(str(paths.reference))
    checked = set()
    for key, value in app["model"].items():
        truth = model_truth(ref, key)
        assert value.dtype == torch.float32 and torch.equal(value, truth), key
        checked.add(key)
    for fqn, state in app["optimizers"]["state"].items():
        for field, value in state.items():
            assert torch.equal(value, ref[f"optim.{fqn}.{field}"]), (fqn, field)
    trainable = app["optimizers"]["param_groups"][0]["params"]
    assert sorted(app["optimizers"]["state"]) == sorted(trainable)
    if spec.lora:  # prime-rl's optimizer order: per module A before B; experts w1, w2, w3
        order = []
        for m in spec.lora_modules():
            names = [f"{w}_lora_{ab}" for w in ("w1", "w2", "w3") for ab in "AB"] if m.endswith(".experts") \
                else ["lora_A", "lora_B"]
            order += [f"{m}.{n}.0" for n in names]
        assert trainable == order
    else:
        assert set(trainable) == set(app["model"]) - ({"lm_head.weight"} if spec.tie_word_embeddings else set())
    run_info = json.loads(paths.run_info.read_text())
    assert app["progress"] == run_info["progress_at_final_save"] == {
        "step": spec.max_steps, "total_tokens": spec.max_steps * spec.tokens_per_step(),
        "total_samples": spec.max_steps * spec.micro_batches}
    assert run_info["groundtruth_checks"].get("frozen_base_equals_bf16_upcast", True) is True


@pytest.mark.parametrize("name", ["E", "X3", "X5"])
def test_interval_checkpoints_lag_one_step_of_progress(runs, name, tmp_path):
    spec, paths = runs(name)
    interval_steps = [s for s in paths.checkpoints if s != spec.max_steps]
    assert interval_steps, "these specs write interval checkpoints"
    for step in interval_steps:
        app = load_dcp(paths.checkpoints[step], tmp_path)
        assert app["progress"] == {"step": step, "total_tokens": (step - 1) * spec.tokens_per_step(),
                                   "total_samples": (step - 1) * spec.micro_batches}


@pytest.mark.parametrize("name", ALL_RUNS)
def test_the_final_broadcast_is_the_trained_state(runs, name):
    spec, paths = runs(name)
    ref = load_file(str(paths.reference))
    exported = hf_dir_tensors(paths.broadcast)
    if spec.lora:
        assert set(exported) == {k[len("adapter_export."):] for k in ref if k.startswith("adapter_export.")}
        for module in spec.lora_modules():
            if module.endswith(".experts"):
                for e in range(spec.num_experts):
                    for proj in ("gate_proj", "up_proj", "down_proj"):
                        for ab in "AB":
                            assert torch.equal(exported[f"{module}.{e}.{proj}.lora_{ab}.weight"],
                                               ref[f"lora.{module}.{e}.{proj}.{ab}"])
            else:
                for ab in "AB":
                    assert torch.equal(exported[f"{module}.lora_{ab}.weight"], ref[f"lora.{module}.{ab}"])
        config = json.loads((paths.broadcast / "adapter_config.json").read_text())
        assert (config["r"], config["lora_alpha"]) == (spec.lora_rank, spec.lora_alpha)
    else:
        trained = {k[len("trained_bf16."):]: v for k, v in ref.items() if k.startswith("trained_bf16.")}
        assert set(exported) == set(trained) and all(torch.equal(exported[k], trained[k]) for k in trained)


@pytest.mark.parametrize("name", ["F", "X4"])
def test_the_expected_hf_dir_loads_in_transformers_with_hf_expert_names(runs, name):
    from transformers import AutoModelForCausalLM

    spec, paths = runs(name)
    ref = load_file(str(paths.reference))
    model = AutoModelForCausalLM.from_pretrained(str(paths.expected_hf), dtype=torch.bfloat16)
    prefix = "merged_bf16." if spec.lora else "trained_bf16."
    inter = spec.moe_intermediate_size
    for layer in range(spec.num_layers):
        experts = model.model.layers[layer].mlp.experts
        for e in range(spec.num_experts):
            p = f"model.layers.{layer}.mlp.experts.{e}"
            assert torch.equal(experts.gate_up_proj[e, :inter], ref[f"{prefix}{p}.gate_proj.weight"])
            assert torch.equal(experts.gate_up_proj[e, inter:], ref[f"{prefix}{p}.up_proj.weight"])
            assert torch.equal(experts.down_proj[e], ref[f"{prefix}{p}.down_proj.weight"])
        gate = ref.get(f"{prefix}model.layers.{layer}.mlp.gate.weight")
        if gate is None:  # a LoRA run does not train the router: the merged model keeps the base's
            gate = load_file(str(paths.base_model / "model.safetensors"))[f"model.layers.{layer}.mlp.gate.weight"]
        assert torch.equal(model.model.layers[layer].mlp.gate.weight, gate)


def test_lora_runs_train_only_the_adapter_and_full_ft_trains_everything(runs):
    for name in ["F", "G"]:
        spec, paths = runs(name)
        ref = load_file(str(paths.reference))
        base = hf_dir_tensors(paths.base_model)
        live = {k[len("live_fp32."):]: v for k, v in ref.items() if k.startswith("live_fp32.")}
        if spec.lora:  # frozen fp32 masters are exactly the bf16 base upcast; every expert's LoRA moved
            assert torch.equal(live["model.layers.0.self_attn.q_proj.weight"], base["model.layers.0.self_attn.q_proj.weight"].float())
            stacked = live["model.layers.1.mlp.experts.w2"]
            for e in range(spec.num_experts):
                assert torch.equal(stacked[e], base[f"model.layers.1.mlp.experts.{e}.down_proj.weight"].float())
                assert ref[f"lora.model.layers.1.mlp.experts.{e}.down_proj.B"].abs().sum() > 0
        else:
            changed = [k for k, v in live.items() if not torch.equal(v, base[k].float())]
            assert sorted(changed) == sorted(live)


# ---------------------------------------------------------------------------------------------- other shapes


def test_without_ep_experts_are_fsdp_rows_over_three_ranks_uneven(runs):
    spec, paths = runs("X3")
    keys = layout(paths.checkpoint)["keys"]
    experts = keys["app.model.model.layers.0.mlp.experts.w1_lora_A.0"]
    assert experts == ("torch.float32", (8, 4, 64), [((0, 0, 0), (3, 4, 64)), ((3, 0, 0), (3, 4, 64)),
                                                     ((6, 0, 0), (2, 4, 64))])
    assert keys["app.model.model.embed_tokens.weight"][2] == [((0, 0), (334, 64)), ((334, 0), (334, 64)),
                                                              ((668, 0), (332, 64))]
    assert "app.model.lm_head.weight" in keys  # tied: DCP keeps both names of the one parameter
    assert not any("k_proj.lora" in k or "o_proj.lora" in k for k in keys)  # targets q, v, experts only


def test_with_ep_2_of_4_ranks_each_rank_holds_its_slice_of_its_ep_block(runs):
    spec, paths = runs("X4")
    lay = layout(paths.checkpoint)
    experts, per_rank = spec.num_experts, spec.num_experts // spec.world_size
    for rank in range(spec.world_size):
        dp, ep = divmod(rank, spec.resolved_ep)  # mesh (dp_shard_mod_ep, ep), row-major
        first = ep * (experts // spec.resolved_ep) + dp * per_rank
        for key in ["app.model.model.layers.0.mlp.experts.w1", "app.optimizers.state.model.layers.1.mlp.experts.w2.exp_avg"]:
            assert lay["files"][(key, (first, 0, 0))] == f"__{rank}_0.distcp"
    run_info = json.loads(paths.run_info.read_text())
    w1 = run_info["dtensor_layout_sample"]["model.layers.0.mlp.experts.w1"]
    assert w1["mesh"].startswith("DeviceMesh((dp_shard_mod_ep=2, ep=2)") and w1["local"] == [2, 32, 64]
    assert run_info["param_groups"][0]["params"][-1] == "lm_head.weight"  # full FT: every parameter trains
