"""The pure merge planner (`plan_from_facts` over facts, no files): matching, refusals, tied embeddings,
sharding, the memory bound. End-to-end behaviour on real files is in test_merge*.py."""
from __future__ import annotations

import pytest
import torch

from ckpt_tools.core.errors import FormatError
from ckpt_tools.ops.merge import AdapterFacts, BaseFacts, FullFact, LoraFact, SourceTensor, memory_bound, plan_from_facts

H, V, I = 8, 32, 12


def base(tied: bool, with_lm_head: bool, kind: str = "hf", config_extra=None) -> BaseFacts:
    dt, file = ("bfloat16", "model.safetensors") if kind == "hf" else ("float32", None)   # DCP: fp32 masters
    names = [("model.embed_tokens.weight", (V, H))]
    for L in range(2):
        names += [(f"model.layers.{L}.mlp.up_proj.weight", (I, H)), (f"model.layers.{L}.input_layernorm.weight", (H,))]
    if with_lm_head:
        names.append(("lm_head.weight", (V, H)))
    t = [SourceTensor(n, dt, shape, file, n if kind == "hf" else f"app.model.{n}") for n, shape in names]
    cfg = {"tie_word_embeddings": tied, "dtype": "bfloat16", **(config_extra or {})}
    return BaseFacts(kind, "/base", tuple(t), cfg, "/base/config.json", (("/base/config.json", 100),))


def lora(module: str, out_f: int, in_f: int, r: int = 2, scale: float = 2.0) -> LoraFact:
    return LoraFact(module, r, scale, False, module + ".A", module + ".B", (r, in_f), (out_f, r))


def adapter(*mods: LoraFact, full=()) -> AdapterFacts:
    return AdapterFacts("peft", "/adapter", None, tuple(mods), tuple(full), {"modules": len(mods)}, 0)


def plan(b, a, **kw):
    return plan_from_facts(b, a, out_dtype=kw.pop("out_dtype", torch.bfloat16), max_shard_bytes=kw.pop("max_shard_bytes", 10**9),
                      **kw)


def test_every_matched_module_is_merged_and_the_rest_copied_verbatim():
    p = plan(base(False, True), adapter(lora("model.layers.0.mlp.up_proj", I, H), lora("model.layers.1.mlp.up_proj", I, H)))
    acts = {j.name: j.action for j in p.jobs}
    assert p.merged_modules == 2 and acts["model.layers.1.mlp.up_proj.weight"] == "merge"
    assert {n for n, a in acts.items() if a == "copy"} == {"model.embed_tokens.weight", "lm_head.weight",
                                                          "model.layers.0.input_layernorm.weight",
                                                          "model.layers.1.input_layernorm.weight"}
    assert p.files[0].action == "copy" and p.tie_word_embeddings == (False, False)


def test_all_problems_are_reported_in_one_error():
    a = adapter(lora("model.layers.0.mlp.up_proj", I, H + 1), lora("model.layers.7.mlp.up_proj", I, H),
                lora("model.layers.9.mlp.up_proj", I, H))
    with pytest.raises(FormatError) as e:
        plan(base(False, True), a)
    msg = str(e.value)
    assert "model.layers.0.mlp.up_proj.weight" in msg and f"[2, {H + 1}]" in msg        # shape
    assert "2 adapter target(s) have no base weight" in msg and "layers.9" in msg      # unmatched
    assert "base names look like" in msg


def test_an_adapter_that_would_change_nothing_is_refused():
    with pytest.raises(FormatError, match="write the base back unchanged"):
        plan(base(False, True), adapter())


def test_quantized_base_is_refused():
    with pytest.raises(FormatError, match="quantized"):
        plan(base(False, True, config_extra={"quantization_config": {"quant_method": "fp8"}}),
             adapter(lora("model.layers.0.mlp.up_proj", I, H)))


def test_lora_on_the_tied_lm_head_materializes_it_from_the_embedding_and_unties():
    p = plan(base(True, False), adapter(lora("lm_head", V, H)))
    lm = next(j for j in p.jobs if j.name == "lm_head.weight")
    assert lm.action == "merge" and lm.src == "model.embed_tokens.weight" and "materialized" in lm.note
    assert next(j for j in p.jobs if j.name == "model.embed_tokens.weight").action == "copy"
    assert p.tie_word_embeddings == (True, False)
    assert ("tie_word_embeddings", True, False) in p.files[0].changes and p.files[0].action == "rewrite"


