"""The genuine prime-rl HEAD checkpoints (E dense LoRA world 4, F MoE expert LoRA world 2 with EP=2,
G full fine-tune): every command against their ground truth, with `torch.equal`, and the run's own
configs giving alpha (no --alpha anywhere)."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from ckpt_tools.cli import main

from .conftest import HEAD_FIXTURES

E, F, G = (HEAD_FIXTURES / n for n in ("E_head_dense", "F_head_moe", "G_head_fullft"))
PEFT_PREFIX = "base_model.model."


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def trainer(variant, step=3):
    return variant / "outputs" / "checkpoints" / f"step_{step}" / "trainer"


def assert_same_tensors(out_file, expected_file):
    ours, expected = load_file(out_file), load_file(expected_file)
    assert sorted(ours) == sorted(expected)
    for k, v in expected.items():
        assert ours[k].dtype == v.dtype and torch.equal(ours[k], v), k


def inspect_json(path):
    r = run("inspect", path, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)["result"]       # the JSON envelope's result


def test_inspect_counts_the_moe_experts_world_size_and_states_the_head_rule():
    r = inspect_json(trainer(F))
    assert r["world_size"] == 2 and r["generation"] == "head"
    assert r["experts"] == {"layers": 2, "experts": 4, "expert_blocks": 2, "lora_expert_modules": 24}
    assert r["ep"] == "auto"                       # the run config's setting
    assert r["lora"]["modules"] == 8 + 24 and r["lora"]["targets"] == ["experts", "k_proj", "o_proj", "q_proj",
                                                                       "v_proj"]
    assert r["alpha"]["alpha"] == 32.0 and r["alpha"]["training_scale"] == 4.0
    assert "trainer model.lora.alpha" in r["alpha"]["rule"] and "bf16" in r["alpha"]["rule"]
    assert str(F / "configs" / "trainer.json") in r["alpha"]["source"]
    assert r["other_keys"] == [] and r["optimizer"].startswith("CPUOffloadOptimizer")


def test_inspect_of_the_full_finetune_and_of_an_interval_checkpoint():
    g = inspect_json(trainer(G))
    assert g["training"] == "full fine-tune" and g["lora"]["modules"] == 0 and g["world_size"] == 2
    e2 = inspect_json(trainer(E, 2))
    assert e2["world_size"] == 4 and e2["progress"]["total_tokens"] == 256   # step 1's totals only
    assert "interval checkpoint" in e2["interval_checkpoint"]
    assert inspect_json(trainer(E))["interval_checkpoint"] is None


def test_inspect_of_a_16e747c_checkpoint_states_the_orchestrator_rule():
    from .conftest import TRAINER
    r = inspect_json(TRAINER)
    assert r["generation"] == "16e747c" and "orchestrator" in r["alpha"]["rule"]


@pytest.mark.parametrize("variant", [E, F], ids=["dense", "moe"])
def test_extract_adapter_equals_prime_rls_own_final_broadcast(tmp_path, variant):
    out = tmp_path / "adapter"
    r = run("extract-adapter", trainer(variant), out, "--base", variant / "base_model", "--layout", "prime-rl")
    assert r.exit_code == 0, r.output
    ours = {k.removeprefix(PEFT_PREFIX): v for k, v in load_file(out / "adapter_model.safetensors").items()}
    theirs = load_file(variant / "outputs" / "broadcasts" / "step_3" / "adapter_model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for k, v in theirs.items():
        assert ours[k].dtype == v.dtype and torch.equal(ours[k], v), k
    cfg = json.loads((out / "adapter_config.json").read_text())
    bc = json.loads((variant / "outputs" / "broadcasts" / "step_3" / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["target_modules"]) == (bc["r"], bc["lora_alpha"], bc["target_modules"])


def test_the_moe_adapter_holds_every_expert_of_every_projection(tmp_path):
    out = tmp_path / "adapter"
    assert run("extract-adapter", trainer(F), out, "--layout", "vllm").exit_code == 0
    keys = set(load_file(out / "adapter_model.safetensors"))
    for layer in (0, 1):
        for e in range(4):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                for ab in "AB":
                    assert f"{PEFT_PREFIX}model.layers.{layer}.mlp.experts.{e}.{proj}.lora_{ab}.weight" in keys
    ref = load_file(F / "reference.safetensors")
    got = load_file(out / "adapter_model.safetensors")
    # w1 = gate, w3 = up, w2 = down: expert e's slice of the stacked live factor
    for w, proj in (("w1", "gate_proj"), ("w2", "down_proj"), ("w3", "up_proj")):
        stacked = ref[f"lora_stacked.model.layers.1.mlp.experts.{w}_lora_B"]
        assert torch.equal(got[f"{PEFT_PREFIX}model.layers.1.mlp.experts.3.{proj}.lora_B.weight"], stacked[3])


@pytest.mark.parametrize("variant", [E, F], ids=["dense", "moe"])
@pytest.mark.parametrize("how", ["hf-base", "base-from-checkpoint"])
def test_merge_equals_the_expected_merged_model(tmp_path, variant, how):
    out = tmp_path / "merged"
    if how == "hf-base":
        r = run("merge", variant / "base_model", trainer(variant), out)
    else:
        r = run("merge", "--base-from-checkpoint", trainer(variant), out, "--config-from", variant / "base_model")
    assert r.exit_code == 0, r.output
    assert_same_tensors(out / "model.safetensors", variant / "expected_merged_hf" / "model.safetensors")


def test_run_config_takes_the_head_json(tmp_path):
    import shutil
    ck = tmp_path / "ckpt"
    shutil.copytree(trainer(E), ck)          # outside the run: no config is found by itself
    assert run("extract-adapter", ck, tmp_path / "a").exit_code != 0
    r = run("extract-adapter", ck, tmp_path / "b", "--run-config", E / "configs" / "trainer.json", "--json")
    assert r.exit_code == 0, r.output
    env = json.loads(r.stdout)
    rep = env["result"] if "alpha" in (env.get("result") or {}) else env["plan"]
    assert rep["alpha"] == 16.0 and "trainer.json" in rep["alpha_source"]


def test_a_key_the_key_model_does_not_know_is_an_error_naming_it(tmp_path):
    import torch.distributed.checkpoint as dcp
    ck = tmp_path / "outputs" / "checkpoints" / "step_1" / "trainer"
    sd = {"app": {"model": {"model.layers.0.mlp.experts.w4": torch.zeros(2, 3, 4),
                            "model.layers.0.self_attn.q_proj.lora_A.0": torch.ones(2, 4),
                            "model.layers.0.self_attn.q_proj.lora_B.0": torch.ones(4, 2),
                            "model.layers.0.self_attn.q_proj.weight": torch.ones(4, 4)}}}
    dcp.save(sd, checkpoint_id=str(ck), no_dist=True)
    for args in (("extract-adapter", ck, tmp_path / "x", "--alpha", "16"),
                 ("merge", "--base-from-checkpoint", ck, tmp_path / "y", "--alpha", "16", "--config-from", E / "base_model"),
                 ("slim", ck, tmp_path / "z")):
        r = run(*args)
        assert r.exit_code != 0 and "app.model.model.layers.0.mlp.experts.w4" in r.output, (args, r.output)
        assert "key model" in r.output
    assert inspect_json(ck)["other_keys"] == ["app.model.model.layers.0.mlp.experts.w4"]
    r = run("verify", ck)                       # a valid DCP: verify warns, names it
    assert "app.model.model.layers.0.mlp.experts.w4" in r.output and "key model" in r.output


def test_export_of_the_full_finetune_equals_the_trained_model_and_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM
    out = tmp_path / "exported"
    r = run("export", trainer(G), out, "--config-from", G / "base_model")
    assert r.exit_code == 0, r.output
    assert_same_tensors(out / "model.safetensors", G / "expected_trained_hf" / "model.safetensors")
    expected = load_file(G / "expected_trained_hf" / "model.safetensors")
    assert all(v.dtype == torch.bfloat16 for v in expected.values())
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    sd = model.state_dict()
    for k, v in expected.items():
        assert torch.equal(sd[k], v), k


def test_export_of_a_lora_run_is_the_merge_from_its_own_masters(tmp_path):
    out = tmp_path / "exported"
    r = run("export", trainer(F), out, "--config-from", F / "base_model", "--json")
    assert r.exit_code == 0, r.output
    assert_same_tensors(out / "model.safetensors", F / "expected_merged_hf" / "model.safetensors")


def test_export_dry_run_is_merges_plan(tmp_path):
    r = run("export", trainer(G), tmp_path / "o", "--config-from", G / "base_model", "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)["plan"]          # the envelope's plan
    assert plan["adapter_kind"] == "none" and {j["action"] for j in plan["jobs"]} == {"cast"}
    assert not (tmp_path / "o").exists()


def _loaded(ckpt_dir, tmp_path, name):
    """Everything torch's own DCP loader reads from a checkpoint, flattened."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(str(ckpt_dir), str(tmp_path / f"{name}.pt"))
    flat = {}

    def walk(d, prefix):
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            else:
                flat[f"{prefix}{k}"] = v
    walk(torch.load(tmp_path / f"{name}.pt", weights_only=False), "")
    return flat


