"""`ckpt merge` on factory runs (4 gloo FSDP2 ranks, uneven 41/41/41/39 shards) with a tied, sharded
bf16 base, and on PEFT adapters of that base (rsLoRA, rank/alpha patterns, a LoRA on the tied
lm_head, modules_to_save of the tied embedding). References: an fp64 merge of the exact LoRA
values (at most 1 ulp apart, single rounding), and the logits of the adapter itself (PeftModel)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from ckpt_tools.cli import main
from tests.factory.factory import FactorySpec, make_run
from ckpt_tools.core.tensor_math import merge_weight, ulps_apart
import ckpt_tools

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def load_dir(d: Path) -> dict[str, torch.Tensor]:
    index = d / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    out = {}
    for f in files:
        out.update(load_file(d / f))
    return out


def fp64_reference(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    return (w.double() + scale * (b.double() @ a.double())).to(w.dtype)


def assert_single_rounding(got: torch.Tensor, w, a, b, scale, name):
    """Bit-equal to fp32 compute with one rounding, and within 1 ulp of the fp64 merge."""
    assert torch.equal(got, merge_weight(w, a, b, scale, out_dtype=got.dtype)), name
    ref = fp64_reference(w, a, b, scale)
    ulps = ulps_apart(got, ref)
    assert int(ulps.max()) <= 1, name
    assert (ulps == 0).float().mean().item() > 0.99, name
    assert not torch.equal(got, w), name


@pytest.fixture(scope="module")
def tied_run(tmp_path_factory):
    spec = FactorySpec.tiny(tie_word_embeddings=True, base_max_shard_size="60KB", num_slots=2)
    return spec, make_run(tmp_path_factory.mktemp("tied") / "run", spec)


@pytest.fixture(scope="module")
def merged_tied(tied_run, tmp_path_factory):
    spec, paths = tied_run
    out = tmp_path_factory.mktemp("m") / "merged"
    r = run("merge", paths.base_model, paths.checkpoint, out)
    assert r.exit_code == 0, r.output
    return out


def test_factory_base_is_sharded_and_tied(tied_run):
    _, paths = tied_run
    assert len(list(paths.base_model.glob("model-*-of-*.safetensors"))) > 2
    assert json.loads((paths.base_model / "config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.weight" not in load_dir(paths.base_model)


def test_dcp_merge_into_sharded_tied_base_is_single_rounded(tied_run, merged_tied):
    spec, paths = tied_run
    truth, base, got = load_file(paths.truth), load_dir(paths.base_model), load_dir(merged_tied)
    assert set(got) == set(base)                          # tied: lm_head stays implicit
    modules = spec.target_modules()
    for m in modules:
        n = m + ".weight"
        assert_single_rounding(got[n], base[n], truth[f"lora.{m}.slot0.A"], truth[f"lora.{m}.slot0.B"], spec.scale, n)
    for n in set(base) - {m + ".weight" for m in modules}:
        assert torch.equal(got[n], base[n]), n
    cfg = json.loads((merged_tied / "config.json").read_text())
    assert cfg == json.loads((paths.base_model / "config.json").read_text())


def test_slot_picks_the_second_adapter_of_a_multi_slot_checkpoint(tied_run, merged_tied, tmp_path):
    spec, paths = tied_run
    r = run("merge", paths.base_model, paths.checkpoint, tmp_path / "s1", "--slot", "1")
    assert r.exit_code == 0, r.output
    truth, base, got = load_file(paths.truth), load_dir(paths.base_model), load_dir(tmp_path / "s1")
    slot0 = load_dir(merged_tied)
    for m in spec.target_modules():
        n = m + ".weight"
        assert_single_rounding(got[n], base[n], truth[f"lora.{m}.slot1.A"], truth[f"lora.{m}.slot1.B"], spec.scale, n)
        assert not torch.equal(got[n], slot0[n]), n
    r = run("merge", paths.base_model, paths.checkpoint, tmp_path / "s2", "--slot", "2")
    assert r.exit_code == 2 and "slot 2 is not in the checkpoint" in r.output and "[0, 1]" in r.output


def test_base_from_tied_checkpoint_omits_the_duplicate_lm_head(tied_run, merged_tied, tmp_path):
    _, paths = tied_run
    out = tmp_path / "o"
    plan = ckpt_tools.merge(None, paths.checkpoint, tmp_path / "plan", dry_run=True, base_from_checkpoint=True,
                            config_from=paths.base_model).plan
    assert [n for n, _ in plan.omitted] == ["lm_head.weight"]
    r = run("merge", "--base-from-checkpoint", paths.checkpoint, out, "--config-from", paths.base_model)
    assert r.exit_code == 0, r.output
    got, want = load_dir(out), load_dir(merged_tied)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_several_output_shards_load_in_transformers_with_the_same_weights(tied_run, merged_tied, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "o"
    r = run("merge", tied_run[1].base_model, tied_run[1].checkpoint, out, "--max-shard-size", "40KB", "--threads", "3")
    assert r.exit_code == 0, r.output
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 5 and shards[-1].name.endswith(f"-of-{len(shards):05d}.safetensors")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    sd = model.state_dict()
    want = load_dir(merged_tied)
    assert all(torch.equal(sd[k], want[k]) for k in want)


# ----------------------------------------------------------------------------- PEFT adapters on the tied base


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.fixture(scope="module")
def rslora_adapter(tied_run, tmp_path_factory):
    """rsLoRA, rank_pattern/alpha_pattern, and a LoRA on lm_head (tied to the embedding)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    _, paths = tied_run
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_pretrained(paths.base_model, dtype=torch.float32)
    cfg = LoraConfig(r=8, lora_alpha=16, use_rslora=True, init_lora_weights=False,
                     target_modules=list(PROJ) + ["lm_head"], rank_pattern={"o_proj": 4},
                     alpha_pattern={"down_proj": 5.0})
    pm = get_peft_model(model, cfg)
    d = tmp_path_factory.mktemp("ad") / "rslora"
    pm.save_pretrained(d, save_embedding_layers=False)
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(1))
    return d, ids, _logits(pm.eval(), ids)


