"""`ckpt fix-adapter` on prime-rl's own adapter exports of the genuine fixture: as-is they apply
nothing in PEFT; repaired, they give the reference adapter's logits."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file

from ckpt_tools.cli import main

from .conftest import BASE, FIXTURE, json_payload
from .test_extract_adapter import base_logits, other_base, peft_logits, reference_adapter_logits  # noqa: F401

BROADCAST = FIXTURE / "outputs/run_default/broadcasts/step_3"
LORA_ADAPTERS = FIXTURE / "outputs/weights/step_3/lora_adapters"
REF_ADAPTER = FIXTURE / "reference_peft_adapter"
EXPORTS = pytest.mark.parametrize("export", [BROADCAST, LORA_ADAPTERS], ids=["broadcast", "lora_adapters"])


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@EXPORTS
def test_prime_rl_exports_as_is_load_in_peft_but_apply_nothing(export):
    """If PEFT ever starts matching these keys, this fails: then fix-adapter's premise changed."""
    assert torch.equal(peft_logits(export), base_logits())
    assert not torch.equal(reference_adapter_logits(), base_logits())


@EXPORTS
def test_fixed_exports_give_the_reference_adapters_logits(export, tmp_path):
    out = tmp_path / "fixed"
    r = run("fix-adapter", export, out, "--json")
    assert r.exit_code == 0, r.output
    rep = json_payload(r.stdout)
    assert rep["modules"] == 21 and rep["lora_alpha"] == 16.0 and rep["fixes"]
    assert Path(rep["base_checked"]).resolve() == BASE.resolve()
    assert torch.equal(peft_logits(out), reference_adapter_logits())
    # values untouched, keys renamed, sorted, safetensors: byte for byte what the peft library wrote
    assert (out / "adapter_model.safetensors").read_bytes() == (REF_ADAPTER / "adapter_model.safetensors").read_bytes()
    assert not (out / "adapter_model.bin").exists()
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["r"] == 8 and cfg["lora_alpha"] == 16.0 and cfg["modules_to_save"] is None


def _copy(src, tmp_path, name="src"):
    dst = tmp_path / "outputs" / "run_default" / "broadcasts" / name if src == BROADCAST else tmp_path / name
    shutil.copytree(src, dst)
    for p in dst.iterdir():
        p.chmod(0o644)
    return dst


def _edit_config(d, **changes):
    p = d / "adapter_config.json"
    cfg = json.loads(p.read_text())
    for k, v in changes.items():
        if v is _DROP:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    p.write_text(json.dumps(cfg))


_DROP = object()


def test_the_training_alpha_replaces_the_trainer_alpha_of_the_export(fixture_copy, tmp_path):
    src = fixture_copy / "outputs/run_default/broadcasts/step_3"
    _edit_config(src, lora_alpha=32.0)   # prime-rl writes the trainer's alpha; training used the orchestrator's
    r = run("fix-adapter", src, tmp_path / "out", "--json")
    assert r.exit_code == 0, r.output
    rep = json_payload(r.stdout)
    assert rep["lora_alpha"] == 16.0 and "orch.toml" in rep["alpha_source"]
    assert any("lora_alpha 32 -> 16" in f for f in rep["fixes"])
    assert torch.equal(peft_logits(tmp_path / "out"), reference_adapter_logits())


def test_without_a_run_config_the_exports_alpha_is_kept_with_a_warning(tmp_path):
    src = _copy(LORA_ADAPTERS, tmp_path)
    r = run("fix-adapter", src, tmp_path / "out", "--base", BASE)
    assert r.exit_code == 0, r.output
    assert "no run config" in r.stderr and "TRAINER" in r.stderr
    assert json.loads((tmp_path / "out/adapter_config.json").read_text())["lora_alpha"] == 16.0


def test_modules_to_save_listed_but_absent_are_dropped(fixture_copy, tmp_path):
    src = fixture_copy / "outputs/run_default/broadcasts/step_3"
    _edit_config(src, modules_to_save=["embed_tokens", "lm_head"])   # variant C's broadcast config
    with pytest.raises(KeyError):
        peft_logits(src)      # what PEFT does with it as-is
    r = run("fix-adapter", src, tmp_path / "out", "--json")
    assert r.exit_code == 0, r.output
    assert any("listed but absent" in f for f in json_payload(r.stdout)["fixes"])
    assert json.loads((tmp_path / "out/adapter_config.json").read_text())["modules_to_save"] is None
    assert torch.equal(peft_logits(tmp_path / "out"), reference_adapter_logits())


