"""hf://buckets/NS/NAME/PATH as a store of `upload_commit.put_output`, through huggingface_hub's bucket API
(`HfApi.batch_bucket_files`: the Xet upload, then a batch of adds, copies and deletes; HF_TOKEN or
`hf auth login`, HF_ENDPOINT; retries huggingface_hub's own).

A bucket has no commits and a batch is not a transaction (the Hub applies each operation on its own and
lists the ones that failed), so it takes the staged steps of `upload_commit`: the files are uploaded
through Xet under the staging prefix, then copied into place by Xet hash (no byte sent again), each
copy's hash checked where it landed. Backups and the undo are copies by hash too: free. A file that is
a remote bucket input's object unchanged (set-lr's data files) is copied by its Xet hash, nothing sent;
another remote source is fetched into the local staging dir first (a batch adds local files).
"""

from __future__ import annotations

import contextlib
import os
from urllib.parse import quote

from ..core.errors import UsageError
from .upload_commit import Counted, Denied, Keys, OutFile, StoreError, settled

__all__ = ["HF_HINT", "HfBucketStore", "takes_as_is"]

HF_HINT = "set HF_TOKEN (or run `hf auth login`) with a token that can write to this bucket"


def _failure(exc: BaseException, request: str, key: str) -> StoreError:
    """A Hub failure as the server's code: a batch's refused operations (each with its reason), an HTTP
    status, else the exception's name and first line."""
    failures = getattr(exc, "failures", None)
    if failures:
        more = f" (and {len(failures) - 1} more refused)" if len(failures) > 1 else ""
        return StoreError(f"{failures[0].get('error')}{more}", request, str(failures[0].get("path", "")))
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if status in (401, 403):
        return Denied(f"{status}", request, key, hint=HF_HINT)
    first = (str(exc).splitlines() or [""])[0]
    return StoreError(f"{status} {first}" if status else f"{type(exc).__name__}: {first}", request, key)


