"""`ckpt average` and `ckpt resize-adapter` against plain torch, on HEAD-factory runs that keep every step
(FSDP2 gloo ranks, torch DCP; dense and MoE with EP): the references read the checkpoints with
torch.distributed.checkpoint and compute in fp64 with torch.linalg; the outputs are read back with
safetensors and loaded by PEFT; the merged average is compared with `ckpt merge` of each step."""
from __future__ import annotations

import json
import re
import math

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from ckpt_tools.cli import main
from ckpt_tools.core.delta_math import choose_rank, ema_weights, normalize_weights
from ckpt_tools.core.errors import UsageError
from tests.factory.head_factory import HeadSpec, make_head_run
from tests.factory.head_spec import ATTN_TARGETS, EXPERT_PROJ

PROJ_EXPERT = {v: k for k, v in EXPERT_PROJ.items()}   # gate_proj -> w1, ...


def ckpt(*args) -> dict:
    r = CliRunner().invoke(main, [*map(str, args), "--json"])
    doc = json.loads(r.stdout)
    assert r.exit_code == 0, (r.stdout, r.stderr)
    return doc


def ckpt_fails(*args) -> dict:
    r = CliRunner().invoke(main, [*map(str, args), "--json"])
    doc = json.loads(r.stdout)
    assert r.exit_code != 0 and doc["error"], r.stdout
    return doc["error"]


# ------------------------------------------------------------------------------------ the runs
@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    spec = HeadSpec.e_dense(world_size=2, num_layers=2, max_steps=3, ckpt_interval=1)
    return spec, make_head_run(tmp_path_factory.mktemp("dense"), spec)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    spec = HeadSpec.f_moe(max_steps=3, ckpt_interval=1)
    return spec, make_head_run(tmp_path_factory.mktemp("moe"), spec)


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """Another run (its own base model dir), with LoRA on the attention projections only."""
    spec = HeadSpec.e_dense(world_size=2, num_layers=2, max_steps=1, ckpt_interval=None, targets=ATTN_TARGETS)
    return spec, make_head_run(tmp_path_factory.mktemp("other"), spec)


@pytest.fixture(scope="module")
def mts(tmp_path_factory):
    """A dense run with modules_to_save = lm_head, norm (prime-rl HEAD trains model.norm and lm_head whole)."""
    spec = HeadSpec.e_mts(max_steps=3, ckpt_interval=1)
    return spec, make_head_run(tmp_path_factory.mktemp("mts"), spec)


@pytest.fixture(scope="module")
def step1_adapter(dense, tmp_path_factory):
    """Step 1 of the dense run as a PEFT adapter (`ckpt extract-adapter`)."""
    _spec, run = dense
    out = tmp_path_factory.mktemp("adapters") / "step_1"
    ckpt("extract-adapter", run.checkpoints[1], out)
    return out


# ------------------------------------------------------------------------------------ references
def dcp_deltas(ckpt_dir, spec) -> dict[str, torch.Tensor]:
    """module -> s * B @ A in fp64, read with torch.distributed.checkpoint (experts: one module each)."""
    import torch.distributed.checkpoint as dcp
    md = dcp.FileSystemReader(str(ckpt_dir)).read_metadata()
    keys = [k for k in md.state_dict_metadata if k.startswith("app.model.") and "lora_" in k]
    sd = {k: torch.empty(md.state_dict_metadata[k].size, dtype=md.state_dict_metadata[k].properties.dtype)
          for k in keys}
    dcp.load(sd, checkpoint_id=str(ckpt_dir), no_dist=True)
    s = spec.lora_alpha / spec.lora_rank
    out = {}
    for k in keys:
        if not k.endswith("lora_A.0"):
            continue
        a, b = sd[k].double(), sd[k.replace("lora_A", "lora_B")].double()
        name = k[len("app.model."):]
        if a.dim() == 2:
            out[name[:-len(".lora_A.0")]] = s * b @ a
        else:                                     # grouped experts: [E, r, in] / [E, out, r]
            experts, w = name[:-len("_lora_A.0")].rsplit(".", 1)
            for x in range(a.shape[0]):
                out[f"{experts}.{x}.{EXPERT_PROJ[w]}"] = s * b[x] @ a[x]
    return out


