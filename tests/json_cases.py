"""Every command's --json runs (success, dry run, failure) on the genuine fixtures, as data: the schema
tests (tests/test_json_envelope.py) validate each output against docs/json.md, and
`python -m tests.json_cases OUT` prints them (to draft a schema for a new command)."""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .conftest import BASE, FIXTURE, FIXTURES, HEAD_FIXTURES, TRAINER

__all__ = ["Case", "CASES"]

ADAPTER = FIXTURE / "reference_peft_adapter"
BROADCAST = FIXTURE / "outputs" / "run_default" / "broadcasts" / "step_3"
EXPORT = FIXTURE / "outputs" / "weights" / "step_3"
MERGED = FIXTURE / "expected_merged_hf"
E = HEAD_FIXTURES / "E_head_dense"
E_CKPT = E / "outputs" / "checkpoints"
G_TRAINER = HEAD_FIXTURES / "G_head_fullft" / "outputs" / "checkpoints" / "step_3" / "trainer"
OLD = 1_600_000_000.0
VERL = FIXTURES / "verl-fsdp2-lora" / "checkpoints"


@dataclass(frozen=True)
class Case:
    command: str
    kind: str                                 # success | dry_run | failure
    args: Callable[[Path], list]              # tmp dir -> argv after the command name
    exit_code: int = 0
    name: str = ""

    @property
    def id(self) -> str:
        return f"{self.command}-{self.kind}" + (f"-{self.name}" if self.name else "")


def _fp8(tmp: Path) -> Path:
    from ckpt_tools.cli import main
    from click.testing import CliRunner

    out = tmp / "fp8"
    r = CliRunner().invoke(main, ["merge", str(BASE), str(TRAINER), str(out), "--dtype", "fp8"])
    assert r.exit_code == 0, r.output
    return out


def _slim(tmp: Path) -> Path:
    from ckpt_tools.cli import main
    from click.testing import CliRunner
    out = tmp / "slim-in"
    r = CliRunner().invoke(main, ["slim", str(TRAINER), str(out), "--base", str(BASE)])
    assert r.exit_code == 0, r.output
    return out


def _gc_run(tmp: Path, with_base: bool = True) -> Path:
    """A HEAD run with checkpoints step_1..3, old enough for gc to touch."""
    run = tmp / "gc-run"
    if with_base:
        shutil.copytree(E / "base_model", run / "base_model")
    shutil.copytree(E / "configs", run / "configs")
    ck = run / "outputs" / "checkpoints"
    for n in (1, 2, 3):
        shutil.copytree(E / "outputs" / "checkpoints" / f"step_{2 if n <= 2 else 3}" / "trainer",
                        ck / f"step_{n}" / "trainer")
    for p in [run, *run.rglob("*")]:
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
        os.utime(p, (OLD, OLD), follow_symlinks=False)
    return ck


def _pair(command: str, args, fail_args, fail_code: int, dry: bool = True) -> list[Case]:
    cases = [Case(command, "success", args)]
    if dry:
        cases.append(Case(command, "dry_run", lambda t: [*args(t), "--dry-run"]))
    cases.append(Case(command, "failure", fail_args, fail_code))
    return cases


