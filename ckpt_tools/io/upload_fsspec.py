"""gs://bucket/prefix (gcsfs) and any other fsspec protocol that writes (az://, memory://, ...) as a store
of `upload_commit.put_output`. Credentials, endpoints and retries are the client's own: for GCS, gcloud's
application-default credentials (GOOGLE_APPLICATION_CREDENTIALS, `gcloud auth application-default login`,
a VM's service account; none is anonymous access), STORAGE_EMULATOR_HOST for another endpoint, gcsfs's
retries of 5xx/429.

Each file is uploaded whole under the staging prefix (gcsfs: one request below 5 MiB, else a resumable
upload, which creates its object only at its last byte), then copied into place by the store itself
(`cp_file`: GCS's objects.rewrite, which within one bucket and storage class moves no data). A file that
is a remote GCS input's object unchanged (set-lr's data files) is rewritten server-side from the generation
that was read; any other remote source is streamed into the upload by range, nothing kept on local disk.
"""

from __future__ import annotations

import contextlib
import logging

from ..core.errors import UsageError
from .upload_commit import Counted, Denied, Keys, OutFile, StoreError, client, run_async, settled

__all__ = ["GCS_HINT", "FsspecStore"]

GCS_HINT = (
    "set GOOGLE_APPLICATION_CREDENTIALS to a service account key file, or run "
    "`gcloud auth application-default login` (STORAGE_EMULATOR_HOST for another endpoint)"
)
STREAM_BYTES = 16 << 20


