"""Other shapes than the genuine fixtures', written by the HEAD factory (FSDP2 + EP gloo ranks, torch's
dcp.save, its own ground truth): 8 experts on 3 ranks, tied embeddings, uneven shards, an MoE full
fine-tune. Every command that turns a checkpoint into weights must equal the truth with torch.equal."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from ckpt_tools.cli import main
from tests.factory.head_factory import HeadSpec, make_head_run

SHAPES = {
    # 8 experts over 3 ranks without EP: uneven expert blocks 3/3/2, uneven dense rows
    "moe8-world3": lambda: HeadSpec.f_moe(world_size=3, num_experts=8, ep=1, hidden_size=48, head_dim=12),
    "moe-tied": lambda: HeadSpec.f_moe(tie_word_embeddings=True),
    "dense-tied-world3": lambda: HeadSpec.e_dense(world_size=3, tie_word_embeddings=True, ckpt_interval=None),
    "moe-fullft": lambda: HeadSpec.f_moe(lora=False, lr=1e-3, scheduler="constant"),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            made[name] = make_head_run(tmp_path_factory.mktemp(name), SHAPES[name]())
        return made[name]
    return get


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_equal_files(out, expected_dir):
    ours = {}
    for f in sorted(out.glob("*.safetensors")):
        ours.update(load_file(f))
    expected = {}
    for f in sorted(expected_dir.glob("*.safetensors")):
        expected.update(load_file(f))
    assert sorted(ours) == sorted(expected)
    for k, v in expected.items():
        assert ours[k].dtype == v.dtype and torch.equal(ours[k], v), k


@pytest.mark.parametrize("shape", ["moe8-world3", "moe-tied", "dense-tied-world3"])
def test_extract_merge_and_export_equal_the_factorys_truth(tmp_path, runs, shape):
    p = runs(shape)
    ad = tmp_path / "adapter"
    r = run("extract-adapter", p.checkpoint, ad, "--base", p.base_model, "--layout", "prime-rl")
    assert r.exit_code == 0, r.output
    ours = {k.removeprefix("base_model.model."): v for k, v in load_file(ad / "adapter_model.safetensors").items()}
    theirs = load_file(p.broadcast / "adapter_model.safetensors")
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], v) for k, v in theirs.items())
    for out, args in ((tmp_path / "m1", ("merge", p.base_model, p.checkpoint)),
                      (tmp_path / "m2", ("merge", "--base-from-checkpoint", p.checkpoint)),
                      (tmp_path / "m3", ("export", p.checkpoint))):
        extra = ("--config-from", p.base_model) if args[0] == "export" or "--base-from-checkpoint" in args else ()
        r = run(*args, out, *extra)
        assert r.exit_code == 0, (args, r.output)
        assert_equal_files(out, p.expected_hf)


def test_the_8_expert_checkpoint_is_counted(runs):
    p = runs("moe8-world3")
    r = run("inspect", p.checkpoint, "--json")
    rep = json.loads(r.stdout)["result"]
    assert rep["experts"]["experts"] == 8 and rep["experts"]["expert_blocks"] == 3 and rep["world_size"] == 3


def test_export_of_an_moe_full_finetune_converts_the_prime_format_weights(tmp_path, runs):
    p = runs("moe-fullft")
    out = tmp_path / "exported"
    r = run("export", p.checkpoint, out, "--config-from", p.base_model)
    assert r.exit_code == 0, r.output
    assert_equal_files(out, p.expected_hf)
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in load_file(out / "model.safetensors")


def test_a_tied_runs_extracted_adapter_applies_in_peft(tmp_path, runs):
    """The tied dense run's adapter (the default layout) loaded by the pinned PEFT on the tied base: its logits
    are the expected merged model's (to its bf16 rounding) and far from the base's (the delta is applied)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    p = runs("dense-tied-world3")
    ad = tmp_path / "adapter"
    r = run("extract-adapter", p.checkpoint, ad, "--base", p.base_model)
    assert r.exit_code == 0, r.output
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(str(p.base_model), dtype=torch.float32).eval()
        assert base.config.tie_word_embeddings
        ids = torch.arange(24).remainder(base.config.vocab_size).reshape(2, 12)
        base_logits = base(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(str(p.expected_hf), dtype=torch.float32).eval()
        merged_logits = merged(input_ids=ids).logits
        peft_logits = PeftModel.from_pretrained(base, str(ad)).eval()(input_ids=ids).logits
    moved = float((merged_logits - base_logits).abs().max())
    assert moved > 1e-3 and float((peft_logits - merged_logits).abs().max()) < 0.1 * moved, moved
