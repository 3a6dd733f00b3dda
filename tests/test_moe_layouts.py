"""`extract-adapter --layout peft|vllm|prime-rl` on the genuine prime-rl HEAD MoE checkpoint (F_head_moe), loaded
where users take it: the pinned PEFT with transformers 5 (fused experts, `target_parameters`), and stock vLLM's
loader rules (per-expert modules; the CPU vLLM itself: tests/test_vllm_cpu.py). Truth is the fixture's own
`reference.safetensors` (`lora.*` factors, `delta_fp32.*` = scale * B @ A) and `expected_merged_hf`."""
from __future__ import annotations

import hashlib
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from .test_head_fixtures import E, F, PEFT_PREFIX, assert_same_tensors, run, trainer

LAYOUTS = ("peft", "vllm", "prime-rl")
IDS = torch.arange(3, 3 + 24).reshape(2, 12)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """The MoE checkpoint extracted in every layout (and the default), once."""
    root = tmp_path_factory.mktemp("moe_layouts")
    out = {}
    for layout in LAYOUTS + ("default",):
        d = root / layout
        args = ["--layout", layout] if layout != "default" else []
        r = run("extract-adapter", trainer(F), d, "--base", F / "base_model", *args)
        assert r.exit_code == 0, r.output
        out[layout] = d
    return out


@pytest.fixture(scope="module")
def ref():
    return load_file(F / "reference.safetensors")


def _model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _peft(adapter):
    from peft import PeftModel
    return PeftModel.from_pretrained(_model(F / "base_model"), str(adapter)).eval()


@pytest.fixture(scope="module")
def truth_logits(ref):
    """Logits of the base with every delta_fp32 (scale * B @ A, fp32) added in fp32: the exact merged model."""
    m = _model(F / "base_model")
    sd = m.state_dict()
    with torch.no_grad():
        for name, delta in ((k[len("delta_fp32."):], v) for k, v in ref.items() if k.startswith("delta_fp32.")):
            ex = re.fullmatch(r"(.+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", name)
            if ex is None:
                sd[name] += delta
                continue
            experts, e, proj = ex[1], int(ex[2]), ex[3]
            if proj == "down":
                sd[f"{experts}.down_proj"][e] += delta
            else:
                rows = delta.shape[0]
                half = slice(0, rows) if proj == "gate" else slice(rows, 2 * rows)
                sd[f"{experts}.gate_up_proj"][e, half] += delta
    return _logits(m)


@pytest.fixture(scope="module")
def base_logits():
    return _logits(_model(F / "base_model"))


@pytest.fixture(scope="module")
def merged_logits():
    return _logits(_model(F / "expected_merged_hf"))


# ------------------------------------------------------------------------------------------ the default
def test_the_default_layout_is_peft_and_dense_runs_are_one_file_in_every_layout(adapters, tmp_path):
    digest = {k: hashlib.sha256((d / "adapter_model.safetensors").read_bytes()).hexdigest() for k, d in adapters.items()}
    assert digest["default"] == digest["peft"] != digest["vllm"] == digest["prime-rl"]
    dense = set()
    for layout in LAYOUTS:
        d = tmp_path / layout
        assert run("extract-adapter", trainer(E), d, "--base", E / "base_model", "--layout", layout).exit_code == 0
        dense.add(tuple(hashlib.sha256((d / f).read_bytes()).hexdigest()
                        for f in ("adapter_model.safetensors", "adapter_config.json")))
    assert len(dense) == 1


def test_prime_rl_and_vllm_layouts_are_prime_rls_own_broadcast(adapters):
    theirs = load_file(F / "outputs" / "broadcasts" / "step_3" / "adapter_model.safetensors")
    for layout in ("vllm", "prime-rl"):
        ours = {k.removeprefix(PEFT_PREFIX): v for k, v in load_file(adapters[layout] / "adapter_model.safetensors").items()}
        assert sorted(ours) == sorted(theirs)
        assert all(torch.equal(ours[k], v) for k, v in theirs.items())


