"""ckpt set-lr / ckpt set: the lr of a resumed run follows the scaled schedule exactly, the Adam
moments are untouched, the source is never written, and only a small patch file + .metadata are new.

Schedule tests use real DCP checkpoints written by `dcp.save` in this process (a tiny model, AdamW
and the factory's prime-rl schedulers), loaded back with `dcp.load` into fresh objects the way
prime-rl resumes; one test does the same through a 4-rank FSDP2 strict load."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckpt_tools.cli import main
from ckpt_tools.formats.dcp.reader import DcpCheckpoint
from tests.factory.factory import FactorySpec, Progress, app_state_class, build_scheduler

from .conftest import TRAINER, json_payload
from .test_slim_rehydrate import bits, surgery_run

FOLLOW_STEPS = 12


def run(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def tree_hashes(d: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


class Trainer:
    """A tiny model trained with AdamW under one of the factory's prime-rl schedulers."""

    def __init__(self, spec: FactorySpec, seed: int = 0):
        torch.manual_seed(seed)
        self.spec = spec
        self.model = torch.nn.Linear(6, 5)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=spec.lr, weight_decay=spec.weight_decay)
        self.sched = build_scheduler(self.opt, spec)
        self.progress = Progress()

    def train(self, steps: int) -> "Trainer":
        for _ in range(steps):
            self.model(torch.randn(3, 6)).square().mean().backward()
            self.opt.step()
            self.sched.step()
            self.opt.zero_grad()
            self.progress.step += 1
        return self

    def app(self):
        return {"app": app_state_class()(self.model, [self.opt], self.sched, self.progress)}

    def save(self, path: Path) -> Path:
        import torch.distributed.checkpoint as dcp
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(self.app(), checkpoint_id=path)
        return path

    def load(self, path: Path) -> "Trainer":
        import torch.distributed.checkpoint as dcp
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(self.app(), checkpoint_id=path)   # default (strict) planner, as prime-rl
        return self

    def follow(self, steps: int = FOLLOW_STEPS) -> list[float]:
        out = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(steps):
                self.sched.step()
                out.append(self.opt.param_groups[0]["lr"])
        return out

    def moments(self) -> dict:
        return {f"{i}.{k}": v.clone() for i, st in self.opt.state_dict()["state"].items() for k, v in st.items()}


SCHEDULES = {
    "linear-warmup, mid-warmup": (dict(scheduler="linear", warmup_steps=4), 2),
    "constant": (dict(scheduler="constant"), 3),
    "WSD, in the stable phase": (dict(scheduler="sequential", decay="linear"), 3),
    "WSD, mid-decay": (dict(scheduler="sequential", decay="linear"), 7),
    "warmup+cosine, mid-warmup": (dict(scheduler="sequential", decay="cosine", warmup_steps=3), 1),
    "warmup+cosine, mid-cosine": (dict(scheduler="sequential", decay="cosine"), 5),
}


def saved(tmp_path: Path, kw: dict, steps: int, name: str = "ckpt", min_lr: float = 0.0):
    spec = FactorySpec.tiny(min_lr=min_lr, **kw)
    t = Trainer(spec).train(steps)
    return spec, t, t.save(tmp_path / name)


@pytest.mark.parametrize("case", list(SCHEDULES))
def test_halved_lr_follows_exactly_half_the_schedule_and_keeps_the_moments(case, tmp_path):
    kw, steps = SCHEDULES[case]
    spec, orig, ckpt = saved(tmp_path, kw, steps, min_lr=1e-4)
    moments = orig.moments()
    lr0 = orig.opt.param_groups[0]["lr"]
    r = run("set-lr", ckpt, tmp_path / "out", "--scale", "0.5")
    assert r.exit_code == 0, r.output
    resumed = Trainer(spec, seed=1).load(tmp_path / "out")
    assert resumed.opt.param_groups[0]["lr"] == 0.5 * lr0
    assert resumed.opt.param_groups[0]["initial_lr"] == 0.5 * spec.lr
    assert resumed.progress.step == steps
    got = resumed.moments()
    assert sorted(got) == sorted(moments) and all(torch.equal(bits(got[k]), bits(moments[k])) for k in got)
    want = [0.5 * x for x in orig.follow()]
    assert resumed.follow() == want   # bit-exact: scaling by 0.5 commutes with every step of the schedule


