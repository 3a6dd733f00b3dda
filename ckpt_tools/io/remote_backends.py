"""The remote protocols behind `io.remote`: list a URL (each object with its size and pinned version)
and fetch a byte range of one object into a sink, streaming, so that a broken body is resumed from
the byte where it stopped. Each backend maps its protocol's failures onto `RemoteChanged` (the pinned
version is gone), `RemoteMissing`, `RemoteDenied` (naming the variable to set) and `RemoteRetry`
(transient). Imported only when a URL is used; the packages are the `remote` extra."""

from __future__ import annotations

import asyncio
import os
import posixpath

from ..core.errors import MissingPathError, UsageError
from .remote_url import RemoteChanged, RemoteDenied, RemoteMissing, RemoteRetry, RemoteUrl

__all__ = [
    "Backend",
    "FsspecBackend",
    "HfBackend",
    "HttpBackend",
    "S3Backend",
    "backend_for",
    "in_repo",
    "run_sync",
    "s3_error",
]

_EXTRA_HINT = "install the remote extra: pip install 'ckpt-tools[remote]'"
_AWS_VARS = (
    "set AWS_PROFILE (or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY; AWS_ENDPOINT_URL for another endpoint)"
)
_HF_VARS = "set HF_TOKEN (or run `hf auth login`) with a token that can read this repo"


def _need(module: str, scheme: str):
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise UsageError(
            f"reading {scheme}:// needs the package {module.split('.')[0]}, which is not installed",
            hint=_EXTRA_HINT,
        ) from None


class Backend:
    scheme = ""

    def list(self, url: RemoteUrl) -> list[tuple[str, int, str | None, object]]:
        raise NotImplementedError

    def fetch(self, obj, start: int, end: int, sink, timeout_s: float) -> None:
        raise NotImplementedError

    def version_now(self, obj) -> str | None:
        return None


def backend_for(url: RemoteUrl) -> Backend:
    if url.scheme == "s3":
        return S3Backend()
    if url.scheme in ("http", "https"):
        return HttpBackend()
    if url.scheme == "hf":
        return HfBackend()
    if url.scheme in ("gs", "gcs"):
        from .remote_gcs import GcsBackend

        return GcsBackend()
    return FsspecBackend(url.scheme)


def run_sync(loop, coro, timeout_s: float):
    """Run `coro` on fsspec's loop thread; a timeout or a dropped connection is RemoteRetry."""
    from fsspec.asyn import sync

    try:
        return sync(loop, asyncio.wait_for, coro, timeout_s * 4 + 5)
    except TimeoutError as exc:
        raise RemoteRetry(f"timed out ({type(exc).__name__})") from None


