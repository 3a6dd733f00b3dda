"""`ckpt diff-vs-base` on the genuine prime-rl fixture and on real files derived from it (written by
safetensors / huggingface_hub), with every expected number recomputed independently in the test."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ckpt_tools.cli import main
from ckpt_tools.ops.diff.run import diff_vs_base
from ckpt_tools.sources.open import open_weights

from .conftest import BASE, FIXTURE, TRAINER, json_payload

EXPORT = FIXTURE / "outputs" / "weights" / "step_3"          # prime-rl's export: the base, LoRA dropped
MERGED = FIXTURE / "expected_merged_hf"                       # bf16(W32 + 2.0 * B@A) for the 21 targets
PEFT = FIXTURE / "reference_peft_adapter"
TARGETED = sorted(f"model.layers.{i}.{m}.weight" for i in range(3) for m in
                  ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def run_json(*args):
    r = run(*args, "--json")
    assert r.exit_code in (0, 3, 4), r.output
    return r.exit_code, json_payload(r.stdout)


def _hf_dir(dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """A real single-file HF dir (safetensors' own writer) with the base model's config."""
    dst.mkdir(parents=True)
    shutil.copy(BASE / "config.json", dst / "config.json")
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def sharded_base(tmp_path_factory) -> Path:
    """The base model re-saved in 3 shards + index by huggingface_hub's sharded writer."""
    from huggingface_hub import save_torch_state_dict

    d = tmp_path_factory.mktemp("sharded") / "base_sharded"
    d.mkdir()
    save_torch_state_dict(load_file(str(BASE / "model.safetensors")), str(d), max_shard_size="200KB")
    shutil.copy(BASE / "config.json", d / "config.json")
    assert (d / "model.safetensors.index.json").is_file() and len(list(d.glob("*.safetensors"))) == 3
    return d


# ------------------------------------------------------------------------------------ the verdicts
def test_prime_rl_export_is_identical_to_base_and_exits_3():
    r = run("diff-vs-base", EXPORT, BASE)
    assert r.exit_code == 3, r.output
    assert "identical to base" in r.output and "not merged" in r.output
    # two HF dirs alike need not be a failed merge: the line says what it means for a trained model's export too
    assert "training changed none of these weights" in r.output, r.output
    code, rep = run_json("diff-vs-base", EXPORT, BASE)
    assert code == 3 and rep["verdict"] == "identical" and rep["counts"] == {"identical": 36}
    assert rep["shared"] == 36 and rep["only_in_weights"] == [] and rep["only_in_base"] == []
    # identity was decided from raw bytes: exactly one read of each side
    assert rep["bytes_read"] == 2 * os.path.getsize(BASE / "model.safetensors") - 2 * _header_len(BASE / "model.safetensors")


def _header_len(p: Path) -> int:
    with open(p, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_expected_merge_differs_in_exactly_the_21_targeted_tensors_with_0_ulps():
    code, rep = run_json("diff-vs-base", MERGED, BASE, "--adapter", TRAINER)
    assert code == 0 and rep["verdict"] == "differs"
    changed = sorted(t["name"] for t in rep["tensors"] if t["status"] == "differs")
    assert changed == TARGETED
    for t in rep["tensors"]:
        if t["role"] == "targeted":
            assert t["adapter_check"]["ok"] and t["adapter_check"]["max_ulps"] == 0, t
            assert t["adapter_check"]["scale"] == 2.0 and t["adapter_check"]["rank"] == 8
        else:
            assert t["role"] == "untargeted" and t["status"] == "identical", t
    ac = rep["adapter_check"]
    assert ac["passed"] and ac["targeted"] == ac["exact"] == 21 and ac["max_ulps"] == 0
    assert ac["untargeted_checked"] == 15 and ac["alpha"] == 16.0 and "orch.toml" in ac["alpha_source"]
    r = run("diff-vs-base", MERGED, BASE, "--adapter", TRAINER)
    assert r.exit_code == 0 and "adapter check passed: 21/21" in r.output and "correctly rounded" in r.output


def test_a_peft_adapter_works_as_the_adapter_too():
    code, rep = run_json("diff-vs-base", MERGED, BASE, "--adapter", PEFT)
    assert code == 0 and rep["adapter_check"]["passed"] and rep["adapter"]["kind"] == "peft"


def test_per_tensor_statistics_match_an_independent_computation():
    _, rep = run_json("diff-vs-base", MERGED, BASE)
    by = {t["name"]: t for t in rep["tensors"]}
    with safe_open(str(MERGED / "model.safetensors"), "pt") as fm, safe_open(str(BASE / "model.safetensors"), "pt") as fb:
        for name in TARGETED[:4] + ["model.norm.weight"]:
            w, w0 = fm.get_tensor(name).double(), fb.get_tensor(name).double()
            t = by[name]
            d = w - w0
            assert t["numel"] == w.numel()
            assert t["changed_elements"] == int((w != w0).sum())
            assert t["changed_fraction"] == pytest.approx(float((w != w0).double().mean()))
            assert t["max_abs_delta"] == pytest.approx(float(d.abs().max()), rel=0, abs=0)
            assert t["rel_fro"] == pytest.approx(float(d.norm() / w0.norm()), rel=1e-12)
    assert by["model.norm.weight"]["status"] == "identical" and by["model.norm.weight"]["rel_fro"] == 0.0


def test_dcp_fp32_base_equals_the_bf16_base_upcast_both_ways():
    code, rep = run_json("diff-vs-base", TRAINER, BASE)
    assert code == 3 and rep["counts"] == {"identical_upcast": 36}
    t = next(t for t in rep["tensors"] if t["name"] == "lm_head.weight")
    assert (t["weights_dtype"], t["base_dtype"]) == ("float32", "bfloat16")
    code, rep = run_json("diff-vs-base", BASE, TRAINER.parent)   # a step dir is accepted too
    assert code == 3 and rep["counts"] == {"identical_upcast": 36} and rep["base"]["kind"] == "dcp"
    r = run("diff-vs-base", TRAINER, BASE)
    assert "after exact upcast" in r.output and "frozen base" in r.output


def test_merged_model_against_the_dcp_base_still_checks_the_adapter_exactly():
    code, rep = run_json("diff-vs-base", MERGED, TRAINER, "--adapter", TRAINER)
    assert code == 0 and rep["adapter_check"]["passed"] and rep["adapter_check"]["max_ulps"] == 0
    assert sorted(t["name"] for t in rep["tensors"] if t["status"] == "differs") == TARGETED


def test_a_wrong_alpha_fails_the_adapter_check_with_exit_4():
    code, rep = run_json("diff-vs-base", MERGED, BASE, "--adapter", TRAINER, "--alpha", "8")
    assert code == 4 and rep["verdict"] == "adapter_mismatch" and not rep["adapter_check"]["passed"]
    off = rep["adapter_check"]["off"]
    assert len(off) == 21 and all(o["max_ulps"] > 0 and o["elements_off"] > 0 for o in off)
    r = run("diff-vs-base", MERGED, BASE, "--adapter", TRAINER, "--alpha", "8")
    assert r.exit_code == 4 and "FAILED" in r.output and "ulps" in r.output


def test_an_untargeted_change_fails_the_adapter_check(tmp_path):
    tensors = load_file(str(MERGED / "model.safetensors"))
    norm = tensors["model.norm.weight"].clone()
    norm[3] = norm[3] * 2
    tensors["model.norm.weight"] = norm
    w = _hf_dir(tmp_path / "w", tensors)
    code, rep = run_json("diff-vs-base", w, BASE, "--adapter", TRAINER)
    assert code == 4 and rep["adapter_check"]["untargeted_changed"] == ["model.norm.weight"]
    assert rep["adapter_check"]["exact"] == 21
    t = next(t for t in rep["tensors"] if t["name"] == "model.norm.weight")
    assert t["changed_elements"] == 1 and t["status"] == "differs"


def test_targeted_only_reads_only_the_targeted_tensors():
    base = open_weights(BASE)
    targeted_bytes = sum(base.info(n).nbytes for n in TARGETED)
    base.close()
    rep = diff_vs_base(MERGED, BASE, adapter=TRAINER, targeted_only=True)
    assert rep.exit_code == 0
    assert rep.bytes_read == 2 * targeted_bytes
    assert sorted(t.name for t in rep.tensors if t.status != "skipped") == TARGETED
    assert sum(t.status == "skipped" for t in rep.tensors) == 15
    r = run("diff-vs-base", EXPORT, BASE, "--targeted-only")
    assert r.exit_code == 2 and "--targeted-only needs --adapter" in r.output


def test_unmerged_export_with_the_adapter_still_exits_3_and_says_the_check_failed():
    code, rep = run_json("diff-vs-base", EXPORT, BASE, "--adapter", TRAINER, "--targeted-only")
    assert code == 3 and not rep["adapter_check"]["passed"] and len(rep["adapter_check"]["off"]) == 21
    assert "adapter check FAILED" in rep["summary"]


# ------------------------------------------------------------------------------------ layouts, names
def test_sharded_dir_equals_the_single_file_base_and_small_blocks_change_nothing(sharded_base):
    code, rep = run_json("diff-vs-base", sharded_base, BASE)
    assert code == 3 and rep["counts"] == {"identical": 36}
    big = diff_vs_base(MERGED, sharded_base).to_json()
    small = diff_vs_base(MERGED, sharded_base, block_bytes=102).to_json()   # blocks straddle elements/shards
    for a, b in zip(big["tensors"], small["tensors"]):
        assert a["name"] == b["name"] and a["status"] == b["status"]
        assert a["changed_elements"] == b["changed_elements"] and a["max_abs_delta"] == b["max_abs_delta"]
        assert a["rel_fro"] == pytest.approx(b["rel_fro"], rel=1e-12)


def test_dcp_weights_streamed_in_small_blocks_equal_a_whole_tensor_read():
    src = open_weights(TRAINER)
    try:
        for name in ("model.layers.0.mlp.gate_proj.weight", "model.norm.weight", "lm_head.weight"):
            whole = src.read_tensor(name).reshape(-1)
            got = torch.cat([src.read_elems(name, s, min(37, whole.numel() - s)) for s in range(0, whole.numel(), 37)])
            assert torch.equal(got, whole), name
    finally:
        src.close()


def test_keys_on_one_side_shape_and_dtype_changes_are_reported(tmp_path):
    tensors = load_file(str(BASE / "model.safetensors"))
    tensors.pop("lm_head.weight")
    tensors["extra.weight"] = torch.ones(3, dtype=torch.bfloat16)
    tensors["model.norm.weight"] = torch.ones(65, dtype=torch.bfloat16)
    tensors["model.layers.0.input_layernorm.weight"] = tensors["model.layers.0.input_layernorm.weight"].float()
    w = _hf_dir(tmp_path / "w", tensors)
    code, rep = run_json("diff-vs-base", w, BASE)
    assert code == 0
    assert rep["only_in_weights"] == ["extra.weight"] and rep["only_in_base"] == ["lm_head.weight"]
    by = {t["name"]: t for t in rep["tensors"]}
    assert by["model.norm.weight"]["status"] == "shape_changed"
    assert by["model.norm.weight"]["weights_shape"] == [65] and by["model.norm.weight"]["base_shape"] == [64]
    ln = by["model.layers.0.input_layernorm.weight"]
    assert ln["status"] == "identical_upcast" and ln["weights_dtype"] == "float32"
    assert rep["counts"] == {"identical": 33, "identical_upcast": 1, "shape_changed": 1}
    r = run("diff-vs-base", w, BASE)
    assert "only in WEIGHTS: extra.weight" in r.output and "shape [64] -> [65]" in r.output


def test_non_finite_values_are_counted_and_kept_out_of_the_statistics(tmp_path):
    tensors = load_file(str(BASE / "model.safetensors"))
    name = "model.layers.1.self_attn.v_proj.weight"
    w = tensors[name].clone()
    w0 = w.double()
    w[0, 0] = float("nan")
    w[5, 7] = w[5, 7] + 1.0
    tensors[name] = w
    code, rep = run_json("diff-vs-base", _hf_dir(tmp_path / "w", tensors), BASE)
    t = next(t for t in rep["tensors"] if t["name"] == name)
    assert code == 0 and t["nonfinite"] == 1 and t["changed_elements"] == 2
    assert t["max_abs_delta"] == float(w.double()[5, 7] - w0[5, 7])
    d = (w.double() - w0)
    d[0, 0] = 0
    assert t["rel_fro"] == pytest.approx(float(d.norm() / w0.norm()), rel=1e-12)


def test_a_hub_id_resolves_from_the_local_cache_offline(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants

    rev = "a" * 40
    repo = tmp_path / "hub" / "models--acme--tiny-qwen3"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for i, name in enumerate(("config.json", "model.safetensors")):   # the cache's blob + symlink layout
        shutil.copy(BASE / name, repo / "blobs" / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snap / name)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    code, rep = run_json("diff-vs-base", EXPORT, "acme/tiny-qwen3")
    assert code == 3 and rep["base"]["label"] == "acme/tiny-qwen3"


def test_errors_exit_1_and_name_the_problem(tmp_path):
    w = _hf_dir(tmp_path / "w", {"other.weight": torch.zeros(2, 2)})
    r = run("diff-vs-base", w, BASE)
    assert r.exit_code == 1 and "share no tensor name" in r.output
    r = run("diff-vs-base", EXPORT, tmp_path / "nope")   # a missing path: exit 2, as everywhere
    assert r.exit_code == 2 and f"error: no such file or directory: {tmp_path / 'nope'}" in r.stderr
    r = run("diff-vs-base", PEFT, BASE)
    assert r.exit_code == 2 and "PEFT adapter" in r.output and "--adapter" in r.output
    # an adapter whose target the base lacks: refused before any tensor byte is read
    tensors = load_file(str(BASE / "model.safetensors"))
    tensors.pop("model.layers.2.mlp.up_proj.weight")
    b = _hf_dir(tmp_path / "b", tensors)
    r = run("diff-vs-base", MERGED, b, "--adapter", PEFT)
    assert r.exit_code == 1 and "does not fit BASE" in r.output and "model.layers.2.mlp.up_proj.weight" in r.output