@pytest.mark.parametrize("variant", [E, F], ids=["dense", "moe"])
def test_slim_then_rehydrate_is_bit_exact(tmp_path, variant):
    slim, back = tmp_path / "slim", tmp_path / "back"
    r = run("slim", trainer(variant), slim, "--base", variant / "base_model")
    assert r.exit_code == 0, r.output
    r = run("rehydrate", slim, back, "--base", variant / "base_model")
    assert r.exit_code == 0, r.output
    a, b = _loaded(trainer(variant), tmp_path, "a"), _loaded(back, tmp_path, "b")
    assert sorted(a) == sorted(b)
    for k, v in a.items():
        assert (torch.equal(v, b[k]) and v.dtype == b[k].dtype) if torch.is_tensor(v) else v == b[k], k
    assert run("verify", back).exit_code == 0


def test_slim_of_the_moe_drops_the_stacked_experts_and_keeps_every_trained_tensor(tmp_path):
    r = run("slim", trainer(F), tmp_path / "slim", "--json")
    assert r.exit_code == 0, r.output
    manifest = json.loads((tmp_path / "slim" / "slim_manifest.json").read_text()) \
        if (tmp_path / "slim" / "slim_manifest.json").exists() else None
    kept = inspect_json(tmp_path / "slim")
    assert kept["groups"]["base"]["count"] == 0 and kept["groups"]["lora"]["count"] == 28
    if manifest is not None:
        assert "model.layers.0.mlp.experts.*.gate_proj.weight" in {d["hf_name"] for d in manifest["dropped"]}


