"""The docs that are generated from code are current, and the README names every command."""
from __future__ import annotations

import subprocess
import sys

from ckpt_tools.cli import main

from .conftest import REPO


def test_cli_reference_is_generated_from_the_current_help():
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_cli_doc.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_readme_lists_every_command():
    readme = (REPO / "README.md").read_text()
    missing = [name for name in main.list_commands(None) if f"ckpt {name}" not in readme]
    assert not missing, missing


# --- every path a doc names is in the repository -------------------------------------------------------
import re  # noqa: E402

# Docs a reader follows: the README and docs/. A path inside a markdown link is relative to its doc and
# is checked by the link test below; the history page names the trees it measured, each by
# commit, so its paths are those of an older tree and are not checked).
_DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
_CURRENT_DOCS = [p for p in _DOCS if p.name != "history.md"]
_CODE_PATH = re.compile(r"(?<![/\w.[(])(?:ckpt_tools|tests|bench|scripts)/[A-Za-z0-9_/.-]*[A-Za-z0-9_]")
_LINK = re.compile(r"\]\(([^)#\s]+)")


def _named_paths(doc):
    for m in _CODE_PATH.finditer(doc.read_text()):
        yield m.group(0).rstrip(".")


def test_every_code_path_a_doc_names_exists():
    missing = []
    for doc in _CURRENT_DOCS:
        for p in _named_paths(doc):
            if not any((REPO / c).exists() for c in (p, p + ".py", p + ".c")):
                missing.append(f"{doc.relative_to(REPO)}: {p}")
    assert not missing, missing


def test_the_path_check_sees_a_missing_path(tmp_path):
    doc = tmp_path / "x.md"
    doc.write_text("see `ckpt_tools/no_such_module.py` and ckpt_tools/io/inputs.py.\n")
    named = list(_named_paths(doc))
    assert named == ["ckpt_tools/no_such_module.py", "ckpt_tools/io/inputs.py"]
    assert not (REPO / named[0]).exists() and (REPO / named[1]).exists()


def test_every_relative_link_in_the_docs_resolves_inside_the_repository():
    broken = []
    for doc in _DOCS:
        for target in _LINK.findall(doc.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            resolved = (doc.parent / target).resolve()
            if not resolved.exists() or not resolved.is_relative_to(REPO):
                broken.append(f"{doc.relative_to(REPO)}: {target}")
    assert not broken, broken


def test_no_doc_sends_readers_to_the_shared_folder():
    # shared/ sits beside a developer's checkout, not in a clone: what a doc needs from it is copied
    # into docs/reference/.
    outside = re.compile(r"(?:\.\./)*\bshared/(?:docs|fixtures)\b")
    found = [f"{doc.relative_to(REPO)}:{n}: {line.strip()}" for doc in _DOCS
             for n, line in enumerate(doc.read_text().splitlines(), 1) if outside.search(line)]
    assert not found, found
