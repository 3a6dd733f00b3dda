"""gs:// (Google Cloud Storage) through the GCS JSON API: reads by range for `io.remote`, writes for
`io.upload`. gcsfs supplies what each ecosystem keeps for itself: the credentials (gcloud application-default
credentials: GOOGLE_APPLICATION_CREDENTIALS, `gcloud auth application-default login`, a VM's service
account; none at all is anonymous access, for public buckets), the endpoint (STORAGE_EMULATOR_HOST for
another server) and its aiohttp session. The requests themselves are made here, so that every failure
comes back as a status (no client-side retry layer under `io.remote`'s own) and every read can be pinned.

Reads: each object's generation is pinned when the URL is listed and every range request names it
(`generation=G`): the server sends that version's bytes or none (404 once it was replaced, on a bucket
without versioning), so an object rewritten mid-read is `RemoteChanged`, never a mix of two versions; an
answer carrying another `X-Goog-Generation` is refused as well. Retries, backoff and resuming a broken
body from the byte where it stopped are `io.remote`'s.

Writes (`GcsWriter`): every file is a resumable upload, and GCS creates the object only when the upload's
last byte arrives. All of every file's data is sent first except its last piece (1 byte to 256 KiB: a
chunk that does not end the upload must be a multiple of 256 KiB); then, with Ctrl-C held, each upload is
finalized by sending that piece, the `.metadata`, index and manifest last (`upload.COMMIT_LAST`). Ctrl-C or
a failure before that cancels every session: no object appears. A failure inside the burst deletes the
objects it had created (when they were new) and cancels the rest. Each finished object's size and MD5 are
checked against the local file. A failed data chunk restarts that file's upload in a new session (a server
may have kept part of a chunk it did not acknowledge; a new session assumes nothing).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import time
from urllib.parse import quote

from ..core.errors import CkptError, MissingPathError, OutputExistsError, UsageError
from .remote_backends import Backend, run_sync
from .remote_url import RemoteChanged, RemoteDenied, RemoteMissing, RemoteRetry, RemoteUrl, settings
from .signals import signals_deferred

__all__ = ["ALIGN_BYTES", "CHUNK_BYTES", "GCS_CREDENTIALS_HINT", "GcsBackend", "GcsWriter"]

GCS_CREDENTIALS_HINT = (
    "set GOOGLE_APPLICATION_CREDENTIALS to a service account key file, or run "
    "`gcloud auth application-default login` (STORAGE_EMULATOR_HOST for another endpoint)"
)
ALIGN_BYTES = 256 << 10  # every chunk of a resumable upload but the one that ends it is a multiple of this
CHUNK_BYTES = 32 << 20  # the data chunk sent per request (a multiple of ALIGN_BYTES)


@contextlib.contextmanager
def _quiet_auth():
    """google-auth logs each failed probe (a metadata server that is not there) as a warning; the CLI's one
    line on a refused request says what to set instead."""
    loggers = [
        logging.getLogger(n)
        for n in (
            "google.auth",
            "google.auth.compute_engine._metadata",
            "google.auth._default",
            "gcsfs",
            "gcsfs.credentials",
        )
    ]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


def split_bucket(url: RemoteUrl) -> tuple[str, str]:
    bucket, _, key = url.path.partition("/")
    if not bucket:
        raise UsageError("a GCS URL is gs://BUCKET[/PATH]", path=url.text)
    return bucket, key.strip("/")


def _status(status: int, where: str, body: bytes = b"") -> None:
    """An HTTP status of the JSON API mapped onto io.remote's kinds (2xx and 308 pass)."""
    if status < 300 or status == 308:
        return
    if status == 412:
        raise RemoteChanged("another generation")
    if status == 404:
        raise RemoteMissing(where)
    if status in (401, 403):
        raise RemoteDenied(
            f"Google Cloud Storage refused access ({status}) to {where}: {GCS_CREDENTIALS_HINT}"
        )
    if status in (408, 429) or status >= 500:
        raise RemoteRetry(f"HTTP {status}")
    try:
        msg = json.loads(body)["error"]["message"]
    except Exception:
        msg = body[:200].decode("utf-8", "replace")
    raise CkptError(f"Google Cloud Storage answered {status}: {msg}", path=where)