# ------------------------------------------------------------------------------------ S3
class S3Backend(Backend):
    """s3fs's client (credentials and AWS_ENDPOINT_URL from botocore's own chain); reads pinned by
    `IfMatch` on the ETag (and VersionId where the bucket is versioned)."""

    scheme = "s3"

    def __init__(self):
        s3fs = _need("s3fs", "s3")
        self.fs = s3fs.S3FileSystem(skip_instance_cache=True, version_aware=False)

    def _client(self):
        from fsspec.asyn import sync

        try:
            return sync(self.fs.loop, self.fs.set_session)
        except Exception as exc:
            raise s3_error(exc, "") from None

    def list(self, url):
        path = url.path
        client = self._client()
        bucket, _, key = path.partition("/")
        out = []
        try:
            try:
                head = run_sync(self.fs.loop, client.head_object(Bucket=bucket, Key=key), 60) if key else None
            except Exception as exc:
                err = s3_error(exc, url.text)
                if not isinstance(err, RemoteMissing):
                    raise err from None
                head = None
            if head is not None:
                return [("", head["ContentLength"], head["ETag"], (bucket, key))]
            prefix = key + "/" if key else ""
            token = None
            while True:
                kw = {"Bucket": bucket, "Prefix": prefix}
                if token:
                    kw["ContinuationToken"] = token
                page = run_sync(self.fs.loop, client.list_objects_v2(**kw), 60)
                for o in page.get("Contents", []):
                    rel = o["Key"][len(prefix) :]
                    if rel and not rel.endswith("/"):
                        out.append((rel, o["Size"], o["ETag"], (bucket, o["Key"])))
                if not page.get("IsTruncated"):
                    break
                token = page["NextContinuationToken"]
        except (RemoteDenied, RemoteRetry):
            raise
        except RemoteMissing:
            out = []
        except Exception as exc:
            raise s3_error(exc, url.text) from None
        if not out:
            raise MissingPathError(url.text)
        return out

    def fetch(self, obj, start, end, sink, timeout_s):
        bucket, key = obj.ref
        client = self._client()

        async def get():
            resp = await client.get_object(
                Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", IfMatch=obj.version
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
            run_sync(self.fs.loop, get(), timeout_s)
        except (RemoteRetry, RemoteChanged):
            raise
        except Exception as exc:
            raise s3_error(exc, obj.url) from None

    def version_now(self, obj):
        bucket, key = obj.ref
        try:
            return run_sync(self.fs.loop, self._client().head_object(Bucket=bucket, Key=key), 60)["ETag"]
        except Exception as exc:
            err = s3_error(exc, obj.url)
            return "(deleted)" if isinstance(err, RemoteMissing) else None


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
    if (
        isinstance(exc, (OSError, asyncio.TimeoutError))
        or name
        in (
            "ReadTimeoutError",
            "ConnectTimeoutError",
            "EndpointConnectionError",
            "ResponseStreamingError",
            "IncompleteReadError",
            "ClientPayloadError",
            "ServerDisconnectedError",
            "ConnectionClosedError",
        )
        or (status or 0) >= 500
        or status == 429
    ):
        return RemoteRetry(f"{name}: {exc}")
    return RemoteRetry(f"{name}: {exc}")


# ------------------------------------------------------------------------------------ HTTP(S)
class HttpBackend(Backend):
    """fsspec's HTTP filesystem (its aiohttp session): a file URL, or a directory URL whose page lists
    its entries as links (a plain index page). Reads pinned by `If-Match` on the ETag seen at open."""

    scheme = "http"

    def __init__(self):
        http = _need("fsspec.implementations.http", "http")
        self.fs = http.HTTPFileSystem(skip_instance_cache=True)

    def _info(self, u: str) -> dict:
        try:
            return self.fs.info(u)
        except FileNotFoundError as exc:  # fsspec says "not found" for any failed HEAD and GET: a 503 too
            cause = exc.__cause__
            if cause is not None and getattr(cause, "status", 404) != 404:
                raise _http_error(cause, u) from None
            if cause is not None and not hasattr(cause, "status"):
                raise RemoteRetry(f"{type(cause).__name__}: {cause}") from None
            raise RemoteMissing(u) from None
        except Exception as exc:
            raise _http_error(exc, u) from None

    def list(self, url):
        base = url.text
        try:
            info = self._info(base)
        except RemoteMissing:
            raise MissingPathError(base) from None
        if not (base.endswith("/") or str(info.get("mimetype", "")).startswith("text/html")):
            return [("", int(info["size"]), info.get("ETag"), base)]
        out, todo = [], [base.rstrip("/") + "/"]
        while todo:
            d = todo.pop()
            try:
                links = self.fs.ls(d, detail=False)
            except Exception as exc:
                raise _http_error(exc, d) from None
            for link in sorted(links):
                if not link.startswith(base.rstrip("/") + "/"):
                    continue
                if link.endswith("/"):
                    todo.append(link)
                    continue
                i = self._info(link)
                out.append((link[len(base.rstrip("/")) + 1 :], int(i["size"]), i.get("ETag"), link))
        if not out:
            raise MissingPathError(base)
        return out

    def fetch(self, obj, start, end, sink, timeout_s):
        import aiohttp

        async def get():
            session = await self.fs.set_session()
            headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
            if obj.version:
                headers["If-Match"] = obj.version
            timeout = aiohttp.ClientTimeout(sock_connect=timeout_s, sock_read=timeout_s)
            async with session.get(obj.ref, headers=headers, timeout=timeout) as r:
                _http_status(r.status, obj.url, r.headers.get("ETag"))
                if r.status != 206 and not (r.status == 200 and start == 0 and end == obj.size):
                    raise UsageError(
                        f"the server answered a byte-range request with {r.status}, not 206",
                        path=obj.url,
                        hint="the server must serve HTTP Range requests",
                    )
                async for chunk in r.content.iter_chunked(1 << 20):
                    sink(chunk)

        try:
            run_sync(self.fs.loop, get(), timeout_s)
        except (RemoteRetry, RemoteChanged, RemoteMissing, RemoteDenied, UsageError):
            raise
        except Exception as exc:
            raise _http_error(exc, obj.url) from None

    def version_now(self, obj):
        try:
            return self.fs.info(obj.ref).get("ETag")
        except FileNotFoundError:
            return "(deleted)"
        except Exception:
            return None


def _http_status(status: int, where: str, etag=None) -> None:
    if status == 412:
        raise RemoteChanged(etag or "another ETag")
    if status == 404:
        raise RemoteMissing(where)
    if status in (401, 403):
        raise RemoteDenied(
            f"the server refused access ({status}) to {where}: put the credentials in the URL's "
            "query or in fsspec's config (FSSPEC_HTTP_HEADERS is not read)"
        )
    if status == 429 or status >= 500:
        raise RemoteRetry(f"HTTP {status}")


def _http_error(exc: Exception, where: str) -> Exception:
    status = getattr(exc, "status", None)
    if isinstance(status, int):
        try:
            _http_status(status, where)
        except Exception as mapped:
            return mapped
    if isinstance(exc, FileNotFoundError):
        return RemoteMissing(where)
    return RemoteRetry(f"{type(exc).__name__}: {exc}")


# ------------------------------------------------------------------------------------ Hugging Face
class HfBackend(Backend):
    """huggingface_hub's HfFileSystem (HF_TOKEN / `hf auth login`, HF_ENDPOINT): a repo's revision resolved
    to its commit at open and every read made at that commit (an immutable snapshot); a bucket's files
    (hf://buckets/ns/name/path) listed through the bucket tree API, each pinned by its Xet hash (checked
    on every read's answer and before an output is committed)."""

    scheme = "hf"

    def __init__(self):
        hf = _need("huggingface_hub", "hf")
        self.hf = hf
        self.fs = hf.HfFileSystem(skip_instance_cache=True, endpoint=os.environ.get("HF_ENDPOINT") or None)

    def list(self, url):
        errors = self.hf.errors
        if url.path.startswith("buckets/"):
            return self._list_bucket(url)
        try:
            res = self.fs.resolve_path(url.path)
            sha = self.fs._api.repo_info(res.repo_id, repo_type=res.repo_type, revision=res.revision).sha
            found = self.fs.find(_with_revision(res, sha), detail=True)
        except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError, FileNotFoundError) as exc:
            cause = exc if isinstance(exc, errors.HfHubHTTPError) else exc.__cause__
            if getattr(getattr(cause, "response", None), "status_code", None) in (401, 403):
                raise UsageError(
                    f"the Hub refused access to {url.text} (no such repo, or it needs a token): {_HF_VARS}"
                ) from None
            raise MissingPathError(url.text, hint=_hf_missing_hint(exc, cause, errors)) from None
        except UsageError:
            raise
        except Exception as exc:
            raise _hf_error(exc, url.text) from None
        out = []
        prefix = res.path_in_repo.strip("/")
        for name, info in found.items():
            if info.get("type") != "file":
                continue
            where = in_repo(name)
            rel = "" if where == prefix else where[len(prefix) + 1 :] if prefix else where
            out.append((rel, int(info["size"]), sha, (res.repo_id, res.repo_type, sha, where)))
        if not out:
            raise MissingPathError(url.text)
        return out

    def _list_bucket(self, url):
        """hf://buckets/ns/name[/prefix]: every file under the prefix (or the file itself), each pinned by
        its Xet hash (a bucket has no commits: each file is one content-addressed object)."""
        parts = url.path.split("/")
        if len(parts) < 3 or not parts[1] or not parts[2]:
            raise UsageError("a bucket URL is hf://buckets/NAMESPACE/NAME[/PATH]", path=url.text)
        bucket_id, prefix = f"{parts[1]}/{parts[2]}", "/".join(parts[3:]).strip("/")
        try:
            self.fs._api.bucket_info(bucket_id)
            found = [
                f
                for f in self.fs._api.list_bucket_tree(bucket_id, prefix or None, recursive=True)
                if f.type == "file" and (not prefix or f.path == prefix or f.path.startswith(prefix + "/"))
            ]
        except self.hf.errors.HfHubHTTPError as exc:
            status = getattr(getattr(exc, "response", None), "status_code", None)
            if status in (401, 403):
                raise UsageError(f"the Hub refused access to {url.text}: {_HF_VARS}") from None
            if status == 404 or type(exc).__name__ == "BucketNotFoundError":
                raise MissingPathError(url.text) from None
            raise _hf_error(exc, url.text) from None
        except Exception as exc:
            raise _hf_error(exc, url.text) from None
        out = [
            (
                "" if f.path == prefix else f.path[len(prefix) + 1 :] if prefix else f.path,
                int(f.size),
                f.xet_hash,
                (bucket_id, "bucket", f.xet_hash, f.path),
            )
            for f in found
        ]
        if not out:
            raise MissingPathError(url.text)
        return out

    def version_now(self, obj):
        repo_id, repo_type, _pinned, in_repo = obj.ref
        if repo_type != "bucket":
            return None  # a repo file is read at its pinned commit: immutable
        try:
            got = list(self.fs._api.get_bucket_paths_info(repo_id, [in_repo]))
        except Exception:
            return None
        return got[0].xet_hash if got else "(deleted)"

    def fetch(self, obj, start, end, sink, timeout_s):
        repo_id, repo_type, sha, in_repo = obj.ref
        from urllib.parse import quote

        from huggingface_hub.utils import get_session

        if repo_type == "bucket":
            url = f"{self.fs.endpoint}/buckets/{repo_id}/resolve/{quote(in_repo)}"
        else:
            url = self.hf.hf_hub_url(
                repo_id, in_repo, repo_type=repo_type, revision=sha, endpoint=self.fs.endpoint
            )
        headers = {
            **self.fs._api._build_hf_headers(),
            "Range": f"bytes={start}-{end - 1}",
            "Accept-Encoding": "identity",
        }
        try:
            with get_session().stream(
                "GET", url, headers=headers, follow_redirects=True, timeout=timeout_s
            ) as r:
                if r.status_code in (401, 403):
                    raise RemoteDenied(f"the Hub refused access to {obj.url}: {_HF_VARS}")
                _http_status(r.status_code, obj.url)
                now = r.headers.get("X-Xet-Hash")
                if repo_type == "bucket" and now and now != sha:  # the file was replaced since it was listed
                    raise RemoteChanged(now)
                if r.status_code != 206 and not (r.status_code == 200 and start == 0 and end == obj.size):
                    raise RemoteRetry(f"HTTP {r.status_code} to a byte-range request")
                for chunk in r.iter_bytes(1 << 20):
                    sink(chunk)
        except (RemoteRetry, RemoteChanged, RemoteMissing, RemoteDenied):
            raise
        except Exception as exc:
            raise _hf_error(exc, obj.url) from None