def test_replacing_the_tied_embedding_keeps_the_old_one_as_lm_head():
    full = (FullFact("model.embed_tokens.weight", "k", "float32", (V, H)),)
    p = plan(base(True, False), adapter(full=full))
    acts = {j.name: (j.action, j.src) for j in p.jobs}
    assert acts["model.embed_tokens.weight"] == ("replace", "k")
    assert acts["lm_head.weight"] == ("copy", "model.embed_tokens.weight")
    assert p.tie_word_embeddings[1] is False


def test_dcp_base_of_a_tied_model_omits_the_duplicate_and_casts_masters():
    b = base(True, True, kind="dcp")
    p = plan(b, adapter(lora("model.layers.0.mlp.up_proj", I, H)))
    assert [n for n, _ in p.omitted] == ["lm_head.weight"]
    assert "lm_head.weight" not in {j.name for j in p.jobs}
    assert {j.action for j in p.jobs if j.name != "model.layers.0.mlp.up_proj.weight"} == {"cast"}
    assert p.tie_word_embeddings == (True, True)


def test_shards_are_greedy_in_base_order_with_save_file_layout_inside():
    b = base(False, True)
    p = plan(b, adapter(lora("model.layers.0.mlp.up_proj", I, H)), max_shard_bytes=V * H * 2)
    assert [s.file_name for s in p.shards][0] == f"model-00001-of-{len(p.shards):05d}.safetensors"
    assert all(s.data_bytes <= V * H * 2 for s in p.shards)
    assert [j.name for j in p.jobs] == [n for s in p.shards for n in s.tensors]
    for s in p.shards:
        assert list(s.tensors) == sorted(s.tensors)           # one dtype: save_file's order is by name
    assert p.index["metadata"]["total_size"] == sum(s.data_bytes for s in p.shards)
    assert set(p.index["weight_map"]) == {t.name for t in b.tensors}


def test_fp32_output_casts_every_float_tensor_and_rewrites_the_config_dtype():
    p = plan(base(False, True), adapter(lora("model.layers.0.mlp.up_proj", I, H)), out_dtype=torch.float32)
    assert {j.action for j in p.jobs} == {"merge", "cast"} and {j.out_dtype for j in p.jobs} == {"float32"}
    assert p.files[0].changes == (("dtype", "bfloat16", "float32"),)


def test_memory_bound_is_the_workers_blocks_not_the_tensors_whatever_the_model():
    from ckpt_tools.ops.merge.plan import MERGE_BLOCK_ELEMS, MIN_BLOCK_ROWS

    h, v, i, r = 4096, 151936, 12288, 32          # Qwen3-8B's widths: a 1.24 GB embedding, 100 MB MLP weights
    names = [("model.embed_tokens.weight", (v, h)), ("lm_head.weight", (v, h))] + \
        [(f"model.layers.{k}.mlp.up_proj.weight", (i, h)) for k in range(4)]
    b = BaseFacts("hf", "/base", tuple(SourceTensor(n, "bfloat16", s, "model.safetensors", n) for n, s in names),
                  {"tie_word_embeddings": False}, "/base/config.json", (("/base/config.json", 100),))
    a = adapter(*[lora(f"model.layers.{k}.mlp.up_proj", i, h, r=r) for k in range(4)])
    one, four = plan(b, a, threads=1), plan(b, a, threads=4)
    rows = MERGE_BLOCK_ELEMS // h + MIN_BLOCK_ROWS - 1                  # the largest block of a merge
    merge_ws = rows * h * (2 + 4 + 2) + (r * h + i * r) * 4          # base rows + fp32 product + out rows; A, B
    assert one.memory_bound_bytes == merge_ws
    assert four.memory_bound_bytes == 4 * merge_ws < 200 * 2**20       # the embedding alone is 1.24 GB
    assert memory_bound(one.jobs, 1, 10**6, "hf") == one.memory_bound_bytes + 10**6
    more = b.tensors + tuple(SourceTensor(f"model.layers.{k}.mlp.up_proj.weight", "bfloat16", (i, h),
                                          "model.safetensors", f"model.layers.{k}.mlp.up_proj.weight") for k in range(4, 9))
    twice = BaseFacts("hf", "/base", more, b.config, b.config_path, b.files)
    assert plan(twice, a, threads=4).memory_bound_bytes == four.memory_bound_bytes   # more layers: the same bound
