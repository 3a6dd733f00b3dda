"""A working-set budget in bytes that concurrent work units acquire their share of (pure: threads only).

Why bytes and not a thread count: the units of one job differ by orders of magnitude (a layer norm of
8 KB beside an mlp projection of 100 MB). One thread count sized from the largest unit runs the whole
job as narrow as its worst unit; a byte budget lets the small units run wide and admits big ones only
while the bytes they hold fit. A unit asks for what it really holds at once (its estimate); a unit
larger than the whole budget waits until nothing else is admitted, then runs alone, so nothing
deadlocks and the bytes held never exceed max(budget, the largest single unit).

    budget = ByteBudget(640 * 2**20)
    with budget.hold(estimate):      # blocks until `estimate` bytes fit beside the units admitted
        ...                          # the unit's work
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["ByteBudget"]


class ByteBudget:
    """`limit` bytes shared by the units admitted at once; `peak` is the most held together (tests)."""

    def __init__(self, limit: int):
        if limit <= 0:
            raise ValueError(f"a byte budget needs a positive limit, not {limit}")
        self.limit = int(limit)
        self.held = 0
        self.peak = 0
        self._units = 0
        self._cond = threading.Condition()

    def _fits(self, n: int) -> bool:
        # a unit larger than the budget is admitted alone (else it would wait forever)
        return self.held + n <= self.limit or self._units == 0

    def acquire(self, n: int, cancelled: Callable[[], bool] | None = None) -> bool:
        """Wait until `n` more bytes fit, then hold them (True). With `cancelled`, the wait also ends,
        holding nothing (False), once it returns True: a pipeline whose worker failed stops waiting for
        bytes that worker will never give back."""
        n = max(0, int(n))
        with self._cond:
            while not self._fits(n):
                if cancelled is not None and cancelled():
                    return False
                self._cond.wait(None if cancelled is None else 0.05)
            self.held += n
            self._units += 1
            self.peak = max(self.peak, self.held)
            return True

    def release(self, n: int) -> None:
        n = max(0, int(n))
        with self._cond:
            self.held -= n
            self._units -= 1
            self._cond.notify_all()

    @contextmanager
    def hold(self, n: int) -> Iterator[None]:
        self.acquire(n)
        try:
            yield
        finally:
            self.release(n)
