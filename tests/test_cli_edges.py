"""The CLI's edges, with the exact words: flags anywhere, NO_COLOR, --overwrite everywhere, dry-run
labels, one missing-path message, swapped arguments, --alpha against the run's config, grouped
problems, our own leftovers, hub ids @revision, readable inspect, numbers, the progress line, help."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import click
import jsonschema
import pytest
from click.testing import CliRunner

from ckpt_tools.cli import COMMANDS, hoist_global_flags, main
from ckpt_tools.cli.mistakes import ROLES, check_roles, looks_like
from ckpt_tools.cli.progress import ProgressLine
from ckpt_tools.cli.render import STATE, clear_progress
from ckpt_tools.core.progress import ProgressEvent
from ckpt_tools.core.units import human_bytes_si, human_number

from .conftest import BASE, FIXTURE, REPO, TRAINER
from .test_json_envelope import SCHEMAS

ADAPTER = FIXTURE / "reference_peft_adapter"
BROADCAST = FIXTURE / "outputs" / "run_default" / "broadcasts" / "step_3"
ORCH = FIXTURE / "outputs" / "run_default" / "configs" / "orch.toml"


def run(*args, **kw):
    return CliRunner().invoke(main, [str(a) for a in args], **kw)


# ---------------------------------------------------------------------------------------- flags
def test_verbose_and_quiet_are_moved_before_the_command_wherever_they_stand():
    assert hoist_global_flags(["merge", "a", "-v", "b", "c"]) == ["-v", "merge", "a", "b", "c"]
    assert hoist_global_flags(["inspect", "x", "--quiet"]) == ["--quiet", "inspect", "x"]
    assert hoist_global_flags(["set", "c", "o", "--", "-v"]) == ["set", "c", "o", "--", "-v"]   # a literal


def test_verbose_after_the_command_shows_the_traceback_and_quiet_after_it_is_accepted(tmp_path):
    r = run("inspect", tmp_path / "nope", "-v")
    assert r.exit_code == 2 and "Traceback" in r.stderr
    assert r.stderr.rstrip().endswith(f"error: no such file or directory: {tmp_path / 'nope'}")
    r = run("inspect", TRAINER, "-q")
    assert r.exit_code == 0 and r.stdout.startswith(f"DCP checkpoint {TRAINER}")
    r = run("inspect", TRAINER, "-q", "-v")
    assert r.exit_code == 2 and "-v/--verbose and -q/--quiet contradict each other: pick one" in r.stderr


def test_no_color_turns_colour_off_even_where_colour_is_forced():
    coloured = run("inspect", TRAINER, "--trust-remote-pickle", color=True)
    assert "\x1b[31mWARNING: --trust-remote-pickle" in coloured.stderr
    plain = run("inspect", TRAINER, "--trust-remote-pickle", color=True, env={"NO_COLOR": "1"})
    assert plain.exit_code == 0 and "\x1b[" not in plain.output
    assert plain.stderr.startswith("WARNING: --trust-remote-pickle: pickles outside the allow-list")


WRITERS = {   # command -> argv with OUT in it (one that writes to a fresh OUT)
    "extract-adapter": lambda out: ["extract-adapter", TRAINER, out],
    "adapter-to-dcp": lambda out: ["adapter-to-dcp", ADAPTER, out, "--base", BASE, "--lr", "1e-3"],
    "fix-adapter": lambda out: ["fix-adapter", BROADCAST, out],
    "merge": lambda out: ["merge", BASE, TRAINER, out],
    "slim": lambda out: ["slim", TRAINER, out, "--base", BASE],
    "set-lr": lambda out: ["set-lr", TRAINER, out, "--scale", "0.5"],
    "set": lambda out: ["set", TRAINER, out, "progress.step=5"],
    "restart-prep": lambda out: ["restart-prep", TRAINER, out, "--base", BASE, "--lr", "5e-3"],
    "average": lambda out: ["average", TRAINER, ADAPTER, out],
    "average --merge": lambda out: ["average", TRAINER, ADAPTER, out, "--merge", BASE],
    "resize-adapter": lambda out: ["resize-adapter", ADAPTER, out, "--rank", "4"],
}


def test_every_writing_command_takes_overwrite_and_its_refusal_names_it(tmp_path):
    for name in [*WRITERS, "rehydrate"]:
        assert "--overwrite" in run(name.split()[0], "--help").output, name
    for name, argv in WRITERS.items():
        out = tmp_path / name
        out.mkdir()
        r = run(*argv(out))
        assert r.exit_code == 1, (name, r.output)
        assert r.stderr.strip().splitlines()[-1] == \
            f"error: {out}: already exists (pass --overwrite to replace it, or another output path)", name


@pytest.mark.parametrize("name", ["extract-adapter", "merge", "set-lr"])
def test_overwrite_replaces_an_earlier_output_and_nothing_else(tmp_path, name):
    out = tmp_path / "out"
    assert run(*WRITERS[name](out)).exit_code == 0
    first = sorted(os.listdir(out))
    r = run(*WRITERS[name](out), "--overwrite")
    assert r.exit_code == 0, r.output
    assert sorted(os.listdir(out)) == first and ".ckpt-tools-output" in first
    (out / "stale").mkdir()                      # something the tool did not write: refused, named
    r = run(*WRITERS[name](out), "--overwrite")
    assert r.exit_code == 1 and "holds entries it did not write: stale" in r.stderr, r.output
    assert (out / "stale").is_dir()


def test_every_dry_run_is_labelled_the_same_way_once(tmp_path):
    for name, argv in WRITERS.items():
        r = run(*argv(tmp_path / name), "--dry-run")
        assert r.exit_code == 0, (name, r.output)
        assert r.stdout.count("(dry run: nothing written)") == 1, (name, r.stdout)
        assert r.stdout.splitlines()[0].endswith("  (dry run: nothing written)"), (name, r.stdout)
        assert not (tmp_path / name).exists()


def test_a_real_merge_prints_its_result_not_the_plan_again(tmp_path):
    r = run("merge", BASE, TRAINER, tmp_path / "m")
    assert r.exit_code == 0
    assert r.stdout.splitlines() == [
        f"wrote {tmp_path / 'm'}: 21 modules merged (rank 8, scale 2, alpha from run config {ORCH}), 15 tensors copied, "
        f"0 cast, 0 replaced; {r.stdout.splitlines()[0].split('; ')[1]}",
        "  base checked: 512 values of 4 fp32 masters equal the base's"]
    dry = run("merge", BASE, TRAINER, tmp_path / "m2", "--dry-run")
    assert "  shards    1 file(s), largest 508.95 KiB (limit 5GB)" in dry.stdout.splitlines()


def test_restart_prep_marks_its_required_options_required(tmp_path):
    r = run("restart-prep", TRAINER, tmp_path / "o", "--base", BASE)
    assert r.exit_code == 2 and "Missing option '--lr'." in r.stderr and "(got None)" not in r.output


# ------------------------------------------------------------------------------ common mistakes
PATH_ARGS = {   # command -> argv with a missing path M in the position named
    "inspect": lambda m, t: ["inspect", m],
    "verify": lambda m, t: ["verify", m],
    "extract-adapter": lambda m, t: ["extract-adapter", m, t / "o"],
    "adapter-to-dcp (ADAPTER)": lambda m, t: ["adapter-to-dcp", m, t / "o", "--base", BASE, "--lr", "1"],
    "adapter-to-dcp (--base)": lambda m, t: ["adapter-to-dcp", ADAPTER, t / "o", "--base", m, "--lr", "1"],
    "fix-adapter": lambda m, t: ["fix-adapter", m, t / "o"],
    "merge (BASE)": lambda m, t: ["merge", m, TRAINER, t / "o"],
    "merge (ADAPTER)": lambda m, t: ["merge", BASE, m, t / "o"],
    "diff-vs-base (WEIGHTS)": lambda m, t: ["diff-vs-base", m, BASE],
    "diff-vs-base (BASE)": lambda m, t: ["diff-vs-base", BASE, m],
    "slim": lambda m, t: ["slim", m, t / "o"],
    "slim (--base)": lambda m, t: ["slim", TRAINER, t / "o", "--base", m],
    "rehydrate": lambda m, t: ["rehydrate", m, t / "o", "--base", BASE],
    "set-lr": lambda m, t: ["set-lr", m, t / "o", "--lr", "1"],
    "set": lambda m, t: ["set", m, t / "o", "progress.step=1"],
    "restart-prep": lambda m, t: ["restart-prep", m, t / "o", "--base", BASE, "--lr", "1"],
    "gc": lambda m, t: ["gc", m, "--keep-full", "1"],
    "doctor": lambda m, t: ["doctor", m],
    "average": lambda m, t: ["average", TRAINER, m, t / "o"],
    "average (--merge)": lambda m, t: ["average", TRAINER, ADAPTER, t / "o", "--merge", m],
    "resize-adapter": lambda m, t: ["resize-adapter", m, t / "o", "--rank", "2"],
}


@pytest.mark.parametrize("case", list(PATH_ARGS))
def test_a_missing_path_is_one_message_and_exit_2_everywhere(case, tmp_path):
    missing = tmp_path / "not-there"
    r = run(*PATH_ARGS[case](missing, tmp_path))
    assert r.exit_code == 2, r.output
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: no such file or directory: {missing}"), line


CHECKPOINTS = FIXTURE / "outputs" / "checkpoints"
WEIGHTS_EXPORT = FIXTURE / "outputs" / "weights" / "step_3"
MERGED = FIXTURE / "expected_merged_hf"


@pytest.fixture(scope="module")
def slim_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("slim") / "slim"
    r = run("slim", TRAINER, out, "--base", BASE)
    assert r.exit_code == 0, r.output
    return out


def _swap_hint(synopsis, a, want_a, b, want_b):
    return f" (`ckpt {synopsis}` takes {a} as {want_a}, {b} as {want_b})"


DCP_, HF_, PEFT_, SLIM_ = "a DCP checkpoint", "an HF model dir", "a PEFT adapter dir", "a slim checkpoint"
SWAPPED = {   # case -> (argv from (tmp, slim dir), the exact error line)
    "merge": (lambda t, s: ["merge", TRAINER, BASE, t / "o"],
              "BASE looks like a DCP checkpoint and ADAPTER like an HF model dir: swapped?"
              + _swap_hint("merge BASE ADAPTER OUT", "BASE", HF_, "ADAPTER", f"{PEFT_} or {DCP_}")),
    "merge --base-from-checkpoint": (
        lambda t, s: ["merge", "--base-from-checkpoint", BASE, t / "o", "--config-from", TRAINER],
        "ADAPTER looks like an HF model dir and --config-from like a DCP checkpoint: swapped?"
        + _swap_hint("merge --base-from-checkpoint [BASE] ADAPTER OUT", "ADAPTER", f"{PEFT_} or {DCP_}",
                     "--config-from", HF_)),
    "export": (lambda t, s: ["export", MERGED, TRAINER, "--overwrite"],
               "CKPT looks like an HF model dir and OUT like a DCP checkpoint: swapped?"
               + _swap_hint("export CKPT OUT", "CKPT", DCP_, "OUT", HF_)),
    "diff-vs-base": (lambda t, s: ["diff-vs-base", ADAPTER, BASE, "--adapter", MERGED],
                     "WEIGHTS looks like a PEFT adapter dir and --adapter like an HF model dir: swapped?"
                     + _swap_hint("diff-vs-base WEIGHTS BASE", "WEIGHTS", f"{HF_} or {DCP_}", "--adapter",
                                  f"{PEFT_} or {DCP_}")),
    "slim": (lambda t, s: ["slim", BASE, t / "o", "--base", TRAINER],
             "CKPT looks like an HF model dir and --base like a DCP checkpoint: swapped?"
             + _swap_hint("slim CKPT OUT", "CKPT", DCP_, "--base", HF_)),
    "rehydrate": (lambda t, s: ["rehydrate", TRAINER, s, "--base", BASE, "--overwrite"],
                  "SLIM looks like a DCP checkpoint and OUT like a slim checkpoint: swapped?"
                  + _swap_hint("rehydrate SLIM OUT", "SLIM", SLIM_, "OUT", DCP_)),
    "rehydrate --base": (lambda t, s: ["rehydrate", BASE, t / "o", "--base", s],
                         "SLIM looks like an HF model dir and --base like a slim checkpoint: swapped?"
                         + _swap_hint("rehydrate SLIM OUT", "SLIM", SLIM_, "--base", HF_)),
    "extract-adapter": (lambda t, s: ["extract-adapter", ADAPTER, TRAINER],
                        "CKPT looks like a PEFT adapter dir and OUT like a DCP checkpoint: swapped?"
                        + _swap_hint("extract-adapter CKPT OUT", "CKPT", DCP_, "OUT", PEFT_)),
    "adapter-to-dcp": (lambda t, s: ["adapter-to-dcp", BASE, t / "o", "--base", ADAPTER, "--lr", "1"],
                       "ADAPTER looks like an HF model dir and --base like a PEFT adapter dir: swapped?"
                       + _swap_hint("adapter-to-dcp ADAPTER OUT", "ADAPTER", PEFT_, "--base", HF_)),
    "adapter-to-dcp --optimizer-from": (
        lambda t, s: ["adapter-to-dcp", TRAINER, t / "o", "--base", BASE, "--optimizer-from", ADAPTER],
        "ADAPTER looks like a DCP checkpoint and --optimizer-from like a PEFT adapter dir: swapped?"
        + _swap_hint("adapter-to-dcp ADAPTER OUT", "ADAPTER", PEFT_, "--optimizer-from", DCP_)),
    "fix-adapter": (lambda t, s: ["fix-adapter", BASE, t / "o", "--base", BROADCAST],
                    "SRC looks like an HF model dir and --base like a PEFT adapter dir: swapped?"
                    + _swap_hint("fix-adapter SRC OUT", "SRC", PEFT_, "--base", HF_)),
    "verify --base": (lambda t, s: ["verify", BASE, "--base", ADAPTER],
                      "PATH looks like an HF model dir and --base like a PEFT adapter dir: swapped?"
                      + _swap_hint("verify PATH --base BASE", "PATH", PEFT_, "--base", f"{HF_} or {DCP_}")),
    "restart-prep": (lambda t, s: ["restart-prep", BASE, t / "o", "--base", TRAINER, "--lr", "1"],
                     "RUN_OR_CKPT looks like an HF model dir and --base like a DCP checkpoint: swapped?"
                     + _swap_hint("restart-prep RUN_OR_CKPT OUT", "RUN_OR_CKPT",
                                  f"{DCP_} or a prime-rl checkpoints dir", "--base", HF_)),
    "gc": (lambda t, s: ["gc", BASE, "--base", CHECKPOINTS, "--keep-full", "1"],
           "CHECKPOINTS_DIR looks like an HF model dir and --base like a prime-rl checkpoints dir: swapped?"
           + _swap_hint("gc CHECKPOINTS_DIR", "CHECKPOINTS_DIR", "a prime-rl checkpoints dir", "--base", HF_)),
}


@pytest.mark.parametrize("case", list(SWAPPED))
def test_swapped_arguments_are_named_for_what_they_are(case, tmp_path, slim_dir):
    argv, line = SWAPPED[case]
    r = run(*argv(tmp_path, slim_dir))
    assert r.exit_code == 2, r.output
    assert r.stderr.strip() == f"error: {line}"
    assert r.stdout == "" and not (tmp_path / "o").exists()


@pytest.mark.parametrize("case", list(SWAPPED))
def test_swapped_arguments_under_json_are_the_failure_envelope(case, tmp_path, slim_dir):
    argv, line = SWAPPED[case]
    r = run(*argv(tmp_path, slim_dir), "--json")
    assert r.exit_code == 2
    doc = json.loads(r.stdout)
    for schema in (SCHEMAS["envelope"], SCHEMAS[case.split()[0]]):
        jsonschema.validate(doc, schema, cls=jsonschema.Draft202012Validator)
    assert doc["schema"] == "ckpt/1" and doc["command"] == case.split()[0] and doc["ok"] is False
    assert doc["exit_code"] == 2 and doc["plan"] is None and doc["result"] is None
    assert doc["error"]["type"] == "UsageError" and doc["error"]["message"] == line
    assert "(" + doc["error"]["hint"] + ")" == line[line.index(" (`ckpt ") + 1:]


LEGIT = {   # ROLES key -> argument sets each command accepts (their ops run them in the other tests)
    "merge": [{"BASE": BASE, "ADAPTER": TRAINER, "OUT": MERGED}, {"BASE": BASE, "ADAPTER": ADAPTER, "OUT": None}],
    "merge --base-from-checkpoint": [{"BASE": None, "ADAPTER": TRAINER, "OUT": MERGED, "--config-from": BASE},
                                     {"BASE": TRAINER, "ADAPTER": ADAPTER, "OUT": None, "--config-from": BASE}],
    "export": [{"CKPT": TRAINER, "OUT": MERGED, "--config-from": WEIGHTS_EXPORT},
               {"CKPT": TRAINER.parent, "OUT": None, "--config-from": "Qwen/Qwen3-0.6B"}],
    "diff-vs-base": [{"WEIGHTS": TRAINER, "BASE": BASE, "--adapter": None},      # DCP weights against an HF base
                     {"WEIGHTS": BASE, "BASE": TRAINER, "--adapter": TRAINER},
                     {"WEIGHTS": MERGED, "BASE": BASE, "--adapter": ADAPTER},
                     {"WEIGHTS": MERGED, "BASE": TRAINER, "--adapter": TRAINER}],
    "slim": [{"CKPT": TRAINER, "OUT": "SLIM", "--base": BASE}, {"CKPT": TRAINER, "OUT": TRAINER, "--base": None}],
    "rehydrate": [{"SLIM": "SLIM", "OUT": TRAINER, "--base": BASE}, {"SLIM": "SLIM", "OUT": "SLIM", "--base": BASE}],
    "extract-adapter": [{"CKPT": TRAINER, "OUT": ADAPTER, "--base": BASE}, {"CKPT": "SLIM", "OUT": None,
                                                                           "--base": WEIGHTS_EXPORT}],
    "adapter-to-dcp": [{"ADAPTER": ADAPTER, "OUT": TRAINER, "--base": BASE, "--optimizer-from": TRAINER},
                       {"ADAPTER": BROADCAST, "OUT": "SLIM", "--base": MERGED, "--optimizer-from": "SLIM"}],
    "fix-adapter": [{"SRC": BROADCAST, "OUT": ADAPTER, "--base": BASE}],
    "average": [{"CKPT_OR_ADAPTER": TRAINER, "OUT": ADAPTER}, {"CKPT_OR_ADAPTER": ADAPTER, "OUT": None},
                {"CKPT_OR_ADAPTER": "SLIM", "OUT": None}],
    "average --merge": [{"CKPT_OR_ADAPTER": TRAINER, "OUT": MERGED, "--merge": BASE},
                        {"CKPT_OR_ADAPTER": ADAPTER, "OUT": None, "--merge": BASE}],
    "resize-adapter": [{"ADAPTER": ADAPTER, "OUT": ADAPTER}, {"ADAPTER": TRAINER, "OUT": None}],
    "report": [{"PATH": TRAINER, "--base": BASE}, {"PATH": CHECKPOINTS, "--base": None}, {"PATH": "SLIM", "--base": BASE},
               {"PATH": MERGED, "--base": BASE}],
    "verify --base": [{"PATH": ADAPTER, "--base": BASE}, {"PATH": ADAPTER, "--base": TRAINER}],
    "restart-prep": [{"RUN_OR_CKPT": TRAINER, "--base": BASE}, {"RUN_OR_CKPT": CHECKPOINTS, "--base": BASE},
                     {"RUN_OR_CKPT": FIXTURE / "outputs", "--base": BASE}, {"RUN_OR_CKPT": FIXTURE, "--base": BASE}],
    "gc": [{"CHECKPOINTS_DIR": CHECKPOINTS, "--base": BASE}, {"CHECKPOINTS_DIR": FIXTURE / "outputs",
                                                              "--base": MERGED}],
}


def test_the_swap_rule_never_refuses_a_legitimate_call(slim_dir):
    """Every argument set above is one its command takes; none may be called swapped."""
    assert sorted(LEGIT) == sorted(ROLES)
    for command, calls in LEGIT.items():
        for paths in calls:
            check_roles(command, {k: slim_dir if v == "SLIM" else v for k, v in paths.items()})   # raises if refused


def test_a_dcp_checkpoint_against_an_hf_base_is_an_ordinary_diff():
    for weights, base in ((TRAINER, BASE), (BASE, TRAINER)):
        r = run("diff-vs-base", weights, base)   # exit 3: the frozen base weights are the base's, bit for bit
        assert r.exit_code == 3 and "identical to base: all 36 shared tensors" in r.stdout, r.output


def test_what_a_path_looks_like_comes_from_its_marker_files(slim_dir):
    assert looks_like(TRAINER) == looks_like(TRAINER.parent) == looks_like(TRAINER / ".metadata") == {"dcp"}
    assert looks_like(slim_dir) == {"dcp", "slim"}
    assert looks_like(ADAPTER) == looks_like(BROADCAST) == {"peft"}
    assert looks_like(BASE) == looks_like(WEIGHTS_EXPORT) == {"hf"}
    assert looks_like(CHECKPOINTS) == {"checkpoints"}
    assert looks_like(FIXTURE / "not-there") == looks_like("Qwen/Qwen3-0.6B") == looks_like(None) == frozenset()


def test_the_roles_table_names_each_commands_own_arguments():
    """Every label of ROLES is an argument of its command as `--help` names it: a positional one in
    the usage line, an option among the command's options (and so is a flag in the key)."""
    for key, roles in ROLES.items():
        name, *flags = key.split()
        cmd = main.get_command(None, name)
        positional = [p.metavar or p.name.upper() for p in cmd.params if isinstance(p, click.Argument)]
        options = {o for p in cmd.params if isinstance(p, click.Option) for o in p.opts}
        assert roles.synopsis.split()[0] == name and set(flags) <= set(roles.synopsis.split()), key
        assert set(flags) <= options, key
        for label in roles.wants:
            assert (label in options) if label.startswith("--") else \
                any(label in m.replace("[", " ").replace("]", " ").split() for m in positional), (key, label)


