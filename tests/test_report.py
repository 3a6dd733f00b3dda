"""`ckpt report` on genuine factory runs with several checkpoint steps (HEAD layout: dense LoRA, MoE LoRA
with grouped experts, a full fine-tune): every number of --json equals plain torch computed on the truth
tensors (each step loaded through torch's own DCP loader, `dcp_to_torch_save`; the final step is also the
factory's live state, reference.safetensors), and every past step's lr is the one the run's optimizer
used at that step (the factory logs it before each optimizer step); the planned lr of the later steps is
the one the run went on to use; the set-lr overlay is the schedule of a checkpoint `ckpt set-lr` really
patched. The page is one self-contained file (no <script>, nothing fetched), rendered in headless
Chromium (tests/test_report_page.py)."""
from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import ckpt_tools
from ckpt_tools.io.owned import OUTPUT_MARKER
from ckpt_tools.cli import main
from tests.factory.head_factory import HeadSpec, make_head_run
from tests.factory.head_spec import EXPERT_PROJ

REL = 1e-5
SPECS = {
    # linear warmup 2 then a WSD decay over the last 2 steps: every past lr differs from the next
    "dense": HeadSpec.e_dense(world_size=2, num_layers=2, max_steps=5, ckpt_interval=1, warmup_steps=2,
                              decay_steps=2),
    "moe": HeadSpec.f_moe(max_steps=4, ckpt_interval=1),            # cosine after 1 warmup step
    "fullft": HeadSpec.g_fullft(max_steps=3, ckpt_interval=1, scheduler="linear", warmup_steps=2),
    "mts": HeadSpec.e_mts(max_steps=3, ckpt_interval=1),           # LoRA + modules_to_save lm_head, norm
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    made = {}
    for name, spec in SPECS.items():
        made[name] = (spec, make_head_run(tmp_path_factory.mktemp(f"report-{name}"), spec))
    return made


@pytest.fixture(scope="module")
def dcp_truth(tmp_path_factory):
    """step checkpoint -> its state through torch's own DCP loader (cached)."""
    tmp = tmp_path_factory.mktemp("dcp-truth")
    cache: dict[Path, dict] = {}

    def load(ckpt: Path) -> dict:
        if ckpt not in cache:
            out = tmp / f"{len(cache)}.pt"
            dcp_to_torch_save(str(ckpt), str(out))
            cache[ckpt] = torch.load(out, weights_only=False)["app"]
            out.unlink()
        return cache[ckpt]
    return load


def close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=REL, abs_tol=0.0) or (a == b == 0.0)


def fro(t: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(t.to(torch.float64)))


def lora_truth(model: dict, spec: HeadSpec) -> dict[str, tuple[float, float]]:
    """HF module -> (||s B@A||_F, ||W||_F), B@A formed in fp64 by plain torch."""
    out = {}
    for module in spec.lora_modules():
        if module.endswith(".experts"):
            for w, proj in EXPERT_PROJ.items():
                a, b = model[f"{module}.{w}_lora_A.0"], model[f"{module}.{w}_lora_B.0"]
                base = model[f"{module}.{w}"]
                for e in range(spec.num_experts):
                    delta = spec.scale * (b[e].double() @ a[e].double())
                    out[f"{module}.{e}.{proj}"] = (fro(delta), fro(base[e]))
        else:
            a, b = model[f"{module}.lora_A.0"], model[f"{module}.lora_B.0"]
            out[module] = (fro(spec.scale * (b.double() @ a.double())), fro(model[f"{module}.weight"]))
    return out


def moment_truth(optim_state: dict, group_of) -> dict[str, dict[str, float]]:
    acc: dict[str, dict[str, float]] = {}
    for fqn, st in optim_state.items():
        g = acc.setdefault(group_of(fqn), {})
        for f in ("exp_avg", "exp_avg_sq"):
            g[f] = g.get(f, 0.0) + fro(st[f]) ** 2
    return {g: {f: math.sqrt(v) for f, v in d.items()} for g, d in acc.items()}


