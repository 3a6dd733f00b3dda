"""The `ckpt` executable: signal handling first, the heavy imports after.

Importing click and the commands (torch among them) takes a second or two. A Ctrl-C or SIGTERM in
that window used to print a 22-51-line traceback; here it ends the command like any other
interruption: one line, exit 130 (SIGINT) or 143 (SIGTERM). Only `os`, `signal` and `sys`, which
the interpreter has already loaded, are imported before the handlers are in place. Errors of the
commands themselves are rendered by `cli._Group` (one line, or JSON under `--json`).
"""
from __future__ import annotations

import os
import signal
import sys


class _EarlyTermination(BaseException):
    """SIGTERM before `atomic.install_signal_handlers` replaced this handler with its own."""

    def __init__(self, signum: int):
        self.exit_code = 128 + signum


def _early_term(signum, frame):
    raise _EarlyTermination(signum)


def _stopped(what: str, code: int) -> int:
    try:
        sys.stderr.write(f"{what}: nothing was written\n")
        sys.stderr.flush()
    except Exception:   # stderr gone: the exit code still says it
        pass
    return code


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _early_term)
    try:
        from .atomic import Terminated, install_signal_handlers

        install_signal_handlers()
        try:
            from click.exceptions import Abort, ClickException

            from .cli import main as cli
            rv = cli.main(args=argv, prog_name="ckpt", standalone_mode=False)
        except ClickException as exc:   # usage errors: click's own message, exit 2
            exc.show()
            return exc.exit_code
        except Abort:                   # Ctrl-C while click parsed the arguments
            return _stopped("interrupted", 130)
        except Terminated as exc:
            return _stopped("terminated", exc.exit_code)
        return rv if isinstance(rv, int) else 0
    except KeyboardInterrupt:
        return _stopped("interrupted", 130)
    except _EarlyTermination as exc:
        return _stopped("terminated", exc.exit_code)


def run() -> None:
    """Console-script entry point."""
    code = main()
    try:
        sys.stdout.flush()
    except BrokenPipeError:   # `ckpt ... | head`: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    sys.exit(code)
