"""ckpt_tools.formats.primerl.config reads both generations' run configs with prime-rl's own rules: the
genuine fixtures' files (every key known, every value as written), TOML includes and their per-table
precedence, the shared keys RLConfig copies down, the trainer tokenizer's early default, and the LoRA
scale rule of each generation. (The 16e747c rules were checked against that commit's RLConfig on the
configs of test_doctor: 0 of ~183 leaves per config differ.)"""
from __future__ import annotations

import json
import shutil

import pytest

from ckpt_tools.core.errors import FormatError, UsageError
from ckpt_tools.formats.primerl.files import GEN_16E747C, GEN_HEAD, config_files, locate_run_configs
from ckpt_tools.formats.primerl.config import load_run_config, lora_settings

from .conftest import FIXTURE, HEAD_FIXTURES, TRAINER


def load(*files, **sections):
    return load_run_config(config_files(list(files), sections))


def flat(d: dict, prefix: str) -> dict:
    """Leaf values of a JSON tree by dotted path (an empty dict is a leaf)."""
    out = {}
    for k, v in d.items():
        out.update(flat(v, f"{prefix}.{k}") if isinstance(v, dict) and v else {f"{prefix}.{k}": v})
    return out


@pytest.mark.parametrize("variant", ["E_head_dense", "F_head_moe", "G_head_fullft"])
def test_head_trainer_json_is_read_with_every_key_known_and_every_value_as_written(variant):
    files = locate_run_configs(HEAD_FIXTURES / variant / "outputs" / "checkpoints")
    assert files.generation == GEN_HEAD and [c.path.name for c in files.files] == ["trainer.json"]
    cfg = load_run_config(files)
    assert cfg.unknown == []
    raw = json.loads((HEAD_FIXTURES / variant / "configs" / "trainer.json").read_text())
    for path, v in flat(raw, "trainer").items():
        assert cfg.value(path) == v, path
    assert cfg.value("trainer.model.optim_cpu_offload") is True


def test_head_lora_scale_is_the_trainers_alpha_over_rank():
    e = lora_settings(load_run_config(locate_run_configs(HEAD_FIXTURES / "F_head_moe")))
    assert (e.trainer_rank, e.trainer_alpha, e.training_scale, e.consistent) == (8, 32.0, 4.0, True)
    assert lora_settings(load_run_config(locate_run_configs(HEAD_FIXTURES / "G_head_fullft"))) is None


def test_the_genuine_orch_toml_is_found_from_the_checkpoint_and_read_with_every_key_known():
    files = locate_run_configs(TRAINER)
    assert files.generation == GEN_16E747C
    assert files.files[0].path == (FIXTURE / "outputs/run_default/configs/orch.toml").resolve()
    cfg = load_run_config(files)
    assert cfg.unknown == [] and cfg.sections == {"orchestrator"}
    assert cfg.value("orchestrator.client.timeout") == 1200 and cfg.value("orchestrator.model.name") == "base_model"
    ls = lora_settings(cfg)   # trainer rank/alpha from the generated name r8-a16.0
    assert (ls.trainer_rank, ls.trainer_alpha, ls.training_alpha, ls.training_scale) == (8, 16.0, 16.0, 2.0)


def test_16e747c_trains_at_the_orchestrators_alpha_which_defaults_to_16(tmp_path):
    """examples/alphabet_sort/rl.toml at 16e747c: trainer rank 32, alpha 64; trains at 0.5, serves 2.0."""
    p = tmp_path / "rl.toml"
    p.write_text("[trainer.model.lora]\nrank = 32\nalpha = 64.0\n")
    ls = lora_settings(load(p))
    assert (ls.training_scale, ls.served_scale, ls.consistent) == (0.5, 2.0, False)
    assert load(p).value("orchestrator.model.lora.name") == "r32-a64.0"


def test_a_later_files_top_level_table_replaces_the_earlier_one(tmp_path):
    (tmp_path / "a.toml").write_text("[trainer]\ndist_timeout_seconds = 1000\n[trainer.optim]\nlr = 1e-5\n")
    (tmp_path / "b.toml").write_text("[trainer]\ndist_timeout_seconds = 2000\n")
    cfg = load(tmp_path / "a.toml", tmp_path / "b.toml")
    assert cfg.value("trainer.dist_timeout_seconds") == 2000
    assert cfg.value("trainer.optim.lr") == 1e-6          # a.toml's [trainer.optim] went with its [trainer]
    assert [(s.path, s.value) for s in cfg.shadowed] == [("trainer.optim.lr", 1e-5)]
    cfg = load(tmp_path / "b.toml", tmp_path / "a.toml")
    assert (cfg.value("trainer.optim.lr"), cfg.shadowed) == (1e-5, [])


