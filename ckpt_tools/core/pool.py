"""Worker threads that never keep a failed command alive (pure: threads only).

`DaemonPool(threads, name)` runs submitted calls as Futures on daemon threads. Daemon, because the workers
of a writing command write: on an error or a signal the command exits without joining them, so a worker
stuck in a write (a hung filesystem) cannot keep the process alive (a ThreadPoolExecutor's workers are
joined at interpreter exit). A command that succeeds has waited for every future before it returns.
Calls run in submission order (one FIFO queue), which the pipelines that admit work in order rely on.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future

__all__ = ["DaemonPool", "one_intra_op_thread"]


def one_intra_op_thread() -> None:
    """The calling worker's own BLAS and OpenMP threads off. `torch.set_num_threads` in the main thread does
    not reach a pool's workers (OpenMP's thread count and MKL's are per thread), so each worker's matmul
    or cast would otherwise start a team of every core's threads, each worker its own: on 16 cores, 16 teams
    of 16 spinning threads (the 16-core GPU host's 1.7B `diff-vs-base --adapter` took 25 s of CPU before
    its workers called this). The workers are the parallelism. torch only where it is loaded already: a
    torch-free command never imports it for this."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


class DaemonPool:
    """`threads` daemon worker threads running submitted calls, first submitted first started."""

    def __init__(self, threads: int, name: str, initializer=None) -> None:
        """`initializer`, where given, runs first in each worker (as ThreadPoolExecutor's)."""
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._initializer = initializer
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
            for i in range(max(1, threads))
        ]
        for t in self._threads:
            t.start()

    def _work(self) -> None:
        if self._initializer is not None:
            self._initializer()
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue  # cancelled before it started
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to the waiting main thread
                future.set_exception(exc)

    def submit(self, fn, *args) -> Future:
        future: Future = Future()
        self._queue.put((future, fn, args))
        return future

    def shutdown(self, wait: bool) -> None:
        for _ in self._threads:
            self._queue.put(None)
        if wait:
            for t in self._threads:
                t.join()