def test_an_alpha_that_contradicts_the_runs_config_warns_with_both_values_and_the_file(tmp_path):
    r = run("merge", BASE, TRAINER, tmp_path / "o", "--alpha", "32", "--dry-run")
    assert r.exit_code == 0
    assert (f"WARNING: --alpha 32 contradicts the run's config {ORCH}: [model.lora] alpha = 16; using --alpha 32 "
            "(scale alpha / rank), drop --alpha to use the run's") in r.stderr.splitlines()
    same = run("merge", BASE, TRAINER, tmp_path / "o", "--alpha", "16", "--dry-run")
    assert "contradicts" not in same.stderr


def test_verify_groups_the_same_problem_of_many_keys_into_one_line():
    r = run("verify", BROADCAST)
    assert r.exit_code == 1
    lines = r.stdout.splitlines()
    assert lines[0] == (f"problem: {BROADCAST}/adapter_model.safetensors: 42 keys: key maps to no LoRA module: PEFT "
                        "expects base_model.model.<module>.lora_A.weight / lora_B.weight and would silently ignore it "
                        "(prime-rl's export key bug: `ckpt fix-adapter` renames it) (e.g. "
                        "'model.layers.0.mlp.down_proj.lora_A.weight', 'model.layers.0.mlp.down_proj.lora_B.weight', "
                        "'model.layers.0.mlp.gate_proj.lora_A.weight'; --json lists all)")
    assert len(lines) == 3 and lines[-1].startswith("FAILED: ") and "43 problem(s)" in lines[-1]


