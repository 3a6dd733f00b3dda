"""Remote inputs: a URL read where it lies, by byte range, through the same read side as a local file, with
nothing written to local disk.

`as_input(value)` turns a URL string into a `RemotePath`: a file or directory of a store (a bucket, a host,
a Hub repo at one commit), with pathlib's reading surface (`/`, `name`, `parent`, `is_dir()`, `is_file()`,
`iterdir()`, `glob()`, `stat()`...), so every format finds its files in a URL as in a local dir, and
`str()` of it is the URL as the user gave it minus its credentials. It has no `__fspath__`: `open()`,
`os.stat()` or `Path()` of it fail loudly instead of reading a local file of that name. Its files are read
through `io.inputs` (`OpenFiles`, `read_input`), which opens them as `RemoteObject`s
(`io.remote_object`): the range readers beside a local file's fd.

Each directory is listed once, when first looked into, by one request (S3 and GCS with a delimiter, an
HTTP index page, the Hub's tree), and the listing is validated before use: a name that is not one plain
segment (`..`, `.`, empty, holding `/` or NUL), a name listed twice or as both a file and a directory, a
size beyond any store's largest object, or a listing of over `MAX_LISTED` entries is refused in one line
naming the URL. A path at or above the URL the user gave is stat'ed, never found by listing its parent
(above what the user named, `bounded` and `search_top` keep the resolvers from climbing).

The stores, listings and opened objects of one command are shared through its `session()` (opened by
`inputs.tracking()` and by each api call): the command sees one version of each object, `bytes_fetched()`
counts what it fetched, `check_unchanged()` re-checks, before an output is committed, that nothing it read
has changed. URL forms: `hf://[datasets/|spaces/]org/name[@rev]/path`, `hf://buckets/ns/name/path`,
`s3://bucket/key`, `gs://bucket/key`, `http(s)://host/path`, and any other fsspec protocol (`az://...`);
credentials are each ecosystem's own (docs/remote.md). Backends: `remote_backends.py`, `remote_http.py`."""

from __future__ import annotations

import contextlib
import fnmatch
import stat as stat_
import threading
import time
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import cast
from urllib.parse import quote, unquote

from ..core.errors import CkptError, MissingFileError, UnsafeInputError, UsageError
from .remote_object import RemoteObject
from .remote_url import RemoteDenied, RemoteMissing, RemoteRetry, RemoteUrl, parse_url, settings

__all__ = [
    "MAX_LISTED",
    "MAX_OBJECT_BYTES",
    "RemotePath",
    "RemoteStat",
    "Session",
    "active",
    "as_input",
    "bytes_fetched",
    "check_unchanged",
    "current_session",
    "input_bytes",
    "is_url",
    "session",
]

MAX_OBJECT_BYTES = 1 << 46  # 64 TiB: beyond any store's largest object (S3 and GCS: 5 TiB)
MAX_LISTED = 1 << 20  # entries in one directory; a checkpoint dir holds tens, a model repo hundreds


def is_url(value) -> bool:
    """Whether `value` names a remote input: a RemotePath, or a URL string."""
    return isinstance(value, RemotePath) or parse_url(value) is not None


# ------------------------------------------------------------------------------------ sessions
class Session:
    """The stores one command opened (so it sees one listing and one version of each object) and the
    objects it read."""

    def __init__(self) -> None:
        self.stores: dict[tuple, RemoteStore] = {}
        self.objects: list[RemoteObject] = []
        self.lock = threading.Lock()

    def bytes_fetched(self) -> int:
        return sum(o.fetched for o in list(self.objects))

    def input_bytes(self) -> int:
        return sum(o.size for o in list(self.objects))


_SESSION: Session | None = None
_SESSION_LOCK = threading.Lock()


@contextlib.contextmanager
def session() -> Iterator[Session]:
    """The remote session of the running command: a new one, or the one already open (an api call inside
    the CLI's command)."""
    global _SESSION
    with _SESSION_LOCK:
        mine = _SESSION is None
        if mine:
            _SESSION = Session()
        s = _SESSION
    assert s is not None
    try:
        yield s
        if mine:  # a clean end: what was fetched ahead and never read still arrives, and is counted
            for obj in list(s.objects):
                obj.settle()
    finally:
        if mine:
            with _SESSION_LOCK:
                _SESSION = None


def current_session() -> Session | None:
    return _SESSION