def _with_revision(res, sha: str) -> str:
    res = type(res)(res.repo_type, res.repo_id, sha, res.path_in_repo)
    return res.unresolve()


def in_repo(name: str) -> str:
    """`name` (as HfFileSystem lists it) -> the path inside the repo."""
    head = name.split("/")
    skip = 2 + (1 if head[0] in ("datasets", "spaces") else 0)
    return "/".join(head[skip:])


def _hf_missing_hint(exc, cause, errors) -> str | None:
    """What is missing in a Hub URL that names nothing: the revision or the repo (the path itself needs no
    hint)."""
    if isinstance(exc, errors.RevisionNotFoundError) or isinstance(cause, errors.RevisionNotFoundError):
        return "the repo has no such revision: give a branch, a tag or a commit after '@'"
    if isinstance(exc, errors.RepositoryNotFoundError) or isinstance(cause, errors.RepositoryNotFoundError):
        return "no such repo (a dataset's URL is hf://datasets/org/name/...)"
    return None


def _hf_error(exc: Exception, where: str) -> Exception:
    resp = getattr(exc, "response", None)
    status = getattr(resp, "status_code", None)
    if status in (401, 403) or type(exc).__name__ in ("GatedRepoError",):
        return UsageError(f"the Hub refused access to {where}: {_HF_VARS}")
    if status == 404:
        return MissingPathError(where)
    return RemoteRetry(f"{type(exc).__name__}: {exc}")


