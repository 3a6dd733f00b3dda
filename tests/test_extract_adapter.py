"""`ckpt extract-adapter` on the genuine prime-rl checkpoint: exact values, PEFT logits, the bytes
it reads, alpha provenance, and one clear error per bad input."""
from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file

from ckpt_tools.cli import main
from ckpt_tools.formats.dcp.reader import DcpCheckpoint
from ckpt_tools.ops.extract_adapter import ExtractOptions, plan_extract, run_extract

from .conftest import BASE, FIXTURE, TRAINER, json_payload

REFERENCE = FIXTURE / "reference.safetensors"
REF_ADAPTER = FIXTURE / "reference_peft_adapter"
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@functools.lru_cache(maxsize=None)
def _ref_inputs():
    with safe_open(str(REFERENCE), "pt") as f:
        return f.get_tensor("ref_input_ids"), f.get_tensor("ref_position_ids")


def peft_logits(adapter_dir=None) -> torch.Tensor:
    """Logits of the fp32 base (optionally with `PeftModel.from_pretrained(base, adapter_dir)`) on
    the fixture's reference input."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(BASE), dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    ids, pos = _ref_inputs()
    with torch.no_grad():
        return model(input_ids=ids, position_ids=pos).logits


@functools.lru_cache(maxsize=None)
def base_logits() -> torch.Tensor:
    return peft_logits(None)


@functools.lru_cache(maxsize=None)
def reference_adapter_logits() -> torch.Tensor:
    return peft_logits(REF_ADAPTER)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.fixture(scope="module")
def extracted(tmp_path_factory):
    out = tmp_path_factory.mktemp("extract") / "adapter"
    r = run("extract-adapter", TRAINER, out, "--json")
    assert r.exit_code == 0, r.output
    return out, json_payload(r.stdout)


def test_extracted_lora_is_bit_equal_to_the_live_models_and_keys_are_peft_keys(extracted):
    out, rep = extracted
    got = load_file(str(out / "adapter_model.safetensors"))
    with safe_open(str(REFERENCE), "pt") as f:
        ref = {k: f.get_tensor(k) for k in f.keys() if k.startswith("lora.")}
    modules = sorted({k.split(".", 1)[1].rsplit(".", 2)[0] for k in ref})
    assert len(modules) == 21
    expected_keys = sorted(f"base_model.model.{m}.lora_{ab}.weight" for m in modules for ab in "AB")
    with safe_open(str(out / "adapter_model.safetensors"), "pt") as f:
        assert list(f.keys()) == expected_keys          # exactly the PEFT keys, sorted
        assert f.metadata() == {"format": "pt"}
    for m in modules:
        for ab in "AB":
            t = got[f"base_model.model.{m}.lora_{ab}.weight"]
            want = ref[f"lora.{m}.adapter0.{ab}"]
            assert t.dtype == torch.float32 and torch.equal(_bits(t), _bits(want)), (m, ab)
    # same values, same sorted keys and metadata: the very bytes the peft library wrote
    assert (out / "adapter_model.safetensors").read_bytes() == (REF_ADAPTER / "adapter_model.safetensors").read_bytes()
    assert rep["modules"] == 21 and rep["rank"] == 8 and rep["alpha"] == 16.0
    assert "orch.toml" in rep["alpha_source"]


def test_adapter_config_is_a_peft_lora_config_with_the_training_scale(extracted):
    out, _ = extracted
    cfg = json.loads((out / "adapter_config.json").read_text())
    ref = json.loads((REF_ADAPTER / "adapter_config.json").read_text())
    assert set(cfg) == set(ref)                          # PEFT's own field set
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM" and cfg["bias"] == "none"
    assert cfg["r"] == 8 and cfg["lora_alpha"] / cfg["r"] == 2.0
    assert cfg["target_modules"] == sorted(PROJ)
    assert cfg["base_model_name_or_path"] == "base_model"     # the run's orch.toml [model] name
    assert cfg["modules_to_save"] is None
    from peft import LoraConfig

    fields = set(LoraConfig.__dataclass_fields__)
    assert set(cfg) - {"peft_type", "auto_mapping", "revision", "base_model_name_or_path", "task_type",
                       "inference_mode"} <= fields


def test_peft_from_pretrained_of_extracted_adapter_gives_the_reference_adapters_logits(extracted):
    out, _ = extracted
    got = peft_logits(out)
    assert torch.equal(got, reference_adapter_logits())
    assert not torch.equal(got, base_logits())           # the LoRA is really applied


def test_extract_reads_only_the_lora_items(tmp_path):
    src = DcpCheckpoint.open(TRAINER).lora(alpha=None, run_config=None)
    plan = plan_extract(src, ExtractOptions(out=tmp_path / "a"))
    lora_items = {(c.file, c.offset, c.length) for k in src.lora_keys() for c in src.ckpt.entries[k].chunks}
    rep = run_extract(plan, src).to_json()
    assert rep["bytes_read"] <= 1.05 * plan.lora_item_bytes
    assert rep["bytes_read"] == src.ckpt.stats.bytes_read
    for file, off, length in src.ckpt.stats.ranges:
        assert any(f == file and o <= off and off + length <= o + n for f, o, n in lora_items), (file, off)
    total_data = sum(src.ckpt.file_size(f) for f in src.ckpt.data_files())
    assert rep["bytes_read"] < 0.2 * total_data


def test_bf16_export_rounds_each_value_once(tmp_path):
    r = run("extract-adapter", TRAINER, tmp_path / "a", "--dtype", "bf16")
    assert r.exit_code == 0, r.output
    got = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    ref = load_file(str(REF_ADAPTER / "adapter_model.safetensors"))
    assert got.keys() == ref.keys()
    for k in ref:
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], ref[k].to(torch.bfloat16)), k


def _trainer_only(tmp_path):
    """The checkpoint alone, copied away from its run (no orch.toml anywhere above it)."""
    dst = tmp_path / "lonely" / "trainer"
    shutil.copytree(TRAINER, dst)
    return dst


def test_without_any_alpha_source_it_explains_and_writes_nothing(tmp_path):
    ckpt = _trainer_only(tmp_path)
    r = run("extract-adapter", ckpt, tmp_path / "out")
    assert r.exit_code == 1
    assert "alpha" in r.output and "--run-config" in r.output and "--alpha" in r.output
    assert not (tmp_path / "out").exists()
    r = run("extract-adapter", ckpt, tmp_path / "out", "--alpha", "8")
    assert r.exit_code == 0, r.output
    cfg = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert cfg["lora_alpha"] == 8.0 and cfg["r"] == 8 and cfg["base_model_name_or_path"] is None
    assert "base_model_name_or_path" in r.stderr or "no base model name" in r.stderr


def test_run_config_and_explicit_alpha_win_in_that_order(tmp_path):
    ckpt = _trainer_only(tmp_path)
    orch = tmp_path / "orch.toml"
    orch.write_text((FIXTURE / "outputs/run_default/configs/orch.toml").read_text().replace("alpha = 16.0", "alpha = 4.0"))
    r = run("extract-adapter", ckpt, tmp_path / "o1", "--run-config", orch, "--json")
    assert r.exit_code == 0, r.output
    assert json_payload(r.stdout)["lora_alpha"] == 4.0
    r = run("extract-adapter", ckpt, tmp_path / "o2", "--run-config", orch, "--alpha", "12", "--json")
    assert json_payload(r.stdout)["lora_alpha"] == 12.0


def test_disagreeing_run_adapter_configs_warn_and_the_training_scale_is_written(fixture_copy, tmp_path):
    cfgp = fixture_copy / "outputs/run_default/broadcasts/step_3/adapter_config.json"
    cfg = json.loads(cfgp.read_text())
    cfg["lora_alpha"] = 32.0            # what prime-rl writes when trainer alpha != orchestrator alpha
    cfgp.write_text(json.dumps(cfg))
    ckpt = fixture_copy / "outputs/checkpoints/step_3/trainer"
    r = run("extract-adapter", ckpt, tmp_path / "out", "--json")
    assert r.exit_code == 0, r.output
    assert "WARNING" in r.stderr and "lora_alpha=32" in r.stderr and "training used scale 2" in r.stderr
    assert json.loads((tmp_path / "out/adapter_config.json").read_text())["lora_alpha"] == 16.0


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path):
    r = run("extract-adapter", TRAINER, tmp_path / "out", "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    plan = json_payload(r.stdout)
    assert plan["dry_run"] and len(plan["tensors"]) == 42 and plan["out_file_bytes"] == 113328
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_without_lora_is_refused(tmp_path):
    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "nolora"
    state = {"app": {"model": {"model.norm.weight": torch.ones(4)}, "progress": {"step": 1}}}
    dcp.save(state, checkpoint_id=str(ckpt), no_dist=True)
    r = run("extract-adapter", ckpt, tmp_path / "out", "--alpha", "16")
    assert r.exit_code == 1 and "no LoRA" in r.output
    assert not (tmp_path / "out").exists()


def test_a_missing_slot_is_a_usage_error(tmp_path):
    r = run("extract-adapter", TRAINER, tmp_path / "out", "--slot", "1")
    assert r.exit_code == 2 and "slot 1" in r.output and "--slot 0" in r.output
    assert not (tmp_path / "out").exists()


def test_a_base_of_other_shapes_is_refused(tmp_path, other_base):
    r = run("extract-adapter", TRAINER, tmp_path / "out", "--base", other_base)
    assert r.exit_code == 1 and "do not fit the base" in r.output and "different base" in r.output
    assert not (tmp_path / "out").exists()


def test_existing_output_is_never_overwritten(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("x")
    r = run("extract-adapter", TRAINER, tmp_path / "out")
    assert r.exit_code == 1 and "already exists" in r.output
    assert (tmp_path / "out" / "keep").read_text() == "x"


@pytest.fixture(scope="session")
def other_base(tmp_path_factory):
    """A real HF Qwen3 model dir (save_pretrained) whose hidden size differs from the fixture's."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    d = tmp_path_factory.mktemp("other_base")
    cfg = Qwen3Config(vocab_size=1000, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    Qwen3ForCausalLM._from_config(cfg, dtype=torch.bfloat16).save_pretrained(str(d))
    return d