@pytest.mark.parametrize("how", [["set-lr", "--scale", "0.5"], ["set", "progress.step=9"]])
def test_verify_deep_knows_the_bytes_our_own_patch_supersedes(tmp_path, how):
    out = tmp_path / "patched"
    assert run(how[0], TRAINER, out, *how[1:]).exit_code == 0
    r = run("verify", out, "--deep")
    assert r.exit_code == 0 and "WARNING" not in r.output
    assert "of old values superseded by a `ckpt set-lr`/`ckpt set` patch (expected)" in r.stdout


# ------------------------------------------------------------------------ hub ids and @revision
def _fake_hub_cache(root: Path, repo: str = "acme/tiny-qwen3", commit: str = "0123456789abcdef" * 2 + "01234567"):
    """The local HF cache layout (`hf download` writes it): refs/<rev> holds the commit, the files
    are under snapshots/<commit>/."""
    d = root / f"models--{repo.replace('/', '--')}"
    shutil.copytree(BASE, d / "snapshots" / commit)
    (d / "refs").mkdir()
    (d / "refs" / "main").write_text(commit)
    return repo, commit


def test_hub_ids_and_revisions_from_the_local_cache_work_for_every_command_taking_a_model(tmp_path):
    cache = tmp_path / "hub"
    repo, commit = _fake_hub_cache(cache)
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}

    def ckpt(*args):
        return subprocess.run([sys.executable, "-m", "ckpt_tools", *map(str, args)], cwd=REPO, env=env,
                              capture_output=True, text=True)
    for spec in (repo, f"{repo}@main", f"{repo}@{commit}"):
        r = ckpt("inspect", spec)
        assert r.returncode == 0 and r.stdout.splitlines()[1].startswith("  Qwen3ForCausalLM: 36 tensors"), r.stderr
    assert ckpt("verify", f"{repo}@main").returncode == 0
    assert ckpt("diff-vs-base", f"{repo}@main", BASE).returncode == 3        # the same bytes as the base
    assert ckpt("merge", f"{repo}@{commit}", TRAINER, tmp_path / "m", "--dry-run").returncode == 0
    r = ckpt("inspect", f"{repo}@v2")
    assert r.returncode == 1 and r.stderr.strip() == (
        f"error: '{repo}@v2' is not a local directory and not in the local HF cache ({cache}) (pass --download to "
        f"fetch only the files this command needs into the cache, or download it with `hf download {repo} "
        "--revision v2`, or pass a directory)")


