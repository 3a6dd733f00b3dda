"""The one JSON renderer and the text helpers every command shares.

Every command hands its report to `emit` under `--json`: the report's own `to_json()` is printed as
strict JSON (a non-finite float, a checkpoint's NaN lr say, becomes "NaN" / "Infinity"), so the shape
of the CLI's JSON is decided here, in one place (the next issue wraps every report in one envelope:
this function). Failures are JSON too, in one shape (`error_object`), from `json_errors` and the CLI's
error edge.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

import click

from ..core.errors import CkptError

__all__ = ["emit", "emit_json", "error_object", "json_errors", "warn", "warn_trust", "is_tty"]


def emit(report) -> None:
    """Print a report (anything with `to_json()`, or a plain JSON-able object) as the command's JSON."""
    emit_json(report.to_json() if hasattr(report, "to_json") else report)


def emit_json(obj) -> None:
    """Print `obj` as strict JSON: a non-finite float (a checkpoint's NaN lr, say) becomes the string
    "NaN" / "Infinity" / "-Infinity", since a bare NaN is not JSON and breaks every parser but Python's."""
    click.echo(json.dumps(_finite(obj), indent=2, sort_keys=False, default=_default, allow_nan=False))


def _finite(o):
    if isinstance(o, float) and not math.isfinite(o):
        return "NaN" if o != o else ("Infinity" if o > 0 else "-Infinity")
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    if hasattr(o, "__dataclass_fields__"):
        return _finite(asdict(o))
    return o


def _default(o):
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "__dataclass_fields__"):
        return asdict(o)
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    return str(o)


def warn(msg: str) -> None:
    click.secho(f"WARNING: {msg}", fg="yellow", err=True)


def warn_trust(trust: bool) -> None:
    if trust:
        click.secho("WARNING: --trust-remote-pickle: pickles outside the allow-list will be executed. "
                    "A crafted checkpoint can run any code on this machine.", fg="red", err=True)


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
        if not self.as_json or exc is None or not isinstance(exc, CkptError):
            return False
        emit_json(error_object(exc.render(), exc.exit_code, exc))
        raise click.exceptions.Exit(exc.exit_code)


def error_object(message: str, exit_code: int, exc=None, kind: str | None = None) -> dict:
    """A failure as JSON, the one shape every command prints under --json (`json_errors` here, and
    the CLI's error edge for every other failure, interruptions included)."""
    return {"error": message, "exit_code": exit_code, "path": getattr(exc, "path", None),
            "key": getattr(exc, "key", None), "hint": getattr(exc, "hint", None),
            "type": kind or (type(exc).__name__ if exc is not None else "error")}