def _export_with_full_tensors(tmp_path, *, perturb: bool):
    """Variant C's lora_adapters export: prime-rl's torch.save of the LoRA plus the fp32
    modules_to_save tensors (equal to the base: its LoRA optimizer never updates them)."""
    src = _copy(LORA_ADAPTERS, tmp_path)
    sd = torch.load(src / "adapter_model.bin", weights_only=True)
    with safe_open(str(BASE / "model.safetensors"), "pt") as f:
        emb = f.get_tensor("model.embed_tokens.weight").float()
        head = f.get_tensor("lm_head.weight").float()
    if perturb:
        emb = emb * 1.5     # "trained": every row differs from the base
    sd["base_model.model.model.embed_tokens.weight"] = emb
    sd["base_model.model.lm_head.weight"] = head
    (src / "adapter_model.bin").unlink()
    torch.save(sd, src / "adapter_model.bin")
    _edit_config(src, modules_to_save=["embed_tokens", "lm_head"])
    return src


def test_modules_to_save_equal_to_the_base_are_dropped(tmp_path):
    src = _export_with_full_tensors(tmp_path, perturb=False)
    r = run("fix-adapter", src, tmp_path / "out", "--base", BASE, "--alpha", "16", "--json")
    assert r.exit_code == 0, r.output
    with safe_open(str(tmp_path / "out/adapter_model.safetensors"), "pt") as f:
        assert len(list(f.keys())) == 42
    assert json.loads((tmp_path / "out/adapter_config.json").read_text())["modules_to_save"] is None
    assert torch.equal(peft_logits(tmp_path / "out"), reference_adapter_logits())


def test_modules_to_save_that_differ_from_the_base_are_kept_with_a_warning(tmp_path):
    src = _export_with_full_tensors(tmp_path, perturb=True)
    r = run("fix-adapter", src, tmp_path / "out", "--base", BASE, "--alpha", "16")
    assert r.exit_code == 0, r.output
    assert "vLLM rejects" in r.stderr
    got = load_file(str(tmp_path / "out/adapter_model.safetensors"))
    assert "base_model.model.model.embed_tokens.weight" in got and "base_model.model.lm_head.weight" not in got
    cfg = json.loads((tmp_path / "out/adapter_config.json").read_text())
    assert cfg["modules_to_save"] == ["model.embed_tokens"]   # the exact module: PEFT matches entries as suffixes
    got_logits = peft_logits(tmp_path / "out")     # PEFT loads it and applies the new embedding
    assert not torch.equal(got_logits, reference_adapter_logits())


def test_a_base_of_other_shapes_is_refused_and_nothing_written(tmp_path, other_base):  # noqa: F811
    r = run("fix-adapter", BROADCAST, tmp_path / "out", "--base", other_base)
    assert r.exit_code == 1 and "0 of 21 LoRA modules match" in r.output
    assert not (tmp_path / "out").exists()


def test_keys_that_match_no_module_of_the_base_are_refused(tmp_path):
    src = _copy(BROADCAST, tmp_path)
    st = src / "adapter_model.safetensors"
    sd = load_file(str(st))
    from safetensors.torch import save_file

    st.unlink()
    save_file({k.replace("model.layers.", "model.decoder.layers."): v for k, v in sd.items()}, str(st),
              metadata={"format": "pt"})
    r = run("fix-adapter", src, tmp_path / "out", "--base", BASE)
    assert r.exit_code == 1 and "0 of 21 LoRA modules match the base" in r.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("export,slot,msg", [(LORA_ADAPTERS, 1, "slots present: [0]"),
                                             (BROADCAST, 1, "single adapter")], ids=["bin", "broadcast"])
def test_an_absent_slot_is_a_usage_error(export, slot, msg, tmp_path):
    r = run("fix-adapter", export, tmp_path / "out", "--slot", slot)
    assert r.exit_code == 2 and msg in r.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("changes,msg", [
    ({"peft_type": "IA3"}, "peft_type 'IA3' is not supported"),
    ({"use_dora": True}, "use_dora=True"),
    ({"r": _DROP}, "has no 'r'"),
    ({"lora_alpha": _DROP}, "has no 'lora_alpha'"),
], ids=["peft_type", "dora", "no_r", "no_alpha"])
def test_bad_configs_get_one_clear_error_each(changes, msg, tmp_path):
    src = _copy(BROADCAST, tmp_path)
    _edit_config(src, **changes)
    r = run("fix-adapter", src, tmp_path / "out")
    assert r.exit_code == 1 and msg in r.output and "adapter_config.json" in r.output
    assert not (tmp_path / "out").exists()


def test_dry_run_json_plan_writes_nothing(tmp_path):
    r = run("fix-adapter", LORA_ADAPTERS, tmp_path / "out", "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    plan = json_payload(r.stdout)
    assert plan["dry_run"] and plan["slot"] == 0 and len(plan["tensors"]) == 42
    assert not (tmp_path / "out").exists()