# ------------------------------------------------------------------------------------ any other fsspec
# protocol
class FsspecBackend(Backend):
    """Any installed fsspec protocol (gs:// through gcsfs, az://, ...): listed by `find`, read by
    `cat_file(start, end)` one part at a time (no resume inside a part), the version (generation,
    ETag) re-checked before an output is committed."""

    def __init__(self, scheme: str):
        fsspec = _need("fsspec", scheme)
        self.scheme = scheme
        try:
            self.fs = fsspec.filesystem(scheme)
        except (ValueError, ImportError) as exc:
            raise UsageError(
                f"cannot read {scheme}:// URLs: {exc}",
                hint=_EXTRA_HINT + (" (gs:// needs gcsfs and gcloud ADC)" if scheme == "gs" else ""),
            ) from None

    @staticmethod
    def _version(info: dict):
        for k in ("generation", "ETag", "etag", "md5Hash", "mtime", "LastModified"):
            if info.get(k) is not None:
                return str(info[k])
        return None

    def list(self, url):
        path = f"{url.scheme}://{url.path}"
        try:
            found = self.fs.find(path, detail=True)
            if not found and self.fs.isfile(path):
                found = {path: self.fs.info(path)}
        except FileNotFoundError:
            raise MissingPathError(url.text) from None
        except PermissionError as exc:
            raise UsageError(
                f"access refused to {url.text}: {exc}",
                hint="gs://: run `gcloud auth application-default login`",
            ) from None
        stripped = self.fs._strip_protocol(path).rstrip("/")
        out = []
        for name, info in found.items():
            if info.get("type", "file") != "file":
                continue
            n = self.fs._strip_protocol(name)
            rel = "" if n == stripped else posixpath.relpath(n, stripped)
            out.append((rel, int(info["size"]), self._version(info), n))
        if not out:
            raise MissingPathError(url.text)
        return out

    def fetch(self, obj, start, end, sink, timeout_s):
        try:
            sink(self.fs.cat_file(obj.ref, start=start, end=end))
        except FileNotFoundError:
            raise RemoteMissing(obj.url) from None
        except PermissionError as exc:
            raise RemoteDenied(f"access refused to {obj.url}: {exc}") from None
        except (OSError, TimeoutError) as exc:
            raise RemoteRetry(f"{type(exc).__name__}: {exc}") from None

    def version_now(self, obj):
        try:
            return self._version(
                self.fs.info(obj.ref, refresh=True)
                if "refresh" in self.fs.info.__code__.co_varnames
                else self.fs.info(obj.ref)
            )
        except FileNotFoundError:
            return "(deleted)"
        except Exception:
            return None
