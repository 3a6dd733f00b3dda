"""The remote protocols behind `io.remote`, each through its ecosystem's own client: list one directory
level, stat one path, and fetch a byte range of one object into a sink (streaming where the client
streams, so a broken body is resumed from the byte where it stopped).

    s3://     s3fs's aiobotocore client (botocore's credential chain, AWS_ENDPOINT_URL); ranges pinned by
              `IfMatch` on the ETag
    hf://     huggingface_hub (HfFileSystem for listings, the resolve endpoint for ranges; HF_TOKEN,
              HF_ENDPOINT): a repo read at the commit its revision had at open; a bucket's files by Xet hash
    gs://     gcsfs in version-aware mode: each object pinned by its generation, ranges through
              `cat_file(path, start, end)` of that generation (gcloud ADC, STORAGE_EMULATOR_HOST)
    http(s):// `io.remote_http`
    other     any installed fsspec protocol: `ls`, `info`, `cat_file(path, start, end)`

A backend addresses paths by their segments below the store's root (the bucket, the host, the repo), and
maps its client's failures onto `RemoteChanged` (the pinned identity is gone), `RemoteMissing`,
`RemoteDenied` (naming what to set) and `RemoteRetry` (transient). Listings come back raw: `io.remote`
validates them. Imported only when a URL is used; the packages are the `remote` extra."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Any

from ..core.errors import CkptError, UsageError
from .remote_url import RemoteChanged, RemoteDenied, RemoteMissing, RemoteRetry

__all__ = [
    "Backend",
    "FsspecBackend",
    "HfBackend",
    "Identity",
    "Listed",
    "S3Backend",
    "in_repo",
    "need",
    "run_sync",
    "s3_error",
]

EXTRA_HINT = "install the remote extra: pip install 'ckpt-tools[remote]'"
_AWS_VARS = (
    "set AWS_PROFILE (or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY; AWS_ENDPOINT_URL for another endpoint)"
)
_HF_VARS = "set HF_TOKEN (or run `hf auth login`) with a token that can read this repo"
GCS_CREDENTIALS_HINT = (
    "set GOOGLE_APPLICATION_CREDENTIALS to a service account key file, or run "
    "`gcloud auth application-default login` (STORAGE_EMULATOR_HOST for another endpoint)"
)


@dataclass(frozen=True)
class Identity:
    """What pins one version of an object: `kind` "etag" (S3, HTTP), "generation" (GCS), "commit" (a Hub
    repo's sha), "xet" (a Hub bucket file's hash), "mtime" (an HTTP Last-Modified, with the size), "none"
    (an HTTP server that sends neither: such an object may be read by one request only)."""

    kind: str
    value: str | None

    def __str__(self) -> str:
        return self.value or "(none)"


@dataclass(frozen=True)
class Listed:
    """One entry of a listing or a stat: a file (its size, identity and the backend's address of it, where
    the listing gives them; None where it does not: an index page) or a directory."""

    name: str
    is_dir: bool
    size: int | None = None
    identity: Identity | None = None
    ref: Any = None


def need(module: str, scheme: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UsageError(
            f"reading {scheme}:// needs the package {module.split('.')[0]}, which is not installed",
            hint=EXTRA_HINT,
        ) from None


def run_sync(loop, coro, timeout_s: float):
    """Run `coro` on fsspec's loop thread; a timeout or a dropped connection is RemoteRetry."""
    from fsspec.asyn import sync

    try:
        return sync(loop, asyncio.wait_for, coro, timeout_s)
    except TimeoutError as exc:
        raise RemoteRetry(f"timed out ({type(exc).__name__})") from None


