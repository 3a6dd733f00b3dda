"""SIGTERM as an exception, and signals held while a rename sequence or a cleanup runs."""
from __future__ import annotations

import contextlib
import signal

__all__ = ["Terminated", "install_signal_handlers", "signals_deferred"]


class Terminated(BaseException):
    """Raised in the main thread on SIGTERM (after `install_signal_handlers()`), so `with` blocks
    clean up as for Ctrl-C. A BaseException, like KeyboardInterrupt: `except Exception` won't eat it."""

    def __init__(self, signum: int = signal.SIGTERM):
        self.signum = signum
        self.exit_code = 128 + signum   # the shell's convention for death by signal
        super().__init__(f"terminated by signal {signal.Signals(signum).name}")


def _raise_terminated(signum, frame):
    raise Terminated(signum)


def install_signal_handlers() -> None:
    """Make SIGTERM raise `Terminated` in the main thread (call once, from the CLI entry point)."""
    signal.signal(signal.SIGTERM, _raise_terminated)


@contextlib.contextmanager
def signals_deferred():
    """Hold SIGINT/SIGTERM while a rename sequence or cleanup runs, so a second Ctrl-C cannot
    leave it half done; they are delivered (and raise) right after."""
    sigs = {signal.SIGINT, signal.SIGTERM}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
