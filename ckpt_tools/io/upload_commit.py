"""An output put at a bucket prefix with the local contract (docs/remote.md, "Writing to a URL").

A store (S3, GCS, a Hugging Face bucket, any fsspec filesystem) has no rename and no transaction over
several objects: each object is replaced on its own. So an output is put at PREFIX in steps such that a
failure or an interrupt at any point leaves the earlier output there intact or the new one complete,
never a mix of the two:

  0. PREFIX is listed. Objects there and no --overwrite, or --overwrite onto a prefix that is not an
     earlier output of ckpt-tools (its marker `owned.OUTPUT_MARKER` missing or not ours, or entries the
     marker does not list), are refused as a local OUT is (`owned.judge`), before anything is written.
  1. staged: every file made complete where no reader looks: S3's open multipart uploads at the final keys
     (completing one is the store's own atomic rename), elsewhere objects under a fresh staging prefix
     beside PREFIX, `.NAME.ckpt-tmp-<hex>/`.
  2. backed up (--overwrite only): the earlier output's objects that the commit replaces, and its marker
     files, copied server-side to `.NAME.ckpt-old-<hex>/`.
  3. the commit, with Ctrl-C held: the ownership marker first rewritten to list the old and the new entries
     (whatever happens next, the prefix stays one that `--overwrite` may replace); the earlier output's
     marker files deleted (a reader finds no `.metadata` rather than an old one naming new data); the new
     data files put in place, then its marker files (`COMMIT_LAST`): the new output is complete. Then the
     earlier output's other objects are deleted and the ownership marker is written, last.
  4. the staging and backup prefixes deleted.
A failure in 1 or 2 deletes what was staged and backed up. A failure in 3 before the new marker files are
all in place undoes the commit: what it put at PREFIX is deleted and the backed-up objects are copied
back, so the earlier output verifies as before. The error is one line naming the URL, the request and the
server's code, and saying which output is there. Retries and credentials are each store client's own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from ..core.errors import CkptError, OutputExistsError, UsageError
from .owned import OUTPUT_MARKER, judge, marker_text
from .signals import Terminated, signals_deferred

__all__ = [
    "COMMIT_LAST",
    "OVERWRITE_HINT",
    "Counted",
    "Denied",
    "Keys",
    "OutFile",
    "Store",
    "StoreError",
    "client",
    "describe",
    "is_marker",
    "put_output",
    "run_async",
    "settled",
]

# written last: what a reader opens first, and that names the other files
COMMIT_LAST = (
    ".metadata",
    "model.safetensors.index.json",
    "ckpt-slim-manifest.json",
    "adapter_config.json",
    "config.json",
)
OVERWRITE_HINT = "pass --overwrite to replace it, or another output path"
_MARKER_MAX_BYTES = 1 << 20
_SETTLE_S = 10.0


class StoreError(Exception):
    """A request the store failed or refused, after its client's own retries: `code` as the server gave
    it (`503 SlowDown`, `403 AccessDenied`), `request` what was asked, `key` of which object."""

    def __init__(self, code: str, request: str, key: str = ""):
        self.code, self.request, self.key = code, request, key
        super().__init__(f"{code} to {request}" + (f" {key}" if key else ""))


class Denied(StoreError):
    """Credentials missing or refused (401/403): the message names what to set."""

    def __init__(self, code: str, request: str, key: str = "", *, hint: str):
        self.hint = hint
        super().__init__(code, request, key)


@dataclass(frozen=True)
class OutFile:
    """One file of an output: `rel` its path inside it ("": the output is this one file), `path` the local
    file written, or `source` a remote input's object the output holds unchanged (set-lr's data files:
    `upload.copy_later`), which the store copies server-side where it can."""

    rel: str
    path: Path
    size: int
    source: Any = None


@dataclass(frozen=True)
class Keys:
    """Where each file of the output lives: at PREFIX, staged beside it, backed up beside it."""

    prefix: str
    tag: str

    def dest(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if rel else self.prefix

    def _beside(self, kind: str, rel: str) -> str:
        parent, _, name = self.prefix.rpartition("/")
        return f"{parent + '/' if parent else ''}.{name}.ckpt-{kind}-{self.tag}/{rel or name}"

    def root(self, kind: str) -> str:
        """The staging ("tmp") or backup ("old") prefix."""
        return self._beside(kind, "").rsplit("/", 1)[0]

    def staged(self, rel: str) -> str:
        return self._beside("tmp", rel)

    def backup(self, rel: str) -> str:
        return self._beside("old", rel)


class Counted:
    """What each store keeps for the report: the files (and bytes) of remote inputs it copied itself,
    server-side (`copy_how`), never sent from here; `create_hint` says how to make a missing bucket."""

    copy_how = ""
    create_hint: str | None = None

    def __init__(self) -> None:
        self.copied_bytes = 0
        self.copied_files = 0

    def copied(self, size: int) -> None:
        self.copied_bytes += size
        self.copied_files += 1


def client(module: str, scheme: str):
    """The store client's package `module` (the `remote` extra), else a UsageError saying to install it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise UsageError(
            f"writing to {scheme}:// needs the package {module.split('.')[0]}, which is not installed",
            hint="install the remote extra: pip install 'ckpt-tools[remote]'",
        ) from None