def test_lr_sets_the_current_lr_exactly_and_scales_the_rest(tmp_path):
    spec, orig, ckpt = saved(tmp_path, dict(scheduler="sequential", decay="linear"), 4)
    lr0 = orig.opt.param_groups[0]["lr"]
    r = run("set-lr", ckpt, tmp_path / "out", "--lr", "3e-3", "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["plan"]["lr_after"] == 3e-3 and rep["plan"]["factor"] == pytest.approx(3e-3 / lr0)
    resumed = Trainer(spec, seed=1).load(tmp_path / "out")
    assert resumed.opt.param_groups[0]["lr"] == 3e-3
    for a, b in zip(resumed.follow(), orig.follow()):
        assert a == pytest.approx(b * 3e-3 / lr0, rel=1e-12, abs=1e-18)
    assert rep["result"]["bytes_written"] < 64 * 1024 and rep["result"]["linked"] == {"hardlink": 1}


def test_min_lr_retargets_the_cosine_floor(tmp_path):
    spec, orig, ckpt = saved(tmp_path, dict(scheduler="sequential", decay="cosine"), 5, min_lr=1e-3)
    r = run("set-lr", ckpt, tmp_path / "out", "--scale", "1", "--min-lr", "2e-5")
    assert r.exit_code == 0, r.output
    resumed = Trainer(spec, seed=1).load(tmp_path / "out")
    assert resumed.opt.param_groups[0]["lr"] == orig.opt.param_groups[0]["lr"]
    trace = resumed.follow(spec.max_steps - 5)
    assert trace[-1] == pytest.approx(2e-5, rel=1e-9)
    assert all(a > b for a, b in zip(trace, trace[1:]))


@pytest.mark.parametrize("steps,phase", [(3, "pending"), (7, "in progress")])
def test_min_lr_retargets_a_linear_decay_to_end_exactly_there_linearly(tmp_path, steps, phase):
    spec, orig, ckpt = saved(tmp_path, dict(scheduler="sequential", decay="linear"), steps)
    r = run("set-lr", ckpt, tmp_path / "out", "--scale", "0.25", "--min-lr", "1e-4")
    assert r.exit_code == 0, r.output
    resumed = Trainer(spec, seed=1).load(tmp_path / "out")
    lr_now = resumed.opt.param_groups[0]["lr"]
    assert lr_now == 0.25 * orig.opt.param_groups[0]["lr"]
    trace = resumed.follow()
    decay_start = spec.max_steps - spec.decay_steps
    end_epoch = decay_start + spec.decay_steps - 1
    assert trace[end_epoch - steps - 1] == pytest.approx(1e-4, rel=1e-9)
    assert trace[-1] == pytest.approx(1e-4, rel=1e-9)            # and it stays there
    decay = [lr_now] + trace if phase == "in progress" else \
        trace[decay_start - steps - 1:]
    decay = decay[: end_epoch - max(steps, decay_start) + 1]
    diffs = [a - b for a, b in zip(decay, decay[1:])]
    assert all(d == pytest.approx(diffs[0], rel=1e-9) for d in diffs) and diffs[0] > 0


def test_min_lr_without_a_decay_phase_is_refused(tmp_path):
    _, _, ckpt = saved(tmp_path, dict(scheduler="linear"), 3)
    r = run("set-lr", ckpt, tmp_path / "out", "--scale", "0.5", "--min-lr", "1e-5")
    assert r.exit_code == 2 and "no decay phase left" in r.output
    assert not (tmp_path / "out").exists()


def test_dry_run_prints_before_after_of_exactly_the_lr_fields_and_writes_nothing(tmp_path):
    spec, _, ckpt = saved(tmp_path, dict(scheduler="sequential", decay="cosine"), 4)
    before = tree_hashes(ckpt)
    r = run("set-lr", ckpt, tmp_path / "out", "--scale", "2", "--dry-run", "--json")
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)["plan"]
    changes = {c["key"]: (c["before"], c["after"]) for c in plan["changes"]}
    assert sorted(changes) == sorted([
        "app.optimizers.param_groups.0.lr", "app.optimizers.param_groups.0.initial_lr", "app.scheduler._last_lr",
        "app.scheduler._schedulers.0.base_lrs", "app.scheduler._schedulers.0._last_lr",
        "app.scheduler._schedulers.1.base_lrs", "app.scheduler._schedulers.1._last_lr"])   # eta_min 0 stays 0
    assert changes["app.scheduler._schedulers.1.base_lrs"] == ([0.01], [0.02])
    old, new = plan["preview"]["before"], plan["preview"]["after"]   # torch's schedulers, replayed
    assert new["steps"] == old["steps"] == spec.max_steps - 4 + 1
    assert [2 * x for x in old["trace_head"]] == new["trace_head"] and new["peak"] == 2 * old["peak"]
    assert not (tmp_path / "out").exists() and tree_hashes(ckpt) == before
    r = run("set-lr", ckpt, tmp_path / "out", "--scale", "2", "--dry-run")
    assert "app.optimizers.param_groups.0.lr" in r.output and "dry run" in r.output