class Backend:
    """One store (a bucket, a host, a repo at one commit). `hides_names`: a listing may leave names out
    (an HTTP index page hides dotfiles): a name looked up and not listed is probed. `stat_first`: a path
    not yet known is stat'ed before it is listed (listing a file URL over HTTP would fetch it)."""

    scheme = ""
    hides_names = False
    stat_first = False
    client_retries = False  # the client retries transient failures itself (then io.remote does not)
    retry_grace_s = 0.0  # what the client's own retries may add to a read's deadline

    def list_dir(self, parts: tuple[str, ...], shown: str) -> list[Listed]:
        """The entries directly inside `parts` (names as the server gives them); RemoteMissing when it
        holds nothing (not a directory)."""
        raise NotImplementedError

    def stat(self, parts: tuple[str, ...], shown: str) -> Listed | None:
        """The file or directory at `parts`, None when nothing is there."""
        raise NotImplementedError

    def fetch(self, obj, start: int, end: int, sink, timeout_s: float, deadline_s: float) -> None:
        """Bytes [start, end) of `obj` (a RemoteObject), as pinned, passed to `sink` as they arrive."""
        raise NotImplementedError

    def identity_now(self, obj) -> Identity | None:
        """The object's identity now (Identity("gone", None) when deleted), None when it cannot be told."""
        return None


# ------------------------------------------------------------------------------------ S3
class S3Backend(Backend):
    """s3fs's aiobotocore client; ranges pinned by `IfMatch` on the ETag."""

    scheme = "s3"

    def __init__(self, bucket: str = ""):
        s3fs = need("s3fs", "s3")
        self.bucket = bucket
        self.fs = s3fs.S3FileSystem(skip_instance_cache=True, version_aware=False)
        self.endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None

    def client(self):
        from fsspec.asyn import sync

        try:
            return sync(self.fs.loop, self.fs.set_session)
        except Exception as exc:
            raise s3_error(exc, "") from None

    def _call(self, coro, shown: str):
        try:
            return run_sync(self.fs.loop, coro, 60)
        except RemoteRetry:
            raise
        except Exception as exc:
            raise s3_error(exc, shown) from None

    def list_dir(self, parts, shown):
        prefix = "/".join(parts) + "/" if parts else ""
        client, out, token = self.client(), [], None
        while True:
            kw = {"Bucket": self.bucket, "Prefix": prefix, "Delimiter": "/"}
            if token:
                kw["ContinuationToken"] = token
            page = self._call(client.list_objects_v2(**kw), shown)
            for o in page.get("Contents", []):
                name = o["Key"][len(prefix) :]
                if name:  # (`dir/` itself: a folder marker a console makes, no entry)
                    out.append(Listed(name, False, o.get("Size"), Identity("etag", o.get("ETag")), o["Key"]))
            out += [Listed(p["Prefix"][len(prefix) : -1], True) for p in page.get("CommonPrefixes", [])]
            if not page.get("IsTruncated"):
                break
            token = page["NextContinuationToken"]
        if not out:
            raise RemoteMissing(shown)
        return out

    def stat(self, parts, shown):
        key = "/".join(parts)
        if key:
            try:
                head = self._call(self.client().head_object(Bucket=self.bucket, Key=key), shown)
                return Listed(parts[-1], False, head["ContentLength"], Identity("etag", head["ETag"]), key)
            except RemoteMissing:
                pass
        try:
            self.list_dir(parts, shown)
        except RemoteMissing:
            return None
        return Listed(parts[-1] if parts else self.bucket, True)

    def fetch(self, obj, start, end, sink, timeout_s, deadline_s):
        client = self.client()

        async def get():
            resp = await client.get_object(
                Bucket=self.bucket, Key=obj.ref, Range=f"bytes={start}-{end - 1}", IfMatch=obj.identity.value
            )
            body = resp["Body"]
            try:
                while True:
                    chunk = await asyncio.wait_for(body.read(1 << 20), timeout_s)
                    if not chunk:
                        break
                    sink(chunk)
            finally:
                body.close()

        try:
            run_sync(self.fs.loop, get(), deadline_s)
        except (RemoteRetry, RemoteChanged):
            raise
        except Exception as exc:
            raise s3_error(exc, obj.url) from None

    def identity_now(self, obj):
        try:
            return Identity(
                "etag",
                self._call(self.client().head_object(Bucket=self.bucket, Key=obj.ref), obj.url)["ETag"],
            )
        except RemoteMissing:
            return Identity("gone", None)
        except Exception:
            return None


