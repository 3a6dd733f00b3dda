#!/usr/bin/env python3
"""Write docs/cli.md from the commands' own --help, so the reference cannot drift from the code.

    python scripts/gen_cli_doc.py            # rewrite docs/cli.md
    python scripts/gen_cli_doc.py --check    # exit 1 if docs/cli.md is stale (tests use this)
"""
from __future__ import annotations

import sys
from pathlib import Path

import click

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ckpt_tools.cli import main  # noqa: E402

HEADER = """# `ckpt` command reference

Generated from each command's `--help` by `scripts/gen_cli_doc.py` (a test fails when this file is
stale). Every command exits 0 on success, 1 on a data error (the message names the file and key and
what to do), 2 on a usage error, 130 on Ctrl-C and 143 on SIGTERM (temporary outputs removed);
`diff-vs-base` also exits 3 (identical to base) and 4 (adapter check failed), `doctor` 3 (a trap
found). `-v`/`-q` may stand anywhere on the line (`ckpt merge A B C -v`); the other global options go
before the command. Under `--json` every command prints one JSON envelope on stdout (docs/json.md).
`NO_COLOR=1` turns colour off; progress is drawn on a terminal only, and never under `-q` or `--json`.

Shell completion (click's): `eval "$(_CKPT_COMPLETE=bash_source ckpt)"` in `~/.bashrc`
(`zsh_source` in `~/.zshrc`; `_CKPT_COMPLETE=fish_source ckpt | source` for fish).
"""


def render() -> str:
    parts = [HEADER]
    ctx = click.Context(main, info_name="ckpt", terminal_width=100, max_content_width=100)
    parts.append("## ckpt\n\n```\n" + main.get_help(ctx) + "\n```\n")
    for name in sorted(main.list_commands(ctx)):
        cmd = main.get_command(ctx, name)
        sub = click.Context(cmd, info_name=f"ckpt {name}", parent=None, terminal_width=100,
                            max_content_width=100)
        parts.append(f"## ckpt {name}\n\n```\n{cmd.get_help(sub)}\n```\n")
    return "\n".join(parts)


if __name__ == "__main__":
    target = REPO / "docs" / "cli.md"
    text = render()
    if "--check" in sys.argv:
        if not target.exists() or target.read_text() != text:
            print("docs/cli.md is stale: run python scripts/gen_cli_doc.py", file=sys.stderr)
            sys.exit(1)
        sys.exit(0)
    target.write_text(text)
    print(f"wrote {target}")
