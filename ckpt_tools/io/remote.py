"""Remote inputs: a URL read by byte range through the same read side as a local file.

`mount(url)` lists the object (or the tree of objects) at `url` once, pins each object's version
(S3 ETag/VersionId, an HTTP ETag, the Hub's commit sha, a GCS generation) and stands a local shadow
tree beside it in a private temp dir: every remote file is there as a sparse placeholder of its exact
size, registered by inode. `inputs.open_input` opens the placeholder (checks unchanged: inside its
tree, a regular file; the sparse check is skipped, the size is the remote one) and every
`pread.pread_into` / `pread_exact` of that fd is served by `RemoteObject.read_into`: exactly the bytes
asked for, by HTTP range request. So every format, source and op reads a URL without knowing it: what
a command reads of a local checkpoint is what it fetches of a remote one, no more.

A read is split into parts of `PART_BYTES`, fetched concurrently (at most `CONCURRENCY` requests in
flight over the whole process, `CKPT_REMOTE_CONCURRENCY`); a part whose body breaks (connection
dropped, a timeout, a 5xx/429) is retried with exponential backoff from the byte where it stopped
(`RETRIES` attempts without progress, `CKPT_REMOTE_RETRIES`; timeout `CKPT_REMOTE_TIMEOUT` s). Every
request carries the pinned version (If-Match, VersionId, the commit in the URL): an object rewritten
mid-read is an error naming it, never a mix of two versions; `check_unchanged()` re-checks the
version of every object read before an output is committed (for servers that ignore If-Match).

The URL forms (parsed here only, `parse_url`): `hf://[datasets/|spaces/]org/name[@rev]/path` through
huggingface_hub's `HfFileSystem`, `s3://bucket/key` (s3fs), `gs://bucket/key` (gcsfs), `http(s)://`
(fsspec's HTTP) and any other protocol fsspec knows and has installed. Credentials come from each
ecosystem's own configuration (HF_TOKEN / `hf auth login`; AWS_PROFILE, AWS_ACCESS_KEY_ID,
AWS_ENDPOINT_URL; gcloud ADC), never a flag. The packages are the `remote` extra, imported only when
a URL is used. Backends: `remote_backends.py`.
"""

from __future__ import annotations

import atexit
import errno
import os
import shutil
import stat
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import CkptError, FormatError, MissingFileError, MissingPathError, UsageError
from .remote_display import add_display, clear_display, display
from .remote_url import (
    CONCURRENCY,
    RETRIES,
    RemoteChanged,
    RemoteDenied,
    RemoteMissing,
    RemoteRetry,
    RemoteUrl,
    parse_url,
    refuse_url_lookalike,
    settings,
)

__all__ = [
    "CONCURRENCY",
    "PART_BYTES",
    "RETRIES",
    "RemoteChanged",
    "RemoteDenied",
    "RemoteMissing",
    "RemoteObject",
    "RemoteRetry",
    "RemoteUrl",
    "active",
    "add_display",
    "bytes_fetched",
    "check_unchanged",
    "display",
    "forget_under",
    "is_remote_path",
    "link_stand_in",
    "mount",
    "mount_root_of",
    "mounted_bytes",
    "object_of_fd",
    "object_of_stat",
    "parse_url",
    "refuse_url_lookalike",
    "reset",
    "settings",
    "url_of",
]

PART_BYTES = 8 << 20
RUN_BYTES = 16 << 20  # adjacent hinted ranges fetched as one request, up to this much
AHEAD_BYTES = 64 << 20  # hinted ranges fetched ahead of the reader, per object, up to this much