class Store(Protocol):
    """What a store does for `put_output`. Every method raises StoreError (Denied) on a refused request."""

    name: str  # for messages: "S3", "Google Cloud Storage", ...
    create_hint: str | None

    def listing(self, prefix: str, *, single: bool) -> dict[str, int]:
        """{path under `prefix`/: size}; with `single`, {"": size} when an object is at `prefix` itself."""

    def read_small(self, key: str) -> bytes: ...

    def stage(self, files: list[OutFile], keys: Keys) -> int:
        """Make every file complete where no reader looks (`keys.staged`, or an open upload); bytes sent."""

    def place(self, rels: list[str], keys: Keys) -> None:
        """Bring staged files into place at `keys.dest`."""

    def copy(self, pairs: list[tuple[str, str]]) -> None:
        """Server-side copies, (source key, destination key)."""

    def put(self, key: str, data: bytes) -> None: ...

    def delete(self, keys: list[str]) -> None:
        """Objects deleted; one that is not there is no error."""

    def discard(self, keys: Keys) -> None:
        """What `stage` made and `place` did not take: uploads aborted, staged objects deleted."""

    def url_of(self, key: str) -> str: ...


def is_marker(rel: str) -> bool:
    """A file a reader opens first: put in place after the data files, deleted first."""
    return rel == OUTPUT_MARKER or rel.rsplit("/", 1)[-1] in COMMIT_LAST


def run_async(loop, coro):
    """`coro` run on the store client's event loop (another thread), its result here. On an interrupt
    (Ctrl-C) the request in flight is given a few seconds to end as it would, so that the cleanup after it
    sees what it made (a request cut off may still be carried out by the server), then it is cancelled."""
    fut = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return fut.result()
    except BaseException:
        with contextlib.suppress(BaseException):  # a second Ctrl-C ends the wait
            concurrent.futures.wait([fut], timeout=_SETTLE_S)
        fut.cancel()
        raise


