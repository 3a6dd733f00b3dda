"""`--overwrite` replaces only an earlier output of ckpt-tools, and OUT never reaches an input by
another path. Inputs are copies of the genuine fixture; OUTs are what a user might point OUT at by
mistake: a folder of their own files, a home-like dir, the current directory spelled absolutely,
`/`, `.`, `..`, another mount of the checkpoint (a real `mount --bind` where it works, a symlinked
alias always). Every refusal is checked in the real run and in the dry run (text and --json), and
every byte of what was at OUT is checked unchanged afterwards.

Figures for docs/reliability.md: `hu.record("overwrite")`, `hu.record("same_inode")`.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from ckpt_tools.io.owned import OUTPUT_MARKER

from . import hardening_util as hu
from .conftest import BASE, FIXTURE, TRAINER


def _cases(root: Path) -> dict[str, Path]:
    """name -> an existing OUT that is not an earlier output of the tool."""
    unrelated = root / "my-notes"
    (unrelated / "drafts").mkdir(parents=True)
    (unrelated / "paper.tex").write_text("\\documentclass{article}\n")
    (unrelated / "drafts" / "v1.txt").write_text("draft\n")
    home = root / "home" / "me"
    (home / ".git").mkdir(parents=True)
    (home / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (home / ".bashrc").write_text("export PS1='$ '\n")
    (home / ".ssh").mkdir()
    (home / ".ssh" / "id_ed25519").write_text("not a real key\n")
    model = root / "downloaded-model"        # looks like an output of merge, but the tool did not write it
    hu.writable_copy(BASE, model)
    ckpt = root / "training-ckpt"            # a genuine checkpoint: the layout slim writes
    hu.writable_copy(TRAINER, ckpt)
    link = root / "link-out"
    link.symlink_to(unrelated)
    file_out = root / "a-file"
    file_out.write_text("keep me\n")
    return {"unrelated files": unrelated, "home-like dir": home, "downloaded HF model": model,
            "genuine checkpoint": ckpt, "symlink": link, "plain file": file_out}


def _argv(out) -> list:
    return ["extract-adapter", TRAINER, out, "--overwrite"]


def _refused_everywhere(argv: list, expect: str, code=(1, 2)) -> int:
    """The real run, the dry run and the dry run under --json all refuse with the same words."""
    real = hu.assert_clean_error(hu.invoke(argv), expect=expect, code=code)
    dry = hu.assert_clean_error(hu.invoke([*argv, "--dry-run"]), expect=expect, code=code)
    assert dry == real, (dry, real)
    r = hu.invoke([*argv, "--dry-run", "--json"])
    assert r.exit_code in ((code,) if isinstance(code, int) else code)
    err = json.loads(r.stdout)["error"]
    assert err["message"] == real.removeprefix("error: "), (err, real)
    return 3


def test_overwrite_refuses_every_out_the_tool_did_not_write_naming_what_it_would_delete(tmp_path):
    cases = _cases(tmp_path)
    before = hu.snapshot(tmp_path)
    runs = 0
    for name, out in cases.items():
        expect = {"symlink": "is a symbolic link", "plain file": "is a file"}.get(
            name, r"is not an output of ckpt-tools \(no \.ckpt-tools-output in it\); --overwrite would delete")
        runs += _refused_everywhere(_argv(out), expect, code=1)
    # the words name what is there, hidden entries included
    line = hu.assert_clean_error(hu.invoke(_argv(cases["home-like dir"])))
    assert "3 entries (.bashrc, .git, .ssh), 3 of them hidden" in line, line
    line = hu.assert_clean_error(hu.invoke(_argv(cases["unrelated files"])))
    assert "2 entries (drafts, paper.tex)" in line, line
    assert hu.diff_snapshots(before, hu.snapshot(tmp_path)) == []
    assert cases["symlink"].is_symlink() and cases["plain file"].read_text() == "keep me\n"
    hu.record("overwrite", refused=len(cases), runs=runs, deleted=0)


def test_the_current_directory_root_dot_and_dotdot_are_refused_however_spelled(tmp_path, monkeypatch):
    here = tmp_path / "work" / "project"
    (here / "src").mkdir(parents=True)
    (here / "src" / "main.py").write_text("print('hi')\n")
    (here / OUTPUT_MARKER).write_text('{"tool": "ckpt-tools", "entries": ["src"]}\n')   # even a marker
    monkeypatch.chdir(here)
    before = hu.snapshot(tmp_path / "work")
    spellings = {f"{here}/.": "is the current directory", f"{here}/src/..": "does not name a new directory",
                 str(tmp_path / "work"): "a directory above the current one", "/": "does not name a new directory",
                 ".": "does not name a new directory", "..": "does not name a new directory"}
    runs = 0
    for out, expect in spellings.items():
        runs += _refused_everywhere(_argv(out), expect, code=2)
    assert hu.diff_snapshots(before, hu.snapshot(tmp_path / "work")) == []
    hu.record("overwrite", refused=len(spellings), runs=runs, deleted=0)


def test_an_earlier_output_is_replaced_and_the_dry_run_says_what_goes(tmp_path):
    out = tmp_path / "adapter"
    assert hu.invoke(["extract-adapter", TRAINER, out]).exit_code == 0
    marker = json.loads((out / OUTPUT_MARKER).read_text())
    assert marker["command"] == "extract-adapter" and marker["entries"] == ["SHA256SUMS",
                                                                             "adapter_config.json",
                                                                             "adapter_model.safetensors"]
    size = sum(p.stat().st_size for p in out.iterdir() if p.name != OUTPUT_MARKER)
    dry = hu.invoke([*_argv(out), "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert dry.stdout.splitlines()[-1].startswith(
        f"  --overwrite would remove {out}: an earlier output of `ckpt extract-adapter`, 3 entries"), dry.stdout
    plan = json.loads(hu.invoke([*_argv(out), "--dry-run", "--json"]).stdout)["plan"]
    assert plan["output"]["exists"] is True and plan["output"]["replaces"]["entries"] == 3
    assert plan["output"]["replaces"]["bytes"] >= size
    fresh = json.loads(hu.invoke(["extract-adapter", TRAINER, tmp_path / "new", "--dry-run", "--json"]).stdout)
    assert fresh["plan"]["output"] == {"out": str(tmp_path / "new"), "exists": False, "replaces": None}
    # the replacement loads in PEFT's own reader like the first (the marker is invisible to it)
    from safetensors.torch import load_file
    first = load_file(out / "adapter_model.safetensors")
    r = hu.invoke(_argv(out))
    assert r.exit_code == 0, r.output
    again = load_file(out / "adapter_model.safetensors")
    assert first.keys() == again.keys() and all((first[k] == again[k]).all() for k in first)
    # an earlier output someone added to: the additions are named and kept
    (out / "my-eval.json").write_text("{}\n")
    line = hu.assert_clean_error(hu.invoke(_argv(out)), expect="holds entries it did not write: my-eval.json")
    assert (out / "my-eval.json").exists() and line
    hu.record("overwrite", replaced=1, refused=1, runs=5, deleted=0)


# ------------------------------------------------------------------------- another path to the input
@contextlib.contextmanager
def _bind_mount(src: Path, dst: Path):
    dst.mkdir()
    if os.geteuid() != 0:
        pytest.skip("a bind mount needs root (CI runs as root)")
    p = subprocess.run(["mount", "--bind", str(src), str(dst)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot bind-mount here ({p.stderr.strip() or p.returncode})")
    try:
        yield dst
    finally:
        subprocess.run(["umount", "-l", str(dst)], capture_output=True)


def _aliases(kind: str, d: Path, root: Path):
    if kind == "bind mount":
        return _bind_mount(d, root / "alias")
    (root / "alias").symlink_to(d)
    return contextlib.nullcontext(root / "alias")


@pytest.mark.parametrize("kind", ["bind mount", "symlink"])
def test_out_reaching_the_input_through_another_mount_is_refused_and_the_input_kept(tmp_path, kind):
    d = tmp_path / "D"
    d.mkdir()
    ck = hu.writable_copy(TRAINER, d / "ck")
    # an input that IS an earlier output (a set-lr OUT, marker and all): only the identity check stands
    assert hu.invoke(["set-lr", ck, d / "lr", "--scale", "0.5"]).exit_code == 0
    before = hu.snapshot(d)
    with _aliases(kind, d, tmp_path) as alias:
        assert os.path.samefile(alias / "ck", ck)
        argvs = {"slim": ["slim", d / "ck", alias / "ck", "--overwrite"],
                 "extract-adapter": ["extract-adapter", d / "ck", alias / "ck", "--overwrite", "--alpha", "16"],
                 "extract-adapter (marked input)": ["extract-adapter", d / "lr", alias / "lr", "--overwrite",
                                                    "--alpha", "16"],
                 "slim into the input": ["slim", d / "ck", alias / "ck" / "inner"],
                 "set-lr (marked input)": ["set-lr", d / "lr", alias / "lr", "--scale", "2", "--overwrite"]}
        runs = 0
        for name, argv in argvs.items():
            runs += _refused_everywhere(argv, "is inside input", code=2)
        assert hu.diff_snapshots(before, hu.snapshot(d)) == []
    hu.record("same_inode", refused=len(argvs), runs=runs, inputs_changed=0)