# ------------------------------------------------------------------------------------------ PEFT layout
def test_peft_layout_config_targets_the_fused_experts_at_the_training_scale(adapters):
    cfg = json.loads((adapters["peft"] / "adapter_config.json").read_text())
    assert cfg["target_parameters"] == ["experts.down_proj", "experts.gate_up_proj"]
    assert "experts" not in cfg["target_modules"]
    assert cfg["r"] == 8 and cfg["lora_alpha"] / cfg["r"] == 4.0
    assert cfg["rank_pattern"] == {"experts.gate_up_proj": 16}
    assert cfg["alpha_pattern"]["experts.gate_up_proj"] / 16 == 4.0
    keys = load_file(adapters["peft"] / "adapter_model.safetensors")
    assert tuple(keys[f"{PEFT_PREFIX}model.layers.0.mlp.experts.base_layer.lora_A.weight"].shape) == (16 * 4, 64)
    assert tuple(keys[f"{PEFT_PREFIX}model.layers.0.mlp.experts.base_layer.lora_B.weight"].shape) == (64, 16 * 4)
    assert tuple(keys[f"{PEFT_PREFIX}model.layers.0.mlp.experts.lora_A.weight"].shape) == (8 * 4, 32)
    assert tuple(keys[f"{PEFT_PREFIX}model.layers.0.mlp.experts.lora_B.weight"].shape) == (64, 8 * 4)


def test_the_delta_peft_applies_is_scale_b_a_of_every_expert_and_projection(adapters, ref):
    from peft.tuners.lora.layer import ParamWrapper
    model = _peft(adapters["peft"])
    wrappers = {}
    for name, mod in model.named_modules():
        if isinstance(mod, ParamWrapper):
            experts = name.removeprefix("base_model.model.").replace(".base_layer", "")
            wrappers[f"{experts}.{mod.parameter_name}"] = mod
    assert sorted(wrappers) == sorted(f"model.layers.{i}.mlp.experts.{p}" for i in (0, 1)
                                      for p in ("gate_up_proj", "down_proj"))
    for name, w in wrappers.items():
        assert w.scaling["default"] == 4.0
        got = w.get_delta_weight("default")                    # [E, out, in], PEFT's own math
        experts, param = name.rsplit(".", 1)
        for e in range(4):
            projs = ("gate", "up") if param == "gate_up_proj" else ("down",)
            want = torch.cat([ref[f"delta_fp32.{experts}.{e}.{p}_proj.weight"] for p in projs])
            # plain torch from the checkpoint's own factors, one rounding of the product
            a = torch.cat([ref[f"lora.{experts}.{e}.{p}_proj.A"] for p in projs])
            plain = torch.cat([4.0 * (ref[f"lora.{experts}.{e}.{p}_proj.B"] @ ref[f"lora.{experts}.{e}.{p}_proj.A"])
                               for p in projs])
            assert a.shape[0] == 8 * len(projs)
            torch.testing.assert_close(got[e], plain, rtol=1e-6, atol=1e-9)
            assert torch.equal(got[e], want), (name, e)   # bit-exact: the zero blocks add exact zeros


def test_peft_loads_the_peft_layout_and_its_logits_are_the_merged_models(adapters, truth_logits, base_logits,
                                                                         merged_logits):
    got = _logits(_peft(adapters["default"]))   # PEFT warns that rank/alpha_pattern match no target *module*: they
    #                                              match the target parameters, which the delta test proves
    torch.testing.assert_close(got, truth_logits, rtol=1e-5, atol=1e-5)     # the exact fp32 merge
    moved = (base_logits - truth_logits).abs().max()
    assert moved > 0.1                                                       # the delta is applied
    assert (got - merged_logits).abs().max() < moved / 50                    # the bf16 merged model: its rounding


def test_peft_refuses_the_per_expert_layout(adapters):
    with pytest.raises(ValueError, match="not supported"):
        _peft(adapters["prime-rl"])


