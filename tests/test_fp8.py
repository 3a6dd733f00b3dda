"""Block-FP8 outputs (`merge --dtype fp8`, `export --dtype fp8`) and FP8 bases, on genuine fixtures.

The truth is plain torch, written here on purpose without the library: the rule (scale = amax(|W32|) / 448 per
128x128 block, 1 for an all-zero block; q = e4m3(clamp(W32 / scale, -448, 448)), nearest even) applied block by
block to W32 from the fixtures' own references (`delta_fp32` = s * B@A and `live_fp32` masters, written by the
fixture's trainer). Every scale must equal the reference's; a code may differ only where the reference value
W32 / scale sits within fp32 rounding of a rounding boundary (counted). The tiny models' dims (64, 162, 32) are
not multiples of 128: the grids have partial blocks. Every output is loaded by transformers (its FP8 config's
`dequantize=True`) and run forward.
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

from .conftest import FIXTURES, json_payload

TINY = FIXTURES / "primerl-tiny"
HEAD = FIXTURES / "primerl-head"
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def load_dir(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def is_projection(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith(".weight") and name.removesuffix(".weight").rsplit(".", 1)[-1] in PROJ


# ----------------------------------------------------------------------------------------- the reference
def rule(w32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The issue's rule, block by block, in plain torch: (codes, scale_inv)."""
    rows, cols = w32.shape
    gr, gc = -(-rows // 128), -(-cols // 128)
    codes = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    scales = torch.empty(gr, gc, dtype=torch.float32)
    for i in range(gr):
        for j in range(gc):
            blk = w32[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            s = blk.abs().max() / 448.0
            s = torch.ones_like(s) if s == 0 else s
            scales[i, j] = s
            codes[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (blk / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    return codes, scales


def expand(scales: torch.Tensor, shape) -> torch.Tensor:
    return scales.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]


def dequant(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return codes.float() * expand(scales, codes.shape)


def assert_rule(codes: torch.Tensor, scales: torch.Tensor, w32: torch.Tensor, name: str) -> int:
    """`codes`/`scales` are the rule applied to `w32`: scales equal, codes equal except at rounding boundaries;
    returns the number of boundary ties."""
    ref_codes, ref_scales = rule(w32)
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32, name
    assert torch.equal(scales, ref_scales), name
    differ = codes.view(torch.uint8) != ref_codes.view(torch.uint8)
    if not bool(differ.any()):
        return 0
    x = (w32 / expand(ref_scales, w32.shape)).clamp(-448, 448)[differ]
    a, b = codes.float()[differ], ref_codes.float()[differ]
    mid = (a + b) / 2
    # adjacent codes, and the exact value within a few fp32 ulps of the midpoint between them
    assert bool(((a - b).abs() <= (torch.maximum(a.abs(), b.abs()) / 8) + 2**-9).all()), name
    assert bool(((x - mid).abs() <= 4 * torch.finfo(torch.float32).eps * mid.abs().clamp_min(2**-9)).all()), name
    return int(differ.sum())


# ----------------------------------------------------------------------------------------- transformers
def transformers_loads(out: Path, ours: dict[str, torch.Tensor]) -> dict:
    """Load `out` with transformers on CPU (FP8 config, dequantize=True), compare its weights with our
    dequantized values, run a forward pass. transformers 5.24's dequantizing loader takes each block's size as
    dim // grid (`Fp8Dequantize._dequantize_one`): right where a dim is a multiple of 128 or at most 128, not
    for a dim like 162 (a grid of 2: it uses blocks of 81). Those tensors must equal that reading of our bytes;
    the rest must equal ours exactly. Returns the counts."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    model = AutoModelForCausalLM.from_pretrained(
        out, quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.float32
    )
    sd = dict(model.state_dict())
    for key in [k for k in sd if k.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
        # transformers fuses a MoE layer's experts: gate_up_proj[e] = cat(gate_proj, up_proj), down_proj[e]
        prefix, fused = key.rsplit(".", 1)
        for e, w in enumerate(sd.pop(key)):
            if fused == "down_proj":
                sd[f"{prefix}.{e}.down_proj.weight"] = w
            else:
                sd[f"{prefix}.{e}.gate_proj.weight"], sd[f"{prefix}.{e}.up_proj.weight"] = w.chunk(2)
    exact = misread = 0
    for name, t in ours.items():
        if t.dtype != torch.float8_e4m3fn:
            continue
        s = ours[name + "_scale_inv"]
        rows, cols = t.shape
        gr, gc = s.shape
        if all(d % 128 == 0 or d <= 128 for d in (rows, cols)):
            assert torch.equal(sd[name], dequant(t, s)), name
            exact += 1
        else:  # transformers' reading: blocks of rows // gr by cols // gc
            bn, bk = rows // gr, cols // gc
            theirs = t.float() * s.repeat_interleave(bn, 0).repeat_interleave(bk, 1)
            assert torch.equal(sd[name], theirs), name
            misread += 1
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4, 5]])).logits
    assert bool(torch.isfinite(logits).all())
    return {"exact": exact, "misread_by_transformers": misread}


# ----------------------------------------------------------------------------------------- the outputs
@pytest.fixture(scope="module")
def tiny_merge(tmp_path_factory):
    out = tmp_path_factory.mktemp("fp8") / "merged"
    r = run("merge", TINY / "base_model", TINY / "outputs/checkpoints/step_3/trainer", out, "--dtype", "fp8",
            "--json")
    assert r.exit_code == 0, r.output
    return out, json_payload(r.output)


def test_merge_fp8_of_a_dense_checkpoint_is_the_rule_applied_to_base_plus_delta(tiny_merge):
    out, report = tiny_merge
    got, base = load_dir(out), load_file(str(TINY / "base_model/model.safetensors"))
    ref = load_file(str(TINY / "reference.safetensors"))
    quantized = ties = 0
    for name, b in base.items():
        if is_projection(name, b):
            w32 = b.float() + ref[f"delta_fp32.adapter0.{name.removesuffix('.weight')}"]
            ties += assert_rule(got[name], got[name + "_scale_inv"], w32, name)
            quantized += 1
        else:
            assert torch.equal(got[name], b), name  # kept: the base's bf16, unchanged
    assert quantized == 21 and set(got) == set(base) | {n + "_scale_inv" for n in base if is_projection(n, base[n])}
    assert ties <= 5
    fp8 = report["fp8"]
    assert fp8["quantized"] == 21 and len(fp8["kept"]) == 15 and 0.02 < fp8["rel_error_max"] < 0.04
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128] and qc["fmt"] == "e4m3"
    assert "lm_head" in qc["modules_to_not_convert"] and "model.layers.0.self_attn.q_proj" not in qc["modules_to_not_convert"]


def test_the_reports_figures_are_its_outputs_error_against_w32(tiny_merge):
    """Per quantized tensor, in plain fp64 on the written codes and scales: ||W32||, ||deq(q) - W32|| and
    ||s * B@A|| (whichever error path ran: the C kernel or its reference, tests/test_fp8_error_c.py)."""
    out, report = tiny_merge
    got, base = load_dir(out), load_file(str(TINY / "base_model/model.safetensors"))
    ref = load_file(str(TINY / "reference.safetensors"))
    figures = report["fp8"]["tensors"]
    for name, b in base.items():
        if not is_projection(name, b):
            continue
        delta = ref[f"delta_fp32.adapter0.{name.removesuffix('.weight')}"]
        w32 = (b.float() + delta).double()
        err = dequant(got[name], got[name + "_scale_inv"]).double() - w32
        f = figures[name]
        assert f["weight_norm"] == pytest.approx(float(w32.norm()), rel=1e-6), name
        assert f["error_norm"] == pytest.approx(float(err.norm()), rel=1e-5), name
        assert f["delta_norm"] == pytest.approx(float(delta.double().norm()), rel=1e-5), name
        assert f["rel_error"] == pytest.approx(f["error_norm"] / f["weight_norm"]), name


def test_merge_fp8_from_the_checkpoint_s_own_masters_writes_the_merge_s_bytes(tiny_merge, tmp_path):
    """`merge --base-from-checkpoint --dtype fp8`: W32 from the checkpoint's fp32 masters, which in this LoRA
    run hold the base's bf16 values exactly (the merge checks a sample), so every file equals the HF-base merge's."""
    out, _ = tiny_merge
    own = tmp_path / "own"
    r = run("merge", "--base-from-checkpoint", TINY / "outputs/checkpoints/step_3/trainer", own, "--config-from",
            TINY / "base_model", "--dtype", "fp8", "--json")
    assert r.exit_code == 0, r.output
    assert json_payload(r.output)["fp8"]["quantized"] == 21
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert files and files == sorted(p.name for p in own.glob("*.safetensors"))
    assert all((own / f).read_bytes() == (out / f).read_bytes() for f in files)


def test_a_delta_below_the_quantization_error_is_named_in_a_warning(tiny_merge, tmp_path):
    """A LoRA scaled down 160,000x (alpha 1e-4 for the run's 16) is smaller than every module's FP8 rounding:
    the merge still succeeds, and its report and warning name the modules; the real scale warns of none."""
    _, report = tiny_merge
    assert report["fp8"]["delta_below_error"] == [] and report["fp8"]["warnings"] == []
    r = run("merge", TINY / "base_model", TINY / "outputs/checkpoints/step_3/trainer", tmp_path / "small",
            "--alpha", "0.0001", "--dtype", "fp8", "--json")
    assert r.exit_code == 0, r.output
    fp8 = json_payload(r.stdout)["fp8"]  # (stderr: --alpha contradicts the run's config)
    assert len(fp8["delta_below_error"]) == 21
    assert all(not f["delta_survives"] and f["delta_norm"] < f["error_norm"] for f in fp8["tensors"].values())
    assert len(fp8["warnings"]) == 1 and "rounds away" in fp8["warnings"][0]
    assert fp8["delta_below_error"][0] in fp8["warnings"][0]


def test_transformers_loads_the_fp8_merge_and_its_partial_blocks_expose_its_loader(tiny_merge):
    out, _ = tiny_merge
    counts = transformers_loads(out, load_dir(out))
    # q/k/v/o (64 or 32 rows, 64 cols) read exactly; gate/up/down (a 162 dim, grid 2) read with blocks of 81
    assert counts == {"exact": 12, "misread_by_transformers": 9}


def test_export_fp8_of_a_full_fine_tune_quantizes_the_trained_masters(tmp_path):
    g = HEAD / "G_head_fullft"
    out = tmp_path / "fp8"
    r = run("export", g / "outputs/checkpoints/step_3/trainer", out, "--config-from", g / "base_model", "--dtype",
            "fp8")
    assert r.exit_code == 0, r.output
    assert "11 tensors cast to bfloat16" in r.output  # the kept ones: not called float8 in the summary
    got, ref = load_dir(out), load_file(str(g / "reference.safetensors"))
    n = 0
    for name, t in got.items():
        if name.endswith("_scale_inv"):
            continue
        live = ref[f"live_fp32.{name}"]
        if t.dtype == torch.float8_e4m3fn:
            assert_rule(t, got[name + "_scale_inv"], live, name)
            n += 1
        else:
            assert t.dtype == torch.bfloat16 and torch.equal(t, live.to(torch.bfloat16)), name
    assert n == 14
    transformers_loads(out, got)


def test_merge_fp8_of_a_moe_checkpoint_quantizes_each_expert(tmp_path):
    f = HEAD / "F_head_moe"
    out = tmp_path / "fp8"
    r = run("merge", f / "base_model", f / "outputs/checkpoints/step_3/trainer", out, "--dtype", "fp8")
    assert r.exit_code == 0, r.output
    got, base = load_dir(out), load_file(str(f / "base_model/model.safetensors"))
    ref = load_file(str(f / "reference.safetensors"))
    experts = 0
    for name, b in base.items():
        if is_projection(name, b):
            delta = ref.get(f"delta_fp32.{name}")
            w32 = b.float() + delta if delta is not None else b.float()
            assert_rule(got[name], got[name + "_scale_inv"], w32, name)
            experts += ".experts." in name
        else:
            assert torch.equal(got[name], b), name  # the router mlp.gate stays bf16
    assert experts == 2 * 4 * 3
    cfg = json.loads((out / "config.json").read_text())
    assert "model.layers.0.mlp.gate" in cfg["quantization_config"]["modules_to_not_convert"]
    transformers_loads(out, got)


@pytest.fixture(scope="module")
def mts_fp8(tmp_path_factory):
    from tests.factory.head_factory import make_head_run
    from tests.factory.head_spec import HeadSpec

    spec = HeadSpec.e_mts()
    paths = make_head_run(tmp_path_factory.mktemp("mts") / "run", spec)
    out = tmp_path_factory.mktemp("mts-fp8") / "fp8"
    r = run("export", paths.checkpoint, out, "--config-from", paths.base_model, "--dtype", "fp8")
    assert r.exit_code == 0, r.output
    return paths, out


def test_export_fp8_with_modules_to_save_keeps_them_bf16_and_is_read_exactly_by_transformers(mts_fp8):
    paths, out = mts_fp8
    got, ref = load_dir(out), load_file(str(paths.reference))
    for name, t in got.items():
        if name.endswith("_scale_inv"):
            continue
        live = ref[f"live_fp32.{name}"]
        if t.dtype == torch.float8_e4m3fn:
            assert_rule(t, got[name + "_scale_inv"], live + ref[f"delta_fp32.{name}"], name)
        else:  # lm_head and model.norm trained (modules_to_save): bf16 of the trained master
            assert torch.equal(t, live.to(torch.bfloat16)), name
    # every dim is 64 or 128: transformers reads every weight exactly
    assert transformers_loads(out, got)["misread_by_transformers"] == 0


# ----------------------------------------------------------------------------------------- FP8 bases
def test_merge_into_an_fp8_base_is_bf16_of_dequantized_plus_delta(tiny_merge, tmp_path):
    fp8_base, _ = tiny_merge
    adapter = TINY / "reference_peft_adapter"
    out = tmp_path / "bf16"
    r = run("merge", fp8_base, adapter, out, "--allow-zero-delta")
    assert r.exit_code == 0, r.output
    got, base = load_dir(out), load_dir(fp8_base)
    a_cfg = json.loads((adapter / "adapter_config.json").read_text())
    s = a_cfg["lora_alpha"] / a_cfg["r"]
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in cfg and not any(n.endswith("_scale_inv") for n in got)
    n = 0
    for name, t in got.items():
        if name in base and base[name].dtype == torch.float8_e4m3fn:
            deq = dequant(base[name], base[name + "_scale_inv"])
            mod = name.removesuffix(".weight")
            a = lora[f"base_model.model.{mod}.lora_A.weight"].float()
            b = lora[f"base_model.model.{mod}.lora_B.weight"].float()
            assert torch.equal(t, (deq + s * (b @ a)).to(torch.bfloat16)), name
            n += 1
        else:
            assert torch.equal(t, base[name]), name
    assert n == 21

    again = tmp_path / "fp8"
    r = run("merge", fp8_base, adapter, again, "--dtype", "fp8")
    assert r.exit_code == 0, r.output
    got = load_dir(again)
    for name, t in got.items():
        if t.dtype == torch.float8_e4m3fn:
            mod = name.removesuffix(".weight")
            a = lora[f"base_model.model.{mod}.lora_A.weight"].float()
            b = lora[f"base_model.model.{mod}.lora_B.weight"].float()
            w32 = dequant(base[name], base[name + "_scale_inv"]) + s * (b @ a)
            assert_rule(t, got[name + "_scale_inv"], w32, name)


def test_a_quantized_base_of_another_kind_is_refused(tmp_path):
    base = tmp_path / "awq"
    shutil.copytree(TINY / "base_model", base)
    cfg = json.loads((base / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (base / "config.json").write_text(json.dumps(cfg))
    r = run("merge", base, TINY / "reference_peft_adapter", tmp_path / "out")
    assert r.exit_code != 0 and "quant_method 'awq'" in r.output and not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------- the proof side
def _edit(src: Path, dst: Path, fn) -> Path:
    """A copy of FP8 dir `src` with its model.safetensors rewritten by `fn(tensors)` (safetensors' own writer)."""
    from safetensors.torch import save_file

    shutil.copytree(src, dst)
    t = load_file(str(dst / "model.safetensors"))
    fn(t)
    (dst / "SHA256SUMS").unlink()
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_diff_vs_base_adapter_accepts_an_fp8_merge_and_reports_its_quantization(tiny_merge):
    out, _ = tiny_merge
    r = run("diff-vs-base", out, TINY / "base_model", "--adapter", TINY / "reference_peft_adapter", "--json")
    assert r.exit_code == 0, r.output
    rep = json_payload(r.output)
    check = rep["adapter_check"]
    assert check["passed"] and check["fp8_checked"] == 21 and check["fp8_ties"] <= 20
    assert 0.02 < check["fp8_error_max"] < 0.04
    t = {x["name"]: x for x in rep["tensors"]}["model.layers.0.self_attn.q_proj.weight"]
    a = t["adapter_check"]
    assert a["ok"] and a["scales_off"] == 0 and a["delta_norm"] > a["error_norm"] and a["delta_survives"]
    # plain diff reads the FP8 side by its dequantized value
    r = run("diff-vs-base", out, TINY / "base_model", "--json")
    assert r.exit_code == 0 and json_payload(r.output)["counts"] == {"differs": 21, "identical": 15}


@pytest.mark.parametrize("fault", ["one code", "a scale"])
def test_diff_vs_base_adapter_refuses_one_wrong_code_or_scale(tiny_merge, tmp_path, fault):
    out, _ = tiny_merge
    name = "model.layers.1.mlp.up_proj.weight"

    def corrupt(t):
        if fault == "one code":
            codes = t[name].view(torch.uint8).clone()
            codes[100, 7] = codes[100, 7] ^ 1  # the next code up or down: one e4m3 step
            t[name] = codes.view(torch.float8_e4m3fn)
        else:
            s = t[name + "_scale_inv"].clone()
            s[1, 0] = s[1, 0] * 1.01  # 1% off (a few ulps stay within what an fp32 merge kernel may give)
            t[name + "_scale_inv"] = s

    bad = _edit(out, tmp_path / "bad", corrupt)
    r = run("diff-vs-base", bad, TINY / "base_model", "--adapter", TINY / "reference_peft_adapter", "--json")
    assert r.exit_code == 4, r.output
    rep = json_payload(r.output)
    assert [o["name"] for o in rep["adapter_check"]["off"]] == [name]
    a = {x["name"]: x for x in rep["tensors"]}[name]["adapter_check"]
    assert (a["elements_off"], a["scales_off"]) == (1, 0) if fault == "one code" else a["scales_off"] == 1


def test_diff_vs_base_adapter_refuses_an_fp8_output_of_the_previous_step(tmp_path):
    e = HEAD / "E_head_dense"
    out = tmp_path / "step2-fp8"
    r = run("merge", e / "base_model", e / "outputs/checkpoints/step_2/trainer", out, "--dtype", "fp8")
    assert r.exit_code == 0, r.output
    ok = run("diff-vs-base", out, e / "base_model", "--adapter", e / "outputs/checkpoints/step_2/trainer")
    assert ok.exit_code == 0, ok.output
    r = run("diff-vs-base", out, e / "base_model", "--adapter", e / "outputs/checkpoints/step_3/trainer", "--json")
    assert r.exit_code == 4, r.output
    assert len(json_payload(r.output)["adapter_check"]["off"]) >= 1


def test_inspect_and_verify_deep_read_an_fp8_dir_in_prime_rl_s_weights_fp8_place(tiny_merge, tmp_path):
    out, _ = tiny_merge
    fp8 = tmp_path / "outputs" / "weights" / "step_3" / "weights-FP8"
    shutil.copytree(out, fp8)
    r = run("verify", fp8, "--deep", "--json")
    assert r.exit_code == 0, r.output
    r = run("inspect", fp8, "--json")
    f = json_payload(r.output)["fp8"]
    assert (f["quantized"], f["kept"], f["problems"]) == (21, 15, [])

    def zero_scale(t):
        s = t["model.layers.0.mlp.down_proj.weight_scale_inv"].clone()
        s[0, 0] = 0.0
        t["model.layers.0.mlp.down_proj.weight_scale_inv"] = s
        del t["model.layers.0.self_attn.q_proj.weight_scale_inv"]

    bad = _edit(out, tmp_path / "bad", zero_scale)
    r = run("verify", bad, "--deep")
    assert r.exit_code != 0
    assert "model.layers.0.self_attn.q_proj.weight" in r.output and "without its" in r.output
    assert "not finite and positive" in r.output


def test_adapter_to_dcp_against_an_fp8_base_checks_logical_shapes_and_writes_dequantized_masters(tiny_merge, tmp_path):
    from ckpt_tools.formats.dcp.reader import DcpCheckpoint

    fp8_base, _ = tiny_merge
    out = tmp_path / "resume"
    r = run("adapter-to-dcp", TINY / "reference_peft_adapter", out, "--base", fp8_base, "--lr", "1e-5")
    assert r.exit_code == 0, r.output
    stored = load_dir(fp8_base)
    with DcpCheckpoint.open(out) as ckpt, ckpt.base_weights() as masters:
        name = "model.layers.1.mlp.down_proj.weight"  # [64, 162]: a partial column block
        assert torch.equal(masters.read_tensor(name), dequant(stored[name], stored[name + "_scale_inv"]))
        assert not any(n.endswith("_scale_inv") for n in masters.names())


def test_extract_adapter_checks_its_lora_against_an_fp8_base_s_logical_shapes(tiny_merge, tmp_path):
    """`extract-adapter --base FP8_DIR`: the LoRA fits the FP8 merge of its own base ([O, I], not the scale
    grid) and is refused against another model's FP8 export, naming the logical shapes."""
    fp8_base, _ = tiny_merge
    ckpt = TINY / "outputs/checkpoints/step_3/trainer"
    r = run("extract-adapter", ckpt, tmp_path / "ok", "--base", fp8_base)
    assert r.exit_code == 0 and "not checked" not in r.output, r.output
    g = HEAD / "G_head_fullft"
    other = tmp_path / "other-fp8"
    r = run("export", g / "outputs/checkpoints/step_3/trainer", other, "--config-from", g / "base_model", "--dtype",
            "fp8")
    assert r.exit_code == 0, r.output
    r = run("extract-adapter", ckpt, tmp_path / "bad", "--base", other)
    assert r.exit_code != 0 and "do not fit the base weight [64, 128]" in r.output, r.output
    assert not (tmp_path / "bad").exists()


def test_average_merge_fp8_and_an_fp8_base_requantized_load_in_transformers(tiny_merge, tmp_path):
    e = HEAD / "E_head_dense" / "outputs" / "checkpoints"
    avg = tmp_path / "avg-fp8"
    r = run("average", e / "step_2" / "trainer", e / "step_3" / "trainer", avg, "--merge",
            HEAD / "E_head_dense" / "base_model", "--dtype", "fp8")
    assert r.exit_code == 0, r.output
    assert run("verify", avg, "--deep").exit_code == 0
    transformers_loads(avg, load_dir(avg))
    fp8_base, _ = tiny_merge
    again = tmp_path / "again"
    r = run("merge", fp8_base, TINY / "reference_peft_adapter", again, "--dtype", "fp8")
    assert r.exit_code == 0, r.output
    transformers_loads(again, load_dir(again))
