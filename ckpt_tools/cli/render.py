"""The one JSON renderer and the text helpers every command shares.

Under `--json` every command prints exactly one JSON object on stdout, the envelope (docs/json.md):

    {"schema": "ckpt/1", "command": "merge", "ok": true, "exit_code": 0, "dry_run": false,
     "plan": {...} | null, "result": {...} | null, "warnings": [...], "error": null | {...}}

`emit(report)` builds it from a report's `to_json()` (a report that carries "plan" and "result"
keys fills both; any other is the plan of a dry run, else the result); `emit_failure` builds it for
an error, from the CLI's error edge (`cli/__init__.py`), `json_errors` and `entry.py` (click's usage
errors). Strict JSON: a non-finite float (a checkpoint's NaN lr, say) becomes the string "NaN" /
"Infinity" / "-Infinity". Warnings `warn()` printed during the command are collected into the envelope
too, so a script sees every warning a person would.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import sys
from dataclasses import asdict

import click

from ..core.errors import CkptError

__all__ = [
    "SCHEMA",
    "STATE",
    "CliState",
    "clear_progress",
    "dry_run_label",
    "emit",
    "emit_failure",
    "emit_json",
    "envelope",
    "error_object",
    "escape_controls",
    "escaped_streams",
    "is_tty",
    "json_errors",
    "one_line",
    "warn",
    "warn_trust",
]

SCHEMA = "ckpt/1"


class CliState:
    """What the global flags decided for this invocation (set by the group's callback)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.verbose = False
        self.quiet = False
        self.as_json = False
        self.warnings: list[str] = []
        self.emitted = False
        self.progress_shown = False  # a progress line is on stderr (cli.progress): clear it before a message
        self.uploaded: list = []  # outputs committed to URLs (io.upload.Uploaded)


STATE = CliState()


def _context_facts() -> tuple[str | None, bool]:
    """The running command's name and whether it is a dry run (from click's context)."""
    ctx = click.get_current_context(silent=True)
    if ctx is None:
        return None, False
    name = ctx.info_name if ctx.parent is not None else ctx.invoked_subcommand
    return name, bool(ctx.params.get("dry_run", False))


def envelope(
    command: str | None,
    payload,
    *,
    dry_run: bool = False,
    exit_code: int = 0,
    error: dict | None = None,
    warnings: list[str] | tuple[str, ...] = (),
) -> dict:
    """The one JSON shape of every command's output."""
    payload = _plain(payload)
    plan = result = None
    if isinstance(payload, dict) and isinstance(payload.get("plan"), dict):
        # a report of the plan/result kind (slim, merge, gc, ...): its other members belong to the plan
        plan = {
            **payload["plan"],
            **{k: v for k, v in payload.items() if k not in ("plan", "result", "dry_run")},
        }
        result = payload.get("result")
    elif payload is not None:
        plan, result = (payload, None) if dry_run else (None, payload)
    seen: list[str] = []
    for w in [*_payload_warnings(payload), *warnings]:
        if isinstance(w, str) and w not in seen:
            seen.append(w)
    return {
        "schema": SCHEMA,
        "command": command,
        "ok": error is None and exit_code == 0,
        "exit_code": exit_code,
        "dry_run": dry_run,
        "plan": plan,
        "result": result,
        "warnings": seen,
        "error": error,
    }


def _payload_warnings(payload) -> list:
    if not isinstance(payload, dict):
        return []
    out = list(payload.get("warnings") or [])
    for part in ("plan", "result"):
        sub = payload.get(part)
        if isinstance(sub, dict):
            out += list(sub.get("warnings") or [])
    return out


def emit(report, *, exit_code: int = 0) -> None:
    """Print a report (anything with `to_json()`, or a plain JSON-able object) as the command's envelope."""
    command, dry_run = _context_facts()
    payload = report.to_json() if hasattr(report, "to_json") else report
    doc = envelope(command, payload, dry_run=dry_run, exit_code=exit_code, warnings=STATE.warnings)
    emit_json(_with_remote(doc))
    STATE.emitted = True
    for w in doc["warnings"]:  # stderr carries every warning in either mode (a person watching a script)
        if w not in STATE.warnings:
            warn(w)


def emit_failure(
    message: str, exit_code: int, exc=None, kind: str | None = None, command: str | None = None
) -> None:
    """Print a failure as the command's envelope (error filled, plan and result null)."""
    name, dry_run = _context_facts()
    emit_json(
        _with_remote(
            envelope(
                command or name,
                None,
                dry_run=dry_run,
                exit_code=exit_code,
                error=error_object(message, exc, kind),
                warnings=STATE.warnings,
            )
        )
    )
    STATE.emitted = True


def _with_remote(doc: dict) -> dict:
    """A command that read or wrote a URL: its local stand-in paths shown as the URLs, and `remote`:
    the bytes fetched next to the remote inputs' size, and what was uploaded (docs/remote.md)."""
    from ..io import hub_fetch, remote
    from ..io.remote_display import display
    from ..io.remote_url import redact

    if hub_fetch.fetched():  # --download fetched hub files into the HF cache (docs/remote.md)
        doc["downloaded"] = [f.to_json() for f in hub_fetch.fetched()]
    doc = redact(display(doc))  # a staged OUT shown as its URL; no URL's credentials, anywhere
    if not remote.active() and not STATE.uploaded:
        return doc
    doc["remote"] = {
        "bytes_fetched": remote.bytes_fetched(),
        "input_bytes": remote.input_bytes(),
        "uploaded": [u.to_json() for u in STATE.uploaded],
    }
    return doc


def emit_json(obj) -> None:
    """Print `obj` as strict JSON: a non-finite float becomes "NaN" / "Infinity" / "-Infinity", since a bare
    NaN is not JSON and breaks every parser but Python's."""
    click.echo(json.dumps(_plain(obj), indent=2, sort_keys=False, allow_nan=False))


def _plain(o):
    """`o` as plain JSON values: dataclasses as dicts, paths as strings, tuples and sets as lists."""
    if isinstance(o, float) and not math.isfinite(o):
        return "NaN" if o != o else ("Infinity" if o > 0 else "-Infinity")
    if o is None or isinstance(o, (bool, int, float, str)):
        return o
    if isinstance(o, dict):
        return {str(k): _plain(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_plain(v) for v in o]
    if isinstance(o, (set, frozenset)):
        return [_plain(v) for v in sorted(o, key=str)]
    if hasattr(o, "__dataclass_fields__"):
        return _plain(asdict(o))
    if hasattr(o, "to_json"):
        return _plain(o.to_json())
    return str(o)


def error_object(message: str, exc=None, kind: str | None = None) -> dict:
    """A failure's `error` member: what went wrong, where, and what to do."""
    return {
        "type": kind or (type(exc).__name__ if exc is not None else "error"),
        "message": message,
        "path": getattr(exc, "path", None),
        "key": getattr(exc, "key", None),
        "hint": getattr(exc, "hint", None),
    }


def dry_run_label(dry_run: bool) -> str:
    """The one label every dry run's text output ends its first line with."""
    return "  (dry run: nothing written)" if dry_run else ""


def clear_progress() -> None:
    """Erase the progress line, if one is drawn, so a message starts on a clean line."""
    if STATE.progress_shown:  # written raw: click.echo would strip the escape off a terminal
        sys.stderr.write("\r\033[K")
        sys.stderr.flush()
        STATE.progress_shown = False


def warn(msg: str) -> None:
    STATE.warnings.append(msg)
    clear_progress()
    click.secho(f"WARNING: {one_line(msg)}", fg="yellow", err=True)


# Names come from strangers' files (keys, file names) and reach the terminal inside our text: a control
# character in one could retitle the terminal, move the cursor or fake an `error:` line. Every write to
# stdout/stderr escapes them (`escaped_streams`), but for the line breaks and tabs of our own text, our
# progress line's redraw and click's colours; names printed one per line escape their line breaks too
# (`one_line`). JSON needs none of it: json.dumps escapes every control character (and all non-ASCII).
_OURS = re.compile(r"\r\x1b\[K|\x1b\[(?:0|1|22|3[0-79]|9[0-7])m")
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
_LINE_BREAK = re.compile("[\n\r\x0b\x0c\x85\u2028\u2029]")


def _escaped(m: re.Match) -> str:
    return m.group().encode("unicode_escape").decode("ascii")


def escape_controls(text: str) -> str:
    """`text` with every control character shown escaped (ESC as `\\x1b`), but newlines and tabs, and the
    sequences we write ourselves (the progress line's `\\r ESC[K`, click's colours)."""
    out, at = [], 0
    for m in _OURS.finditer(text):
        out += [_CONTROL.sub(_escaped, text[at : m.start()]), m.group()]
        at = m.end()
    out.append(_CONTROL.sub(_escaped, text[at:]))
    return "".join(out)


def one_line(text: str) -> str:
    """`text` (a name, or a message naming one) as one line: its line breaks shown escaped."""
    return _LINE_BREAK.sub(_escaped, str(text))


class _EscapedStream:
    """A text stream whose writes go through `escape_controls`; anything else is the stream's own."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        return self._stream.write(escape_controls(text) if isinstance(text, str) else text)

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextlib.contextmanager
def escaped_streams():
    """stdout and stderr escaping control characters for the duration (the CLI's whole run)."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _EscapedStream(sys.stdout), _EscapedStream(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


def warn_trust(trust: bool) -> None:
    if trust:
        msg = (
            "--trust-remote-pickle: pickles outside the allow-list will be executed. A crafted checkpoint "
            "can run "
            "any code on this machine."
        )
        STATE.warnings.append(msg)
        click.secho(f"WARNING: {msg}", fg="red", err=True)


def is_tty() -> bool:
    return sys.stderr.isatty()


class json_errors:
    """`with json_errors(as_json):` under --json, a CkptError is printed as the failure envelope on stdout
    and the command exits with its code; without --json it propagates to the CLI's error edge."""

    def __init__(self, as_json: bool):
        self.as_json = as_json

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if not self.as_json or exc is None or not isinstance(exc, CkptError):
            return False
        click.echo(f"error: {exc}", err=True)
        emit_failure(exc.render(), exc.exit_code, exc)
        raise click.exceptions.Exit(exc.exit_code)