def active() -> bool:
    """Whether the running command has opened any remote object."""
    s = _SESSION
    return bool(s is not None and s.objects)


def bytes_fetched() -> int:
    """Bytes received by the running command from every remote object (retried bytes counted again)."""
    s = _SESSION
    return s.bytes_fetched() if s is not None else 0


def input_bytes() -> int:
    """The total size of the remote objects the running command opened."""
    s = _SESSION
    return s.input_bytes() if s is not None else 0


def check_unchanged() -> None:
    """Every object the running command read still has the identity pinned when it was opened, else a
    FormatError naming it (called before an output is committed)."""
    s = _SESSION
    for obj in list(s.objects) if s is not None else []:
        if obj.fetched:
            obj.check_unchanged()


# ------------------------------------------------------------------------------------ stores
def _split(url: RemoteUrl) -> tuple[str, tuple[str, ...]]:
    """(the store's root, the path's segments below it) of `url`."""
    segs = url.path.split("/")
    n = 1
    if url.scheme == "hf":
        n = 3 if segs[0] in ("datasets", "spaces", "buckets") else 2
        if len(segs) < n or not all(segs[:n]):
            raise UsageError(
                "a Hub URL is hf://ORG/NAME[@REV][/PATH] (hf://datasets/..., hf://buckets/NS/NAME/...)",
                path=url.shown,
            )
    root, rest = "/".join(segs[:n]), segs[n:]
    if not root:
        raise UsageError("the URL names no bucket, host or repo", path=url.shown)
    parts = tuple(unquote(s) for s in rest) if url.scheme in ("http", "https") else tuple(rest)
    if any(not _plain(p) for p in parts):
        raise UsageError(
            "the URL has an empty, `.` or `..` segment: it names no single object",
            path=url.shown,
            hint="write the path without them",
        )
    return root, parts


def _plain(name) -> bool:
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\0" not in name


class RemoteStore:
    """One bucket, host, or Hub repo at one commit, as one command sees it: what it listed, stat'ed and
    opened. `url`: a URL of the store with its credentials (the requests'), `root`: the bucket/host/repo."""

    def __init__(self, url: RemoteUrl, root: str, session: Session | None):
        self.url, self.root, self.session = url, root, session
        self.shown_root = f"{url.scheme_as_given}://{root}"
        self._backend = None
        self._dirs: dict[tuple[str, ...], dict | None] = {}  # listed dirs: name -> Listed (None: not a dir)
        self._known: dict[tuple[str, ...], object] = {}  # path -> Listed, or None (nothing there)
        self._objects: dict[tuple[str, ...], RemoteObject] = {}
        self._lock = threading.RLock()

    @property
    def backend(self):
        if self._backend is None:
            self._backend = _backend_for(self.url, self.root)
        return self._backend

    def shown(self, parts: tuple[str, ...]) -> str:
        if self.url.scheme in ("http", "https"):
            parts = tuple(quote(p, safe="!$&'()*+,;=:@~") for p in parts)
        return "/".join((self.shown_root, *parts))

    def _retried(self, what: str, fn, parts):
        """`fn(parts, shown)`, transient failures retried with backoff; refused credentials a UsageError."""
        cfg, failures, shown = settings(), 0, self.shown(parts)
        while True:
            try:
                return fn(parts, shown)
            except RemoteRetry as exc:
                failures += 1
                own = getattr(self.backend, "client_retries", False)
                if failures > (0 if own else cfg["retries"]):
                    raise CkptError(
                        f"{what} failed "
                        + ("after the client's own retries" if own else f"{failures} times in a row")
                        + f": {exc}",
                        path=shown,
                        hint="the server or the link is failing; retry later",
                    ) from None
                time.sleep(min(cfg["backoff_s"] * (2 ** (failures - 1)), 30.0))
            except RemoteDenied as exc:
                raise UsageError(str(exc), path=shown) from None

    def listing(self, parts: tuple[str, ...]) -> dict | None:
        """The entries of the directory `parts` by name, listed once and validated; None if it is none."""
        with self._lock:
            if parts in self._dirs:
                return self._dirs[parts]
            try:
                raw = self._retried("listing", self.backend.list_dir, parts)
            except RemoteMissing:
                raw = None
            got = None if raw is None else _validated(raw, self.shown(parts))
            self._dirs[parts] = got
            if got is not None:
                from .remote_backends import Listed

                self._known[parts] = Listed(parts[-1] if parts else self.root, True)
            return got

    def entry(self, parts: tuple[str, ...], anchor: int):
        """What is at `parts` (a `Listed` file or directory), None when nothing is. A path strictly below
        the URL the user gave (`anchor` segments) is found in its parent's listing (probed by name where
        a listing may hide names); one at or above it is stat'ed, its parent never listed for it."""
        with self._lock:
            if parts in self._known:
                return self._known[parts]
            if parts and (parts[:-1] in self._dirs or len(parts) > anchor):
                if parts[:-1] not in self._dirs:
                    parent = self.entry(parts[:-1], anchor)
                    if parent is None or not parent.is_dir:  # inside nothing, or inside a file
                        self._known[parts] = None
                        return None
                listing = self.listing(parts[:-1])
                found = None if listing is None else listing.get(parts[-1])
                if found is None and listing is not None and self.backend.hides_names:
                    found = self._stat(parts)
                    if found is not None:
                        listing[parts[-1]] = found
            else:
                found = self._stat(parts)
            self._known[parts] = found
            return found

    def _stat(self, parts):
        b = self.backend
        if not b.stat_first and self.listing(parts) is not None:
            return self._known[parts]
        try:
            found = self._retried("looking it up", b.stat, parts)
        except RemoteMissing:
            return None
        if found is not None and found.is_dir is False:
            _check_size(found.name, found.size, self.shown(parts))
        return found

    def open(self, parts: tuple[str, ...], anchor: int, what: str) -> RemoteObject:
        """The object at `parts`, its identity pinned (opened once per command)."""
        with self._lock:
            obj = self._objects.get(parts)
            if obj is not None:
                return obj
            shown = self.shown(parts)
            e = self.entry(parts, anchor)
            if e is None:
                raise MissingFileError(f"no such {what}", path=shown)
            if e.is_dir:
                raise UnsafeInputError(
                    f"{what} is a directory, expected a regular file; refusing to open it", path=shown
                )
            if e.size is None or e.identity is None:  # an index page's entry: its size and identity by HEAD
                e = self._retried("looking it up", self.backend.stat, parts)
                if e is None or e.is_dir or e.size is None:
                    raise MissingFileError(f"{what} is not served as a file with a size", path=shown)
                _check_size(e.name, e.size, shown)
            obj = RemoteObject(shown, int(e.size), e.identity, self.backend, e.ref)
            self._objects[parts] = obj
            if self.session is not None:
                with self.session.lock:
                    self.session.objects.append(obj)
            return obj