CASES: list[Case] = [
    Case("inspect", "success", lambda t: [TRAINER], name="dcp"),
    Case("inspect", "success", lambda t: [BASE], name="hf"),
    Case("inspect", "success", lambda t: [ADAPTER], name="peft"),
    Case("inspect", "success", lambda t: [TRAINER, "--keys"], name="keys"),
    Case("inspect", "success", lambda t: [FIXTURE / "outputs" / "checkpoints"], name="checkpoints"),
    Case("inspect", "success", lambda t: [_slim(t)], name="slim"),
    Case("inspect", "failure", lambda t: [t / "missing"], 2),
    *_pair("extract-adapter", lambda t: [TRAINER, t / "adapter"], lambda t: [TRAINER, t / "a", "--slot", "7"], 2),
    *_pair("adapter-to-dcp", lambda t: [ADAPTER, t / "resume", "--base", BASE, "--lr", "1e-3"],
           lambda t: [ADAPTER, t / "resume", "--base", t / "nothing-here", "--lr", "1e-3"], 2),
    *_pair("fix-adapter", lambda t: [BROADCAST, t / "fixed"], lambda t: [BASE, t / "fixed"], 1),
    *_pair("merge", lambda t: [BASE, TRAINER, t / "merged"], lambda t: [BASE, BASE, t / "merged"], 2),
    *_pair("average", lambda t: [E_CKPT / "step_2" / "trainer", E_CKPT / "step_3" / "trainer", t / "avg", "--ema", "0.5"],
           lambda t: [E_CKPT / "step_3" / "trainer", t / "avg"], 2),
    Case("average", "success", lambda t: [E_CKPT / "step_2" / "trainer", E_CKPT / "step_3" / "trainer", t / "avg-merged",
                                          "--merge", E / "base_model", "--rank", "4"], name="merge"),
    Case("average", "dry_run", lambda t: [E_CKPT / "step_2" / "trainer", E_CKPT / "step_3" / "trainer", t / "avg-merged",
                                          "--merge", E / "base_model", "--dry-run"], name="merge"),
    Case("merge", "success", lambda t: [BASE, TRAINER, t / "fp8", "--dtype", "fp8"], name="fp8"),
    Case("average", "success", lambda t: [E_CKPT / "step_2" / "trainer", E_CKPT / "step_3" / "trainer", t / "avg-fp8",
                                          "--merge", E / "base_model", "--dtype", "fp8"], name="merge-fp8"),
    Case("export", "success", lambda t: [G_TRAINER, t / "exported-fp8", "--dtype", "fp8"], name="fp8"),
    *_pair("resize-adapter", lambda t: [ADAPTER, t / "r4", "--rank", "4"], lambda t: [ADAPTER, t / "r4"], 2),
    *_pair("export", lambda t: [G_TRAINER, t / "exported"], lambda t: [t / "missing", t / "exported"], 2),
    Case("diff-vs-base", "success", lambda t: [MERGED, BASE]),
    Case("diff-vs-base", "success", lambda t: [EXPORT, BASE], 3, name="identical"),
    Case("diff-vs-base", "success", lambda t: [_fp8(t), BASE, "--adapter", ADAPTER], name="fp8"),
    Case("diff-vs-base", "failure", lambda t: [t / "missing", BASE], 2),
    Case("verify", "success", lambda t: [TRAINER]),
    Case("verify", "success", lambda t: [ADAPTER, "--base", BASE], name="peft"),
    Case("verify", "failure", lambda t: [t / "missing"], 2),
    *_pair("slim", lambda t: [TRAINER, t / "slim", "--base", BASE], lambda t: [BASE, t / "slim"], 2),
    *_pair("rehydrate", lambda t: [_slim(t), t / "full", "--base", BASE], lambda t: [TRAINER, t / "full", "--base", BASE], 2),
    *_pair("set-lr", lambda t: [TRAINER, t / "lr", "--scale", "0.5"], lambda t: [TRAINER, t / "lr"], 2),
    *_pair("set", lambda t: [TRAINER, t / "set", "progress.step=5"], lambda t: [TRAINER, t / "set", "nope=1"], 2),
    Case("set-lr", "success", lambda t: [VERL, t / "global_step_2", "--scale", "0.5"], name="verl"),
    Case("set-lr", "dry_run", lambda t: [VERL, t / "global_step_2", "--lr", "1e-3", "--dry-run"], name="verl"),
    Case("set", "success", lambda t: [VERL, t / "global_step_2", "lr_scheduler.last_epoch=3"], name="verl"),
    *_pair("restart-prep", lambda t: [TRAINER, t / "restart", "--base", BASE, "--lr", "5e-3"],
           lambda t: [TRAINER, t / "restart", "--base", BASE], 2),
    *_pair("gc", lambda t: [_gc_run(t), "--keep-full", "1"],
           lambda t: [_gc_run(t, with_base=False), "--keep-full", "1"], 2),
    Case("report", "success", lambda t: [E / "outputs" / "checkpoints", "--scale", "0.5"]),
    Case("report", "dry_run", lambda t: [E / "outputs" / "checkpoints", "-o", t / "r.html", "--dry-run"]),
    Case("report", "success", lambda t: [MERGED, "--base", BASE], name="merged"),
    Case("report", "failure", lambda t: [MERGED], 2),
    Case("doctor", "success", lambda t: [FIXTURE], 3),
    Case("doctor", "failure", lambda t: [t / "missing.toml"], 2),
]


if __name__ == "__main__":
    import json
    import sys
    import tempfile

    from click.testing import CliRunner

    from ckpt_tools.cli import main
    for case in CASES:
        with tempfile.TemporaryDirectory() as d:
            argv = [case.command, *map(str, case.args(Path(d))), "--json"]
            r = CliRunner().invoke(main, argv)
            print(f"### {case.id} exit {r.exit_code} (expected {case.exit_code})")
            print(r.stdout)
            if r.exit_code != case.exit_code:
                print("STDERR:", r.stderr, file=sys.stdout)
