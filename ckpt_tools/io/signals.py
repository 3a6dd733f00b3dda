"""SIGTERM as an exception, and signals held while a rename sequence or a cleanup runs."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["Terminated", "install_signal_handlers", "signals_deferred"]


class Terminated(BaseException):
    """Raised in the main thread on SIGTERM (after `install_signal_handlers()`), so `with` blocks
    clean up as for Ctrl-C. A BaseException, like KeyboardInterrupt: `except Exception` won't eat it."""

    def __init__(self, signum: int = signal.SIGTERM):
        self.signum = signum
        self.exit_code = 128 + signum  # the shell's convention for death by signal
        super().__init__(f"terminated by signal {signal.Signals(signum).name}")


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated(signum)


def install_signal_handlers() -> None:
    """Make SIGTERM raise `Terminated` in the main thread (call once, from the CLI entry point)."""
    signal.signal(signal.SIGTERM, _raise_terminated)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM while a rename sequence or cleanup runs, so a second Ctrl-C cannot
    leave it half done; they are delivered (and raise) right after.

    Blocking them in this thread is not enough: a signal sent to the process goes to any thread that
    does not block it (an HTTP client's or hf_xet's worker threads), and Python then runs the handler
    in the main thread all the same. So in the main thread the handlers are swapped for one that only
    records the signal, and the recorded one is raised again once the old handlers are back."""
    sigs = (signal.SIGINT, signal.SIGTERM)
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, set(sigs))
    caught: list[int] = []
    old_handlers = {}
    if threading.current_thread() is threading.main_thread():
        for s in sigs:
            if signal.getsignal(s) is not None:  # None: a handler set outside Python, left alone
                old_handlers[s] = signal.signal(s, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)  # one pending here is recorded
        finally:
            for s, handler in old_handlers.items():
                signal.signal(s, handler)
        if caught:
            signal.raise_signal(caught[0])