def s3_error(exc: Exception, where: str) -> Exception:
    name = type(exc).__name__
    if name in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
        return RemoteDenied(f"no AWS credentials found for {where or 's3'}: {_AWS_VARS}")
    resp = getattr(exc, "response", None) or {}
    code = str(resp.get("Error", {}).get("Code", ""))
    status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
    if code in ("PreconditionFailed", "412") or status == 412:
        return RemoteChanged("another ETag")
    if code in ("NoSuchKey", "NoSuchBucket", "404", "NotFound") or status == 404:
        return RemoteMissing(where)
    if code in (
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "AccessDenied",
        "403",
        "ExpiredToken",
        "InvalidToken",
    ) or status in (401, 403):
        return RemoteDenied(f"S3 refused the credentials for {where} ({code or status}): {_AWS_VARS}")
    return RemoteRetry(f"{name}: {exc}")


# ------------------------------------------------------------------------------------ Hugging Face
class HfBackend(Backend):
    """huggingface_hub: a repo (`org/name`, `datasets/org/name`, `spaces/org/name`, with `@revision`) read
    at the commit its revision had when it was first listed, or a bucket (`buckets/ns/name`) whose files
    are pinned by their Xet hash (checked on every range's answer and before an output is committed)."""

    scheme = "hf"
    stat_first = True

    def __init__(self, root: str):
        self.hf = need("huggingface_hub", "hf")
        self.fs = self.hf.HfFileSystem(
            skip_instance_cache=True, endpoint=os.environ.get("HF_ENDPOINT") or None
        )
        repo, _, rev = root.partition("@")
        head = repo.split("/")
        self.bucket = head[0] == "buckets"
        self.repo_type = {"datasets": "dataset", "spaces": "space", "buckets": "bucket"}.get(head[0], "model")
        self.repo_id = "/".join(head[1:] if self.repo_type != "model" else head)
        self.revision = rev or None
        self.root = root
        self._sha: str | None = None

    def sha(self, shown: str) -> str:
        """The commit the revision names, resolved once (every read of this store is made at it)."""
        if self._sha is None:
            try:
                self._sha = self.fs._api.repo_info(
                    self.repo_id, repo_type=self.repo_type, revision=self.revision
                ).sha
            except Exception as exc:
                raise _hf_error(exc, shown, self.hf.errors) from None
        return self._sha

    def _path(self, parts, shown: str) -> str:
        kind = {"dataset": "datasets/", "space": "spaces/"}.get(self.repo_type, "")
        return f"{kind}{self.repo_id}@{self.sha(shown)}" + ("/" + "/".join(parts) if parts else "")

    def _bucket_files(self, parts, shown: str) -> list:
        prefix = "/".join(parts)
        try:
            got = self.fs._api.list_bucket_tree(self.repo_id, prefix or None, recursive=True)
            return [f for f in got if getattr(f, "type", "file") == "file"]
        except Exception as exc:
            raise _hf_error(exc, shown, self.hf.errors) from None

    def list_dir(self, parts, shown):
        if self.bucket:
            return _levelled(
                parts,
                [(f.path, f.size, Identity("xet", f.xet_hash)) for f in self._bucket_files(parts, shown)],
                shown,
            )
        try:
            found = self.fs.ls(self._path(parts, shown), detail=True, refresh=True)
        except FileNotFoundError:
            raise RemoteMissing(shown) from None
        except (CkptError, RemoteMissing, RemoteRetry, RemoteDenied):
            raise
        except Exception as exc:
            raise _hf_error(exc, shown, self.hf.errors) from None
        out = []
        for info in found:
            name = str(info["name"]).rstrip("/").rsplit("/", 1)[-1]
            where = "/".join((*parts, name))
            if info.get("type") == "directory":
                out.append(Listed(name, True))
            else:
                out.append(Listed(name, False, info.get("size"), Identity("commit", self._sha), where))
        if not out:
            raise RemoteMissing(shown)
        return out

    def stat(self, parts, shown):
        if self.bucket:
            files = self._bucket_files(parts, shown)
            key = "/".join(parts)
            for f in files:
                if f.path == key:
                    return Listed(parts[-1], False, f.size, Identity("xet", f.xet_hash), key)
            return Listed(parts[-1] if parts else self.repo_id, True) if files else None
        try:
            info = self.fs.info(self._path(parts, shown), refresh=True)
        except FileNotFoundError:
            return None
        except (CkptError, RemoteMissing, RemoteRetry, RemoteDenied):
            raise
        except Exception as exc:
            raise _hf_error(exc, shown, self.hf.errors) from None
        name = parts[-1] if parts else self.repo_id
        if info.get("type") == "directory":
            return Listed(name, True)
        return Listed(name, False, info.get("size"), Identity("commit", self._sha), "/".join(parts))

    def fetch(self, obj, start, end, sink, timeout_s, deadline_s):
        from urllib.parse import quote

        from huggingface_hub.utils import get_session

        if self.bucket:
            url = f"{self.fs.endpoint}/buckets/{self.repo_id}/resolve/{quote(obj.ref)}"
        else:
            url = self.hf.hf_hub_url(
                self.repo_id, obj.ref, repo_type=self.repo_type, revision=self._sha, endpoint=self.fs.endpoint
            )
        headers = {
            **self.fs._api._build_hf_headers(),
            "Range": f"bytes={start}-{end - 1}",
            "Accept-Encoding": "identity",
        }
        try:
            with get_session().stream(
                "GET", url, headers=headers, follow_redirects=True, timeout=min(timeout_s, deadline_s)
            ) as r:
                if r.status_code in (401, 403):
                    raise RemoteDenied(f"the Hub refused access to {obj.url}: {_HF_VARS}")
                http_status(r.status_code, obj.url)
                now = r.headers.get("X-Xet-Hash")
                if self.bucket and now and now != obj.identity.value:  # replaced since it was listed
                    raise RemoteChanged(now)
                if r.status_code != 206 and not (r.status_code == 200 and start == 0 and end == obj.size):
                    raise RemoteRetry(f"HTTP {r.status_code} to a byte-range request")
                for chunk in r.iter_bytes(1 << 20):
                    sink(chunk)
        except (RemoteRetry, RemoteChanged, RemoteMissing, RemoteDenied):
            raise
        except Exception as exc:
            raise _hf_error(exc, obj.url, self.hf.errors) from None

    def identity_now(self, obj):
        if not self.bucket:
            return None  # a repo file is read at its pinned commit: immutable
        try:
            got = list(self.fs._api.get_bucket_paths_info(self.repo_id, [obj.ref]))
        except Exception:
            return None
        return Identity("xet", got[0].xet_hash) if got else Identity("gone", None)