# ------------------------------------------------------------------------------------ objects
@dataclass
class RemoteObject:
    """One remote file: its URL, size and version pinned at `mount`, read by range."""

    url: str
    size: int
    version: str | None
    backend: object  # remote_backends.Backend
    ref: object  # what the backend needs to address it
    fetched: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _plan: list = field(default_factory=list, repr=False)  # hinted units [(start, end)], in read order
    _plan_at: dict = field(default_factory=dict, repr=False)  # a unit's start -> its index in _plan
    _ahead: dict = field(default_factory=dict, repr=False)  # unit index -> (buffer, its part futures)
    _cache: tuple | None = field(default=None, repr=False)  # (start, bytes) of the unit being read
    _run_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

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
            from ..core.errors import TruncatedFileError

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
            for k in [k for k in self._ahead if k < i]:  # units the reader skipped
                del self._ahead[k]
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
                    _pool().submit(self._part, view, start, s, min(s + PART_BYTES, end - start))
                    for s in range(0, end - start, PART_BYTES)
                ],
            )

    def _fetch(self, mv, offset: int, n: int) -> None:
        parts = [(s, min(s + PART_BYTES, n)) for s in range(0, n, PART_BYTES)]
        if len(parts) <= 1:
            if n:
                self._part(mv, offset, 0, n)
            return
        futures = [_pool().submit(self._part, mv, offset, s, e) for s, e in parts]
        for f in futures:
            f.result()

    def _part(self, mv, offset: int, start: int, end: int) -> None:
        got = 0
        want = end - start
        cfg = settings()
        failures = 0

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
            try:
                self.backend.fetch(self, offset + start + got, offset + end, sink, cfg["timeout_s"])
                if got < want:
                    raise RemoteRetry(f"the body ended after {got} of {want} bytes")
            except RemoteChanged as exc:
                raise FormatError(
                    f"the object changed while it was being read (pinned version {self.version}, "
                    f"now {exc or 'another'}); nothing read from it is used",
                    path=self.url,
                    hint="rerun once the writer has finished; a remote input must not change "
                    "during a command",
                ) from None
            except RemoteMissing:
                raise MissingFileError(
                    "the object is gone (it was listed when the command started)",
                    path=self.url,
                    hint="it was deleted mid-read; rerun",
                ) from None
            except RemoteDenied as exc:
                raise UsageError(str(exc), path=self.url) from None
            except RemoteRetry as exc:
                failures = 0 if got > before else failures + 1
                if failures > cfg["retries"]:
                    raise CkptError(
                        f"reading bytes [{offset + start + got}, {offset + end}) failed "
                        f"{failures} times in a row: {exc}",
                        path=self.url,
                        hint="the server or the link is failing; retry later (CKPT_REMOTE_RETRIES, "
                        "CKPT_REMOTE_TIMEOUT raise the patience)",
                    ) from None
                time.sleep(min(cfg["backoff_s"] * (2 ** (failures - 1)), 30.0))


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=settings()["concurrency"], thread_name_prefix="ckpt-fetch")
        return _POOL


# ------------------------------------------------------------------------------------ the shadow trees
_BY_INODE: dict[tuple[int, int], RemoteObject] = {}
_MOUNTS: dict[str, tuple[Path, RemoteUrl]] = {}  # url text -> (shadow root, url)
_SHADOW: list[Path] = []  # the temp dirs holding shadow trees
_ABSENT: dict[str, CkptError] = {}  # url text -> the missing-path error its listing gave
_STAND_INS: dict[tuple[int, int], str] = {}  # placeholders made outside a shadow tree -> their path
_MOUNT_LOCK = threading.Lock()


def active() -> bool:
    """Whether any URL is mounted in this process (the local-only fast path checks this first)."""
    return bool(_BY_INODE)


def object_of_stat(st: os.stat_result) -> RemoteObject | None:
    return _BY_INODE.get((st.st_dev, st.st_ino)) if _BY_INODE else None


def object_of_fd(fd: int) -> RemoteObject | None:
    """The remote object behind `fd` (a placeholder opened by `inputs.open_input`), else None."""
    if not _BY_INODE:
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return _BY_INODE.get((st.st_dev, st.st_ino))


def is_remote_path(path) -> bool:
    return mount_root_of(path) is not None


def mount_root_of(path) -> Path | None:
    """The root of the shadow tree `path` lies in (a mounted URL), else None. What is above that root
    stands for nothing: a resolver looking around an input (a run's configs) must stop there."""
    found = _mount_of(path) if _BY_INODE else None
    return found[0] if found else None


def url_of(path) -> str | None:
    """The URL a path in a shadow tree stands for (the mounted URL, or a file or dir below it), else None."""
    found = _mount_of(path)
    if not found:
        return None
    _root, text, rel = found
    return text if rel == "." else text.rstrip("/") + "/" + rel.replace(os.sep, "/")


def _mount_of(path) -> tuple[Path, str, str] | None:
    """(root, URL, path relative to the root) of the mount `path` lies in."""
    real = os.path.realpath(path)
    for text, (root, _url) in list(_MOUNTS.items()):
        if real == str(root) or real.startswith(str(root) + os.sep):
            return root, text, os.path.relpath(real, root)
    return None


def link_stand_in(src, dst) -> RemoteObject:
    """`dst` (new) made a second name of the remote object whose placeholder is `src`, so that an output
    bound for a URL holding an input's file unchanged (set-lr's data files) has `io.upload` copy the object
    (server-side where the store can), nothing fetched here: a hard link of the placeholder, else (another
    filesystem) a new placeholder registered until `forget_under` its dir. Either reads as the object."""
    obj = object_of_stat(os.stat(src))
    if obj is None:
        raise ValueError(f"{src} is not a remote object's placeholder")
    try:
        os.link(src, dst, follow_symlinks=False)
        return obj
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
            raise
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o400)
    try:
        os.ftruncate(fd, obj.size)
        new = os.fstat(fd)
    finally:
        os.close(fd)
    with _MOUNT_LOCK:
        _BY_INODE[(new.st_dev, new.st_ino)] = obj
        _STAND_INS[(new.st_dev, new.st_ino)] = os.path.realpath(dst)
    return obj