def _backend_for(url: RemoteUrl, root: str):
    """The backend of the store `root` (the bucket, host or repo of `url`), imported on first use."""
    if url.scheme in ("http", "https"):
        from .remote_http import HttpBackend

        return HttpBackend(url, root)
    from .remote_backends import FsspecBackend, HfBackend, S3Backend

    if url.scheme == "s3":
        return S3Backend(root)
    if url.scheme == "hf":
        return HfBackend(root)
    return FsspecBackend(url.scheme, root)


def _check_size(name, size, shown: str) -> None:
    if size is not None and (
        isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_OBJECT_BYTES
    ):
        raise UnsafeInputError(
            f"the listing gives {name!r} a size of {size!r} bytes, beyond any object a store "
            f"holds ({MAX_OBJECT_BYTES:,}); refusing the listing",
            path=shown,
            hint="the server's listing is crafted or damaged; nothing was read or written",
        )


def _validated(raw, shown: str) -> dict:
    """A listing as {name: Listed}, each name one plain segment, listed once, with a sane size."""
    if len(raw) > MAX_LISTED:
        raise UnsafeInputError(
            f"the listing holds {len(raw):,} entries, over the {MAX_LISTED:,} a directory may "
            "hold here; refusing it",
            path=shown,
            hint="name a directory further down",
        )
    out: dict = {}
    for e in raw:
        if not _plain(e.name):
            raise UnsafeInputError(
                f"the listing names {e.name!r}, which is not one plain name inside this "
                "directory (an empty, `.` or `..` segment, a `/` or a NUL); refusing the listing",
                path=shown,
                hint="the server's listing is crafted or damaged; nothing was read or written",
            )
        if e.name in out:
            both = out[e.name].is_dir != e.is_dir
            raise UnsafeInputError(
                f"the listing names {e.name!r} "
                + ("both as a file and as a directory" if both else "twice")
                + "; refusing the listing",
                path=shown,
                hint="the server's listing is crafted or damaged; nothing was read or written",
            )
        if not e.is_dir:
            _check_size(e.name, e.size, shown)
        out[e.name] = e
    return out