def in_repo(name: str) -> str:
    """`name` (as HfFileSystem lists it) -> the path inside the repo."""
    head = name.split("/")
    skip = 2 + (1 if head[0] in ("datasets", "spaces") else 0)
    return "/".join(head[skip:])


def _levelled(parts, files, shown: str) -> list[Listed]:
    """One level of a recursive listing [(path below the store's root, size, identity)] under `parts`: its
    files, and a directory per first segment of the deeper ones (names as listed: checked by io.remote)."""
    prefix = "/".join(parts) + "/" if parts else ""
    out: list[Listed] = []
    dirs: dict[str, Listed] = {}
    for path, size, ident in files:
        if not path.startswith(prefix):
            continue
        head, sep, _ = path[len(prefix) :].partition("/")
        if sep:
            dirs.setdefault(head, Listed(head, True))
        else:
            out.append(Listed(head, False, size, ident, path))
    if not out and not dirs:
        raise RemoteMissing(shown)
    return out + list(dirs.values())


def http_status(status: int, where: str, etag=None) -> None:
    """An HTTP status mapped onto the remote failures (2xx and 3xx pass)."""
    if status == 412:
        raise RemoteChanged(etag or "another version")
    if status == 404:
        raise RemoteMissing(where)
    if status in (401, 403):
        raise RemoteDenied(
            f"the server refused access ({status}) to {where}: put the credentials in the URL "
            "(user:password@host, or the query) or in fsspec's config"
        )
    if status in (408, 429) or status >= 500:
        raise RemoteRetry(f"HTTP {status}")


