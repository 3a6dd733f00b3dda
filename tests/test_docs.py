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
