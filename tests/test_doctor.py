"""ckpt doctor: each trap, alone in an otherwise clean config, is found with its key and its fix; the
clean config exits 0; the genuine fixtures' run dirs (16e747c and HEAD) are read and their real traps
found (the tiny run's weights export is the base; E's offloaded resume would not restore the lr).

Configs are `tests/fixtures/configs/good.toml` (written from prime-rl 16e747c's field names and
defaults) with one change per case. Each case's TOML parses with prime-rl 16e747c's own RLConfig
(checked while writing these tests: ckpt-tools' value for every leaf of the parsed config equals
prime-rl's, 0 differences), except the one prime-rl refuses (an unknown key in a strict table)."""
from __future__ import annotations

import copy
import json
import shutil
import tomllib
from pathlib import Path

import pytest
import tomlkit
from click.testing import CliRunner

from ckpt_tools.cli import main
from ckpt_tools.ops.doctor.run import doctor
from ckpt_tools.ops.doctor.traps import TRAPS
from ckpt_tools.core.primerl_state import SchedulerSpec, build_optim_state

from .conftest import FIXTURE, FIXTURES, HEAD_FIXTURES, json_payload

CONFIGS = FIXTURES / "configs"
GOOD = tomllib.loads((CONFIGS / "good.toml").read_text())