def _hf_error(exc: Exception, where: str, errors) -> Exception:
    from ..core.errors import MissingPathError

    resp = getattr(exc, "response", None)
    status = getattr(resp, "status_code", None)
    cause = exc.__cause__
    if (
        isinstance(exc, errors.GatedRepoError)
        or status in (401, 403)
        or getattr(getattr(cause, "response", None), "status_code", None) in (401, 403)
    ):
        return UsageError(
            f"the Hub refused access to {where} (no such repo, or it needs a token): {_HF_VARS}"
        )
    if isinstance(exc, errors.RevisionNotFoundError) or isinstance(cause, errors.RevisionNotFoundError):
        return MissingPathError(
            where, hint="the repo has no such revision: give a branch, a tag or a commit after '@'"
        )
    if isinstance(
        exc, (errors.RepositoryNotFoundError, getattr(errors, "BucketNotFoundError", ()))
    ) or isinstance(cause, errors.RepositoryNotFoundError):
        return MissingPathError(where, hint="no such repo (a dataset's URL is hf://datasets/org/name/...)")
    if status == 404 or isinstance(exc, FileNotFoundError):
        return RemoteMissing(where)
    return RemoteRetry(f"{type(exc).__name__}: {exc}")


# --------------------------------------------------------------------------------- gs://, any fsspec protocol
@contextlib.contextmanager
def _quiet_auth():
    """google-auth logs each failed probe (a metadata server that is not there) as a warning; the CLI's one
    line on a refused request says what to set instead."""
    names = (
        "google.auth",
        "google.auth.compute_engine._metadata",
        "google.auth._default",
        "gcsfs",
        "gcsfs.credentials",
        "gcsfs.retry",
    )
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


