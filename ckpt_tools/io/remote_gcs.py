"""gs:// (Google Cloud Storage) through the GCS JSON API: reads by range for `io.remote` (writes go
through gcsfs: `io.upload_fsspec`). gcsfs supplies what each ecosystem keeps for itself: the credentials
(gcloud application-default credentials: GOOGLE_APPLICATION_CREDENTIALS, `gcloud auth
application-default login`, a VM's service account; none at all is anonymous access, for public
buckets), the endpoint (STORAGE_EMULATOR_HOST for another server) and its aiohttp session. The requests
themselves are made here, so that every failure comes back as a status (no client-side retry layer
under `io.remote`'s own) and every read can be pinned.

Reads: each object's generation is pinned when the URL is listed and every range request names it
(`generation=G`): the server sends that version's bytes or none (404 once it was replaced, on a bucket
without versioning), so an object rewritten mid-read is `RemoteChanged`, never a mix of two versions; an
answer carrying another `X-Goog-Generation` is refused as well. Retries, backoff and resuming a broken
body from the byte where it stopped are `io.remote`'s.
"""

from __future__ import annotations

import contextlib
import json
import logging
from urllib.parse import quote

from ..core.errors import CkptError, MissingPathError, UsageError
from .remote_backends import Backend, run_sync
from .remote_url import RemoteChanged, RemoteDenied, RemoteMissing, RemoteRetry, RemoteUrl

__all__ = ["GCS_CREDENTIALS_HINT", "GcsBackend"]

GCS_CREDENTIALS_HINT = (
    "set GOOGLE_APPLICATION_CREDENTIALS to a service account key file, or run "
    "`gcloud auth application-default login` (STORAGE_EMULATOR_HOST for another endpoint)"
)


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