# ------------------------------------------------------------------------------------------ vLLM layout
def test_vllm_layout_is_what_vllms_qwen3_moe_lora_loader_reads(adapters):
    """vLLM 0.32's rules for a Qwen3MoeForCausalLM (is_3d_moe_weight False): every key parses
    (`parse_fine_tuned_lora_name`: `base_model.model.` + module + `.lora_A|B.weight`); an expert module's suffix
    from `.experts` on must be an expected module `experts.<e>.<gate|up|down>_proj` (from its packed
    `experts` mapping over `get_moe_expert_mapping`), dense ones by their last name; per-expert A [r, in],
    B [out, r] (`pack_moe` stacks them per expert); no fused 3-D tensor (`_validate_moe_lora_format` refuses
    one on a 2-D MoE model)."""
    cfg = json.loads((adapters["vllm"] / "adapter_config.json").read_text())
    sd = load_file(adapters["vllm"] / "adapter_model.safetensors")
    expected = {f"experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")} | {
        "q_proj", "k_proj", "v_proj", "o_proj"}
    seen = set()
    for k, v in sd.items():
        m = re.fullmatch(r"base_model\.model\.(.+)\.lora_([AB])\.weight", k)
        assert m, k
        module = m[1]
        assert "base_layer" not in module
        suffix = module[module.find(".experts") + 1:] if ".experts" in module else module.rsplit(".", 1)[-1]
        assert suffix in expected, k
        r = cfg["r"]
        assert v.ndim == 2 and (v.shape[0] == r if m[2] == "A" else v.shape[1] == r), k
        seen.add((module, m[2]))
    assert len(seen) == len(sd) == 2 * 2 * (4 + 4 * 3)
    assert not cfg.get("target_parameters") and not cfg.get("rank_pattern")


# ------------------------------------------------------------------------------------------ round trips
@pytest.mark.parametrize("layout", LAYOUTS)
def test_adapter_to_dcp_of_every_layout_gives_back_the_genuine_lora_bit_exactly(adapters, tmp_path, layout):
    from ckpt_tools.formats.dcp.reader import DcpCheckpoint
    out = tmp_path / "outputs" / "checkpoints" / "step_3" / "trainer"
    r = run("adapter-to-dcp", adapters[layout], out, "--base", F / "base_model", "--world-size", "2", "--lr", "0.01",
            "--step", "3")
    assert r.exit_code == 0, r.output
    genuine, ours = DcpCheckpoint.open(trainer(F)), DcpCheckpoint.open(out)
    lora = [k for k in genuine.entries if "lora_" in k and k.startswith("app.model.")]
    assert len(lora) == 2 * (4 * 2 + 3 * 2)
    for k in lora:
        assert ours.entries[k].shape == genuine.entries[k].shape, k
        assert torch.equal(ours.read_tensor(k), genuine.read_tensor(k)), k


@pytest.mark.parametrize("layout", ["peft", "prime-rl"])
def test_merge_of_every_layout_is_the_expected_merged_model(adapters, tmp_path, layout):
    r = run("merge", F / "base_model", adapters[layout], tmp_path / "m")
    assert r.exit_code == 0, r.output
    assert_same_tensors(tmp_path / "m" / "model.safetensors", F / "expected_merged_hf" / "model.safetensors")


def test_a_fused_lora_that_is_not_the_block_form_it_claims_is_refused_naming_the_key(adapters, tmp_path):
    d = shutil.copytree(adapters["peft"], tmp_path / "bad")
    sd = load_file(d / "adapter_model.safetensors")
    k = f"{PEFT_PREFIX}model.layers.1.mlp.experts.base_layer.lora_B.weight"
    sd[k][0, 8 * 4 + 2] = 1.0       # up's rank column 8 of expert 2, on a gate row: off its block
    save_file(sd, d / "adapter_model.safetensors", metadata={"format": "pt"})
    r = run("merge", F / "base_model", d, tmp_path / "m")
    assert r.exit_code == 1 and "not zero outside its rows" in r.output and "lora_B" in r.output, r.output


# ------------------------------------------------------------------------------------------ inspect
def test_inspect_says_the_layout_and_who_loads_it(adapters, tmp_path):
    got = {}
    for layout in ("peft", "vllm"):
        r = run("inspect", adapters[layout], "--json")
        assert r.exit_code == 0, r.output
        got[layout] = json.loads(r.stdout)["result"]
    assert got["peft"]["layout"] == "peft" and got["peft"]["layouts"] == ["peft"]
    assert got["peft"]["modules"] == got["vllm"]["modules"] == 32 and got["peft"]["rank"] == 8
    assert got["vllm"]["layout"] == "per-expert" and got["vllm"]["layouts"] == ["vllm", "prime-rl"]
    assert got["peft"]["consumers"]["peft"].startswith("loads")
    assert got["vllm"]["consumers"]["peft"].startswith("refuses")
    assert got["vllm"]["consumers"]["vllm"].startswith("loads")
    text = run("inspect", adapters["peft"]).output
    assert "layout: peft" in text and "target_parameters" in text
    d = tmp_path / "dense"
    assert run("extract-adapter", trainer(E), d, "--base", E / "base_model").exit_code == 0
    r = run("inspect", d, "--json")
    assert json.loads(r.stdout)["result"]["layout"] == "dense"