class HfBucketStore(Counted):
    name = "the Hub"
    copy_how = "by Xet hash"

    def __init__(self, bucket_id: str, where: str):
        from huggingface_hub import HfApi

        super().__init__()
        self.api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)
        self.bucket_id, self.where = bucket_id, where
        self.hashes: dict[str, str] = {}  # path in the bucket -> its Xet hash, as listed, staged or copied
        self.staged: list[str] = []

    def _run(self, request: str, key: str, fn, *args, **kw):
        try:
            with _quiet_progress():
                return settled(fn, *args, **kw)
        except Exception as exc:
            raise _failure(exc, request, key) from None

    def url_of(self, key: str) -> str:
        return f"hf://buckets/{self.bucket_id}/{key}"

    def listing(self, prefix: str, *, single: bool) -> dict[str, int]:
        try:
            with _quiet_progress():
                self.api.bucket_info(self.bucket_id)
        except Exception as exc:
            status = getattr(getattr(exc, "response", None), "status_code", None)
            if type(exc).__name__ == "BucketNotFoundError" or status == 404:
                raise UsageError(
                    "the bucket does not exist",
                    path=self.where,
                    hint=f"create it first: hf buckets create {self.bucket_id}",
                ) from None
            raise _failure(exc, "bucket info", self.bucket_id) from None
        tree = self._run(
            "list", prefix, self.api.list_bucket_tree, self.bucket_id, prefix=prefix, recursive=True
        )
        out = {}
        for f in tree:
            if getattr(f, "type", "file") != "file" or not (
                f.path == prefix or f.path.startswith(prefix + "/")
            ):
                continue
            self.hashes[f.path] = f.xet_hash
            out[f.path[len(prefix) + 1 :]] = int(f.size)
        return out

    def read_small(self, key: str) -> bytes:
        from huggingface_hub.utils import get_session

        url = f"{self.api.endpoint}/buckets/{self.bucket_id}/resolve/{quote(key)}"
        r = self._run(
            "get", key, get_session().get, url, headers=self.api._build_hf_headers(), follow_redirects=True
        )
        if r.status_code != 200:
            raise _failure(type("HTTPError", (Exception,), {"response": r})(r.reason_phrase), "get", key)
        return r.content

    # ---- staging: uploaded through Xet under the staging prefix
    def stage(self, files: list[OutFile], keys: Keys) -> int:
        adds, copies, sent = [], [], 0
        for f in files:
            key = keys.staged(f.rel)
            self.staged.append(key)
            ref = _bucket_ref(f.source) if f.source is not None else None
            if ref is not None:
                copies.append(("bucket", ref[0], ref[1], key))
                self.copied(f.size)
            else:  # a local file (io.upload fetched any other remote source first)
                adds.append((str(f.path), key))
                sent += f.size
        self._run(
            "upload", keys.staged(""), self.api.batch_bucket_files, self.bucket_id, add=adds, copy=copies
        )
        self._check({keys.staged(f.rel): f.size for f in files})
        return sent

    def _check(self, want: dict[str, int], hashes: dict[str, str] | None = None) -> None:
        """Each path there with its size (and, given `hashes`, its Xet hash); their hashes recorded."""
        got = {
            f.path: f
            for f in self._run("paths info", "", self.api.get_bucket_paths_info, self.bucket_id, list(want))
        }
        for path, size in want.items():
            f = got.get(path)
            if f is None or int(f.size) != size or (hashes and f.xet_hash != hashes[path]):
                what = "missing" if f is None else f"{f.size} bytes, Xet hash {f.xet_hash}"
                raise StoreError(f"other contents than were put there ({what})", "check", path)
            self.hashes[path] = f.xet_hash

    # ---- the commit's requests
    def place(self, rels: list[str], keys: Keys) -> None:
        self.copy([(keys.staged(r), keys.dest(r)) for r in rels])

    def copy(self, pairs: list[tuple[str, str]]) -> None:
        if not pairs:
            return
        unknown = [s for s, _ in pairs if s not in self.hashes]
        if unknown:
            for f in self._run("paths info", "", self.api.get_bucket_paths_info, self.bucket_id, unknown):
                self.hashes[f.path] = f.xet_hash
        ops = [("bucket", self.bucket_id, self.hashes[s], d) for s, d in pairs]
        self._run("copy", pairs[0][1], self.api.batch_bucket_files, self.bucket_id, copy=ops)
        sizes = {
            f.path: int(f.size)
            for f in self._run(
                "paths info", "", self.api.get_bucket_paths_info, self.bucket_id, [s for s, _ in pairs]
            )
        }
        self._check({d: sizes.get(s, -1) for s, d in pairs}, {d: self.hashes[s] for s, d in pairs})

    def put(self, key: str, data: bytes) -> None:
        self._run("upload", key, self.api.batch_bucket_files, self.bucket_id, add=[(data, key)])

    def delete(self, keys: list[str]) -> None:
        if keys:
            self._run("delete", keys[0], self.api.batch_bucket_files, self.bucket_id, delete=list(keys))
            for k in keys:
                self.hashes.pop(k, None)

    def discard(self, keys: Keys) -> None:
        staged, self.staged = self.staged, []
        self.delete(staged)


def takes_as_is(src) -> bool:
    """Whether a bucket copies the remote input's object `src` itself (another bucket's, by Xet hash);
    any other is fetched into a local file first."""
    return _bucket_ref(src) is not None


def _bucket_ref(src) -> tuple[str, str] | None:
    """(bucket id, Xet hash) of a remote input's object when it is in a Hugging Face bucket."""
    if getattr(src, "store", None) == "hf-bucket":
        return src.bucket, src.version
    ref = getattr(src, "ref", None)
    if getattr(getattr(src, "backend", None), "scheme", None) == "hf" and ref and ref[1] == "bucket":
        return ref[0], ref[2]
    return None


class _quiet_progress(contextlib.AbstractContextManager):
    """huggingface_hub's progress bars off while ckpt uploads (ckpt has its own line)."""

    def __enter__(self):
        from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars

        self.was_on = not are_progress_bars_disabled()
        if self.was_on:
            disable_progress_bars()
        return self

    def __exit__(self, *exc):
        if self.was_on:
            from huggingface_hub.utils import enable_progress_bars

            enable_progress_bars()
        return False