def test_in_place_swaps_metadata_atomically_and_keeps_a_restorable_backup(fixture_copy):
    trainer = fixture_copy / TRAINER.relative_to(TRAINER.parents[3])
    data_before = {k: v for k, v in tree_hashes(trainer).items() if k.endswith(".distcp")}
    old_meta = (trainer / ".metadata").read_bytes()
    r = run("set-lr", trainer, "--in-place", "--lr", "1e-3")
    assert r.exit_code == 0, r.output
    backups = list(trainer.glob(".metadata.bak-*"))
    assert len(backups) == 1 and backups[0].read_bytes() == old_meta
    after = tree_hashes(trainer)
    assert {k: after[k] for k in data_before} == data_before and "__patch_0.distcp" in after
    rep = json_payload(run("inspect", trainer, "--json").stdout)
    assert rep["lr"] == 1e-3 and rep["initial_lr"] == pytest.approx(1e-3)
    backups[0].replace(trainer / ".metadata")   # the documented undo
    assert json_payload(run("inspect", trainer, "--json").stdout)["lr"] == 0.01


def test_set_lr_on_a_slim_checkpoint_keeps_it_marked_slim(tmp_path):
    assert run("slim", TRAINER, tmp_path / "slim").exit_code == 0
    r = run("set-lr", tmp_path / "slim", tmp_path / "slim-lr", "--scale", "0.5")
    assert r.exit_code == 0, r.output
    rep = json_payload(run("inspect", tmp_path / "slim-lr", "--json").stdout)
    assert rep["slim"] is True and rep["lr"] == 0.005


# ------------------------------------------------------------------------------------------ ckpt set
def test_set_changes_typed_scalars_and_nothing_else(tmp_path):
    out = tmp_path / "out"
    r = run("set", TRAINER, out, "progress.step=100", "app.optimizers.param_groups.0.amsgrad=true",
            "optimizers.param_groups.0.betas=[0.8, 0.99]", "optimizers.param_groups.0.eps=1")
    assert r.exit_code == 0, r.output
    a, b = DcpCheckpoint.open(TRAINER), DcpCheckpoint.open(out)
    assert b.read_object("app.progress.step") == 100 and type(b.read_object("app.progress.step")) is int
    assert b.read_object("app.optimizers.param_groups.0.amsgrad") is True
    assert b.read_object("app.optimizers.param_groups.0.betas") == (0.8, 0.99)
    eps = b.read_object("app.optimizers.param_groups.0.eps")
    assert eps == 1.0 and type(eps) is float
    changed = {"app.progress.step", "app.optimizers.param_groups.0.amsgrad", "app.optimizers.param_groups.0.betas",
               "app.optimizers.param_groups.0.eps"}
    for k, e in a.entries.items():
        if k in changed:
            continue
        f = b.entries[k]
        if e.is_tensor:
            assert [(c.file, c.offset, c.length) for c in e.chunks] == [(c.file, c.offset, c.length) for c in f.chunks]
        else:
            assert b.read_object(k) == a.read_object(k)
    assert (out / "__0_0.distcp").stat().st_ino == (TRAINER / "__0_0.distcp").stat().st_ino