def dcp_full(ckpt_dir, names) -> dict[str, torch.Tensor]:
    """HF name -> the checkpoint's fp32 master of a trained full tensor, read with torch DCP (fp64)."""
    import torch.distributed.checkpoint as dcp
    md = dcp.FileSystemReader(str(ckpt_dir)).read_metadata()
    keys = {n: f"app.model.{n}" for n in names}
    sd = {k: torch.empty(md.state_dict_metadata[k].size, dtype=md.state_dict_metadata[k].properties.dtype)
          for k in keys.values()}
    dcp.load(sd, checkpoint_id=str(ckpt_dir), no_dist=True)
    return {n: sd[k].double() for n, k in keys.items()}


def peft_deltas(adapter_dir) -> dict[str, torch.Tensor]:
    """module -> scale * B @ A in fp64 from a PEFT dir, with PEFT's scale rule (rank/alpha patterns)."""
    cfg = json.loads((adapter_dir / "adapter_config.json").read_text())
    sd = load_file(str(adapter_dir / "adapter_model.safetensors"))
    out = {}
    for k, a in sd.items():
        if k.endswith(".lora_A.weight"):
            m = k[len("base_model.model."):-len(".lora_A.weight")]
            r = cfg["rank_pattern"].get(m, cfg["r"])
            alpha = cfg["alpha_pattern"].get(m, cfg["lora_alpha"])
            assert a.shape[0] == r and a.dtype == torch.float32
            out[m] = (alpha / r) * sd[k.replace("lora_A", "lora_B")].double() @ a.double()
    return out


def best_rank_k(d: torch.Tensor, k: int) -> torch.Tensor:
    """The truncated SVD of the full matrix (torch.linalg.svd, fp64): Eckart-Young's D_k."""
    u, s, vh = torch.linalg.svd(d, full_matrices=False)
    return (u[:, :k] * s[:k]) @ vh[:k]


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x - ref).norm() / ref.norm())


# ------------------------------------------------------------------------------------ average
def test_the_average_of_a_checkpoint_a_slim_one_and_an_adapter_is_the_weighted_mean_of_their_deltas(
        dense, step1_adapter, tmp_path):
    spec, run = dense
    slim = tmp_path / "step_3-slim"
    ckpt("slim", run.checkpoints[3], slim, "--base", run.base_model)
    # the slim copy lies outside the run: --alpha says what its (and the other checkpoint's) run used
    doc = ckpt("average", step1_adapter, run.checkpoints[2], slim, tmp_path / "avg", "--weights", "1,2,5",
               "--alpha", spec.lora_alpha)
    res = doc["result"]
    assert res["weights"] == [1 / 8, 2 / 8, 5 / 8] and [i["kind"] for i in res["inputs"]] == ["peft", "dcp", "dcp"]
    assert res["rank"] == 3 * spec.lora_rank and res["rank_rule"] is None
    steps = [dcp_deltas(run.checkpoints[s], spec) for s in (1, 2, 3)]
    got = peft_deltas(tmp_path / "avg")
    assert sorted(got) == sorted(steps[0]) and len(got) == len(spec.lora_modules())
    for m, d in got.items():
        ref = sum(w * st[m] for w, st in zip((1 / 8, 2 / 8, 5 / 8), steps))
        assert rel(d, ref) < 1e-6, m


def test_ema_equals_the_recurrence_in_step_order_whatever_the_order_given(dense, tmp_path):
    spec, run = dense
    beta = 0.7
    doc = ckpt("average", run.checkpoints[3], run.checkpoints[1], run.checkpoints[2], tmp_path / "ema", "--ema", beta)
    res = doc["result"]
    assert [i["step"] for i in res["inputs"]] == [1, 2, 3] and res["method"] == "ema"
    assert res["weights"] == pytest.approx(ema_weights(3, beta), rel=1e-15)
    steps = [dcp_deltas(run.checkpoints[s], spec) for s in (1, 2, 3)]
    got = peft_deltas(tmp_path / "ema")
    for m, d in got.items():
        ema = steps[0][m]                      # ema_1 = x_1 seeds the recurrence
        for st in steps[1:]:
            ema = beta * ema + (1 - beta) * st[m]
        assert rel(d, ema) < 1e-6, m


