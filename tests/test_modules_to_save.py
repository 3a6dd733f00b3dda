"""prime-rl HEAD's `lora.modules_to_save` end to end, on a factory run that trains lm_head and model.norm
beside the LoRA (prime-rl 559b447's freeze rule, 2 gloo FSDP2 ranks, untied Qwen3).

The truth is plain torch: the factory's `reference.safetensors` (the live fp32 masters, the LoRA, and
`expected_merged_hf` = bf16(W + s * B @ A) for the LoRA modules, bf16(trained master) for lm_head and
model.norm). Every output is loaded by the library its users load it with (PEFT, transformers,
safetensors) and compared with that truth exactly, or to bf16 rounding where PEFT computes unmerged.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from ckpt_tools.cli import main
from tests.factory.head_factory import make_head_run
from tests.factory.head_spec import HeadSpec

from .conftest import json_payload
from .test_slim_rehydrate import assert_bit_equal_checkpoints

SAVED = ["lm_head.weight", "model.norm.weight"]   # what ("lm_head", "norm") trains: not q_norm, k_norm, *_layernorm


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def mts(tmp_path_factory):
    spec = HeadSpec.e_mts()
    paths = make_head_run(tmp_path_factory.mktemp("mts") / "run", spec)
    return spec, paths, load_file(str(paths.reference))


@pytest.fixture(scope="module")
def expected(mts):
    return load_file(str(mts[1].expected_hf / "model.safetensors"))


@pytest.fixture(scope="module")
def adapter(mts, tmp_path_factory):
    out = tmp_path_factory.mktemp("mts-adapter") / "adapter"
    r = run("extract-adapter", mts[1].checkpoint, out)
    assert r.exit_code == 0, r.output
    return out, r


def _model_tensors(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


# ------------------------------------------------------------------------------------------ the run
def test_the_factory_trains_exactly_lm_head_and_model_norm_beside_the_lora(mts):
    spec, paths, ref = mts
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(paths.checkpoint)).read_metadata().state_dict_metadata
    with_state = {k.removeprefix("app.optimizers.state.").rsplit(".", 1)[0] for k in md
                  if k.startswith("app.optimizers.state.")}
    assert sorted(p for p in with_state if "lora_" not in p) == SAVED
    assert "app.model.model.layers.0.self_attn.q_norm.weight" in md   # a frozen "norm" by name only
    run_info = json.loads(paths.run_info.read_text())
    assert run_info["param_groups"][0]["params"][-2:] == ["model.norm.weight", "lm_head.weight"]
    base = load_file(str(paths.base_model / "model.safetensors"))
    for name in SAVED:   # trained: the fp32 master moved off the bf16 base
        assert not torch.equal(ref[f"live_fp32.{name}"].to(torch.bfloat16), base[name])
        assert torch.equal(ref[f"trained_bf16.{name}"], ref[f"live_fp32.{name}"].to(torch.bfloat16))
    # prime-rl's broadcast: modules_to_save listed by suffix, none of their tensors held
    cfg = json.loads((paths.broadcast / "adapter_config.json").read_text())
    held = load_file(str(paths.broadcast / "adapter_model.safetensors"))
    assert cfg["modules_to_save"] == ["lm_head", "norm"] and all("lora_" in k for k in held)


def test_inspect_lists_the_trained_full_tensors_from_the_optimizer_state(mts):
    r = run("inspect", mts[1].checkpoint, "--json")
    assert r.exit_code == 0, r.output
    assert json_payload(r.stdout)["modules_to_save"] == SAVED
    r = run("inspect", mts[1].checkpoint)
    assert "trained full tensors (modules_to_save, from their optimizer state): lm_head.weight, model.norm.weight" \
        in r.output


# ------------------------------------------------------------------------------------------ adapter
def test_extract_adapter_writes_the_trained_masters_as_exact_modules_to_save(mts, adapter):
    _, _, ref = mts
    out, r = adapter
    assert "vLLM refuses" in r.stderr and "never updates" not in r.output
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["modules_to_save"] == ["lm_head", "model.norm"]   # "norm" would make PEFT wrap every *norm
    got = load_file(str(out / "adapter_model.safetensors"))
    for name in SAVED:
        assert torch.equal(got[f"base_model.model.{name}"], ref[f"live_fp32.{name}"]), name
    lora = [k for k in got if "lora_" in k]
    assert len(lora) == 2 * 14 and len(got) == len(lora) + 2


def test_the_adapter_loads_in_peft_with_only_those_modules_wrapped_and_applies_them(mts, adapter, expected):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, paths, _ = mts
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(7))

    def logits(model):
        with torch.no_grad():
            return model(input_ids=ids).logits.float()

    base = AutoModelForCausalLM.from_pretrained(str(paths.base_model), dtype=torch.bfloat16)
    base_logits = logits(base)
    exp_logits = logits(AutoModelForCausalLM.from_pretrained(str(paths.expected_hf), dtype=torch.bfloat16))
    pm = PeftModel.from_pretrained(base, str(adapter[0]))
    wrapped = sorted(n for n, m in pm.named_modules() if type(m).__name__ == "ModulesToSaveWrapper")
    assert wrapped == ["base_model.model.lm_head", "base_model.model.model.norm"]
    got = logits(pm)
    # PEFT computes the LoRA unmerged (bf16 rounding apart); the trained lm_head/norm replace the base's
    assert (got - exp_logits).abs().max() < 0.1 * (exp_logits - base_logits).abs().max()
    merged = pm.merge_and_unload().state_dict()
    for name in SAVED:
        assert torch.equal(merged[name], expected[name]), name


# ------------------------------------------------------------------------------------------ merges
@pytest.mark.parametrize("how", ["BASE CKPT", "BASE ADAPTER", "--base-from-checkpoint"])
def test_merges_apply_the_trained_tensors_exactly(mts, adapter, expected, how, tmp_path):
    _, paths, _ = mts
    out = tmp_path / "merged"
    args = {"BASE CKPT": [paths.base_model, paths.checkpoint, out],
            "BASE ADAPTER": [paths.base_model, adapter[0], out],
            "--base-from-checkpoint": ["--base-from-checkpoint", paths.checkpoint, out,
                                       "--config-from", paths.base_model]}[how]
    r = run("merge", *args)
    assert r.exit_code == 0, r.output
    got = _model_tensors(out)
    assert set(got) == set(expected)
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []


def test_slim_keeps_them_and_rehydrate_rebuilds_the_checkpoint_bit_equal(mts, expected, tmp_path):
    _, paths, _ = mts
    r = run("slim", paths.checkpoint, tmp_path / "slim", "--base", paths.base_model)
    assert r.exit_code == 0, r.output
    r = run("inspect", tmp_path / "slim", "--json")
    assert json_payload(r.stdout)["modules_to_save"] == SAVED   # unique state: kept
    r = run("rehydrate", tmp_path / "slim", tmp_path / "full", "--base", paths.base_model)
    assert r.exit_code == 0, r.output
    assert assert_bit_equal_checkpoints(paths.checkpoint, tmp_path / "full") > 0
    r = run("merge", paths.base_model, tmp_path / "full", tmp_path / "merged", "--run-config", paths.trainer_config)
    assert r.exit_code == 0, r.output
    got = _model_tensors(tmp_path / "merged")
    assert [k for k in expected if not torch.equal(got[k], expected[k])] == []


# ------------------------------------------------------------------------------------------ broadcast
def test_fix_adapter_refuses_the_broadcast_without_the_checkpoint_and_fills_it_with(mts, adapter, tmp_path):
    _, paths, _ = mts
    r = run("fix-adapter", paths.broadcast, tmp_path / "bad")
    assert r.exit_code == 1 and "modules_to_save ['lm_head', 'norm'] are listed" in r.output
    assert "--checkpoint" in r.output and not (tmp_path / "bad").exists()
    r = run("fix-adapter", paths.broadcast, tmp_path / "fixed", "--checkpoint", paths.checkpoint)
    assert r.exit_code == 0, r.output
    # the same trained state as extract-adapter's, to the byte (LoRA from the broadcast, masters from CKPT)
    assert (tmp_path / "fixed" / "adapter_model.safetensors").read_bytes() == \
        (adapter[0] / "adapter_model.safetensors").read_bytes()
    assert json.loads((tmp_path / "fixed" / "adapter_config.json").read_text()) == \
        json.loads((adapter[0] / "adapter_config.json").read_text())


def test_fix_adapter_refuses_a_checkpoint_of_another_step(mts, tmp_path):
    _, paths, _ = mts
    step2 = paths.broadcasts[2]   # kept by retention; the only checkpoint is step 3
    r = run("fix-adapter", step2, tmp_path / "out", "--checkpoint", paths.checkpoint)
    assert r.exit_code == 1 and "is not the state this export was written from" in r.output


def test_doctor_flags_broadcasts_listing_modules_to_save_they_do_not_hold(mts):
    _, paths, _ = mts
    r = run("doctor", paths.root, "--json")
    found = [f for f in json_payload(r.stdout)["findings"] if f["trap"] == "broadcast-modules-to-save"]
    assert len(found) == 1 and found[0]["severity"] == "error" and r.exit_code == 3
    assert f"--checkpoint {paths.checkpoint}" in found[0]["fix"]


# ------------------------------------------------------------------------------------------ run configs
@pytest.mark.parametrize("sub", ["configs/resolved", "configs/latest/resolved"])
def test_configs_under_resolved_dirs_give_alpha_and_base_to_every_command(mts, sub, tmp_path):
    _, paths, _ = mts
    root = tmp_path / "run"
    shutil.copytree(paths.root / "outputs", root / "outputs", symlinks=True)
    shutil.copytree(paths.base_model, root / "base_model")
    (root / sub).mkdir(parents=True)
    shutil.copy(paths.trainer_config, root / sub / "trainer.json")
    ckpt = root / "outputs" / "checkpoints" / "step_3" / "trainer"
    r = run("extract-adapter", ckpt, tmp_path / "adapter", "--json")
    assert r.exit_code == 0, r.output
    res = json_payload(r.stdout)
    assert str(root / sub / "trainer.json") in res["alpha_source"] and res["lora_alpha"] == 16.0
    assert res["base_checked"] == str(root / "base_model")
    r = run("export", ckpt, tmp_path / "export", "--json")   # config and tokenizer from the run's base
    assert r.exit_code == 0, r.output


def test_the_one_launch_dir_rule_covers_every_config_layout(tmp_path):
    from ckpt_tools.formats.primerl.run_dir import launch_dir_of

    (tmp_path / "outputs").mkdir()
    for sub in ("configs", "configs/resolved", "configs/latest/resolved"):
        assert launch_dir_of(tmp_path / sub / "trainer.json", "outputs") == tmp_path.resolve()
    # rl: <output_dir>/<run.name>/configs/trainer.json, the trainer's output_dir relative to the launch dir
    (tmp_path / "outputs" / "my-run").mkdir()
    assert launch_dir_of(tmp_path / "outputs" / "my-run" / "configs" / "trainer.json", "outputs/my-run") \
        == tmp_path.resolve()
    assert launch_dir_of(tmp_path / "outputs" / "run_default" / "configs" / "orch.toml", "outputs/run_default") \
        == tmp_path.resolve()


# ------------------------------------------------------------------------------------------ 1-D LoRA
def test_a_lora_on_a_1d_weight_is_refused_naming_the_key(mts, adapter, tmp_path):
    from safetensors.torch import save_file

    _, paths, _ = mts
    src = tmp_path / "norm-lora"
    src.mkdir()
    t = {k: v for k, v in load_file(str(adapter[0] / "adapter_model.safetensors")).items() if "lora_" in k}
    t["base_model.model.model.norm.lora_A.weight"] = torch.zeros(8, 64)
    t["base_model.model.model.norm.lora_B.weight"] = torch.zeros(64, 8)
    save_file(t, str(src / "adapter_model.safetensors"))
    cfg = json.loads((adapter[0] / "adapter_config.json").read_text())
    cfg.update(modules_to_save=None, target_modules=cfg["target_modules"] + ["norm"])
    (src / "adapter_config.json").write_text(json.dumps(cfg))
    r = run("merge", paths.base_model, src, tmp_path / "out")
    assert r.exit_code == 1 and "internal error" not in r.output
    assert "key 'model.norm.weight'" in r.output and "not a 2-D linear weight" in r.output
    assert "drop these modules" in r.output and not (tmp_path / "out").exists()


def test_modules_to_save_entries_are_exact_module_names_and_ambiguous_ones_are_refused():
    from ckpt_tools.core.errors import FormatError
    from ckpt_tools.formats.peft.writer import exact_modules_to_save

    base = ["model.norm.weight", "lm_head.weight", "model.layers.0.self_attn.q_norm.weight",
            "model.layers.0.input_layernorm.weight", "model.embed_tokens.weight"]
    assert exact_modules_to_save(["model.norm.weight", "lm_head.weight"], base) == ["lm_head", "model.norm"]
    with pytest.raises(FormatError, match="input_layernorm also ends with it"):   # PEFT's str.endswith match
        exact_modules_to_save(["norm.weight"], base + ["norm.weight"])


# ------------------------------------------------------------------------------------------ diff-vs-base
def test_diff_vs_base_checks_the_trained_tensors_bit_for_bit_and_one_changed_element_fails(mts, adapter, tmp_path):
    """`diff-vs-base --adapter`: lm_head and model.norm (modules_to_save) must be the adapter's tensors in
    W's dtype, compared block by block; the LoRA modules by value."""
    from safetensors.torch import save_file
    _, paths, _ = mts
    r = run("diff-vs-base", paths.expected_hf, paths.base_model, "--adapter", adapter[0], "--json")
    doc = json_payload(r.stdout)
    assert r.exit_code == 0, doc
    replaced = {t["name"]: t["adapter_check"] for t in doc["tensors"] if t["role"] == "replaced"}
    assert sorted(replaced) == SAVED and all(c["ok"] and c["elements_off"] == 0 for c in replaced.values())
    bad = tmp_path / "bad"
    shutil.copytree(paths.expected_hf, bad)
    for f in bad.glob("*.safetensors"):
        sd = load_file(str(f))
        if "lm_head.weight" in sd:
            sd["lm_head.weight"].view(-1).view(torch.int16)[12345] += 1   # one ulp of one element
            save_file(sd, str(f), metadata={"format": "pt"})
    for extra in bad.glob("SHA256SUMS*"):
        extra.unlink()
    r = run("diff-vs-base", bad, paths.base_model, "--adapter", adapter[0], "--json")
    off = json_payload(r.stdout)["adapter_check"]["off"]
    assert r.exit_code == 4 and off == [{"name": "lm_head.weight", "max_ulps": 1, "elements_off": 1, "problem": None}]
