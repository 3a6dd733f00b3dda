"""The rehydrate pipeline: work admitted in order by the main thread within one memory budget, done by a
pool of workers, each holding one pooled block buffer.

The main thread registers every output item in the order a sequential writer writes them (which fixes its
offset in its data file: `DcpWriter.reserve_chunk`), then hands the work that makes its bytes to the pool:
a kept item to check and copy, or a block of a rebuilt tensor's rows (`rebuild`). Before a unit is handed
over it acquires its bytes from the budget (`core.budget.ByteBudget`): one slot of `SLOT_BYTES` (a block of
8 MiB of fp32 rows and their 4 MiB of bf16), a row larger than that its own bytes, alone. So the blocks in
flight hold at most `BUDGET_BYTES` (192 MiB), whatever the number of workers, cores or ranks and whatever
the largest tensor; more workers only make them sooner. Units are admitted in order and the pool starts
them in order, so a unit never waits for bytes a later one holds (the sha256 of a tensor, fed in row order,
holds finished blocks until their turn: they were admitted before any block they wait for was not).

Buffers are reused, most recently used first, so their pages stay resident: no page fault and no zeroing
per block (a fresh 64 MiB block per read cost the 8B rehydrate 7.5 million minor faults).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ...core.budget import ByteBudget
from ...core.pool import DaemonPool, one_intra_op_thread

__all__ = ["BUDGET_BYTES", "SLOT_BYTES", "Hold", "Pipeline"]

SLOT_BYTES = 12 << 20  # one block in flight: 8 MiB of fp32 rows + their 4 MiB of bf16 base rows
BUDGET_BYTES = 16 * SLOT_BYTES  # every block in flight at once: 192 MiB, for any number of workers


class Hold:
    """A unit's share of the budget and, once asked for, its buffer; released exactly once (by the unit, by
    whoever it handed its bytes to, or by the pipeline when it fails)."""

    def __init__(self, pipe: Pipeline, held: int, buffer_bytes: int):
        self._pipe, self._held, self._buffer_bytes = pipe, held, buffer_bytes
        self._buf: memoryview | None = None
        self._released = False

    @property
    def has_buffer(self) -> bool:
        return self._buffer_bytes > 0

    def buffer(self) -> memoryview:
        if self._buf is None:
            self._buf = self._pipe.take_buffer(self._buffer_bytes)
        return self._buf

    def release(self) -> None:
        with self._pipe.lock:
            if self._released:
                return
            self._released = True
        if self._buf is not None:
            self._pipe.give_buffer(self._buf)
            self._buf = None
        self._pipe.budget.release(self._held)


class Pipeline:
    """`submit(fn, nbytes)`: `fn(hold)` on a worker once `nbytes` fit (the caller waits: admitted in order);
    `fn` releases `hold` when it no longer needs its buffer (or hands it on). The first failure of any unit
    is kept (`error`); the units not started yet then do nothing, the main thread stops submitting, and
    `drain` raises it."""

    def __init__(self, threads: int, *, budget_bytes: int | None = None, slot_bytes: int | None = None):
        self.budget = ByteBudget(budget_bytes or BUDGET_BYTES)
        self.slot_bytes = slot_bytes or SLOT_BYTES
        self.lock = threading.Lock()
        self._idle = threading.Condition(self.lock)
        self._free: list[memoryview] = []
        self._outstanding = 0
        self.buffers_made = 0  # slots allocated (tests: the working set actually used)
        self.error: BaseException | None = None
        self._pool = DaemonPool(threads, "ckpt-rehydrate", initializer=one_intra_op_thread)

    def failed(self) -> bool:
        return self.error is not None

    # ---------------------------------------------------------------- buffers
    def take_buffer(self, nbytes: int) -> memoryview:
        if (
            nbytes > self.slot_bytes
        ):  # a row larger than a slot: its own buffer (it holds its bytes of the budget)
            return memoryview(bytearray(nbytes))
        with self.lock:
            if self._free:
                return self._free.pop()
            self.buffers_made += 1
        return memoryview(bytearray(self.slot_bytes))

    def give_buffer(self, buf: memoryview) -> None:
        if len(buf) == self.slot_bytes:
            with self.lock:
                self._free.append(buf)

    # ---------------------------------------------------------------- units
    def hold(self, nbytes: int) -> Hold | None:
        """The main thread's own share of `nbytes` (work it does itself: a tensor that does not stream), once
        it fits; None if a unit failed meanwhile."""
        if not self.budget.acquire(nbytes, self.failed):
            return None
        return Hold(self, nbytes, 0)

    def submit(self, fn: Callable[[Hold], None], nbytes: int, *, buffer: bool = True) -> bool:
        """Hand `fn` to the workers once its bytes fit: a slot when it needs a `buffer` of at most a slot's
        bytes, else `nbytes` (a row larger than a slot, or bytes the unit allocates itself). False (nothing
        submitted) when a unit failed meanwhile."""
        held = max(nbytes, self.slot_bytes) if buffer else nbytes
        if not self.budget.acquire(held, self.failed):
            return False
        hold = Hold(self, held, nbytes if buffer else 0)
        with self.lock:
            self._outstanding += 1
        self._pool.submit(self._run, fn, hold)
        return True

    def _run(self, fn: Callable[[Hold], None], hold: Hold) -> None:
        try:
            if self.error is None:
                fn(hold)
            else:
                hold.release()
        except BaseException as exc:  # kept for the main thread, which raises it
            hold.release()
            with self.lock:
                if self.error is None:
                    self.error = exc
        finally:
            with self.lock:
                self._outstanding -= 1
                self._idle.notify_all()

    def drain(self, tick: Callable[[], None] | None = None) -> None:
        """Wait until every unit submitted is done (`tick()` about every 0.1 s meanwhile: progress); the
        first failure is raised."""
        while True:
            with self.lock:
                if self._outstanding and self.error is None:
                    self._idle.wait(0.1)
                busy, error = self._outstanding, self.error
            if error is not None:
                raise error
            if tick is not None:
                tick()
            if not busy:
                return

    def raise_failure(self) -> None:
        """The first failure of a unit, raised in the main thread (a no-op while none failed)."""
        if self.error is not None:
            raise self.error

    def close(self, wait: bool) -> None:
        """Stop the workers; on an error or a signal they are not waited for (each unit is bounded, and they
        are daemon threads: a write stuck in a hung filesystem cannot keep the command alive), and the units
        not started yet do nothing."""
        if not wait:
            with self.lock:
                self.error = self.error or RuntimeError("the rehydrate was stopped")
        self._pool.shutdown(wait=wait)