def test_toml_files_load_after_the_file_relative_to_it_depth_first(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "main.toml").write_text('toml_files = ["sub/c1.toml"]\nmax_steps = 50\n')
    (tmp_path / "sub/c1.toml").write_text('toml_files = ["c2.toml"]\nmax_steps = 10\n')
    (tmp_path / "sub/c2.toml").write_text('[orchestrator]\nbatch_size = 32\n')
    files = config_files([tmp_path / "main.toml"])
    assert [c.path.name for c in files.files] == ["main.toml", "c1.toml", "c2.toml"]
    cfg = load_run_config(files)
    assert cfg.value("max_steps") == 10 and cfg.value("trainer.max_steps") == 10   # copied down (rl.py:351)
    assert cfg.value("orchestrator.batch_size") == 32


def test_a_section_file_nests_under_its_key(tmp_path):
    (tmp_path / "rl.toml").write_text("[orchestrator]\nbatch_size = 64\n")
    (tmp_path / "t.toml").write_text("dist_timeout_seconds = 2000\n[optim]\nlr = 3e-4\n")
    cfg = load(tmp_path / "rl.toml", trainer=tmp_path / "t.toml")
    assert cfg.value("trainer.dist_timeout_seconds") == 2000 and cfg.value("trainer.optim.lr") == 3e-4
    (tmp_path / "t2.toml").write_text('toml_files = ["x.toml"]\n')
    with pytest.raises(UsageError, match="NotImplementedError"):
        load(tmp_path / "rl.toml", trainer=tmp_path / "t2.toml")


def test_shared_keys_win_over_the_sections_own_and_the_tokenizer_defaults_before_them(tmp_path):
    p = tmp_path / "rl.toml"
    p.write_text('[model]\nname = "Org/Big"\n[ckpt]\ninterval = 5\n[trainer.ckpt]\ninterval = 7\n'
                 '[orchestrator]\noutput_dir = "elsewhere/run_x"\n')
    cfg = load(p)
    assert cfg.value("trainer.ckpt.interval") == 5 and "rl.py:267" in cfg.origin("trainer.ckpt.interval")
    assert cfg.value("orchestrator.ckpt.interval") == 5 and cfg.enabled("orchestrator.ckpt")
    assert cfg.value("trainer.model.name") == "Org/Big"
    assert cfg.value("trainer.tokenizer.name") == "Qwen/Qwen3-0.6B"      # the trap
    assert cfg.value("orchestrator.output_dir") == "outputs/run_default"


def test_variants_none_strings_and_unknown_keys(tmp_path):
    p = tmp_path / "rl.toml"
    p.write_text('[trainer.optim]\nlr = 1e-5\nmomentum = 0.5\n[trainer.ckpt]\nweights = "None"\n'
                 '[trainer.scheduler]\ntype = "cosine"\n[orchestrator.client]\ntimeuot = 5\n')
    cfg = load(p)
    assert cfg.variant("trainer.optim") == "adamw" and cfg.value("trainer.optim.betas1") == 0.9
    assert cfg.value("trainer.scheduler.warmup_steps") == 10 and cfg.value("trainer.scheduler.decay_steps") is None
    assert cfg.enabled("trainer.ckpt") and not cfg.enabled("trainer.ckpt.weights")
    unknown = {u.path: u.policy for u in cfg.unknown}
    assert unknown == {"trainer.optim.momentum": "drop", "orchestrator.client.timeuot": "forbid"}


def test_locating_refuses_two_runs_and_reports_bad_files(tmp_path):
    out = tmp_path / "outputs"
    for run in ("run_a", "run_b"):
        shutil.copytree(FIXTURE / "outputs/run_default/configs", out / run / "configs")
    with pytest.raises(UsageError, match="several runs"):
        locate_run_configs(out)
    assert locate_run_configs(tmp_path / "outputs" / "run_a").files[0].path.parent.parent.name == "run_a"
    bad = tmp_path / "x.toml"
    bad.write_text("a = [")
    with pytest.raises(FormatError, match="not valid TOML"):
        load(bad)
