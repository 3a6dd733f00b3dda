"""The `ckpt` executable: signal handling first, the heavy imports after.

Importing click and the commands (torch among them) takes a second or two. A Ctrl-C or SIGTERM in
that window used to print a 22-51-line traceback; here it ends the command like any other
interruption: one line, exit 130 (SIGINT) or 143 (SIGTERM), once the imports are done (the signals
are held meanwhile). They are held from `main`'s first line, through the built-in `_signal` (the
`signal` module imports `enum`: 30 ms of a window where a Ctrl-C printed a traceback); `python -m
ckpt_tools` holds them from `__main__`'s first line. Only `os` and `sys`, which the interpreter has
already loaded, are imported before that. Once the command has returned they stay held to the end: a
Ctrl-C after a command finished (its output complete, its report printed) changes nothing, and its exit
code is the command's. Errors of the commands themselves are rendered by the error edge in `cli` (one
line, or JSON under `--json`).
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # (typing's is not imported: no import time before the signals are held)
if TYPE_CHECKING:
    from .io.signals import Terminated

HELD = None  # the signal mask `__main__` found before it held SIGINT/SIGTERM (None: not run by it)

__all__ = ["main", "run"]


class _EarlyTermination(BaseException):
    """SIGTERM before `io.signals.install_signal_handlers` replaced this handler with its own."""

    def __init__(self, signum: int):
        self.exit_code = 128 + signum


def _early_term(signum, frame):
    raise _EarlyTermination(signum)


def _stopped(what: str, code: int) -> int:
    try:
        sys.stderr.write(f"{what}: nothing was written\n")
        sys.stderr.flush()
    except Exception:  # stderr gone: the exit code still says it
        pass
    return code


def _hold() -> set:
    """Hold SIGINT and SIGTERM (a pending one is delivered when released); the mask found before."""
    import _signal  # built in, loaded with the interpreter: no import time

    return _signal.pthread_sigmask(_signal.SIG_BLOCK, {_signal.SIGINT, _signal.SIGTERM})


def main(argv: list[str] | None = None) -> int:
    # SIGINT/SIGTERM are held while modules are imported: an exception raised in the middle of
    # a C extension's initialization (numpy's, under torch) leaves it half-loaded, and the next
    # import of it fails with an ImportError instead of ending cleanly. A signal that arrives
    # meanwhile is delivered when the imports are done (a second or two later) and ends the
    # command as below.
    held = _hold() if HELD is None else HELD
    import signal

    signal.signal(signal.SIGTERM, _early_term)
    terminated: tuple[type[_EarlyTermination | Terminated], ...] = (_EarlyTermination,)
    rv = None
    try:
        try:
            from .io.signals import Terminated, install_signal_handlers

            terminated = (_EarlyTermination, Terminated)
            from click.exceptions import Abort, ClickException

            from .cli import main as cli

            install_signal_handlers()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, held)
        try:
            rv = cli.main(args=argv, prog_name="ckpt", standalone_mode=False)
        except ClickException as exc:  # usage errors: click's own message, exit 2
            _hold()
            exc.show()
            return exc.exit_code
        except Abort:  # Ctrl-C while click parsed the arguments
            _hold()
            return _stopped("interrupted", 130)
        _hold()  # done: a Ctrl-C from here on changes nothing (the module docstring)
        return rv if isinstance(rv, int) else 0
    except BaseException as exc:
        _hold()  # the ending is not interrupted in turn
        if rv is not None:  # the command had finished (its output and report complete): its exit code
            return rv if isinstance(rv, int) else 0
        if isinstance(exc, KeyboardInterrupt):
            return _stopped("interrupted", 130)
        if isinstance(exc, terminated):
            return _stopped("terminated", exc.exit_code)
        raise


def _workers_alive() -> bool:
    """A daemon worker thread still running: the merge pipeline's workers are daemons on purpose (an
    interrupted command does not wait for them: ops/merge/pipeline.py), and one may be inside torch or
    BLAS at this moment."""
    import threading  # already loaded by the commands that start threads; cheap otherwise

    main_thread = threading.main_thread()
    return any(t.daemon and t.is_alive() for t in threading.enumerate() if t is not main_thread)


def run() -> None:
    """Console-script entry point."""
    code = main()
    try:
        sys.stdout.flush()
    except BrokenPipeError:  # `ckpt ... | head`: the reader left
        from .io.files import stdout_to_devnull

        stdout_to_devnull()
    if code in (130, 143) or (code and _workers_alive()):
        # Interrupted (or failed) with workers possibly inside torch/BLAS: the interpreter's
        # finalization would tear down native thread pools under them and abort with SIGABRT
        # ("terminate called without an active exception", 9 of 10 Ctrl-C of a 400M-parameter merge).
        # The command has already removed its temporary files, released its locks and said its one
        # line: end the process here, with its exit code.
        try:
            sys.stderr.flush()
        except Exception:  # stderr gone: the exit code still says it
            pass
        os._exit(code)
    sys.exit(code)