class FsspecBackend(Backend):
    """An installed fsspec protocol: gs:// through gcsfs in version-aware mode (each object pinned by its
    generation, every range read at it: a replaced object's bytes are never served), any other by its
    `info()`'s version field (re-checked before an output is committed). Retries are the client's own."""

    client_retries = True
    retry_grace_s = 40.0  # gcsfs: 6 tries, waiting 1-2, 2-3, 4-5, 8-9, 16-17 s between them

    def __init__(self, scheme: str, root: str = ""):
        self.scheme = "gs" if scheme == "gcs" else scheme
        self.root = root
        # gs://: gcsfs's JSON-API filesystem itself, not the default ExtendedGcsFileSystem (gcsfs >= 2025.x),
        # which asks the Storage Control gRPC API each bucket's layout (zonal/HNS) before any read
        fsspec = need("gcsfs.core" if self.scheme == "gs" else "fsspec", scheme)
        try:
            with _quiet_auth():
                if self.scheme == "gs":
                    import aiohttp

                    self.fs = fsspec.GCSFileSystem(skip_instance_cache=True, version_aware=True)
                    self.timeout: Any = aiohttp.ClientTimeout
                else:
                    self.fs = fsspec.filesystem(scheme, skip_instance_cache=True)
        except ImportError as exc:
            raise UsageError(f"cannot read {scheme}:// URLs: {exc}", hint=EXTRA_HINT) from None
        except Exception as exc:  # a credentials file that cannot be read or parsed
            raise UsageError(
                f"the credentials for {scheme}:// could not be loaded: {exc}",
                hint=GCS_CREDENTIALS_HINT if self.scheme == "gs" else None,
            ) from None

    def _path(self, parts) -> str:
        return "/".join((self.root, *parts))

    def _identity(self, info: dict) -> Identity | None:
        if self.scheme == "gs":
            return Identity("generation", str(info["generation"])) if info.get("generation") else None
        for k in ("ETag", "etag", "md5Hash", "mtime", "LastModified", "last_modified"):
            if info.get(k) is not None:
                return Identity("etag" if "tag" in k.lower() else "mtime", str(info[k]))
        return None

    def _run(self, fn, *args, **kw):
        """`fn(*args, **kw)` (an fsspec call), its failures mapped (a missing path is RemoteMissing)."""
        try:
            with _quiet_auth():
                return fn(*args, **kw)
        except FileNotFoundError:
            raise RemoteMissing(str(args[0]) if args else "") from None
        except RemoteRetry:
            raise
        except PermissionError as exc:
            raise RemoteDenied(self._denied(exc)) from None
        except OSError as exc:
            text = str(exc)
            if (
                "Forbidden" in text
                or "401" in text
                or "Unauthorized" in text
                or "Invalid Credentials" in text
            ):
                raise RemoteDenied(self._denied(exc)) from None
            raise RemoteRetry(f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}") from None
        except Exception as exc:
            code = getattr(exc, "code", None)
            if code in (401, 403):
                raise RemoteDenied(self._denied(exc, code)) from None
            if isinstance(code, int):  # gcsfs's HttpError, after its own retries
                raise RemoteRetry(f"HTTP {code}") from None
            raise RemoteRetry(
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            ) from None

    def _denied(self, exc, code=None) -> str:
        if self.scheme == "gs":
            return f"Google Cloud Storage refused access ({code or 401}): {GCS_CREDENTIALS_HINT}"
        return f"access refused ({type(exc).__name__}): {str(exc).splitlines()[0] if str(exc) else ''}"

    def list_dir(self, parts, shown):
        try:
            found = self._run(self.fs.ls, self._path(parts), detail=True, refresh=True)
        except RemoteMissing:
            raise RemoteMissing(shown) from None
        # as the filesystem names its entries (memory:// lists `/out/x` for `out`)
        base = self.fs._strip_protocol(f"{self.scheme}://{self._path(parts)}").rstrip("/")
        out = []
        for info in found:
            full, is_dir = str(info["name"]), info.get("type") == "directory"
            full = full[:-1] if is_dir and full.endswith("/") else full  # `dir/`'s one slash, no more
            if not is_dir and full in (base, base + "/"):
                continue  # a placeholder object naming the directory (`dir/`)
            # a name is what follows `base/` as listed (`..`, empty or holding `/`: io.remote refuses it);
            # gcsfs lists a prefix `dir//` (an empty segment) as `dir` itself: an empty name
            name = "" if full == base else full[len(base) + 1 :] if full.startswith(base + "/") else full
            if is_dir:
                out.append(Listed(name, True))
            else:
                out.append(Listed(name, False, info.get("size"), self._identity(info), full))
        if not out:
            raise RemoteMissing(shown)
        return out

    def stat(self, parts, shown):
        try:
            info = self._run(self.fs.info, self._path(parts), refresh=True)
        except RemoteMissing:
            return None
        name = parts[-1] if parts else self.root
        if info.get("type") == "directory":
            return Listed(name, True)
        return Listed(name, False, info.get("size"), self._identity(info), self._path(parts))

    def fetch(self, obj, start, end, sink, timeout_s, deadline_s):
        kw: dict[str, Any] = {}
        if self.scheme == "gs":  # that generation's bytes, or 404 once it was replaced
            kw["generation"] = obj.identity.value if obj.identity is not None else None
            self.fs.requests_timeout = self.timeout(sock_connect=timeout_s, sock_read=timeout_s)
        try:
            if getattr(self.fs, "async_impl", False):  # on the client's loop, within the read's deadline
                data = self._run(
                    run_sync, self.fs.loop, self.fs._cat_file(obj.ref, start=start, end=end, **kw), deadline_s
                )
            else:
                data = self._run(self.fs.cat_file, obj.ref, start=start, end=end, **kw)
            sink(data)
        except RemoteMissing:
            now = self.identity_now(obj)
            if now is not None and now.kind != "gone":
                raise RemoteChanged(str(now)) from None
            raise RemoteMissing(obj.url) from None

    def identity_now(self, obj):
        try:
            return self._identity(self._run(self.fs.info, obj.ref, refresh=True))
        except RemoteMissing:
            return Identity("gone", None)
        except Exception:
            return None