def lora_group(fqn: str) -> str:
    """An optimizer param's module kind: `model.layers.0.self_attn.q_proj.lora_A.0` -> `self_attn.q_proj`;
    experts' `w1_lora_A.0` -> `mlp.experts.gate_proj`; `model.norm.weight` -> `norm`; `lm_head.weight` -> `lm_head`."""
    if not fqn.startswith("model.layers."):
        return fqn.removeprefix("model.").removesuffix(".weight")
    rest = fqn.split(".", 3)[3]
    if ".experts." in rest:
        part, w = rest.split(".experts.")
        return f"{part}.experts.{EXPERT_PROJ[w.split('_lora_')[0]]}"
    return rest.rsplit(".lora_", 1)[0].removesuffix(".weight")


def report_json(path, *args) -> dict:
    r = CliRunner().invoke(main, ["report", str(path), *map(str, args), "--json"])
    assert r.exit_code == 0, (r.stdout, r.stderr)
    doc = json.loads(r.stdout)
    assert doc["ok"] and doc["command"] == "report"
    return doc["result"]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_every_lora_number_equals_plain_torch_on_the_truth_tensors_at_every_step(runs, dcp_truth, kind):
    spec, paths = runs[kind]
    res = report_json(paths.root / "outputs" / "checkpoints")
    assert sorted(res["steps"], key=int) == [str(s) for s in spec.checkpoint_steps()]
    for step, ckpt in paths.checkpoints.items():
        app = dcp_truth(ckpt)
        got = res["steps"][str(step)]
        truth = lora_truth(app["model"], spec)
        assert sorted(got["modules"]) == sorted(truth)
        for module, (d, w) in truth.items():
            m = got["modules"][module]
            assert close(m["delta_fro"], d) and close(m["weight_fro"], w), (step, module, m, d, w)
            assert close(m["rel_delta"], d / w)
        moments = moment_truth(app["optimizers"]["state"], lora_group)
        assert sorted(g for g, v in got["groups"].items() if v["exp_avg_fro"] is not None) == sorted(moments)
        for g, v in moments.items():
            assert close(got["groups"][g]["exp_avg_fro"], v["exp_avg"]), (step, g)
            assert close(got["groups"][g]["exp_avg_sq_fro"], v["exp_avg_sq"]), (step, g)
        # a group's change is the norm of its modules' stacked changes
        for g, row in got["groups"].items():
            mods = [t for n, t in truth.items() if re.sub(r"\.\d+\.", ".", n.split(".", 3)[3]) == g]
            assert mods and close(row["delta_fro"], math.sqrt(sum(d * d for d, _ in mods)))
    # the final step is also the factory's live state (reference.safetensors)
    ref = load_file(str(paths.reference))
    last = res["steps"][str(spec.max_steps)]["modules"]
    for name in ref:
        if name.startswith("delta_fp32."):
            module = name.removeprefix("delta_fp32.").removesuffix(".weight")
            assert close(last[module]["delta_fro"], fro(ref[name])), module


def test_a_full_fine_tune_is_measured_from_its_masters_against_the_base(runs, dcp_truth):
    spec, paths = runs["fullft"]
    res = report_json(paths.root / "outputs" / "checkpoints")   # the base from the run config's model.name
    base = load_file(str(paths.base_model / "model.safetensors"))
    for step, ckpt in paths.checkpoints.items():
        model = dcp_truth(ckpt)["model"]
        got = res["steps"][str(step)]
        assert got["training"] == "full fine-tune"
        trained = {k.removesuffix(".weight"): v for k, v in model.items() if k in base}
        assert sorted(got["modules"]) == sorted(trained)
        for module, w in trained.items():
            w0 = base[module + ".weight"].float()
            m = got["modules"][module]
            assert close(m["delta_fro"], fro(w - w0)) and close(m["weight_fro"], fro(w0)), (step, module)
            assert m["max_abs_delta"] == float((w - w0).abs().max())
        moments = moment_truth(dcp_truth(ckpt)["optimizers"]["state"], lora_group)
        for g, v in moments.items():
            assert close(got["groups"][g]["exp_avg_fro"], v["exp_avg"]), (step, g)
            assert close(got["groups"][g]["exp_avg_sq_fro"], v["exp_avg_sq"]), (step, g)