def test_rslora_adapter_with_patterns_and_a_tied_lm_head_lora(tied_run, rslora_adapter, tmp_path):
    from transformers import AutoModelForCausalLM

    _, paths = tied_run
    ad, ids, peft_logits = rslora_adapter
    r = run("merge", paths.base_model, ad, tmp_path / "bf16")
    assert r.exit_code == 0, r.output
    assert "tie_word_embeddings" in r.output         # warned: the tied pair diverges
    base, got = load_dir(paths.base_model), load_dir(tmp_path / "bf16")
    lora = load_file(ad / "adapter_model.safetensors")
    checked = 0
    for key in lora:
        if ".lora_A." not in key:
            continue
        module = key[len("base_model.model."):].replace(".lora_A.weight", "")
        a, b = lora[key], lora[key.replace("lora_A", "lora_B")]
        rank = a.shape[0]
        alpha = 5.0 if module.endswith("down_proj") else 16.0
        assert rank == (4 if module.endswith("o_proj") else 8)
        w = base["model.embed_tokens.weight" if module == "lm_head" else module + ".weight"]
        assert_single_rounding(got[module + ".weight"], w, a, b, alpha / math.sqrt(rank), module)
        checked += 1
    assert checked == 2 * 7 + 1
    assert torch.equal(got["model.embed_tokens.weight"], base["model.embed_tokens.weight"])
    cfg = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False

    # What the adapter computes (PeftModel forward), in fp32: our fp32 merge reproduces it. (PEFT's own
    # merge_and_unload adds the lm_head delta into the shared embedding too; we write both tensors.)
    r = run("merge", paths.base_model, ad, tmp_path / "fp32", "--dtype", "fp32")
    assert r.exit_code == 0, r.output
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.float32).eval()
    assert ours.lm_head.weight.data_ptr() != ours.model.embed_tokens.weight.data_ptr()
    assert (_logits(ours, ids) - peft_logits).abs().max().item() <= 1e-5


def test_modules_to_save_embedding_on_a_tied_base_materializes_the_old_lm_head(tied_run, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    _, paths = tied_run
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_pretrained(paths.base_model, dtype=torch.float32)
    pm = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["embed_tokens"],
                                          init_lora_weights=False))
    emb = pm.base_model.model.model.embed_tokens.modules_to_save["default"].weight
    with torch.no_grad():
        emb.add_(torch.randn_like(emb))      # a trained embedding, different from the base
    pm.save_pretrained(tmp_path / "ad")
    ids = torch.randint(0, 1000, (2, 12), generator=torch.Generator().manual_seed(2))
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(paths.base_model, dtype=torch.float32),
                                         tmp_path / "ad").eval()
    want = _logits(reloaded, ids)

    r = run("merge", paths.base_model, tmp_path / "ad", tmp_path / "o", "--dtype", "fp32", "--json")
    assert r.exit_code == 0, r.output
    counts = json.loads(r.stdout)["plan"]["counts"]
    assert counts["replace"] == 1 and counts["merge"] == 2
    base, got = load_dir(paths.base_model), load_dir(tmp_path / "o")
    assert torch.equal(got["lm_head.weight"], base["model.embed_tokens.weight"].float())
    assert torch.equal(got["model.embed_tokens.weight"], load_file(tmp_path / "ad" / "adapter_model.safetensors")[
        "base_model.model.model.embed_tokens.weight"])
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "o", dtype=torch.float32).eval()
    assert (_logits(ours, ids) - want).abs().max().item() <= 1e-5
