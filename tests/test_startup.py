"""`ckpt --help`, `--version`, `ckpt <command> --help` of every command, `inspect` of every format and
`verify` never import torch (nor transformers, peft, safetensors, numpy, huggingface_hub); `slim` (with or
without --base) and `extract-adapter`, which move and cast bytes, import numpy but never torch: each runs in
a fresh interpreter and sys.modules is checked after it. Their wall time is measured by bench/
(docs/benchmarks.md), not asserted here."""
from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from ckpt_tools.cli import COMMANDS, main

from .conftest import BASE, FIXTURE, HEAD_FIXTURES, REPO, TRAINER

HEAVY = ("torch", "transformers", "peft", "safetensors", "numpy", "huggingface_hub", "accelerate", "matplotlib", "PIL")

PROBE = """
import sys
from ckpt_tools.entry import main
rc = main(sys.argv[1:])
heavy = sorted({m.split(".")[0] for m in sys.modules} & set(%r))
print("HEAVY=" + ",".join(heavy), file=sys.stderr)
sys.exit(rc)
""" % (HEAVY,)


def heavy_modules(*args) -> tuple[int, list[str], str]:
    r = subprocess.run([sys.executable, "-c", PROBE, *map(str, args)], cwd=REPO, capture_output=True, text=True)
    line = [ln for ln in r.stderr.splitlines() if ln.startswith("HEAVY=")]
    assert line, r.stderr
    return r.returncode, [m for m in line[-1][6:].split(",") if m], r.stdout


@pytest.fixture(scope="module")
def slim_ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("slim") / "slim"
    r = CliRunner().invoke(main, ["slim", str(TRAINER), str(out), "--base", str(BASE)])
    assert r.exit_code == 0, r.output
    return out


CASES = {
    "--help": ["--help"],
    "--version": ["--version"],
    "inspect DCP": ["inspect", TRAINER],
    "inspect DCP --json": ["inspect", TRAINER, "--json"],
    "inspect DCP --keys": ["inspect", TRAINER, "--keys"],
    "inspect HEAD MoE": ["inspect", HEAD_FIXTURES / "F_head_moe" / "outputs" / "checkpoints" / "step_3" / "trainer"],
    "inspect checkpoints dir": ["inspect", FIXTURE / "outputs" / "checkpoints"],
    "inspect HF": ["inspect", BASE],
    "inspect PEFT": ["inspect", FIXTURE / "reference_peft_adapter"],
    "inspect prime-rl broadcast": ["inspect", FIXTURE / "outputs" / "run_default" / "broadcasts" / "step_3"],
    "verify DCP": ["verify", TRAINER],
    "verify HF": ["verify", BASE],
    "verify PEFT --base": ["verify", FIXTURE / "reference_peft_adapter", "--base", BASE],
    "verify DCP --deep": ["verify", TRAINER, "--deep"],   # CRC32 of every record: zlib, not torch
}


@pytest.mark.parametrize("name", list(CASES))
def test_metadata_commands_never_import_torch(name):
    rc, heavy, out = heavy_modules(*CASES[name])
    assert rc == 0 and out
    assert heavy == [], f"{name} imported {heavy}"


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_commands_help_never_imports_torch(command):
    """A command module imports its op (torch, for most) inside the command function, not at module
    level: `ckpt <command> --help` only declares options. Over the COMMANDS table, so a new command
    is covered the day it is registered."""
    rc, heavy, out = heavy_modules(command, "--help")
    assert rc == 0 and out.startswith(f"Usage: ckpt {command} "), out[:200]
    assert heavy == [], f"`ckpt {command} --help` imported {heavy}"


def test_inspect_of_a_slim_checkpoint_never_imports_torch(slim_ckpt):
    rc, heavy, out = heavy_modules("inspect", slim_ckpt)
    assert rc == 0 and "SLIM" in out.upper() and heavy == []


MOE = HEAD_FIXTURES / "F_head_moe" / "outputs" / "checkpoints" / "step_3" / "trainer"
DENSE_HEAD = HEAD_FIXTURES / "E_head_dense" / "outputs" / "checkpoints" / "step_2" / "trainer"

# Commands that only move, check and cast bytes (issue 22): numpy, never torch (a CUDA build's import is seconds).
BYTE_MOVERS = {
    "slim": lambda out: ["slim", TRAINER, out],
    "slim --base": lambda out: ["slim", TRAINER, out, "--base", BASE],
    "slim of a HEAD MoE run": lambda out: ["slim", MOE, out],
    "extract-adapter": lambda out: ["extract-adapter", TRAINER, out],
    "extract-adapter --dtype bf16": lambda out: ["extract-adapter", TRAINER, out, "--dtype", "bf16"],
    "extract-adapter of a HEAD dense run": lambda out: ["extract-adapter", DENSE_HEAD, out],
    "extract-adapter of a MoE run (fused PEFT layout)": lambda out: ["extract-adapter", MOE, out],
    "extract-adapter --layout vllm --dtype bf16": lambda out: ["extract-adapter", MOE, out, "--layout", "vllm",
                                                               "--dtype", "bf16"],
}


@pytest.mark.parametrize("name", list(BYTE_MOVERS))
def test_the_commands_that_move_bytes_never_import_torch(name, tmp_path):
    rc, heavy, out = heavy_modules(*BYTE_MOVERS[name](tmp_path / "out"))
    assert rc == 0, out
    assert "torch" not in heavy and set(heavy) <= {"numpy"}, f"{name} imported {heavy}"
    assert any((tmp_path / "out").iterdir())


def test_a_command_that_computes_with_tensors_still_gets_torch(tmp_path):
    rc, heavy, _ = heavy_modules("merge", BASE, FIXTURE / "reference_peft_adapter", tmp_path / "m")
    assert rc == 0 and "torch" in heavy


def test_the_help_listing_is_each_commands_own_first_line():
    """`ckpt --help` lists commands from cli.COMMANDS without importing them: the table must say
    what each command's own help says."""
    for name, (_, line) in COMMANDS.items():
        cmd = main.get_command(None, name)
        own = " ".join(cmd.help.split("\n\n")[0].split())
        assert own.startswith(line.rstrip(".").rstrip(" ...")), (name, own, line)