class GcsBackend(Backend):
    """gs://bucket/key for `io.remote`: listed through the JSON API (objects.get, then objects.list of the
    prefix), every object pinned by its generation; ranges read from the media endpoint with
    `generation=` (see the module docstring)."""

    scheme = "gs"

    def __init__(self):
        import importlib

        try:
            gcsfs = importlib.import_module("gcsfs")
        except ImportError:
            raise UsageError(
                "reading gs:// needs the package gcsfs, which is not installed",
                hint="install the remote extra: pip install 'ckpt-tools[remote]'",
            ) from None
        with _quiet_auth():
            try:
                self.fs = gcsfs.GCSFileSystem(skip_instance_cache=True)
            except Exception as exc:  # a credentials file that cannot be read or parsed
                raise UsageError(
                    f"the Google Cloud credentials could not be loaded: {exc}", hint=GCS_CREDENTIALS_HINT
                ) from None
        self.endpoint = self.fs._location.rstrip("/")

    # ---- requests
    def headers(self, extra: dict | None = None) -> dict:
        out = dict(extra or {})
        try:
            with _quiet_auth():
                self.fs.credentials.apply(out)
        except Exception as exc:  # a refresh the token server refused
            raise RemoteDenied(
                f"the Google Cloud credentials could not be refreshed ({type(exc).__name__}: "
                f"{exc}): {GCS_CREDENTIALS_HINT}"
            ) from None
        return out

    def object_url(self, bucket: str, key: str, *, media: bool = False) -> str:
        head = f"{self.endpoint}/download" if media else self.endpoint
        return f"{head}/storage/v1/b/{quote(bucket, safe='')}/o/{quote(key, safe='')}"

    def call(
        self, method: str, url: str, *, params=None, headers=None, data=None, timeout_s: float = 60.0
    ) -> tuple[int, dict, bytes]:
        """One request, its whole answer: (status, headers, body). A failed connection or a timeout is
        RemoteRetry; the status is the caller's to map (`_status`)."""
        import aiohttp

        hdrs = self.headers(headers)

        async def go():
            session = await self.fs._set_session()
            timeout = aiohttp.ClientTimeout(sock_connect=timeout_s, sock_read=timeout_s)
            async with session.request(
                method, url, params=params, headers=hdrs, data=data, timeout=timeout
            ) as r:
                return r.status, dict(r.headers), await r.read()

        try:
            return run_sync(self.fs.loop, go(), timeout_s)
        except RemoteRetry:
            raise
        except Exception as exc:
            raise RemoteRetry(f"{type(exc).__name__}: {exc}") from None

    def json_call(self, method: str, url: str, where: str, **kw) -> dict:
        status, _h, body = self.call(method, url, **kw)
        _status(status, where, body)
        return json.loads(body) if body else {}

    # ---- io.remote's Backend
    def meta(self, bucket: str, key: str, where: str) -> dict:
        return self.json_call(
            "GET", self.object_url(bucket, key), where, params={"fields": "name,size,generation,md5Hash"}
        )

    def names(self, bucket: str, prefix: str, where: str) -> list[dict]:
        """Every object under `prefix` (objects.list, paged)."""
        out, token = [], None
        while True:
            params = {"prefix": prefix, "fields": "items(name,size,generation),nextPageToken"}
            if token:
                params["pageToken"] = token
            page = self.json_call(
                "GET", f"{self.endpoint}/storage/v1/b/{quote(bucket, safe='')}/o", where, params=params
            )
            out += page.get("items", [])
            token = page.get("nextPageToken")
            if not token:
                return out

    def list(self, url):
        bucket, key = split_bucket(url)
        try:
            if key:
                try:
                    m = self.meta(bucket, key, url.text)
                    return [("", int(m["size"]), str(m["generation"]), (bucket, key))]
                except RemoteMissing:
                    pass
            prefix = key + "/" if key else ""
            found = self.names(bucket, prefix, url.text)
        except RemoteMissing:  # no such bucket
            raise MissingPathError(url.text) from None
        out = [
            (o["name"][len(prefix) :], int(o["size"]), str(o["generation"]), (bucket, o["name"]))
            for o in found
            if not o["name"].endswith("/")
        ]  # `dir/` placeholders hold nothing
        if not out:
            raise MissingPathError(url.text)
        return sorted(out)

    def fetch(self, obj, start, end, sink, timeout_s):
        import aiohttp

        bucket, key = obj.ref
        url = self.object_url(bucket, key, media=True)
        params = {"alt": "media", "generation": obj.version}
        # identity: an object stored gzip-encoded would otherwise come compressed, not the stored bytes
        hdrs = self.headers({"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"})

        async def get():
            session = await self.fs._set_session()
            timeout = aiohttp.ClientTimeout(sock_connect=timeout_s, sock_read=timeout_s)
            async with session.get(
                url, params=params, headers=hdrs, timeout=timeout, auto_decompress=False
            ) as r:
                if r.status == 404:
                    return "missing"
                _status(r.status, obj.url, await r.read() if r.status >= 300 and r.status != 308 else b"")
                now = r.headers.get("X-Goog-Generation")
                if now and now != obj.version:
                    raise RemoteChanged(now)
                if r.status != 206 and not (r.status == 200 and start == 0 and end == obj.size):
                    raise UsageError(
                        f"the server answered a byte-range request with {r.status}, not 206",
                        path=obj.url,
                        hint="an object stored with Content-Encoding: gzip is served decompressed, "
                        "whole: store checkpoints without it",
                    )
                async for chunk in r.content.iter_chunked(1 << 20):
                    sink(chunk)
            return "ok"

        try:
            got = run_sync(self.fs.loop, get(), timeout_s)
        except (RemoteRetry, RemoteChanged, RemoteMissing, RemoteDenied, UsageError, CkptError):
            raise
        except Exception as exc:
            raise RemoteRetry(f"{type(exc).__name__}: {exc}") from None
        if got == "missing":  # the pinned generation is gone: replaced (changed) or deleted
            now = self.version_now(obj)
            if now is not None and now != "(deleted)":
                raise RemoteChanged(now)
            raise RemoteMissing(obj.url)

    def version_now(self, obj):
        bucket, key = obj.ref
        try:
            return str(self.meta(bucket, key, obj.url)["generation"])
        except RemoteMissing:
            return "(deleted)"
        except Exception:
            return None


