"""The key rule table for both prime-rl generations (pure): every row, its inverse, and what no row knows."""
from __future__ import annotations

import pytest

from ckpt_tools.core.errors import FormatError
from ckpt_tools.core.keys import (
    classify, expert_hf_name, expert_names, expert_parts, lora_key, peft_target, require_known, router_prime_name,
    stacked_base_key, stacked_hf_pattern, stacked_lora_key, summarize_lora,
)


def model(fqn):
    return classify(f"app.model.{fqn}", ("app", "model", fqn))


@pytest.mark.parametrize("w, proj", [("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")])
def test_grouped_expert_lora_and_stacked_weights_map_to_hf_projections(w, proj):
    a = model(f"model.layers.1.mlp.experts.{w}_lora_A.0")
    assert (a.group, a.module, a.ab, a.slot, a.expert_proj) == ("lora", "model.layers.1.mlp.experts", "A", 0, proj)
    assert stacked_lora_key(a.module, proj, "A", 0) == a.key
    b = model(f"model.layers.1.mlp.experts.{w}")
    assert b.group == "base" and b.stacked and b.hf_name is None
    assert expert_hf_name(b, 5) == f"model.layers.1.mlp.experts.5.{proj}.weight"
    assert stacked_base_key(b.module, proj) == b.key
    assert expert_names(stacked_hf_pattern(b), 2, 2) == [f"model.layers.1.mlp.experts.{e}.{proj}.weight" for e in (2, 3)]
    assert expert_parts(f"model.layers.1.mlp.experts.7.{proj}") == ("model.layers.1.mlp.experts", 7, proj)


def test_router_dense_lora_and_hf_weights():
    r = model("model.layers.0.mlp.router.gate.weight")
    assert r.group == "base" and r.hf_name == "model.layers.0.mlp.gate.weight"
    assert router_prime_name(r.hf_name) == "model.layers.0.mlp.router.gate.weight"
    d = model("model.layers.0.self_attn.q_proj.lora_B.0")
    assert (d.group, d.module, d.ab, d.stacked) == ("lora", "model.layers.0.self_attn.q_proj", "B", False)
    assert lora_key(d.module, "B", 0) == d.key
    assert model("model.layers.0.mlp.experts.3.up_proj.weight").hf_name == "model.layers.0.mlp.experts.3.up_proj.weight"
    assert peft_target("model.layers.0.mlp.experts.3.up_proj") == "experts"
    assert peft_target("model.layers.0.mlp.up_proj") == "up_proj"


@pytest.mark.parametrize("fqn", ["model.layers.0.mlp.experts.w4", "model.layers.0.mlp.experts.w1_lora_C.0",
                                 "model.rotary_emb.inv_freq", "model.layers.0.mlp.experts.w1_lora_A"])
def test_what_no_rule_knows_is_other_and_refused_by_name(fqn):
    info = model(fqn)
    assert info.group == "other"
    with pytest.raises(FormatError, match="key model") as exc:
        require_known([info, model("model.norm.weight")], "x/.metadata")
    assert fqn in str(exc.value.message)


def test_a_stacked_factor_counts_one_module_per_expert():
    infos = [model(f"model.layers.0.mlp.experts.{w}_lora_{ab}.0") for w in ("w1", "w2", "w3") for ab in "AB"]
    infos.append(model("model.layers.0.self_attn.q_proj.lora_A.0"))
    shapes = {i.key: ((8, 4, 16) if "lora_A" in i.key else (8, 16, 4)) for i in infos}
    shapes["app.model.model.layers.0.self_attn.q_proj.lora_A.0"] = (4, 16)
    st = summarize_lora(infos, shapes, {})
    assert st.modules == 8 * 3 + 1 and st.expert_modules == 24 and st.rank == 4
    assert st.targets == ("experts", "q_proj")


def test_step_dirs_layers_and_adapter_lora_keys_are_read_by_one_row_each():
    """The names every module reads the same way: a step dir, a decoder layer, a LoRA factor's key in an
    adapter file (PEFT's spelling and prime-rl's exports': no prefix, an adapter slot)."""
    from ckpt_tools.core.keys import HF_DECODER_LAYER, PEFT_LORA_KEY, layer_of, step_of

    assert [step_of(n) for n in ("step_12", "step_0", "step_", "step_3.tmp", "xstep_3", "trainer")] == \
        [12, 0, None, None, None, None]
    assert [layer_of(n) for n in ("model.layers.7.mlp.up_proj", "layers.2.attn.", "model.layers.x.",
                                  "model.embed_tokens")] == [7, 2, None, None]
    assert HF_DECODER_LAYER.match("model.layers.3.mlp.up_proj.weight")[1] == "3"
    assert HF_DECODER_LAYER.match("model.visual.layers.3.mlp.weight") is None   # not the decoder's
    spell = {k: (m["prefix"], m["module"], m["ab"], m["slot"]) if (m := PEFT_LORA_KEY.match(k)) else None for k in (
        "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight",   # PEFT
        "model.layers.0.mlp.up_proj.lora_B.weight",                    # prime-rl's broadcast
        "base_model.model.model.layers.0.mlp.up_proj.lora_A.1.weight", # prime-rl's weights export (slot)
        "base_model.model.model.embed_tokens.weight",                  # not a LoRA factor
    )}
    assert list(spell.values()) == [
        ("base_model.model.", "model.layers.0.mlp.up_proj", "A", None),
        (None, "model.layers.0.mlp.up_proj", "B", None),
        ("base_model.model.", "model.layers.0.mlp.up_proj", "A", "1"),
        None,
    ]