# ------------------------------------------------------------------------------------------ fix-adapter
def test_fix_adapter_of_prime_rls_moe_broadcast_writes_the_peft_layout_byte_for_byte(adapters, tmp_path):
    out = tmp_path / "fixed"
    r = run("fix-adapter", F / "outputs" / "broadcasts" / "step_3", out, "--base", F / "base_model")
    assert r.exit_code == 0, r.output
    assert "peft layout" in r.output
    for f in ("adapter_model.safetensors", "adapter_config.json"):
        assert (out / f).read_bytes() == (adapters["peft"] / f).read_bytes(), f


@pytest.mark.parametrize("layout", ["vllm", "prime-rl", "peft"])
def test_fix_adapter_reads_the_peft_layout_and_writes_any_layout_exactly(adapters, tmp_path, layout):
    out = tmp_path / "fixed"
    r = run("fix-adapter", adapters["peft"], out, "--base", F / "base_model", "--alpha", "32", "--layout", layout)
    assert r.exit_code == 0, r.output
    want = adapters["peft" if layout == "peft" else "prime-rl"] / "adapter_model.safetensors"
    assert (out / "adapter_model.safetensors").read_bytes() == want.read_bytes()


def test_diff_vs_base_checks_the_peft_layout_expert_by_expert(adapters):
    r = run("diff-vs-base", F / "expected_merged_hf", F / "base_model", "--adapter", adapters["peft"])
    assert r.exit_code == 0, r.output
    assert "adapter check passed: 32/32 targeted tensors are the correctly rounded" in r.output


def test_a_fused_lora_whose_rank_pattern_does_not_divide_its_rows_is_refused_naming_the_module(adapters, tmp_path):
    d = shutil.copytree(adapters["peft"], tmp_path / "bad")
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg["rank_pattern"] = {"experts.gate_up_proj": 12}
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    r = run("merge", F / "base_model", d, tmp_path / "m")
    assert r.exit_code == 1 and "mlp.experts.base_layer: fused expert LoRA" in r.output and "R=12" in r.output, r.output
    assert not (tmp_path / "m").exists()


def test_a_peft_trained_fused_expert_lora_merges_exactly_as_peft_merges_it(tmp_path):
    """Not our block form: PEFT's own fused LoRA (one A per expert shared by gate and up) is read as gate =
    (A_e, B_e[:I]), up = (A_e, B_e[I:]) and merged into the per-expert weights PEFT's merge_and_unload makes."""
    from peft import LoraConfig, get_peft_model
    torch.manual_seed(0)
    pm = get_peft_model(_model(F / "base_model"), LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=["gate_up_proj", "down_proj"],
        init_lora_weights=False))
    pm.save_pretrained(str(tmp_path / "ad"))
    merged = pm.merge_and_unload().state_dict()
    r = run("merge", F / "base_model", tmp_path / "ad", tmp_path / "m", "--dtype", "fp32")
    assert r.exit_code == 0, r.output
    ours = load_file(tmp_path / "m" / "model.safetensors")
    for layer in (0, 1):
        p = f"model.layers.{layer}.mlp.experts"
        for e in range(4):
            gate_up = torch.cat([ours[f"{p}.{e}.gate_proj.weight"], ours[f"{p}.{e}.up_proj.weight"]])
            torch.testing.assert_close(gate_up, merged[f"{p}.gate_up_proj"][e], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(ours[f"{p}.{e}.down_proj.weight"], merged[f"{p}.down_proj"][e], rtol=1e-6,
                                       atol=1e-7)
        torch.testing.assert_close(ours[f"model.layers.{layer}.self_attn.q_proj.weight"],
                                   merged[f"model.layers.{layer}.self_attn.q_proj.weight"], rtol=1e-6, atol=1e-7)
    up = "model.layers.0.mlp.experts.1.up_proj.weight"
    assert not torch.equal(ours[up], load_file(F / "base_model" / "model.safetensors")[up].float())   # applied