def test_modules_to_save_are_measured_from_their_masters_beside_the_lora(runs, dcp_truth):
    spec, paths = runs["mts"]
    res = report_json(paths.root / "outputs" / "checkpoints")
    base = load_file(str(paths.base_model / "model.safetensors"))
    for step, ckpt in paths.checkpoints.items():
        app = dcp_truth(ckpt)
        got = res["steps"][str(step)]["modules"]
        saved = {k.removesuffix(".weight") for k in app["optimizers"]["state"] if ".lora_" not in k}
        assert saved == {"lm_head", "model.norm"}
        assert sorted(got) == sorted(set(lora_truth(app["model"], spec)) | saved)
        for module, (d, w) in lora_truth(app["model"], spec).items():
            assert close(got[module]["delta_fro"], d) and close(got[module]["weight_fro"], w), (step, module)
        for module in saved:
            w, w0 = app["model"][module + ".weight"], base[module + ".weight"].float()
            assert close(got[module]["delta_fro"], fro(w - w0)), (step, module)
            assert fro(w - w0) > 0 or step == 1, (step, module)    # step 1 ran at the warmup's lr 1e-10
            assert close(got[module]["weight_fro"], fro(w0))
        moments = moment_truth(app["optimizers"]["state"], lora_group)
        for g, v in moments.items():
            assert close(res["steps"][str(step)]["groups"][g]["exp_avg_fro"], v["exp_avg"]), (step, g)


def test_every_past_step_ran_at_the_reported_lr_and_the_later_steps_at_the_planned_one(runs):
    for kind, (spec, paths) in runs.items():
        used = {s["step"]: s["lr_used"] for s in json.loads(paths.run_info.read_text())["per_step"]}
        assert len(set(used.values())) > 1, kind     # a schedule that moves
        for step, ckpt in paths.checkpoints.items():
            lr = report_json(ckpt)["lr"]
            assert lr["step"] == step and lr["max_steps"] == spec.max_steps
            assert {int(k): v for k, v in lr["past"].items()} == {k: used[k] for k in range(1, step + 1)}, kind
            assert {int(k): v for k, v in lr["planned"].items()} == {k: used[k] for k in range(step + 1, spec.max_steps + 1)}


def test_the_set_lr_overlay_is_the_schedule_of_the_checkpoint_set_lr_writes(runs, tmp_path):
    spec, paths = runs["dense"]
    ckpt = paths.checkpoints[2]
    for flag, value, kw in (("--set-lr", "3e-3", {"lr": 3e-3}), ("--scale", "0.3", {"scale": 0.3})):
        overlay = report_json(ckpt, flag, value)["lr"]["set_lr"]
        out = tmp_path / f"patched-{flag[2:]}"
        ckpt_tools.set_lr(ckpt, out, **kw)
        patched = report_json(out, "--run-config", paths.trainer_config)["lr"]
        assert overlay["planned"] == patched["planned"] and len(patched["planned"]) == spec.max_steps - 2
        assert overlay["lr_after"] == patched["planned"]["3"]


def test_a_slim_step_takes_its_weight_norms_from_the_bf16_base(runs, dcp_truth, tmp_path):
    spec, paths = runs["dense"]
    slim = tmp_path / "slim"
    ckpt_tools.slim(paths.checkpoints[3], slim)
    res = report_json(slim, "--base", paths.base_model, "--run-config", paths.trainer_config)
    assert res["steps"]["3"]["slim"] is True
    base = load_file(str(paths.base_model / "model.safetensors"))
    truth = lora_truth(dcp_truth(paths.checkpoints[3])["model"], spec)
    for module, (d, _w) in truth.items():
        m = res["steps"]["3"]["modules"][module]
        assert close(m["delta_fro"], d) and close(m["weight_fro"], fro(base[module + ".weight"].float()))


def test_a_merged_dir_against_its_base_is_measured_tensor_by_tensor(runs):
    spec, paths = runs["moe"]
    res = report_json(paths.expected_hf, "--base", paths.base_model)
    got = res["steps"]["merged"]["modules"]
    merged = load_file(str(paths.expected_hf / "model.safetensors"))
    base = load_file(str(paths.base_model / "model.safetensors"))
    assert sorted(got) == sorted(n.removesuffix(".weight") for n in merged)
    for n, w in merged.items():
        m = got[n.removesuffix(".weight")]
        w0 = base[n].float()
        assert close(m["delta_fro"], fro(w.float() - w0)) and close(m["weight_fro"], fro(w0)), n