@pytest.fixture(autouse=True)
def empty_hf_cache(tmp_path, monkeypatch):
    """Hub ids resolve from the local HF cache only: point it at an empty dir, so no test depends on
    what this machine happens to have cached."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))


def _set(d: dict, path: str, value) -> None:
    *parents, leaf = path.split(".")
    for p in parents:
        d = d.setdefault(p, {})
    if value is DELETE:
        d.pop(leaf)
    else:
        d[leaf] = value


DELETE = object()

# trap id -> (changes to good.toml, the key the finding must name, a piece of its fix)
CASES = {
    "unknown-key (dropped)": ({"trainer.optim.lr": DELETE, "trainer.optim.learning_rate": 1e-5},
                              "trainer.optim.learning_rate", "keys there: lr"),
    "unknown-key (refused)": ({"trainer.model.nmae": "x"}, "trainer.model.nmae", "remove `nmae"),
    "unknown-key (broadcast timeout)": ({"trainer.weight_broadcast.timeout": 7200}, "trainer.weight_broadcast.timeout",
                                        "remove `timeout = 7200`"),
    "dist-timeout": ({"trainer.dist_timeout_seconds": DELETE}, "trainer.dist_timeout_seconds",
                     "dist_timeout_seconds = 3600"),
    "client-timeout": ({"orchestrator.client.timeout": DELETE}, "orchestrator.client.timeout", "timeout = 5400"),
    "no-retention": ({"max_steps": DELETE, "ckpt.keep_last": DELETE}, "ckpt.keep_last", "keep_last = 2"),
    "tokenizer-default": ({"trainer.model.name": DELETE, "trainer.tokenizer.name": DELETE}, "trainer.tokenizer.name",
                          'name = "Qwen/Qwen3-32B"'),
    "lora-alpha": ({"orchestrator.model.lora.alpha": DELETE}, "orchestrator.model.lora.alpha", "alpha = 64.0"),
    "weights-are-base": ({"trainer.ckpt.weights": DELETE}, "trainer.ckpt.weights", 'weights = "None"'),
    "linear-decay-crash": ({"trainer.scheduler.type": "linear", "trainer.scheduler.warmup_steps": 10,
                            "trainer.scheduler.decay_steps": 1}, "trainer.scheduler.decay_steps", "decay_steps = 2"),
    "max-model-len-noop": ({"max_model_len": 32768}, "max_model_len", "[inference.model]\nmax_model_len = 32768"),
    "max-tokens": ({"orchestrator.sampling.max_tokens": DELETE}, "orchestrator.sampling.max_tokens", "max_tokens = "),
    "world-size": ({"trainer.model.cp": 3}, "trainer.model.cp", "cp = 2"),
    "output-dir": ({"orchestrator.output_dir": "runs/a/run_a"}, "orchestrator.output_dir", 'output_dir = "runs/a"'),
}


def write_case(tmp: Path, changes: dict, name: str = "rl.toml") -> Path:
    d = copy.deepcopy(GOOD)
    for path, value in changes.items():
        _set(d, path, value)
    p = tmp / name
    p.write_text(tomlkit.dumps(d))
    return p


def run(*args):
    return CliRunner().invoke(main, ["doctor", *map(str, args)])


def test_the_clean_config_has_no_finding_and_exits_0(tmp_path):
    r = run(CONFIGS / "good.toml", "--json")
    assert r.exit_code == 0, r.output
    rep = json_payload(r.stdout)
    assert rep["findings"] == [] and rep["generation"] == "16e747c"


@pytest.mark.parametrize("case", list(CASES))
def test_each_trap_alone_is_found_with_its_key_and_fix(case, tmp_path):
    changes, key, fix = CASES[case]
    cfg = write_case(tmp_path, changes)
    r = run(cfg, "--json")
    assert r.exit_code == 3, r.output
    findings = json_payload(r.stdout)["findings"]
    trap = case.split(" ")[0]
    assert [f["trap"] for f in findings] == [trap], findings     # this trap, and nothing else
    f = findings[0]
    assert f["key"] == key and fix in f["fix"], f
    assert f["why"] and f["source"] and f["toml"].endswith(key.rpartition(".")[2])


def test_every_trap_has_a_test():
    covered = {c.split(" ")[0] for c in CASES} | {"shadowed-table", "disk", "resume-lr", "resume-lr-offload",
                                                  "broadcast-modules-to-save",   # tests/test_modules_to_save.py
                                                  "attempts"}   # tests/test_attempts.py
    assert covered == {name for name, _ in TRAPS}


def test_the_dropped_lr_typo_says_what_lr_training_runs_at(tmp_path):
    rep = doctor(None, files=[write_case(tmp_path, CASES["unknown-key (dropped)"][0])])
    (f,) = rep.findings
    assert f.severity == "error" and "lr = 1e-06" in f.why and f.value == 1e-5


def test_a_later_files_table_replaces_the_earlier_ones_whole(tmp_path):
    """prime-rl merges files per top-level table: extra.toml's [wandb] drops good.toml's name/offline."""
    (tmp_path / "extra.toml").write_text('[wandb]\nproject = "lora-rl"\n')
    main_toml = write_case(tmp_path, {"toml_files": ["extra.toml"]})
    rep = doctor(None, files=[main_toml])
    assert {f.key for f in rep.findings} == {"wandb.name", "wandb.offline"}
    assert all(f.trap == "shadowed-table" and "extra.toml" in f.fix for f in rep.findings)
    assert rep.exit_code == 3


def test_toml_files_inside_a_table_is_reported_as_never_loaded(tmp_path):
    rep = doctor(None, files=[write_case(tmp_path, {"trainer.toml_files": ["x.toml"]})])
    (f,) = rep.findings
    assert f.trap == "shadowed-table" and f.key == "trainer.toml_files" and f.severity == "warning"


def test_the_documented_bad_config_shows_its_traps():
    rep = doctor(None, files=[CONFIGS / "bad.toml"])
    found = {(f.trap, f.key) for f in rep.findings}
    assert {("max-model-len-noop", "max_model_len"), ("tokenizer-default", "trainer.tokenizer.name"),
            ("no-retention", "ckpt.keep_last"), ("world-size", "trainer.model.cp"),
            ("lora-alpha", "orchestrator.model.lora.alpha"), ("unknown-key", "trainer.optim.learning_rate"),
            ("unknown-key", "trainer.weight_broadcast.timeout"), ("output-dir", "orchestrator.output_dir"),
            ("max-tokens", "orchestrator.sampling.max_tokens"), ("dist-timeout", "trainer.dist_timeout_seconds"),
            ("weights-are-base", "trainer.ckpt.weights")} <= found, found


# ------------------------------------------------------------------------------------------ run dirs
def test_the_genuine_16e747c_run_dir_is_read_and_its_weights_export_is_the_base():
    rep = doctor(FIXTURE)
    assert rep.generation == "16e747c" and rep.config_files[0]["path"].endswith("run_default/configs/orch.toml")
    assert [c["step"] for c in rep.checkpoints] == [3]
    (w,) = [f for f in rep.findings if f.trap == "weights-are-base"]
    assert w.severity == "error" and w.fix.startswith("ckpt merge ") and "step_3/trainer" in w.fix
    assert not [f for f in rep.findings if f.trap == "unknown-key"]   # every key of the genuine orch.toml is known
    assert any("trainer settings" in n for n in rep.notes)


def test_a_16e747c_run_whose_adapter_configs_claim_another_alpha_is_found(tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURE / "outputs" / "run_default", run_dir / "outputs" / "run_default")
    cfg = run_dir / "outputs/run_default/broadcasts/step_3/adapter_config.json"
    d = json.loads(cfg.read_text())
    d["lora_alpha"] = 64.0          # the trainer's alpha, while orch.toml trains at 16 (r8-a16.0)
    cfg.write_text(json.dumps(d))
    rep = doctor(run_dir)
    (f,) = [f for f in rep.findings if f.trap == "lora-alpha"]
    assert f.key == "orchestrator.model.lora.alpha" and f.value == 16.0 and "ckpt fix-adapter" in f.fix


def test_head_dense_run_an_offloaded_resume_would_not_restore_the_lr(tmp_path):
    """E_head_dense as an interrupted run would leave it (its genuine step_2 checkpoint, no final
    step_3): resuming it with the default optim_cpu_offload would not restore step_2's lr."""
    run_dir = tmp_path / "E"
    for part in ("configs", "base_model", "outputs/checkpoints/step_2"):
        shutil.copytree(HEAD_FIXTURES / "E_head_dense" / part, run_dir / part)
    r = run(run_dir, "--json")
    assert r.exit_code == 3, r.output
    rep = json_payload(r.stdout)
    assert rep["generation"] == "head"
    (f,) = rep["findings"]
    # step_2 (an interval checkpoint) holds lr 0.01; the freshly built warmup LinearLR sets 0.01 * 1e-8
    assert f["trap"] == "resume-lr-offload" and f["severity"] == "warning"
    assert "step_2 holds lr 0.01" in f["why"] and "1e-10" in f["why"]
    assert f["fix"].startswith("[trainer.model]\noptim_cpu_offload = false")