def test_average_with_a_rank_is_the_best_rank_k_of_the_exact_average(dense, tmp_path):
    spec, run = dense
    exact = ckpt("average", *[run.checkpoints[s] for s in (1, 2, 3)], tmp_path / "exact")["result"]
    k = ckpt("average", *[run.checkpoints[s] for s in (1, 2, 3)], tmp_path / "k5", "--rank", 5)["result"]
    assert exact["rank"] == 24 and k["rank"] == 5
    full, low = peft_deltas(tmp_path / "exact"), peft_deltas(tmp_path / "k5")
    for m in full:
        sv = torch.linalg.svdvals(full[m])
        err = float(sv[5:].square().sum().sqrt())
        assert float((full[m] - low[m]).norm()) == pytest.approx(err, rel=1e-6), m
        assert k["truncations"][m]["error"] == pytest.approx(err, rel=1e-6), m


# ------------------------------------------------------------------------------------ resize
def test_resize_error_is_the_norm_of_the_discarded_singular_values_and_no_random_rank_k_beats_it(dense, tmp_path):
    spec, run = dense
    K = 3
    doc = ckpt("resize-adapter", run.checkpoints[3], tmp_path / "r3", "--rank", K)
    res = doc["result"]
    ref = dcp_deltas(run.checkpoints[3], spec)
    got = peft_deltas(tmp_path / "r3")
    g = torch.Generator().manual_seed(0)
    total_sq = 0.0
    for m, d in ref.items():
        sv = torch.linalg.svdvals(d)
        err = float(sv[K:].square().sum().sqrt())
        t = res["truncations"][m]
        assert t["rank"] == K and t["rank_in"] == spec.lora_rank
        assert t["error"] == pytest.approx(err, rel=1e-6), m
        assert t["energy_kept"] == pytest.approx(float(sv[:K].square().sum() / sv.square().sum()), rel=1e-9)
        assert float((d - got[m]).norm()) == pytest.approx(err, rel=1e-6), m
        assert rel(got[m], best_rank_k(d, K)) < 1e-6, m
        total_sq += err ** 2
        for _ in range(10):   # a random rank-K fit (best scalar multiple) and a random K-dim projection of D
            x = torch.randn(d.shape[0], K, generator=g, dtype=torch.float64) @ \
                torch.randn(K, d.shape[1], generator=g, dtype=torch.float64)
            x *= float((d * x).sum() / (x * x).sum())
            q, _ = torch.linalg.qr(torch.randn(d.shape[0], K, generator=g, dtype=torch.float64))
            for y in (x, q @ (q.T @ d)):
                assert float((d - y).norm()) >= err * (1 - 1e-12)
    assert res["error"] == pytest.approx(math.sqrt(total_sq), rel=1e-6)


def test_resize_by_energy_keeps_the_smallest_rank_that_reaches_it(dense, step1_adapter, tmp_path):
    spec, _run = dense
    E = 0.9
    res = ckpt("resize-adapter", step1_adapter, tmp_path / "e", "--energy", E)["result"]
    ref = peft_deltas(step1_adapter)
    got = peft_deltas(tmp_path / "e")
    for m, d in ref.items():
        sq = torch.linalg.svdvals(d).square()
        cum = torch.cumsum(sq, 0) / sq.sum()
        k = res["ranks"][m]
        assert cum[k - 1] >= E and (k == 1 or cum[k - 2] < E), m
        assert float((d - got[m]).norm()) == pytest.approx(float(sq[k:].sum().sqrt()), rel=1e-6), m
        assert rel(got[m], best_rank_k(d, k)) < 1e-6, m
    assert len(set(res["ranks"].values())) > 1   # the modules differ: rank_pattern is exercised