# ------------------------------------------------------------------------------------ paths
class RemoteStat:
    """What `RemotePath.stat()` gives: a file's size, or a directory (read-only modes)."""

    def __init__(self, size: int, is_dir: bool):
        self.st_size = size
        self.st_mode = (stat_.S_IFDIR | 0o555) if is_dir else (stat_.S_IFREG | 0o444)
        self.st_blocks = (size + 511) // 512
        self.st_mtime = self.st_mtime_ns = self.st_dev = self.st_ino = 0
        self.st_nlink = 1


class RemotePath:
    """A file or directory of a URL (module docstring). Immutable; hashable; sorted by its text."""

    __slots__ = ("_anchor", "_parts", "_store")

    def __init__(self, store: RemoteStore, parts: tuple[str, ...], anchor: int):
        self._store, self._parts, self._anchor = store, parts, anchor

    # ---- pure
    def __str__(self) -> str:
        return self._store.shown(self._parts)

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def as_posix(self) -> str:
        return str(self)

    def __copy__(self) -> RemotePath:
        return self

    def __deepcopy__(self, memo) -> RemotePath:  # immutable; its store is the command's, shared
        return self

    def __eq__(self, other) -> bool:
        return isinstance(other, RemotePath) and other._store is self._store and other._parts == self._parts

    def __hash__(self) -> int:
        return hash((id(self._store), self._parts))

    def __lt__(self, other) -> bool:
        return str(self) < str(other)

    def __le__(self, other) -> bool:
        return str(self) <= str(other)

    def __gt__(self, other) -> bool:
        return str(self) > str(other)

    def __ge__(self, other) -> bool:
        return str(self) >= str(other)

    def _at(self, parts: tuple[str, ...]) -> RemotePath:
        return RemotePath(self._store, parts, self._anchor)

    @property
    def name(self) -> str:
        return self._parts[-1] if self._parts else ""

    @property
    def suffix(self) -> str:
        return PurePosixPath(self.name).suffix if self.name else ""

    @property
    def suffixes(self) -> list[str]:
        return PurePosixPath(self.name).suffixes if self.name else []

    @property
    def stem(self) -> str:
        return PurePosixPath(self.name).stem if self.name else ""

    @property
    def parent(self) -> RemotePath:
        return self._at(self._parts[:-1])

    @property
    def parents(self) -> tuple[RemotePath, ...]:
        return tuple(self._at(self._parts[:i]) for i in range(len(self._parts) - 1, -1, -1))

    @property
    def parts(self) -> tuple[str, ...]:
        return (self._store.shown_root, *self._parts)

    def joinpath(self, *others) -> RemotePath | Path:
        out: RemotePath | Path = self
        for o in others:
            out = out / o
        return out

    def __truediv__(self, other) -> RemotePath | Path:
        text = str(other) if isinstance(other, PurePosixPath) else other
        if not isinstance(text, str):
            return NotImplemented
        if text.startswith("/"):  # as pathlib: an absolute path replaces this one (a local path)
            return Path(text)
        parts = list(self._parts)
        for seg in text.split("/"):
            if seg in ("", "."):
                continue
            if seg == "..":
                if parts:
                    parts.pop()
                continue
            if "\0" in seg:
                raise ValueError(f"a NUL byte in a path segment: {seg!r}")
            parts.append(seg)
        return self._at(tuple(parts))

    def with_name(self, name: str) -> RemotePath:
        if not self._parts or not _plain(name):
            raise ValueError(f"{self!r} has an empty name, or {name!r} is not a plain name")
        return self._at((*self._parts[:-1], name))

    def with_suffix(self, suffix: str) -> RemotePath:
        return self.with_name(str(PurePosixPath(self.name).with_suffix(suffix)))

    def relative_to(self, other) -> PurePosixPath:
        if not self.is_relative_to(other):
            raise ValueError(f"{self!s} is not in the subpath of {other!s}")
        return (
            PurePosixPath(*self._parts[len(other._parts) :])
            if len(self._parts) > len(other._parts)
            else PurePosixPath(".")
        )

    def is_relative_to(self, other) -> bool:
        return (
            isinstance(other, RemotePath)
            and other._store is self._store
            and self._parts[: len(other._parts)] == other._parts
        )

    def match(self, pattern: str) -> bool:
        return PurePosixPath("/", *self._parts).match(pattern)

    def resolve(self, strict: bool = False) -> RemotePath:
        return self

    def absolute(self) -> RemotePath:
        return self

    def expanduser(self) -> RemotePath:
        return self

    @property
    def url(self) -> RemoteUrl:
        """The URL of this path, with the credentials of the one it came from (for requests)."""
        return self._store.url.child("/".join(self._parts)) if self._parts else self._store.url

    def within_given(self, other: RemotePath) -> bool:
        """Whether this path lies at or below the URL the user gave for `other`."""
        return (
            other._store is self._store
            and self._parts[: other._anchor] == other._parts[: other._anchor]
            and len(self._parts) >= other._anchor
        )

    def given(self) -> RemotePath:
        """The URL the user gave, that this path was reached from."""
        return self._at(self._parts[: self._anchor])

    # ---- what is there
    def _entry(self):
        return self._store.entry(self._parts, self._anchor)

    def exists(self) -> bool:
        return self._entry() is not None

    def is_dir(self) -> bool:
        e = self._entry()
        return e is not None and e.is_dir

    def is_file(self) -> bool:
        e = self._entry()
        return e is not None and not e.is_dir

    def is_symlink(self) -> bool:
        return False

    def is_fifo(self) -> bool:
        return False

    def is_socket(self) -> bool:
        return False

    def is_char_device(self) -> bool:
        return False

    def is_block_device(self) -> bool:
        return False

    def samefile(self, other) -> bool:
        return self == other

    def iterdir(self) -> Iterator[RemotePath]:
        if not self.is_dir():
            raise NotADirectoryError(str(self)) if self.exists() else FileNotFoundError(str(self))
        listing = self._store.listing(self._parts) or {}
        return iter([self._at((*self._parts, n)) for n in sorted(listing)])

    def glob(self, pattern: str) -> Iterator[RemotePath]:
        segs = [s for s in pattern.split("/") if s not in ("", ".")]
        return iter(sorted(set(self._glob(segs))))

    def rglob(self, pattern: str) -> Iterator[RemotePath]:
        return self.glob("**/" + pattern)

    def _glob(self, segs: list[str]) -> Iterator[RemotePath]:
        if not segs:
            yield self
            return
        head, rest = segs[0], segs[1:]
        if head == "**":
            yield from self._glob(rest)
            for c in self.iterdir() if self.is_dir() else []:
                if c.is_dir():
                    yield from c._glob(segs)
        elif any(ch in head for ch in "*?["):
            for c in self.iterdir() if self.is_dir() else []:
                if fnmatch.fnmatchcase(c.name, head):
                    yield from c._glob(rest)
        else:
            c = self._at((*self._parts, head))
            if c.exists():
                yield from c._glob(rest)

    def stat(self) -> RemoteStat:
        e = self._entry()
        if e is None:
            raise FileNotFoundError(f"no such file or directory: {self}")
        if e.is_dir:
            return RemoteStat(0, True)
        return RemoteStat(self.open(what="file").size, False)

    lstat = stat

    def open(self, *, what: str = "file") -> RemoteObject:
        """The object at this path, opened (its identity pinned) for range reads (`io.inputs` calls this;
        a format never needs to)."""
        return self._store.open(self._parts, self._anchor, what)


def as_input(value) -> Path:
    """An input as the read side takes it: a URL string (or RemotePath) as a RemotePath in the running
    command's session, anything else as a local Path. Typed as a Path: a RemotePath has pathlib's reading
    surface, which is all an input is used for (a write, `open()` or `os.*` of it fails loudly)."""
    if isinstance(value, RemotePath):
        return cast(Path, value)
    url = parse_url(value)
    if url is None:
        return value if isinstance(value, Path) else Path(value)
    root, parts = _split(url)
    s = _SESSION
    key = ("gs" if url.scheme == "gcs" else url.scheme, url.userinfo, root, url.query)
    store = s.stores.get(key) if s is not None else None
    if store is None and s is not None and not url.userinfo and not url.query:
        # the URL as shown (a plan's text, a message's) of a store this command opened with credentials:
        # that store, credentials and all, when there is one such
        same = [st for k, st in s.stores.items() if k[0] == key[0] and k[2] == root]
        store = same[0] if len(same) == 1 else None
    if store is None:
        store = RemoteStore(url, root, s)
        if s is not None:
            s.stores[key] = store
    return cast(Path, RemotePath(store, parts, len(parts)))
