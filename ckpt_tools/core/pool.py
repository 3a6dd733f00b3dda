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

__all__ = ["DaemonPool"]


class DaemonPool:
    """`threads` daemon worker threads running submitted calls, first submitted first started."""

    def __init__(self, threads: int, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
                         for i in range(max(1, threads))]
        for t in self._threads:
            t.start()

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue                  # cancelled before it started
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
