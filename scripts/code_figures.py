#!/usr/bin/env python3
"""The code-health figures of #34 for one or more revisions, each measured the same way.

    python scripts/code_figures.py REV [REV ...]      e.g. scripts/code_figures.py 6469dbe main

Each REV is exported with `git archive` into a temporary dir and measured there:

- modules and lines: the `.py` files under ckpt_tools/ and their line count (as written at that REV);
- long functions: bodies over 60 and over 100 lines, measured as tests/test_layout.py measures them
  (first statement after the docstring to the last line; nested functions counted on their own);
- import cycles: the strongly connected sets of modules of tests/test_layout.py's import graph (lazy
  imports included, `if TYPE_CHECKING:` blocks not), as (cycles, modules in them);
- mypy-ignored modules: the modules of pyproject.toml's `ignore_errors` overrides;
- what a command runs: `ckpt merge` (and `ckpt extract-adapter`) on the genuine tiny fixture
  (tests/fixtures/primerl-tiny of this checkout, the same input for every REV), run with PYTHONPATH=<tree>
  under `sys.setprofile` / `threading.setprofile`: the files under ckpt_tools/ in which at least one
  function ran, and the distinct functions that ran (file, qualified name, first line; module bodies,
  comprehensions, generator expressions and lambdas not counted). The optional C fast paths are not
  built in an exported tree, so both REVs run their Python paths.

The test rules are imported from this checkout's tests/test_layout.py, so every REV is measured by the
same code. Prints one Markdown table, a column per REV.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.test_layout import function_lengths, import_cycles, import_graph  # noqa: E402

TINY = REPO / "tests" / "fixtures" / "primerl-tiny"

# Run inside the measured tree's interpreter: profile every Python call, run the CLI, dump what ran.
_TRACER = r"""
import json, runpy, sys, threading
root, dump = sys.argv[1], sys.argv[2]
sys.argv = ["ckpt", *sys.argv[3:]]
seen = set()
def prof(frame, event, arg):
    if event == "call":
        c = frame.f_code
        if c.co_filename.startswith(root) and not c.co_name.startswith("<"):
            seen.add((c.co_filename[len(root):], c.co_qualname, c.co_firstlineno))
threading.setprofile(prof)
sys.setprofile(prof)
try:
    runpy.run_module("ckpt_tools", run_name="__main__")
except SystemExit as e:
    code = e.code
else:
    code = 0
finally:
    sys.setprofile(None)
    threading.setprofile(None)
json.dump({"rc": code, "seen": sorted(seen)}, open(dump, "w"))
"""


def export(rev: str, into: Path) -> Path:
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev], cwd=REPO, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def static_figures(tree: Path) -> dict:
    pkg = tree / "ckpt_tools"
    files = sorted(p for p in pkg.rglob("*.py") if "__pycache__" not in p.parts)
    lengths = [n for p in files for _q, n in function_lengths(ast.parse(p.read_text()), p.name)]
    cycles = import_cycles(import_graph(pkg))
    overrides = tomllib.loads((tree / "pyproject.toml").read_text()).get("tool", {}).get("mypy", {})
    ignored = {
        m
        for o in overrides.get("overrides", [])
        if o.get("ignore_errors")
        for m in ([o["module"]] if isinstance(o["module"], str) else o["module"])
    }
    return {
        "modules": len(files),
        "lines": sum(len(p.read_text().splitlines()) for p in files),
        "functions": len(lengths),
        "over 60 lines": sum(n > 60 for n in lengths),
        "over 100 lines": sum(n > 100 for n in lengths),
        "import cycles (modules in them)": f"{len(cycles)} ({sum(len(c) for c in cycles)})",
        "mypy-ignored modules": len(ignored),
    }


def traced(tree: Path, work: Path, args: list[str]) -> tuple[int, int]:
    """(files, distinct functions) under ckpt_tools/ that ran for `ckpt ARGS`."""
    dump = work / "trace.json"
    root = str(tree / "ckpt_tools") + "/"
    env = {"PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HOME": str(work)}
    cmd = [sys.executable, "-c", _TRACER, root, str(dump), *args]
    p = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    got = json.loads(dump.read_text())
    if got["rc"] not in (0, None):
        raise SystemExit(f"`ckpt {' '.join(args)}` failed in {tree} ({got['rc']}):\n{p.stderr}")
    seen = got["seen"]
    return len({f for f, _q, _l in seen}), len(seen)


def command_figures(tree: Path, work: Path) -> dict:
    trainer = next(iter(sorted((TINY / "outputs" / "checkpoints").glob("step_*/trainer"))))
    base = TINY / "base_model"
    out = {}
    for name, args in (
        ("merge", ["merge", str(base), str(trainer), str(work / "merged")]),
        ("extract-adapter", ["extract-adapter", str(trainer), str(work / "adapter")]),
    ):
        files, funcs = traced(tree, work, args)
        out[f"`ckpt {name}` on the tiny fixture: files (functions) run"] = f"{files} ({funcs})"
    return out


def measure(rev: str, tmp: Path) -> dict:
    tree = export(rev, tmp / "tree")
    work = tmp / "work"
    work.mkdir()
    return {**static_figures(tree), **command_figures(tree, work)}


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    columns = {}
    for rev in argv:
        short = subprocess.run(["git", "rev-parse", "--short", rev], cwd=REPO, check=True, capture_output=True,
                               text=True).stdout.strip()
        tmp = Path(tempfile.mkdtemp(prefix="code-figures-"))
        try:
            columns[f"{rev} ({short})" if short != rev else rev] = measure(rev, tmp)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    rows = list(next(iter(columns.values())))
    print("| figure | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for r in rows:
        print(f"| {r} | " + " | ".join(str(c[r]) for c in columns.values()) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