def forget_under(directory) -> None:
    """Unregister the new placeholders of `link_stand_in` under `directory`, before it is removed (a
    freed inode must never be taken for a remote object later)."""
    top = os.path.realpath(directory) + os.sep
    with _MOUNT_LOCK:
        for ident in [i for i, where in _STAND_INS.items() if where.startswith(top)]:
            del _STAND_INS[ident]
            _BY_INODE.pop(ident, None)


def _shadow_dir() -> Path:
    d = Path(tempfile.mkdtemp(prefix="ckpt-remote-"))
    _SHADOW.append(d)
    if len(_SHADOW) == 1:
        atexit.register(reset)
    return d


def mount(value, *, what: str = "input") -> Path:
    """The local shadow path standing for the URL `value` (a file or a tree); listed and pinned once."""
    url = parse_url(value)
    if url is None:
        raise UsageError(f"not a URL: {value!r}")
    with _MOUNT_LOCK:
        known = _MOUNTS.get(url.text)
        if known is not None:
            return known[0]
        if url.text in _ABSENT:  # listed once and nothing there: the same answer, not a second listing
            raise _ABSENT[url.text]
        from .remote_backends import backend_for

        backend = backend_for(url)
        try:
            entries = _listed(backend, url)  # [(rel path or "" for the object itself, size, version, ref)]
            if not entries:
                raise MissingFileError(
                    "no such file or directory (nothing at this URL)",
                    path=url.text,
                    hint="check the bucket/repo, the revision and the path",
                )
        except (MissingPathError, MissingFileError) as exc:
            _ABSENT[url.text] = exc
            raise
        root = _shadow_dir() / url.name
        for rel, size, version, ref in entries:
            p = root / rel if rel else root
            p.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o400)
            try:
                os.ftruncate(fd, size)
                st = os.fstat(fd)
            finally:
                os.close(fd)
            shown = url.text + ("/" + rel if rel else "")
            _BY_INODE[(st.st_dev, st.st_ino)] = RemoteObject(shown, size, version, backend, ref)
        if root.is_dir():
            os.chmod(root, 0o500)
        _MOUNTS[url.text] = (root, url)
        add_display(root, url.text)
        return root


def _listed(backend, url: RemoteUrl):
    """`backend.list(url)`, transient failures retried with backoff as reads are."""
    cfg, failures = settings(), 0
    while True:
        try:
            return backend.list(url)
        except RemoteRetry as exc:
            failures += 1
            if failures > cfg["retries"]:
                raise CkptError(
                    f"listing failed {failures} times in a row: {exc}",
                    path=url.text,
                    hint="the server or the link is failing; retry later",
                ) from None
            time.sleep(min(cfg["backoff_s"] * (2 ** (failures - 1)), 30.0))
        except RemoteDenied as exc:
            raise UsageError(str(exc), path=url.text) from None
        except RemoteMissing:
            raise MissingPathError(url.text) from None


def bytes_fetched() -> int:
    """Bytes received from every remote object so far (retried bytes counted again)."""
    return sum(o.fetched for o in _objects())


def mounted_bytes() -> int:
    """The total size of every mounted remote object (the inputs' size)."""
    return sum(o.size for o in _objects())


def _objects() -> list[RemoteObject]:
    """Every mounted object once (a stand-in is a second inode of one)."""
    return list({id(o): o for o in list(_BY_INODE.values())}.values())


def check_unchanged() -> None:
    """Every object read so far still has the version pinned at open, else a FormatError naming it
    (called before an output is committed)."""
    for obj in _objects():
        if obj.fetched and obj.version is not None:
            now = obj.backend.version_now(obj)
            if now is not None and now != obj.version:
                raise FormatError(
                    f"the object changed while the command ran (version {obj.version} at open, "
                    f"{now} now); nothing was written",
                    path=obj.url,
                    hint="rerun once the writer has finished",
                )


def reset() -> None:
    """Forget every mount and remove the shadow trees (atexit; tests)."""
    with _MOUNT_LOCK:
        _BY_INODE.clear()
        _STAND_INS.clear()
        _MOUNTS.clear()
        _ABSENT.clear()
        clear_display()
        while _SHADOW:
            d = _SHADOW.pop()
            for dirpath, dirnames, _ in os.walk(d):
                for name in dirnames:
                    os.chmod(os.path.join(dirpath, name), stat.S_IRWXU)
            shutil.rmtree(d, ignore_errors=True)