def test_a_model_dir_without_base_is_refused_naming_the_flag(runs):
    _spec, paths = runs["moe"]
    r = CliRunner().invoke(main, ["report", str(paths.expected_hf), "--json"])
    assert r.exit_code == 2 and "--base" in json.loads(r.stdout)["error"]["message"]


def test_the_page_and_pngs_are_written_self_contained_and_never_over_an_existing_file(runs, tmp_path):
    _spec, paths = runs["moe"]
    page, pngs = tmp_path / "r.html", tmp_path / "png"
    r = CliRunner().invoke(main, ["report", str(paths.root / "outputs" / "checkpoints"), "-o", str(page),
                                  "--png", str(pngs), "--scale", "0.5"])
    assert r.exit_code == 0, r.output
    text = page.read_text()
    assert "<svg" in text and "<script" not in text.lower()
    assert "http://" not in text.replace("http://www.w3.org/", "") and "https://" not in text
    files = sorted(p.name for p in pngs.iterdir() if p.name != OUTPUT_MARKER)   # (the tool's own output marker)
    assert {"lr.png", "steps.png", "bytes.png"} <= set(files) and any(f.startswith("experts_") for f in files)
    from PIL import Image
    for f in files:
        with Image.open(pngs / f) as im:
            assert im.format == "PNG" and im.size[0] > 300
    again = CliRunner().invoke(main, ["report", str(paths.checkpoints[1]), "-o", str(page)])
    assert again.exit_code != 0 and "already exists" in again.output + again.stderr
    assert page.read_text() == text


def test_diff_vs_base_report_draws_the_comparison(runs, tmp_path):
    _spec, paths = runs["moe"]
    page = tmp_path / "diff.html"
    r = CliRunner().invoke(main, ["diff-vs-base", str(paths.expected_hf), str(paths.base_model), "--report", str(page),
                                  "--json"])
    assert r.exit_code == 0, r.stderr
    changed = [t for t in json.loads(r.stdout)["result"]["tensors"] if t["changed_fraction"]]
    text = page.read_text()
    assert changed and all(t["name"] in text for t in changed)
    assert "<svg" in text and "<script" not in text.lower()


CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser") if shutil.which(n)), None)
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--enable-logging=stderr", "--v=0"]


def chromium(page: Path, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    profile = tmp / f"profile-{len(list(tmp.glob('profile-*')))}"
    profile.mkdir()
    return subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args, page.as_uri()],
                          capture_output=True, text=True, timeout=180)


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it: "
                                             "apt-get install -y chromium)")
def test_the_page_renders_in_headless_chromium_not_blank_and_without_console_errors(runs, tmp_path):
    from PIL import Image, ImageStat
    _spec, paths = runs["moe"]
    page = tmp_path / "report.html"
    r = CliRunner().invoke(main, ["report", str(paths.root / "outputs" / "checkpoints"), "-o", str(page),
                                  "--scale", "0.5"])
    assert r.exit_code == 0, r.output
    shot = tmp_path / "shot.png"
    run = chromium(page, tmp_path, f"--screenshot={shot}", "--window-size=1280,2400")
    assert shot.is_file(), run.stderr[-2000:]
    with Image.open(shot) as im:
        assert im.size == (1280, 2400)
        gray = im.convert("L")
        assert ImageStat.Stat(gray).var[0] > 100          # not a blank page
        # the plots are drawn: a good share of the pixels is neither the page's background nor white
        hist = gray.histogram()
        assert sum(hist[:200]) > 0.05 * im.size[0] * im.size[1]
    console = [ln for ln in run.stderr.splitlines() if "CONSOLE" in ln or "Uncaught" in ln]
    assert console == [], console
    dom = chromium(page, tmp_path, "--dump-dom")
    assert dom.returncode == 0 and "<svg" in dom.stdout and "<script" not in dom.stdout.lower()
    assert [ln for ln in dom.stderr.splitlines() if "CONSOLE" in ln] == []