@pytest.mark.parametrize("variant", ["E_head_dense", "F_head_moe", "G_head_fullft"])
def test_head_run_configs_are_read_with_every_key_known(variant):
    rep = doctor(HEAD_FIXTURES / variant, compare_weights=False)
    assert rep.generation == "head" and rep.config_files[0]["path"].endswith("configs/trainer.json")
    assert not [f for f in rep.findings if f.trap == "unknown-key"]


def test_head_runs_that_finished_have_no_resume_trap():
    """E, F and G end with their final checkpoint (step = max_steps): nothing to resume."""
    for v in ("E_head_dense", "F_head_moe", "G_head_fullft"):
        assert doctor(HEAD_FIXTURES / v).findings == [], v


def test_resume_with_a_new_lr_is_found_against_the_checkpoints_lr(tmp_path):
    cfg = write_case(tmp_path, {"ckpt.resume_step": 3})
    rep = doctor(None, files=[cfg], outputs=FIXTURE / "outputs", compare_weights=False)
    (f,) = [f for f in rep.findings if f.trap == "resume-lr"]
    # the genuine checkpoint was trained at lr 0.01; the config asks 1e-5: set-lr scales by 1e-3
    assert f.severity == "error" and "--in-place --scale 0.001" in f.fix and "0.01" in f.why
    assert [x.trap for x in rep.findings] == ["resume-lr"]


def test_checkpoints_that_will_not_fit_the_disk_suggest_gc(tmp_path):
    cfg = write_case(tmp_path, {"max_steps": 10**8, "ckpt.interval": 1, "ckpt.keep_last": DELETE})
    rep = doctor(None, files=[cfg], outputs=FIXTURE / "outputs", compare_weights=False)
    (f,) = [f for f in rep.findings if f.trap == "disk"]
    assert f.severity == "error" and f.fix.startswith("ckpt gc ") and "--keep-full 2" in f.fix


def test_the_linear_decay_crash_is_real_in_torch():
    """What the check claims: prime-rl's linear schedule with decay_steps = 1 raises ZeroDivisionError
    when it enters the decay phase (replayed with torch's own schedulers), and 2 does not."""
    spec = SchedulerSpec(kind="linear", warmup_steps=10, decay_steps=1, max_steps=200)
    build_optim_state(1e-5, spec, 198, preview_steps=0)
    with pytest.raises(ZeroDivisionError):
        build_optim_state(1e-5, spec, 199, preview_steps=0)
    build_optim_state(1e-5, SchedulerSpec(kind="linear", warmup_steps=10, decay_steps=2, max_steps=200), 200,
                      preview_steps=0)


def test_unreadable_config_is_one_clean_error_and_json_under_json(tmp_path):
    p = tmp_path / "rl.toml"
    p.write_text("[trainer\n")
    r = run(p)
    assert r.exit_code == 1 and "not valid TOML" in r.stderr and "Traceback" not in r.output
    r = run(p, "--json")
    assert r.exit_code == 1 and "not valid TOML" in json.loads(r.stdout)["error"]["message"]


def test_a_head_run_that_resumed_with_the_optimizer_offloaded_ran_at_the_wrong_lr(tmp_path):
    run_dir = tmp_path / "E"
    shutil.copytree(HEAD_FIXTURES / "E_head_dense", run_dir)
    cfg = json.loads((run_dir / "configs/trainer.json").read_text())
    cfg["resume"] = {"step": 2, "dir": None}      # the run's trainer config as a resumed run writes it
    (run_dir / "configs/trainer.json").write_text(json.dumps(cfg))
    (f,) = doctor(run_dir, compare_weights=False).findings
    assert f.trap == "resume-lr-offload" and f.severity == "error" and "this run resumed from" in f.why


def test_a_bare_checkpoints_dir_is_read_without_a_config(tmp_path):
    ck = tmp_path / "checkpoints"
    shutil.copytree(FIXTURE / "outputs" / "checkpoints", ck)
    rep = doctor(ck)
    assert rep.generation is None and rep.findings == [] and [c["step"] for c in rep.checkpoints] == [3]
    assert any("no prime-rl config" in n for n in rep.notes) and rep.exit_code == 0


def test_the_save_count_follows_prime_rls_cadence():
    """Every interval multiple before max_steps, plus the final checkpoint (counted, not listed: a
    10**8-step run costs nothing)."""
    from ckpt_tools.ops.doctor.traps_run import saves_after

    def listed(max_steps, interval, after):
        return len([k for k in range(after + 1, max_steps) if interval and k % interval == 0]) + (after < max_steps)

    assert all(saves_after(m, i, a) == listed(m, i, a) for m in range(1, 30) for i in (None, 1, 2, 5) for a in range(32))
    assert saves_after(10**8, 1) == 10**8
