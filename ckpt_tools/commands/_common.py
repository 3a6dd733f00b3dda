"""Options and rendering shared by commands."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
trust_option = click.option(
    "--trust-remote-pickle", "trust_pickle", is_flag=True,
    help="DANGEROUS: unpickle checkpoint metadata/items beyond the allow-list. Only for files you made.")
dry_run_option = click.option("--dry-run", is_flag=True, help="Print the plan and write nothing.")


def alpha_options(f):
    f = click.option("--run-config", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                     help="prime-rl orchestrator config (outputs/run_*/configs/orch.toml) whose "
                          "[model.lora] alpha set the training scale.")(f)
    f = click.option("--alpha", type=float, help="LoRA alpha training used (scale = alpha / rank).")(f)
    return f


def warn_trust(trust: bool) -> None:
    if trust:
        click.secho("WARNING: --trust-remote-pickle: pickles outside the allow-list will be executed. "
                    "A crafted checkpoint can run any code on this machine.", fg="red", err=True)


def emit_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=False, default=_default))


def _default(o):
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "__dataclass_fields__"):
        from dataclasses import asdict
        return asdict(o)
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    return str(o)


def warn(msg: str) -> None:
    click.secho(f"WARNING: {msg}", fg="yellow", err=True)


def is_tty() -> bool:
    return sys.stderr.isatty()


class json_errors:
    """`with json_errors(as_json):` under --json, a CkptError is printed as one JSON object on stdout
    ({"error": message, "exit_code": n, "path": ..., "key": ..., "hint": ...}) and the command exits
    with its code; without --json it propagates to the CLI's error edge (one `error:` line)."""

    def __init__(self, as_json: bool):
        self.as_json = as_json

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        from ..errors import CkptError

        if not self.as_json or exc is None or not isinstance(exc, CkptError):
            return False
        emit_json({"error": exc.render(), "exit_code": exc.exit_code, "path": exc.path, "key": exc.key,
                   "hint": exc.hint})
        raise click.exceptions.Exit(exc.exit_code)
