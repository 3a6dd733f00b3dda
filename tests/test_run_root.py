"""One run-dir resolver (`formats.primerl.run_dir.resolve_run`): from any dir of a prime-rl run (trainer,
step, checkpoints, outputs, launch dir) of either generation, the run's outputs dir, its config, its launch
dir and its base model, the same for every command. On the genuine fixtures, on the layouts prime-rl's `rl`
entrypoint and later versions write (`outputs/<run.name>/configs`, `configs/resolved/`), and on factory runs.

The bug it fixed: extract-adapter (`--run-config`) and average looked a run's base model up in a dir of
their own (the config's dir, two levels up), not the launch dir export and gc use, and did not find it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from ckpt_tools.cli import main
from ckpt_tools.formats.primerl import run_dir

from .conftest import FIXTURE, HEAD_FIXTURES, json_payload

E, F, G = (HEAD_FIXTURES / n for n in ("E_head_dense", "F_head_moe", "G_head_fullft"))


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def steps(outputs: Path) -> list[Path]:
    return sorted((outputs / "checkpoints").iterdir(), key=lambda p: int(p.name.split("_")[1]))


def head_rl_layout(dst: Path, variant: Path = E, configs: str = "configs") -> Path:
    """The genuine HEAD run `variant` as prime-rl's `rl` entrypoint lays a named run out: launched from `dst`
    (`model.name = "base_model"`), the trainer's `output_dir = outputs/myrun` holding its checkpoints and
    `<configs>/trainer.json`. Returns the outputs dir."""
    shutil.copytree(variant / "base_model", dst / "base_model")
    out = dst / "outputs" / "myrun"
    shutil.copytree(variant / "outputs" / "checkpoints", out / "checkpoints")
    shutil.copytree(variant / "outputs" / "broadcasts", out / "broadcasts")
    cfg = json.loads((variant / "configs" / "trainer.json").read_text())
    cfg["output_dir"] = "outputs/myrun"
    (out / configs).mkdir(parents=True)
    (out / configs / "trainer.json").write_text(json.dumps(cfg, indent=2))
    return out


def head_resolved_layout(dst: Path, variant: Path = E, configs: str = "configs/resolved") -> Path:
    """The genuine HEAD run as later prime-rl writes it: the resolved configs under `<run>/configs/resolved/`
    (or `configs/latest/resolved/`). Returns the run (= launch) dir."""
    shutil.copytree(variant, dst, ignore=shutil.ignore_patterns("configs"))
    (dst / configs).mkdir(parents=True)
    shutil.copy(variant / "configs" / "trainer.json", dst / configs / "trainer.json")
    return dst


def found_by_export_and_gc(trainer: Path) -> tuple[str, str]:
    """The base dir `ckpt export` takes its config from and the one `ckpt gc` records, for a run in place."""
    r = run("export", trainer, trainer.parent / "never-written", "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    export = str(Path(next(f["src"] for f in json_payload(r.stdout)["files"] if f["name"] == "config.json")).parent)
    r = run("gc", trainer.parent.parent, "--keep-full", "1", "--min-age", "0", "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    gc = json_payload(r.stdout)["base"]["dir"]
    return export, gc


# ------------------------------------------------------------------------------------------------ the bug
def test_extract_adapter_with_run_config_finds_the_base_export_and_gc_find(tmp_path):
    """A genuine HEAD checkpoint of an `rl` run (output_dir outputs/myrun, model.name relative to the launch
    dir), copied out of the run and extracted with --run-config the run's trainer.json: the base is the one
    export and gc find for the run in place, not "not found locally" (it was looked up in outputs/myrun)."""
    outputs = head_rl_layout(tmp_path / "launch")
    trainer = steps(outputs)[-1] / "trainer"
    export, gc = found_by_export_and_gc(trainer)
    assert Path(export) == Path(gc) == (tmp_path / "launch" / "base_model").resolve()
    lonely = tmp_path / "ckpt"
    shutil.copytree(trainer, lonely)
    r = run("extract-adapter", lonely, tmp_path / "adapter", "--run-config", outputs / "configs" / "trainer.json",
            "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    plan = json_payload(r.stdout)
    assert plan["base_model_name_or_path"] == "base_model"
    assert plan["base_checked"] is not None and Path(plan["base_checked"]).resolve() == Path(export)
    assert not any("not found locally" in w for w in plan["warnings"]), plan["warnings"]


@pytest.mark.parametrize("configs", ["configs/resolved", "configs/latest/resolved"])
def test_average_finds_the_base_of_a_run_with_resolved_configs(tmp_path, configs):
    """`ckpt average` of two genuine HEAD checkpoints whose run keeps its configs under configs/resolved/: the
    base recorded for each input is the run's base_model that export and gc find (it was looked up in
    `<run>/configs`)."""
    root = head_resolved_layout(tmp_path / "E", configs=configs)
    a, b = (s / "trainer" for s in steps(root / "outputs"))
    export, gc = found_by_export_and_gc(b)
    assert Path(export) == Path(gc) == (root / "base_model").resolve()
    r = run("average", a, b, tmp_path / "avg", "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    inputs = json_payload(r.stdout)["inputs"]
    assert [i["base"] for i in inputs] == ["base_model"] * 2
    assert [Path(i["base_dir"]) for i in inputs] == [Path(export)] * 2


# ------------------------------------------------------------------------------------ the resolver itself
def run_dirs(outputs: Path, launch: Path) -> dict[str, Path]:
    """Every dir of a run a command may be given: trainer, step, checkpoints, outputs, launch, broadcast."""
    step = steps(outputs)[-1]
    dirs = {"trainer": step / "trainer", "step": step, "checkpoints": outputs / "checkpoints", "outputs": outputs}
    if (launch / "outputs" / "checkpoints").is_dir():
        dirs["launch"] = launch
    broadcasts = sorted(outputs.glob("broadcasts/step_*")) + sorted(outputs.glob("run_*/broadcasts/step_*"))
    if broadcasts:
        dirs["broadcast"] = broadcasts[-1]
    return dirs


def gc_base_dir(checkpoints: Path) -> Path | None:
    """What `ckpt gc` finds (its own config discovery, `resolve_base` over the loaded RunConfig)."""
    from ckpt_tools.formats.primerl.config import load_run_config, locate_run_configs
    found = locate_run_configs(checkpoints)
    b = run_dir.resolve_base(None, load_run_config(found) if found is not None else None)
    return None if b is None or b.dir is None else b.dir.resolve()


def check_run(outputs: Path, launch: Path, config: Path) -> None:
    launch, config = launch.resolve(), config.resolve()
    for what, d in run_dirs(outputs, launch).items():
        run = run_dir.resolve_run(d)
        assert run.outputs == outputs.resolve(), what
        assert run.configs == (config,) and run.config == config and not run.named, what
        assert run.launch == launch and run.model_root == launch, what
        assert run.base_name == "base_model", what
        base = run_dir.run_base(run)
        assert base is not None and base.dir == launch / "base_model" and base.problem is None, what
    trainer = steps(outputs)[-1] / "trainer"
    assert run_dir.run_base_of(trainer).dir == launch / "base_model"      # export's, extract-adapter's
    assert gc_base_dir(outputs / "checkpoints") == launch / "base_model"  # gc's, doctor's, report's
    named = run_dir.resolve_run(trainer, config=config)
    assert named.named and named.launch == launch and run_dir.run_base(named).how == "--run-config"


GENUINE = {"16e747c tiny": (FIXTURE, "outputs/run_default/configs/orch.toml"),
           "head dense": (E, "configs/trainer.json"), "head moe": (F, "configs/trainer.json"),
           "head fullft": (G, "configs/trainer.json")}


@pytest.mark.parametrize("name", list(GENUINE))
def test_the_resolver_on_every_genuine_fixture(name):
    root, config = GENUINE[name]
    check_run(root / "outputs", root, root / config)


@pytest.mark.parametrize("configs", ["configs", "configs/resolved", "configs/latest/resolved"])
def test_the_resolver_on_the_layouts_of_newer_runs(tmp_path, configs):
    outputs = head_rl_layout(tmp_path / "rl", G, configs)         # outputs/<run.name>/{configs, checkpoints}
    check_run(outputs, tmp_path / "rl", outputs / configs / "trainer.json")
    root = head_resolved_layout(tmp_path / "resolved", F, configs)
    check_run(root / "outputs", root, root / configs / "trainer.json")


def test_outside_a_run_the_resolver_finds_nothing_and_never_climbs(tmp_path):
    lonely = tmp_path / "outputs" / "ckpt"      # an `outputs` dir above it, but not prime-rl's layout
    shutil.copytree(E / "outputs" / "checkpoints" / "step_3" / "trainer", lonely)
    shutil.copytree(E / "configs", tmp_path / "configs")    # a run config two levels up: not this one's
    run = run_dir.resolve_run(lonely)
    assert (run.outputs, run.configs, run.launch, run.base_name) == (None, (), None, None)
    assert run_dir.run_base(run) is None and run.model_root == tmp_path   # the export guess (fix-adapter's)


@pytest.fixture(scope="module")
def factory_runs(tmp_path_factory):
    from tests.factory.factory import FactorySpec, make_run
    from tests.factory.head_factory import HeadSpec, make_head_run
    old = make_run(tmp_path_factory.mktemp("old") / "run", FactorySpec.tiny(steps=1))
    head = make_head_run(tmp_path_factory.mktemp("head") / "run", HeadSpec.e_dense(max_steps=2))
    return old, head


def test_the_resolver_on_the_factorys_runs(factory_runs):
    old, head = factory_runs
    check_run(old.root / "outputs", old.root, old.orch_toml)
    check_run(head.root / "outputs", head.root, head.trainer_config)
