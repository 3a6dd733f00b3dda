"""One remote object, read by range: the remote half of `io.inputs`' range readers (a local file's is its
fd, read by `pread`).

A `RemoteObject` is made when a command opens a file of a URL (`io.remote.RemotePath`), with the object's
identity pinned then (`remote_backends.Identity`: an ETag, a GCS generation, a Hub commit or Xet hash; an
HTTP server's size and Last-Modified where that is all it sends). Every request carries that identity
(If-Match, `generation=`, the commit in the URL) and every answer is checked against it: an object
rewritten mid-read is an error naming it, never a mix of two versions. An object with no identity at all
(an HTTP server that sends neither ETag nor Last-Modified) may be read by one request only: a second one
could see another version, and is refused. `check_unchanged()` re-checks the identity before an output
is committed (for a server that ignores the conditions).

A read is split into parts of `PART_BYTES`, fetched concurrently by a pool of daemon threads (at most
`CKPT_REMOTE_CONCURRENCY` requests in flight in the process; daemon threads, so Ctrl-C never waits for a
stalled request); a part whose body breaks (a dropped connection, a stall of `CKPT_REMOTE_TIMEOUT` s, a
5xx/429) is retried with exponential backoff from the byte where it stopped (`CKPT_REMOTE_RETRIES`
failures in a row; a client that retries itself, gcsfs, is trusted with that). A part must also finish
within `CKPT_REMOTE_TIMEOUT` s plus its size at `CKPT_REMOTE_MIN_RATE` bytes/s, retries included: a server
that drips a byte a minute ends the read in one line naming the object. `hint()` lets a reader that knows
what it will read next have adjacent ranges fetched as one request, ahead of it."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from concurrent.futures import Future

from ..core.errors import CkptError, FormatError, MissingFileError, TruncatedFileError, UsageError
from .remote_url import RemoteChanged, RemoteDenied, RemoteMissing, RemoteRetry, settings

__all__ = ["AHEAD_BYTES", "PART_BYTES", "RUN_BYTES", "RemoteObject"]

PART_BYTES = 8 << 20
RUN_BYTES = 16 << 20  # adjacent hinted ranges fetched as one request, up to this much
AHEAD_BYTES = 64 << 20  # hinted ranges fetched ahead of the reader, per object, up to this much


class RemoteObject:
    """One remote file: `url` (shown, without credentials), `size` and `identity` pinned at open, read by
    range through `backend` (`ref`: the backend's address of it). What a writer needs to copy it
    server-side: `store` ("s3", "gs", "hf", "hf-bucket", "http" or the fsspec protocol), `bucket` and
    `key` (s3, gs; a Hub bucket's id and path), `endpoint` (S3's endpoint URL, None for AWS's), `version`."""

    def __init__(self, url: str, size: int, identity, backend, ref):
        self.url, self.size, self.identity, self.backend, self.ref = url, size, identity, backend, ref
        self.fetched = 0
        self.requests = 0
        self._lock = threading.Lock()
        self._plan: list[tuple[int, int]] = []  # hinted units [(start, end)], in read order
        self._plan_at: dict[int, int] = {}  # a unit's start -> its index in _plan
        self._ahead: dict[
            int, tuple[bytearray, list[Future]]
        ] = {}  # unit index -> (buffer, its part futures)
        self._cache: tuple[int, bytearray] | None = None  # (start, bytes) of the unit being read
        self._stray: list[Future] = []  # fetches of units the reader skipped
        self._run_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"RemoteObject({self.url!r}, {self.size} bytes, {self.identity})"

    # ---- what a writer asks (a server-side copy)
    @property
    def version(self) -> str | None:
        return None if self.identity is None else self.identity.value

    @property
    def store(self) -> str:
        s = self.backend.scheme
        return "hf-bucket" if s == "hf" and getattr(self.backend, "bucket", False) else s

    @property
    def bucket(self) -> str | None:
        b = self.backend
        return (
            b.repo_id
            if self.store == "hf-bucket"
            else getattr(b, "bucket", None)
            if b.scheme == "s3"
            else getattr(b, "root", None)
            if b.scheme == "gs"
            else None
        )

    @property
    def key(self) -> str | None:
        if self.store == "gs":
            return str(self.ref).split("/", 1)[1]
        return str(self.ref) if self.store in ("s3", "hf-bucket") else None

    @property
    def endpoint(self) -> str | None:
        return getattr(self.backend, "endpoint", None)

    def version_now(self) -> str | None:
        """The identity's value now; "(deleted)" when the object is gone; None when it cannot be told."""
        now = self.backend.identity_now(self)
        return None if now is None else "(deleted)" if now.kind == "gone" else now.value

    def unchanged(self) -> bool:
        now = self.backend.identity_now(self)
        return (
            now is None
            or self.identity is None
            or (now.kind, now.value) == (self.identity.kind, self.identity.value)
        )

    def check_unchanged(self) -> None:
        """A FormatError naming the object when its identity is no longer the one pinned at open."""
        if not self.unchanged():
            raise FormatError(
                f"the object changed while the command ran ({self.identity} at open, "
                f"{self.version_now()} now); nothing was written",
                path=self.url,
                hint="rerun once the writer has finished",
            )

    def settle(self) -> None:
        """Wait for the ranges fetched ahead that the reader never asked for (a command's end: what it
        fetched is then all counted, and nothing of it is still on the wire)."""
        with self._run_lock:
            pending = [f for _buf, futures in self._ahead.values() for f in futures] + self._stray
            self._ahead.clear()
            self._stray = []
        for f in pending:
            with contextlib.suppress(Exception):
                f.result()

    # ---- reads
    def hint(self, ranges) -> None:
        """`ranges` ([(offset, length)]) are about to be read, in this order: consecutive ones that are
        adjacent are fetched as one request (a unit of up to `RUN_BYTES`), and the units are fetched
        ahead of the reader, up to `CONCURRENCY` of them and `AHEAD_BYTES` at once, so small items cost
        the link's bandwidth, not one round trip each. A unit is fetched in full when its first byte is
        read, and served from it. Nothing outside the hinted ranges is ever fetched."""
        spans = [(o, o + n) for o, n in ranges if n > 0]  # in the order they will be read
        units = []
        i = 0
        while i < len(spans):
            j, end = i, spans[i][1]
            while (
                j + 1 < len(spans) and spans[j + 1][0] == end and spans[j + 1][1] - spans[i][0] <= RUN_BYTES
            ):
                j += 1
                end = spans[j][1]
            if end - spans[i][0] <= RUN_BYTES:  # a bigger item is read straight into the reader's buffer
                units.append((spans[i][0], end))
            i = j + 1
        with self._run_lock:
            for u in units:
                if u[0] not in self._plan_at:
                    self._plan_at[u[0]] = len(self._plan)
                    self._plan.append(u)

    def read_into(self, buf, offset: int) -> None:
        mv = memoryview(buf).cast("B")
        n = len(mv)
        if offset < 0 or offset + n > self.size:
            raise TruncatedFileError(
                f"bytes [{offset}, {offset + n}) lie beyond the end of the object ({self.size} bytes)",
                path=self.url,
            )
        if (self._plan_at or self._cache is not None) and self._from_plan(mv, offset, n):
            return
        self._fetch(mv, offset, n)

    def _from_plan(self, mv, offset: int, n: int) -> bool:
        with self._run_lock:
            c = self._cache
            if c is not None and c[0] <= offset and offset + n <= c[0] + len(c[1]):
                mv[:] = memoryview(c[1])[offset - c[0] : offset - c[0] + n]
                if offset + n == c[0] + len(c[1]):
                    self._cache = None
                return True
            i = self._plan_at.get(offset)
            if i is None or self._plan[i][1] < offset + n:
                return False
            del self._plan_at[offset]
            self._launch(i)
            buf, futures = self._ahead.pop(i)
            for k in [k for k in self._ahead if k < i]:  # units the reader skipped: still on the wire
                self._stray += self._ahead.pop(k)[1]
            self._launch(i + 1)
        for f in futures:
            f.result()
        mv[:] = memoryview(buf)[:n]
        if len(buf) > n:
            with self._run_lock:
                self._cache = (offset, buf)
        return True

    def _launch(self, i: int) -> None:
        """Start fetching unit i and the ones after it (still unread), within the read-ahead bounds
        (`_run_lock` held)."""
        window, budget = settings()["concurrency"], AHEAD_BYTES
        for k in range(i, len(self._plan)):
            start, end = self._plan[k]
            if k - i >= window or (k > i and budget < end - start):
                break
            budget -= end - start
            if (
                k in self._ahead
                or self._plan_at.get(start) not in (k, None)
                or (k > i and start not in self._plan_at)
            ):
                continue
            buf = bytearray(end - start)
            view = memoryview(buf)
            self._ahead[k] = (
                buf,
                [
                    _POOL.submit(self._part, view, start, s, min(s + PART_BYTES, end - start))
                    for s in range(0, end - start, PART_BYTES)
                ],
            )

    def _fetch(self, mv, offset: int, n: int) -> None:
        parts = [(s, min(s + PART_BYTES, n)) for s in range(0, n, PART_BYTES)]
        if len(parts) <= 1:
            if n:
                self._part(mv, offset, 0, n)
            return
        futures = [_POOL.submit(self._part, mv, offset, s, e) for s, e in parts]
        for f in futures:
            f.result()

    def _part(self, mv, offset: int, start: int, end: int) -> None:
        """Bytes [offset + start, offset + end) into mv[start:end], retried from where a body broke."""
        got, want, cfg, failures = 0, end - start, settings(), 0
        grace = cfg["timeout_s"] + getattr(self.backend, "retry_grace_s", 0.0)
        deadline = time.monotonic() + grace + (want / cfg["min_rate"] if cfg["min_rate"] else 1e9)

        def sink(chunk) -> None:
            nonlocal got
            k = len(chunk)
            if got + k > want:
                raise RemoteRetry(f"the server sent more than the {want} bytes asked for")
            mv[start + got : start + got + k] = chunk
            got += k
            with self._lock:
                self.fetched += k

        while got < want:
            before = got
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._too_slow(offset + start, offset + end, got, cfg)
            self._count_request()
            try:
                self.backend.fetch(self, offset + start + got, offset + end, sink, cfg["timeout_s"], left)
                if got < want:
                    raise RemoteRetry(f"the body ended after {got} of {want} bytes")
            except RemoteRetry as exc:
                failures = 0 if got > before else failures + 1
                own = getattr(self.backend, "client_retries", False)
                if failures > (0 if own else cfg["retries"]):
                    if deadline - time.monotonic() <= 0:
                        raise self._too_slow(offset + start, offset + end, got, cfg) from None
                    raise CkptError(
                        f"reading bytes [{offset + start + got}, {offset + end}) failed "
                        + ("after the client's own retries" if own else f"{failures} times in a row")
                        + f": {exc}",
                        path=self.url,
                        hint="the server or the link is failing; retry later (CKPT_REMOTE_RETRIES, "
                        "CKPT_REMOTE_TIMEOUT raise the patience)",
                    ) from None
                time.sleep(
                    min(cfg["backoff_s"] * (2 ** (failures - 1)), 30.0, max(0.0, deadline - time.monotonic()))
                )
            except (RemoteChanged, RemoteMissing, RemoteDenied) as exc:
                raise self._failure(exc) from None

    def _count_request(self) -> None:
        with self._lock:
            self.requests += 1
            again = self.requests > 1
        if again and self.identity is not None and self.identity.kind == "none":
            raise FormatError(
                "the server sends neither an ETag nor a Last-Modified for this object, so a second "
                "request of it could read another version; refusing to mix versions",
                path=self.url,
                hint="serve it with ETags or Last-Modified (nginx, Apache and Caddy send both by "
                "default), or download it and pass the local copy",
            )

    def _failure(self, exc: Exception) -> CkptError:
        if isinstance(exc, RemoteChanged):
            return FormatError(
                f"the object changed while it was being read (pinned {self.identity}, now "
                f"{exc or 'another'}); nothing read from it is used",
                path=self.url,
                hint="rerun once the writer has finished; a remote input must not change during a command",
            )
        if isinstance(exc, RemoteMissing):
            return MissingFileError(
                "the object is gone (it was there when the command opened it)",
                path=self.url,
                hint="it was deleted mid-read; rerun",
            )
        return UsageError(str(exc), path=self.url)

    def _too_slow(self, a: int, b: int, got: int, cfg: dict) -> CkptError:
        return CkptError(
            f"reading bytes [{a}, {b}) got {got:,} of {b - a:,} bytes within {cfg['timeout_s']:g} s + "
            f"{cfg['min_rate']:,.0f} bytes/s: the server has stalled",
            path=self.url,
            hint="the server or the link is too slow; CKPT_REMOTE_MIN_RATE (bytes/s) and "
            "CKPT_REMOTE_TIMEOUT (s) set the patience",
        )


class _DaemonPool:
    """`submit(fn, *args) -> Future` on daemon threads (at most CKPT_REMOTE_CONCURRENCY): a read
    interrupted by Ctrl-C never keeps the process alive waiting for a stalled request."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def submit(self, fn, *args) -> Future:
        f: Future = Future()
        self._q.put((f, fn, args))
        with self._lock:
            if len(self._threads) < settings()["concurrency"]:
                t = threading.Thread(target=self._work, name=f"ckpt-fetch-{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
        return f

    def _work(self) -> None:
        while True:
            f, fn, args = self._q.get()
            if not f.set_running_or_notify_cancel():
                continue
            try:
                f.set_result(fn(*args))
            except BaseException as exc:
                f.set_exception(exc)


_POOL = _DaemonPool()