@contextlib.contextmanager
def _quiet_auth():
    """google-auth and gcsfs log each failed probe and retry as a warning; the one line of a refused or
    failed request says what to do instead."""
    loggers = [logging.getLogger(n) for n in ("google.auth", "google.auth._default", "gcsfs", "fsspec")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, lv in zip(loggers, levels):
            lg.setLevel(lv)


def _failure(exc: BaseException, request: str, key: str, hint: str) -> StoreError:
    """A client's failure as the server's code: gcsfs's HttpError (code), its OSError for 403 and
    FileNotFoundError for 404, google-auth's refusals; else the exception's name and first line."""
    name, first = type(exc).__name__, (str(exc).splitlines() or [""])[0]
    code = getattr(exc, "code", None) or getattr(exc, "status", None)
    if "Forbidden" in first or code in (401, 403) or name in ("RefreshError", "DefaultCredentialsError"):
        return Denied(
            f"{code or 403} {first.split(':')[0] if code is None else 'Forbidden'}", request, key, hint=hint
        )
    if isinstance(exc, FileNotFoundError):
        err = StoreError("404 Not Found", request, key)
        err.hint = "check that the bucket exists"  # type: ignore[attr-defined]
        return err
    if isinstance(exc, FileExistsError):
        return StoreError("412 Precondition Failed", request, key)
    if name == "ProxyError":
        return StoreError("502 Bad Gateway", request, key)
    if code:
        message = str(getattr(exc, "message", "")).rsplit(",", 1)[0]
        return StoreError(f"{code} {message}".strip(), request, key)
    return StoreError(f"{name}: {first}" if first else name, request, key)


class FsspecStore(Counted):
    copy_how = "objects.rewrite"

    def __init__(self, scheme: str):
        super().__init__()
        self.scheme = "gs" if scheme in ("gs", "gcs") else scheme
        self.name = "Google Cloud Storage" if self.scheme == "gs" else f"{scheme}://"
        self.hint = GCS_HINT if self.scheme == "gs" else f"check the credentials of {scheme}:// (fsspec's)"
        if self.scheme == "gs":
            self.create_hint = "create it first: gcloud storage buckets create gs://BUCKET"
        # gcsfs.core's class: the package's default (gcsfs >= 2025.x) first asks each bucket's layout over
        # gRPC, which waits out a 60 s timeout on every request where that API is not there (an emulator, a
        # token without the permission); the JSON API class writes plain and hierarchical buckets alike
        lib = client("gcsfs.core" if self.scheme == "gs" else "fsspec", scheme)
        with _quiet_auth():
            try:
                if self.scheme == "gs":
                    self.fs = lib.GCSFileSystem(skip_instance_cache=True)
                else:
                    self.fs = lib.filesystem(scheme, skip_instance_cache=True)
            except ImportError as exc:
                raise UsageError(f"writing to {scheme}:// needs {exc.name or 'its fsspec package'}") from None
            except Exception as exc:  # a credentials file that cannot be read or parsed
                raise UsageError(
                    f"the credentials for {scheme}:// could not be loaded: {exc}", hint=self.hint
                ) from None
        self.staged: list[str] = []

    def path_of(self, url_path: str) -> str:
        """The filesystem's path of `scheme://url_path`."""
        return self.fs._strip_protocol(f"{self.scheme}://{url_path}").rstrip("/")

    def url_of(self, key: str) -> str:
        return f"{self.scheme}://{key.lstrip('/') if self.scheme == 'gs' else key}"

    def _call(self, method: str, request: str, key: str, *args, **kw):
        """`fs.method(*args)`: the async one on the client's loop where there is one (so an interrupt
        cancels it), each failure as a StoreError."""
        try:
            with _quiet_auth():
                if getattr(self.fs, "async_impl", False):
                    return run_async(self.fs.loop, getattr(self.fs, "_" + method)(*args, **kw))
                return settled(getattr(self.fs, method), *args, **kw)
        except Exception as exc:
            raise _failure(exc, request, key, self.hint) from None

    def listing(self, prefix: str, *, single: bool) -> dict[str, int]:
        self.fs.invalidate_cache()
        if single:
            try:
                info = self._call("info", "get", prefix, prefix)
            except StoreError as exc:
                if exc.code.startswith("404"):
                    return {}
                raise
            return {"": int(info["size"])} if info.get("type") == "file" else {}
        found = self._call("find", "list", prefix + "/", prefix, detail=True)
        n = len(prefix) + 1
        return {
            p[n:]: int(i.get("size") or 0) for p, i in found.items() if p.startswith(prefix + "/") and p[n:]
        }

    def read_small(self, key: str) -> bytes:
        return self._call("cat_file", "get", key, key)

    # ---- staging: whole objects under the staging prefix
    def stage(self, files: list[OutFile], keys: Keys) -> int:
        sent = 0
        for f in files:
            key = keys.staged(f.rel)
            self.staged.append(key)
            if f.source is None:
                self._call("put_file", "upload", key, str(f.path), key)
                sent += f.size
            elif self._rewrite_source(f.source, key):
                self.copied(f.size)
            else:
                sent += self._stream(f, key)
        return sent

    def _stream(self, f: OutFile, key: str) -> int:
        """A remote input's object that is not in this store: read by range, written through the client."""
        try:
            with _quiet_auth(), self.fs.open(key, "wb") as out:
                for off in range(0, f.size, STREAM_BYTES):
                    buf = bytearray(min(STREAM_BYTES, f.size - off))
                    f.source.read_into(buf, off)
                    out.write(buf)
        except Exception as exc:
            if not isinstance(exc, StoreError) and type(exc).__module__.startswith("ckpt_tools"):
                raise
            raise _failure(exc, "upload", key, self.hint) from None
        return f.size

    def _rewrite_source(self, src, key: str) -> bool:
        """A remote GCS input's object rewritten into `key` by the store itself, from the generation read
        (a replaced object's other generation is never copied: 404/412); False where it cannot be."""
        ref = _gs_ref(src) if self.scheme == "gs" else None
        if ref is None:
            return False
        bucket, _, dest = key.partition("/")
        pin = {"sourceGeneration": src.version, "ifSourceGenerationMatch": src.version}

        async def rewrite():
            out = {"done": False}
            token = {}
            while out.get("done") is not True:
                out = await self.fs._call(
                    "POST",
                    "b/{}/o/{}/rewriteTo/b/{}/o/{}",
                    ref[0],
                    ref[1],
                    bucket,
                    dest,
                    json_out=True,
                    **pin,
                    **token,
                )
                token = {"rewriteToken": out.get("rewriteToken")}

        try:
            with _quiet_auth():
                run_async(self.fs.loop, rewrite())
        except (FileNotFoundError, FileExistsError):
            from ..core.errors import FormatError

            raise FormatError(
                f"the object changed while it was being copied (generation {src.version} at open)",
                path=src.url,
                hint="rerun once the writer has finished",
            ) from None
        except Exception as exc:
            raise _failure(exc, "rewrite", key, self.hint) from None
        return True

    # ---- the commit's requests
    def place(self, rels: list[str], keys: Keys) -> None:
        self.copy([(keys.staged(r), keys.dest(r)) for r in rels])

    def copy(self, pairs: list[tuple[str, str]]) -> None:
        for src, dst in pairs:
            self._call("cp_file", "copy", dst, src, dst)

    def put(self, key: str, data: bytes) -> None:
        self._call("pipe_file", "upload", key, key, data)

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            try:
                self._call("rm_file", "delete", key, key)
            except StoreError as exc:
                if not exc.code.startswith("404"):
                    raise

    def discard(self, keys: Keys) -> None:
        staged, self.staged = self.staged, []
        self.delete(staged)


def _gs_ref(src) -> tuple[str, str] | None:
    """(bucket, key) of a remote input's object when it is in GCS."""
    if getattr(src, "store", None) == "gs":
        return src.bucket, src.key
    if getattr(getattr(src, "backend", None), "scheme", None) == "gs":
        return tuple(src.ref)
    return None