# ------------------------------------------------------------------------------ readable output
def test_inspect_of_an_hf_dir_and_a_peft_adapter_reads_like_the_dcp_view():
    assert run("inspect", BASE).stdout.splitlines() == [
        f"HF model dir {BASE}",
        "  Qwen3ForCausalLM: 36 tensors (36 BF16), 505.31 KiB in 1 shard(s): model.safetensors",
        "  config dtype bfloat16; tied embeddings no"]
    assert run("inspect", ADAPTER).stdout.splitlines() == [
        f"PEFT adapter {ADAPTER} (adapter_model.safetensors)",
        "  LoRA: 21 modules, rank 8, lora_alpha 16 -> scale 2; targets down_proj, gate_proj, k_proj, o_proj, q_proj, "
        "up_proj, v_proj",
        "  weights float32, 105.56 KiB; modules_to_save none",
        "  base_model_name_or_path: base_model",
        "  layout: dense (no expert LoRA: every --layout writes this file; PEFT, vLLM and prime-rl load it)"]
    r = run("inspect", BROADCAST)
    assert r.stdout.splitlines()[1] == "  LoRA: NO module matches (lora_alpha 16)"
    assert "rank: []" not in r.stdout and "{'" not in r.stdout


def test_numbers_are_printed_as_people_write_them():
    assert [human_number(x) for x in (0.006666666700000001, 5e-06, 16.0, 2.0, 1e-3, 1 / 3, 3, True)] == [
        "0.0066666667", "5e-6", "16", "2", "0.001", "0.33333333", "3", "True"]
    assert [human_bytes_si(n) for n in (5 * 10**9, 150_000, 999)] == ["5GB", "150KB", "999B"]
    out = run("set-lr", TRAINER, "--lr", "0.0066666667", "--dry-run").stdout
    assert out.splitlines()[0].startswith(f"set-lr {TRAINER}: lr 0.01 -> 0.0066666667 (x0.66666667)")