@pytest.mark.parametrize("assignment,message", [
    ("progress.step=7.5", "expected an int like the current value 3"),
    ("optimizers.param_groups.0.lr=fast", "expected a float"),
    ("optimizers.param_groups.0.amsgrad=2", "expected a bool"),
    ("optimizers.param_groups.0.betas=[0.9]", "JSON array of 2 element(s)"),
    ("optimizers.param_groups.0.foreach=true", "current value is None"),
    ("model.model.norm.weight=1", "is a tensor"),
    ("progres.step=3", "did you mean progress.step"),
    ("progress.step", "is not KEY=VALUE"),
])
def test_set_refuses_values_of_another_type_and_non_byte_items(tmp_path, assignment, message):
    r = run("set", TRAINER, tmp_path / "out", assignment)
    assert r.exit_code == 2 and message in r.output, r.output
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------ 4-rank FSDP2
@pytest.mark.slow
def test_factory_sequential_lr_resumes_strictly_on_the_scaled_schedule(tmp_path_factory):
    from safetensors.torch import load_file

    from tests.factory.fsdp_check import load_strict

    paths = surgery_run(tmp_path_factory)
    truth = json.loads(paths.truth_json.read_text())
    spec = FactorySpec.from_dict(truth["spec"])
    assert spec.scheduler == "sequential" and spec.decay == "cosine"
    src_before = tree_hashes(paths.checkpoint)
    out = tmp_path_factory.mktemp("factory-lr") / "lr"
    r = run("set-lr", paths.checkpoint, out, "--scale", "0.5", "--json")
    assert r.exit_code == 0, r.output
    res = json.loads(r.stdout)["result"]
    assert res["linked"] == {"hardlink": 4} and res["seconds"] < 5
    new_files = [p for p in out.iterdir() if p.stat().st_nlink == 1 and p.name != ".ckpt-tools-output"]
    assert sorted(p.name for p in new_files) == [".metadata", "__patch_0.distcp"]
    assert (out / "__patch_0.distcp").stat().st_size < 32 * 1024
    assert res["bytes_written"] == sum(p.stat().st_size for p in new_files)
    assert tree_hashes(paths.checkpoint) == src_before

    # The schedule the run would have followed, replayed from scratch with the factory's own scheduler.
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=spec.lr)
    sched = build_scheduler(opt, spec)
    trace = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(spec.steps + 8):
            opt.step()
            sched.step()
            trace.append(opt.param_groups[0]["lr"])
    assert trace[spec.steps - 1] == truth["lr"]

    got = load_strict(out, paths.base_model, dataclasses.replace(spec), world_size=4, steps_after=8)
    assert got["lr"] == 0.5 * truth["lr"]
    assert got["lr_trace"] == [0.5 * x for x in trace[spec.steps:]]
    optim_truth = {k[len("optim."):]: v for k, v in load_file(str(paths.truth)).items() if k.startswith("optim.")}
    assert sorted(got["optim"]) == sorted(optim_truth)
    for k, v in got["optim"].items():
        assert torch.equal(bits(v), bits(optim_truth[k])), k
    rep = json_payload(run("inspect", out, "--json").stdout)
    assert rep["lr"] == 0.5 * truth["lr"] and rep["scheduler"]["_last_lr"] == [0.5 * truth["lr"]]