# ------------------------------------------------------------------------------------ writes
class _Session:
    """One file's resumable upload: the session URI, how much of the file the server holds."""

    def __init__(self, key: str, path, size: int):
        self.key, self.path, self.size = key, path, size
        self.location: str | None = None
        self.sent = 0
        self.md5 = hashlib.md5()
        # everything but the last piece goes before the commit; the last piece (>= 1 byte) ends the upload
        self.body_end = ((size - 1) // ALIGN_BYTES) * ALIGN_BYTES if size else 0


class GcsWriter:
    """An output tree uploaded to gs://bucket/prefix and committed in one burst (module docstring)."""

    def __init__(self):
        self.b = GcsBackend()
        self.committed = False
        self.url_text = ""

    def _retried(self, what: str, fn):
        """`fn()`, transient failures (connection, timeout, 5xx, 429) retried with io.remote's backoff."""
        cfg, failures = settings(), 0
        while True:
            try:
                return fn()
            except RemoteRetry as exc:
                failures += 1
                if failures > cfg["retries"]:
                    raise CkptError(
                        f"{what} failed {failures} times in a row: {exc}",
                        path=self.url_text,
                        hint="the server or the link is failing; nothing was committed unless the "
                        "message says so; retry later",
                    ) from None
                time.sleep(min(cfg["backoff_s"] * (2 ** (failures - 1)), 30.0))
            except RemoteDenied as exc:
                raise UsageError(str(exc), path=self.url_text) from None
            except RemoteMissing as exc:
                raise UsageError(
                    f"{what}: not found ({exc})",
                    path=self.url_text,
                    hint="check that the bucket exists: gcloud storage buckets create gs://BUCKET",
                ) from None
            except RemoteChanged:  # an ifGenerationMatch=0 that failed: the object appeared meanwhile
                raise CkptError(
                    f"{what}: the object was created by another writer meanwhile",
                    path=self.url_text,
                    hint="another process writes the same output; rerun (--overwrite replaces it)",
                ) from None

    def _start(self, bucket: str, s: _Session, *, overwrite: bool) -> None:
        params = {"uploadType": "resumable", "name": s.key}
        if not overwrite:  # GCS refuses to create it if another writer made it meanwhile (412 at the end)
            params["ifGenerationMatch"] = "0"

        def go():
            status, hdrs, body = self.b.call(
                "POST",
                f"{self.b.endpoint}/upload/storage/v1/b/{quote(bucket, safe='')}/o",
                params=params,
                headers={
                    "Content-Type": "application/json",
                    "X-Upload-Content-Type": "application/octet-stream",
                },
                data=json.dumps({"name": s.key}).encode(),
            )
            _status(status, self.url_text, body)
            loc = hdrs.get("Location") or hdrs.get("location")
            if not loc:
                raise CkptError(
                    "the server started a resumable upload without a session URI", path=self.url_text
                )
            return loc

        s.location = self._retried(f"starting the upload of {s.key}", go)
        s.sent, s.md5 = 0, hashlib.md5()

    def _cancel(self, s: _Session) -> None:
        if s.location is None:
            return
        try:
            self.b.call("DELETE", s.location, timeout_s=10)  # GCS answers 499
        except Exception:
            pass
        s.location = None

    def _chunk(self, s: _Session, data: bytes, end_total: int | None):
        """Send `data` at `s.sent`; `end_total` (the file's size) ends the upload. Returns the object's
        metadata when it ended it, None when the server holds the data and waits for more."""
        last = s.sent + len(data) - 1
        rng = (
            f"bytes */{end_total}"
            if not data
            else f"bytes {s.sent}-{last}/{end_total if end_total is not None else '*'}"
        )
        # the body's time on the wire counts too: a slow uplink (32 KB/s) must not time a chunk out
        wait_s = max(settings()["timeout_s"], 60.0, len(data) / (32 << 10) / 4)
        status, hdrs, body = self.b.call(
            "PUT", s.location, headers={"Content-Range": rng}, data=data, timeout_s=wait_s
        )
        if status == 404 or status == 410:
            raise RemoteMissing(s.key)  # the session is gone (expired, cancelled, or already finished)
        _status(status, self.url_text, body)
        if status == 308:
            held = hdrs.get("Range") or hdrs.get("range")
            kept = int(held.rsplit("-", 1)[1]) + 1 if held else 0
            if kept < s.sent or kept > s.sent + len(data):
                raise RemoteRetry(f"the server holds {kept} bytes of {s.key}, {s.sent + len(data)} were sent")
            s.md5.update(data[: kept - s.sent])
            s.sent = kept
            return None
        return json.loads(body) if body else {}

    def _send_body(self, bucket: str, s: _Session, *, overwrite: bool) -> None:
        """Every byte of `s` but its last piece; a failed chunk starts the file over in a new session."""
        cfg, failures = settings(), 0
        with open(s.path, "rb") as fh:
            while s.sent < s.body_end:
                fh.seek(s.sent)
                data = fh.read(min(CHUNK_BYTES, s.body_end - s.sent))
                try:
                    self._chunk(s, data, None)
                    failures = 0
                except (RemoteRetry, RemoteMissing) as exc:
                    failures += 1
                    if failures > cfg["retries"]:
                        raise CkptError(
                            f"uploading {s.key} failed {failures} times in a row: {exc}",
                            path=self.url_text,
                            hint="the server or the link is failing; nothing was committed; retry later",
                        ) from None
                    time.sleep(min(cfg["backoff_s"] * (2 ** (failures - 1)), 30.0))
                    self._cancel(s)
                    self._start(bucket, s, overwrite=overwrite)
                except RemoteDenied as exc:
                    raise UsageError(str(exc), path=self.url_text) from None

    def _finish(self, bucket: str, s: _Session) -> dict:
        """Send the last piece of `s`: the object appears. Its size and MD5 are checked."""
        with open(s.path, "rb") as fh:
            fh.seek(s.body_end)
            tail = fh.read(s.size - s.body_end)
        whole = s.md5.copy()
        whole.update(tail)
        want_md5 = base64.b64encode(whole.digest()).decode()
        attempts = [0]

        def go():
            attempts[0] += 1
            try:
                return self._chunk(s, tail, s.size)
            except RemoteMissing:
                if attempts[0] == 1:
                    raise CkptError(
                        f"the upload session of {s.key} was lost before it was finished",
                        path=self.url_text,
                        hint="rerun",
                    ) from None
                # an earlier try ended the upload but its answer was lost: the object says
                try:
                    return self.b.meta(bucket, s.key, self.url_text)
                except RemoteMissing:
                    raise CkptError(
                        f"the upload session of {s.key} was lost before it was finished",
                        path=self.url_text,
                        hint="rerun",
                    ) from None

        meta = self._retried(f"finishing the upload of {s.key}", go)
        if meta is None:
            raise CkptError(
                f"the server did not end the upload of {s.key} at its last byte", path=self.url_text
            )
        if int(meta.get("size", -1)) != s.size or (meta.get("md5Hash") and meta["md5Hash"] != want_md5):
            raise CkptError(
                f"{s.key} arrived as {meta.get('size')} bytes (md5 {meta.get('md5Hash')}), "
                f"{s.size} bytes (md5 {want_md5}) were sent",
                path=self.url_text,
                hint="the upload was corrupted on the way; rerun",
            )
        return meta

    def upload(self, url: RemoteUrl, files, *, overwrite: bool):
        from .upload import Uploaded, fetched_locally, fetched_note

        self.url_text = url.text
        bucket, prefix = split_bucket(url)
        old = (
            [
                o["name"]
                for o in self._retried(
                    "listing the output prefix", lambda: self.b.names(bucket, prefix + "/", url.text)
                )
            ]
            if prefix
            else []
        )
        if old and not overwrite:
            raise OutputExistsError(
                "already exists (objects under this prefix)",
                path=url.text,
                hint="pass --overwrite to replace it, or another output path",
            )
        files, fetched = fetched_locally(files)  # a remote input's unchanged object (set-lr's data files)
        sessions: list[_Session] = []
        try:
            for rel, path, size in files:
                s = _Session(f"{prefix}/{rel}" if rel else prefix, path, size)
                sessions.append(s)
                self._start(bucket, s, overwrite=overwrite)
                self._send_body(bucket, s, overwrite=overwrite)
        except BaseException:
            with signals_deferred():
                for s in sessions:
                    self._cancel(s)
            raise
        made: list[tuple[str, str]] = []
        with signals_deferred():  # the commit: each upload ended by its last piece, the markers last
            try:
                for s in sessions:
                    meta = self._finish(bucket, s)
                    made.append((s.key, str(meta.get("generation", ""))))
            except BaseException:
                self._undo(bucket, made, sessions, overwrite=overwrite)
                raise
            new = {s.key for s in sessions}
            for key in old:
                if key not in new:
                    self._retried(f"deleting the old {key}", lambda key=key: self._delete(bucket, key, None))
            self.committed = True
        return Uploaded(
            url.text,
            len(files),
            sum(s.size for s in sessions),
            "gcs resumable uploads, finished at the end" + fetched_note(fetched),
        )

    def _delete(self, bucket: str, key: str, generation: str | None) -> None:
        params = {"ifGenerationMatch": generation} if generation else None
        status, _h, body = self.b.call("DELETE", self.b.object_url(bucket, key), params=params)
        if status not in (404, 412):
            _status(status, self.url_text, body)

    def _undo(self, bucket: str, made, sessions, *, overwrite: bool) -> None:
        """A failure inside the commit burst: the objects it created are deleted (each at the generation it
        made, so nothing newer is touched) when they were new, the other sessions cancelled."""
        if not overwrite:
            for key, gen in made:
                with contextlib.suppress(Exception):
                    self._delete(bucket, key, gen or None)
        done = {k for k, _ in made}
        for s in sessions:
            if s.key not in done:
                self._cancel(s)