def settled(fn: Callable, *args, **kw):
    """`fn(*args, **kw)` (a blocking client call) in a worker thread, its result here: on an interrupt the
    request in flight is given a few seconds to end as it would, so that the cleanup after it sees what it
    made (a request cut off may still be carried out by the server)."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="ckpt-upload")
    fut = pool.submit(fn, *args, **kw)
    try:
        return fut.result()
    except BaseException:
        with contextlib.suppress(BaseException):  # a second Ctrl-C ends the wait
            concurrent.futures.wait([fut], timeout=_SETTLE_S)
        raise
    finally:
        pool.shutdown(wait=False)


def put_output(
    store: Store,
    where: str,
    prefix: str,
    files: list[OutFile],
    *,
    overwrite: bool,
    done: Callable | None = None,
) -> tuple[int, list[str]]:
    """The output `files` put at `prefix` of `store` (`where`: its URL, for messages) in the steps of the
    module docstring; `done()` is called once it is in place (before an interrupt held meanwhile arrives).
    Returns the bytes sent from here, and what the cleanup could not remove (staged or backed-up objects)."""
    keys = Keys(prefix, secrets.token_hex(4))
    left: list[str] = []  # what the cleanup could not remove
    single = len(files) == 1 and files[0].rel == ""
    old, _replaces = _existing(store, where, prefix, overwrite=overwrite, single=single)
    backup = [] if single else sorted(old)
    try:
        sent = store.stage(files, keys)
        store.copy([(keys.dest(r), keys.backup(r)) for r in backup])
    except BaseException as exc:
        with signals_deferred():
            _quietly(_discard, store, keys)
            _quietly(_clear, store, keys.root("old"))
        raise _failed(exc, store, where, "nothing was written there") from None
    with signals_deferred():
        try:
            if single:
                _single(store, where, keys)
            else:
                _commit(store, where, keys, old, [f.rel for f in files], left)
            if done is not None:
                done()
        finally:
            _quietly(_discard, store, keys, left=left, store=store)
    return sent, left


def describe(store: Store, where: str, prefix: str, *, overwrite: bool, single: bool = False) -> dict:
    """What putting an output at `prefix` would replace, after the refusals the real run makes (a dry run's
    account of OUT, as `staging.describe_output`'s): {"out", "exists", "replaces"}."""
    listed, replaces = _existing(store, where, prefix, overwrite=overwrite, single=single)
    return {"out": where, "exists": bool(listed), "replaces": replaces}


def _existing(
    store: Store, where: str, prefix: str, *, overwrite: bool, single: bool
) -> tuple[dict[str, int], dict | None]:
    """{path: size} of the earlier output at `prefix` and what replacing it deletes (`owned.judge`), after
    the refusals of `--overwrite`'s rule."""
    try:
        listed = store.listing(prefix, single=single)
    except StoreError as exc:
        if exc.code.startswith("404"):  # a prefix with nothing under it lists empty: the bucket is missing
            raise UsageError("the bucket does not exist", path=where, hint=store.create_hint) from None
        raise _failed(exc, store, where, "nothing was written there") from None
    if not single:
        listed.pop("", None)  # an object named like the prefix is another object, not under it
    if not listed:
        return {}, None
    if not overwrite:
        raise OutputExistsError("already exists", path=where, hint=OVERWRITE_HINT)  # the words of a local OUT
    if single:
        return listed, {"command": None, "version": None, "entries": 1, "bytes": sum(listed.values())}
    names = sorted({rel.split("/", 1)[0] for rel in listed})
    marker = None
    if listed.get(OUTPUT_MARKER, _MARKER_MAX_BYTES + 1) <= _MARKER_MAX_BYTES:
        try:
            marker = store.read_small(f"{prefix}/{OUTPUT_MARKER}")
        except Exception as exc:
            raise _failed(exc, store, where, "nothing was written there") from None
    return listed, judge(where, names, marker, lambda: sum(listed.values()))


def _single(store: Store, where: str, keys: Keys) -> None:
    """A one-file output: one object replaced whole (each store replaces an object atomically)."""
    try:
        store.place([""], keys)
    except Exception as exc:
        raise _failed(
            exc, store, where, "nothing was written there (an earlier object is as it was)"
        ) from None


def _commit(
    store: Store, where: str, keys: Keys, old: dict[str, int], new: list[str], left: list[str]
) -> None:
    """Step 3 of the module docstring (signals held by the caller)."""
    entries = sorted({r.split("/", 1)[0] for r in [*old, *new]} - {OUTPUT_MARKER})
    touched: list[str] = []  # what of PREFIX the commit has changed (or tried to)
    try:
        touched.append(OUTPUT_MARKER)
        store.put(keys.dest(OUTPUT_MARKER), marker_text(entries, committing=keys.tag).encode())
        for (
            step
        ) in (  # the earlier output's marker files first, then its objects the new one does not replace
            [r for r in old if is_marker(r) and r != OUTPUT_MARKER],
            [r for r in old if r not in set(new) and not is_marker(r)],
        ):
            touched += step
            store.delete([keys.dest(r) for r in step])
        for group in (  # the new data files, then its marker files: then it is complete
            [r for r in new if not is_marker(r)],
            [r for r in new if is_marker(r) and r != OUTPUT_MARKER],
        ):
            touched += group
            store.place(group, keys)
    except Exception as exc:
        undone = _undo(store, keys, old, touched)
        if undone is None:
            _quietly(_clear, store, keys.root("old"))
            state = "the earlier output was put back as it was" if old else "nothing is left there"
        else:
            state = (
                f"putting the earlier state back failed too ({undone}): {_leftovers(store, keys, bool(old))}"
            )
        raise _failed(exc, store, where, state) from None
    _quietly(_clear, store, keys.root("old"), left=left, store=store)  # the earlier output is not coming back
    try:
        if OUTPUT_MARKER in new:
            store.place([OUTPUT_MARKER], keys)
        else:
            store.delete([keys.dest(OUTPUT_MARKER)])
    except Exception as exc:
        raise _failed(
            exc,
            store,
            where,
            f"the new output is in place and complete, but its {OUTPUT_MARKER} still lists the earlier "
            "output's entries too (a rerun with --overwrite replaces it cleanly)",
        ) from None


def _undo(store: Store, keys: Keys, old: dict[str, int], touched: list[str]) -> str | None:
    """The commit taken back: what it put at PREFIX that was not there deleted, the backed-up objects it
    replaced or deleted copied back (data files first, the ownership marker last). None when done, else
    what failed."""
    try:
        store.delete([keys.dest(r) for r in touched if r not in old])
        back = sorted(
            (r for r in set(touched) if r in old and r != OUTPUT_MARKER), key=lambda r: (is_marker(r), r)
        )
        store.copy([(keys.backup(r), keys.dest(r)) for r in back])
        if OUTPUT_MARKER in old:
            store.copy([(keys.backup(OUTPUT_MARKER), keys.dest(OUTPUT_MARKER))])
    except Exception as exc:
        return str(exc)
    return None


def _leftovers(store: Store, keys: Keys, had_old: bool) -> str:
    old = f"the earlier output's objects are under {store.url_of(keys.backup(''))}; " if had_old else ""
    return f"{old}the prefix holds part of each; rerun with --overwrite once the store answers"


def _discard(store: Store, keys: Keys) -> None:
    """What was staged, gone: the store's own (uploads aborted), then whatever is under the staging prefix
    (an upload an interrupt cut off that the server carried out all the same)."""
    store.discard(keys)
    _clear(store, keys.root("tmp"))


def _clear(store: Store, root: str) -> None:
    """Every object under the staging or backup prefix `root` deleted."""
    store.delete([f"{root}/{rel}" for rel in store.listing(root, single=False)])


def _quietly(fn: Callable, *args, left: list[str] | None = None, store: Store | None = None) -> None:
    """A cleanup step that may fail (the store gone): what it leaves is under the staging or backup prefix,
    and, given `left`, said there (the object it failed on, the server's code)."""
    try:
        fn(*args)
    except Exception as exc:
        if left is not None and store is not None:
            key = getattr(exc, "key", "")
            left.append(
                f"{store.url_of(key) if key else store.name} ({getattr(exc, 'code', type(exc).__name__)})"
            )


def _failed(exc: BaseException, store: Store, where: str, state: str) -> BaseException:
    """`exc` as the one line the user sees: the URL, what the store answered, where the output stands.
    Interrupts and our own errors pass as they are."""
    if isinstance(exc, (KeyboardInterrupt, Terminated, CkptError)) or not isinstance(exc, Exception):
        return exc
    if isinstance(exc, Denied):
        return UsageError(f"{store.name} refused access to {where} ({exc}); {state}", hint=exc.hint)
    if isinstance(exc, StoreError):
        return CkptError(
            f"uploading to {where} failed: {store.name} answered {exc}; {state}",
            hint="rerun when the store answers",
        )
    first = str(exc).splitlines()[0] if str(exc) else ""
    return CkptError(
        f"uploading to {where} failed: {type(exc).__name__}: {first}; {state}",
        hint="check the endpoint, then rerun",
    )