# ---------------------------------------------------------------------------------- progress, help
def test_the_progress_line_shows_bytes_rate_and_eta_and_is_off_under_quiet_and_json():
    ev = ProgressEvent("compare", 3, 12, unit="tensors", name="model.layers.0.mlp.up_proj.weight",
                       bytes_done=3 * 2**20, bytes_total=12 * 2**20, elapsed_s=2.0)
    assert ProgressLine.line(ev) == ("  compare [    3/12]   3.00 MiB / 12.00 MiB (25%)  1.50 MiB/s  ETA 0:06  "
                                     "model.layers.0.mlp.up_proj.weight       ")
    assert ProgressLine.line(ProgressEvent("crc32", 50, 200, elapsed_s=1.0)).startswith(
        "  crc32       50 B / 200 B (25%)  50 B/s  ETA 0:03")
    STATE.reset()
    STATE.quiet = True
    assert ProgressLine.for_terminal() is None
    STATE.reset()
    STATE.as_json = True
    assert ProgressLine.for_terminal() is None
    STATE.reset()


def test_a_message_clears_the_progress_line_first(capsys):
    STATE.reset()
    STATE.progress_shown = True
    clear_progress()
    assert capsys.readouterr().err == "\r\x1b[K" and not STATE.progress_shown


@pytest.mark.parametrize("name", list(COMMANDS))
def test_help_examples_are_never_wrapped(name):
    cmd = main.get_command(None, name)
    example = cmd.help[cmd.help.index("Example:"):].splitlines()[1:]
    lines = [ln.strip() for ln in example if ln.strip()]
    assert lines and all(len(ln) <= 90 for ln in lines), lines
    r = CliRunner().invoke(main, [name, "--help"], terminal_width=60)
    shown = [ln.strip() for ln in r.output.splitlines()]
    for ln in lines:
        assert ln in shown, (name, ln)


def test_shell_completion_is_documented_and_works():
    assert "_CKPT_COMPLETE=bash_source ckpt" in (REPO / "docs" / "cli.md").read_text()
    r = subprocess.run([sys.executable, "-m", "ckpt_tools"], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, "_CKPT_COMPLETE": "bash_complete", "COMP_WORDS": "ckpt re",
                            "COMP_CWORD": "1"})
    assert r.returncode == 0 and "plain,rehydrate" in r.stdout and "plain,restart-prep" in r.stdout