def test_the_outputs_load_in_peft_with_exactly_their_deltas(dense, step1_adapter, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    spec, run = dense
    ckpt("resize-adapter", step1_adapter, tmp_path / "e", "--energy", 0.9)
    ckpt("average", step1_adapter, run.checkpoints[2], tmp_path / "avg", "--ema", 0.5)
    for out in (tmp_path / "e", tmp_path / "avg"):
        base = AutoModelForCausalLM.from_pretrained(str(run.base_model), dtype=torch.float32)
        model = PeftModel.from_pretrained(base, str(out))
        ours = peft_deltas(out)
        seen = 0
        for name, mod in model.named_modules():
            if hasattr(mod, "lora_A") and "default" in getattr(mod, "lora_A", {}):
                m = name[len("base_model.model."):]
                d = mod.scaling["default"] * mod.lora_B["default"].weight.double() @ mod.lora_A["default"].weight.double()
                assert rel(d, ours[m]) < 1e-6, m
                seen += 1
        assert seen == len(ours) == len(spec.lora_modules())
        with torch.no_grad():
            assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


# ------------------------------------------------------------------------------------ --merge
@pytest.mark.parametrize("which", ["dense", "mts"])
def test_the_merged_average_equals_the_average_of_the_merged_steps_to_bf16_rounding(which, request, tmp_path):
    _spec, run = request.getfixturevalue(which)     # mts: lm_head and model.norm are replaced, not merged
    steps = (1, 2, 3)
    for s in steps:
        ckpt("merge", run.base_model, run.checkpoints[s], tmp_path / f"m{s}", "--dtype", "fp32")
    doc = ckpt("average", *[run.checkpoints[s] for s in steps], tmp_path / "avg", "--merge", run.base_model)
    assert doc["result"]["merged_modules"] == 14
    assert doc["result"]["counts"]["replace"] == (2 if which == "mts" else 0)
    ours = load_file(str(tmp_path / "avg" / "model.safetensors"))
    merged = [load_file(str(tmp_path / f"m{s}" / "model.safetensors")) for s in steps]
    base = load_file(str(run.base_model / "model.safetensors"))
    assert sorted(ours) == sorted(base)
    for name, t in ours.items():
        assert t.dtype == torch.bfloat16
        ref = sum(m[name].double() for m in merged) / len(steps)
        if torch.equal(base[name].double(), ref):
            assert torch.equal(t, base[name]), name       # not a LoRA target: the base, bit for bit
            continue
        # one bf16 rounding of W + mean delta: within half a bf16 ulp of the exact mean, plus the fp32 noise
        # of the terms (a mean that cancels to near zero keeps their absolute rounding error)
        ulp = torch.pow(2.0, torch.floor(torch.log2(ref.abs().clamp_min(1e-30))) - 7)
        noise = 1e-6 * torch.stack([m[name].double().abs() for m in merged]).amax(0)
        assert ((t.double() - ref).abs() <= 0.5 * ulp + noise).all(), name
        assert (t == ref.to(torch.bfloat16)).double().mean() > 0.99, name


# ------------------------------------------------------------------------------------ modules_to_save
def test_trained_full_tensors_are_averaged_with_the_same_weights_and_load_in_peft(mts, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    spec, run = mts
    names = ["lm_head.weight", "model.norm.weight"]
    res = ckpt("average", *[run.checkpoints[s] for s in (1, 2, 3)], tmp_path / "avg", "--weights", "1,1,2")["result"]
    assert res["modules_to_save"] == names
    cfg = json.loads((tmp_path / "avg" / "adapter_config.json").read_text())
    assert cfg["modules_to_save"] == ["lm_head", "model.norm"]
    sd = load_file(str(tmp_path / "avg" / "adapter_model.safetensors"))
    masters = [dcp_full(run.checkpoints[s], names) for s in (1, 2, 3)]
    for n in names:
        ref = 0.25 * masters[0][n] + 0.25 * masters[1][n] + 0.5 * masters[2][n]
        assert not torch.equal(masters[0][n], masters[2][n])        # they trained
        got = sd[f"base_model.model.{n}"]
        assert got.dtype == torch.float32 and rel(got.double(), ref) < 1e-6, n
    steps = [dcp_deltas(run.checkpoints[s], spec) for s in (1, 2, 3)]
    for m, d in peft_deltas(tmp_path / "avg").items():
        assert rel(d, 0.25 * steps[0][m] + 0.25 * steps[1][m] + 0.5 * steps[2][m]) < 1e-6, m
    base = AutoModelForCausalLM.from_pretrained(str(run.base_model), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(tmp_path / "avg"))
    loaded = dict(model.named_parameters())
    assert torch.equal(loaded["base_model.model.lm_head.modules_to_save.default.weight"], sd["base_model.model.lm_head.weight"])
    assert torch.equal(loaded["base_model.model.model.norm.modules_to_save.default.weight"],
                       sd["base_model.model.model.norm.weight"])
    # resize-adapter keeps them as they are
    ckpt("resize-adapter", tmp_path / "avg", tmp_path / "r2", "--rank", 2)
    small = load_file(str(tmp_path / "r2" / "adapter_model.safetensors"))
    for n in names:
        assert torch.equal(small[f"base_model.model.{n}"], sd[f"base_model.model.{n}"])


def test_runs_that_train_different_full_tensors_are_refused_even_when_targets_may_differ(dense, mts, tmp_path):
    err = ckpt_fails("average", dense[1].checkpoints[3], mts[1].checkpoints[3], tmp_path / "avg",
                     "--allow-mismatch", "base", "--allow-mismatch", "targets")
    assert "train different full tensors (modules_to_save)" in err["message"] and "lm_head.weight" in err["message"]


# ------------------------------------------------------------------------------------ MoE
def test_moe_average_and_resize_are_exact_per_expert(moe, tmp_path):
    spec, run = moe
    ckpts = [run.checkpoints[s] for s in (1, 2, 3)]
    avg = ckpt("average", *ckpts, tmp_path / "avg", "--layout", "prime-rl")["result"]   # per-expert modules
    steps = [dcp_deltas(c, spec) for c in ckpts]
    got = peft_deltas(tmp_path / "avg")
    experts = [m for m in got if ".experts." in m]
    assert len(experts) == spec.num_layers * spec.num_experts * 3 and avg["modules"] == len(got) == len(steps[0])
    for m, d in got.items():
        assert rel(d, sum(st[m] for st in steps) / 3) < 1e-6, m
    res = ckpt("resize-adapter", ckpts[-1], tmp_path / "r2", "--rank", 2, "--layout", "prime-rl")["result"]
    small = peft_deltas(tmp_path / "r2")
    for m in experts:
        sv = torch.linalg.svdvals(steps[-1][m])
        err = float(sv[2:].square().sum().sqrt())
        assert res["truncations"][m]["error"] == pytest.approx(err, rel=1e-6), m
        assert float((steps[-1][m] - small[m]).norm()) == pytest.approx(err, rel=1e-6), m


def test_moe_average_in_the_peft_layout_loads_in_peft_and_applies_every_expert(moe, tmp_path):
    """The default layout: gate and up of every expert as PEFT's fused expert LoRA (target_parameters). The
    same factors as the per-expert layout, read back by ckpt's reader; PEFT applies them: its logits are
    an fp32 merge's of the average, far from the base's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from ckpt_tools.formats.peft.adapter import open_peft_adapter

    spec, run = moe
    ckpts = [run.checkpoints[s] for s in (1, 2, 3)]
    for layout in ("peft", "prime-rl"):
        ckpt("average", *ckpts, tmp_path / layout, "--layout", layout)
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    keys = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    assert cfg["target_parameters"] and not any(re.search(r"\.experts\.\d+\.", k) for k in keys), sorted(keys)[:4]
    with open_peft_adapter(tmp_path / "peft", strict=True).lora() as fused, \
            open_peft_adapter(tmp_path / "prime-rl", strict=True).lora() as per_expert:
        assert sorted(fused.modules) == sorted(per_expert.modules)
        for m in per_expert.modules:
            for x, y in zip(fused.read_pair(m), per_expert.read_pair(m)):
                assert torch.equal(x, y), m
    ckpt("merge", run.base_model, tmp_path / "peft", tmp_path / "merged", "--dtype", "fp32")
    ids = torch.arange(0, 24).remainder(spec.vocab_size).reshape(2, 12)
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(str(run.base_model), dtype=torch.float32).eval()
        base_logits = base(input_ids=ids).logits
        peft_logits = PeftModel.from_pretrained(base, str(tmp_path / "peft")).eval()(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32).eval()
        merged_logits = merged(input_ids=ids).logits
    moved = float((merged_logits - base_logits).abs().max())
    assert moved > 1e-3 and float((peft_logits - merged_logits).abs().max()) < 1e-3 * moved


# ------------------------------------------------------------------------------------ refusals
def test_inputs_of_different_alphas_are_refused_naming_them_unless_allowed(dense, tmp_path):
    spec, run = dense
    a32 = tmp_path / "step_1-a32"
    ckpt("extract-adapter", run.checkpoints[1], a32, "--alpha", 32)
    err = ckpt_fails("average", run.checkpoints[2], a32, tmp_path / "avg")
    assert err["type"] == "FormatError" and "lora alpha 16 " in err["message"] and " vs 32 " in err["message"]
    assert "--allow-mismatch alpha" in err["hint"] and not (tmp_path / "avg").exists()
    ckpt("average", run.checkpoints[2], a32, tmp_path / "avg", "--allow-mismatch", "alpha")
    d1, d2 = dcp_deltas(run.checkpoints[1], spec), dcp_deltas(run.checkpoints[2], spec)
    for m, d in peft_deltas(tmp_path / "avg").items():
        assert rel(d, 0.5 * 2 * d1[m] + 0.5 * d2[m]) < 1e-6, m     # each input keeps its own scale


def test_runs_of_different_bases_and_targets_are_refused_naming_the_difference(dense, other, tmp_path):
    _spec, run = dense
    _ospec, orun = other
    err = ckpt_fails("average", run.checkpoints[3], orun.checkpoints[1], tmp_path / "avg")
    assert "base model 'base_model'" in err["message"] and str(orun.base_model) in err["message"]
    assert "LoRA targets differ: 14 vs 8 modules" in err["message"] and "model.layers.0.mlp.down_proj" in err["message"]
    err = ckpt_fails("average", run.checkpoints[3], orun.checkpoints[1], tmp_path / "avg", "--allow-mismatch", "base")
    assert "base model" not in err["message"] and "LoRA targets differ" in err["message"]
    assert "--allow-mismatch targets" in err["hint"] and not (tmp_path / "avg").exists()


def test_bad_weights_ema_and_rank_rules_are_usage_errors(dense, tmp_path):
    _spec, run = dense
    two = [run.checkpoints[1], run.checkpoints[2]]
    for extra, words in ((["--weights", "1"], "--weights has 1 values for 2 inputs"),
                         (["--weights", "1,-1"], "positive sum"),
                         (["--ema", "1.5"], "beta must be in [0, 1)"),
                         (["--rank", "2", "--energy", "0.9"], "not both")):
        err = ckpt_fails("average", *two, tmp_path / "x", *extra)
        assert err["type"] == "UsageError" and words in err["message"], (extra, err)
    err = ckpt_fails("average", run.checkpoints[1], tmp_path / "x")
    assert "at least 2 inputs" in err["message"]
    err = ckpt_fails("resize-adapter", run.checkpoints[1], tmp_path / "x")
    assert "exactly one of --rank K or --energy E" in err["message"]


def test_the_rank_rules_and_weights_on_plain_numbers():
    assert ema_weights(1, 0.9) == [1.0]
    assert sum(ema_weights(5, 0.9)) == pytest.approx(1.0, abs=1e-15)
    assert normalize_weights([1, 3]) == [0.25, 0.75]
    s = torch.tensor([3.0, 2.0, 1.0, 0.0], dtype=torch.float64)   # energies 9, 4, 1 of 14
    assert [choose_rank(s, energy=e) for e in (0.5, 9 / 14, 0.65, 13 / 14, 0.99, 1.0)] == [1, 1, 2, 2, 3, 3]
    assert choose_rank(s, rank=10) == 4 and choose_rank(torch.zeros(3, dtype=torch.float64), energy=0.9) == 1
    with pytest.raises(UsageError):
        choose_rank(s, energy=0.0)


def test_the_clis_mismatch_choices_are_the_ops():
    from ckpt_tools.cli.commands.average import MISMATCH_CHOICES
    from ckpt_tools.ops.average import MISMATCH_KINDS
    assert MISMATCH_CHOICES == MISMATCH_KINDS


def test_a_dry_run_writes_nothing_and_an_existing_out_needs_overwrite(dense, tmp_path):
    _spec, run = dense
    two = [run.checkpoints[2], run.checkpoints[3]]
    for extra in ([], ["--merge", run.base_model], ["--rank", "2"]):
        doc = ckpt("average", *two, tmp_path / "o", *extra, "--dry-run")
        assert doc["dry_run"] and doc["plan"] and not (tmp_path / "o").exists(), extra
    ckpt("average", *two, tmp_path / "o")
    before = (tmp_path / "o" / "adapter_model.safetensors").read_bytes()
    err = ckpt_fails("average", *two, tmp_path / "o", "--ema", "0.5")
    assert err["type"] == "OutputExistsError"
    ckpt("average", *two, tmp_path / "o", "--ema", "0.9", "--overwrite")
    assert (tmp_path / "o" / "adapter_model.safetensors").read_bytes() != before
    err = ckpt_fails("resize-adapter", tmp_path / "o", tmp_path / "o" / "inner", "--rank", "2")
    assert not (tmp_path / "o" / "inner").exists() and err["message"]