def test_a_full_finetune_has_nothing_to_slim_and_inspect_counts_no_frozen_bytes(tmp_path):
    # every base weight has optimizer state: nothing is recoverable from the public base
    r = run("slim", trainer(G), tmp_path / "slim")
    assert r.exit_code == 2 and "no frozen base weights to drop" in r.output
    assert not (tmp_path / "slim").exists()
    assert inspect_json(trainer(G))["frozen_bytes"] == 0


@pytest.mark.parametrize("variant", [E, F, G], ids=["dense", "moe", "fullft"])
def test_set_lr_on_head_checkpoints_warns_that_the_offloaded_resume_ignores_param_group_lr(tmp_path, variant):
    r = run("set-lr", trainer(variant), tmp_path / "o", "--scale", "0.5")
    assert r.exit_code == 0, r.output
    assert "fused=False" in r.output and "optim_cpu_offload" in r.output
    assert run("verify", tmp_path / "o").exit_code == 0
    a = inspect_json(trainer(variant))
    b = inspect_json(tmp_path / "o")
    assert b["initial_lr"] == a["initial_lr"] * 0.5


def test_diff_vs_base_with_the_moe_adapter_checks_every_expert_weight(tmp_path):
    out = tmp_path / "merged"
    assert run("merge", F / "base_model", trainer(F), out).exit_code == 0
    r = run("diff-vs-base", out, F / "base_model", "--adapter", trainer(F), "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    text = json.dumps(rep)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in text
    assert "32/32" in r.output or rep.get("adapter_check", {}).get("targeted", 32) == 32


def test_the_extracted_moe_adapter_verifies_and_merges_like_the_checkpoint(tmp_path):
    ad, out = tmp_path / "adapter", tmp_path / "merged"
    assert run("extract-adapter", trainer(F), ad, "--base", F / "base_model").exit_code == 0
    r = run("verify", ad, "--base", F / "base_model")
    assert r.exit_code == 0 and "matches no module" not in r.output, r.output
    assert run("merge", F / "base_model", ad, out).exit_code == 0
    assert_same_tensors(out / "model.safetensors", F / "expected_merged_hf" / "model.safetensors")


def test_adapter_to_dcp_of_the_moe_adapter_rebuilds_prime_rls_own_layout(tmp_path):
    from ckpt_tools.formats.dcp.reader import DcpCheckpoint
    ad, out = tmp_path / "adapter", tmp_path / "outputs" / "checkpoints" / "step_3" / "trainer"
    assert run("extract-adapter", trainer(F), ad, "--base", F / "base_model").exit_code == 0
    r = run("adapter-to-dcp", ad, out, "--base", F / "base_model", "--world-size", "2", "--lr", "0.01", "--step", "3")
    assert r.exit_code == 0, r.output
    genuine, ours = DcpCheckpoint.open(trainer(F)), DcpCheckpoint.open(out)

    def layout(ck):
        return {k: (e.shape, e.dtype, [(c.offsets, c.sizes) for c in e.chunks]) for k, e in ck.entries.items()
                if hasattr(e, "chunks")}
    assert layout(ours) == layout(genuine)          # stacked experts, router, expert blocks by expert index
    for k in layout(genuine):
        if k.startswith("app.model."):
            assert torch.equal(ours.read_tensor(k), genuine.read_tensor(k)), k
    p = "app.optimizers.param_groups.0.params"
    assert ours.read_object(p) == genuine.read_object(p)


def test_export_takes_config_and_tokenizer_from_the_runs_base_model_by_default(tmp_path):
    import shutil
    r = run("export", trainer(G), tmp_path / "o")
    assert r.exit_code == 0, r.output
    assert_same_tensors(tmp_path / "o" / "model.safetensors", G / "expected_trained_hf" / "model.safetensors")
    assert (tmp_path / "o" / "tokenizer.json").read_bytes() == (G / "base_model" / "tokenizer.json").read_bytes()
    lonely = tmp_path / "ckpt"
    shutil.copytree(trainer(G), lonely)
    r = run("export", lonely, tmp_path / "p")
    assert r.exit_code == 2 and "--config-from" in r.output and not (tmp_path / "p").exists()


@pytest.mark.parametrize("variant", [F, G], ids=["moe-lora", "fullft"])
def test_export_under_torchrun_writes_the_same_bytes_as_one_process(tmp_path, variant):
    from .test_dist import digest, solo, torchrun
    one, two = tmp_path / "one", tmp_path / "two"
    args = ("export", trainer(variant), "{out}", "--max-shard-size", "100KB")
    assert solo(*[one if a == "{out}" else a for a in args]).returncode == 0
    r = torchrun(*[two if a == "{out}" else a for a in args])
    assert r.returncode == 0, r.stderr
    assert len([n for n in digest(two) if n.endswith(".safetensors")]) > 2 and digest(two) == digest(one)
