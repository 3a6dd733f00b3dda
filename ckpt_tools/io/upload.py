"""Outputs to a URL: written locally first (the op's own atomic output dir, in a private temp dir),
then uploaded and committed in one step, so that a reader never sees half an output.

  - `s3://bucket/prefix`: every file is a multipart upload whose parts are all sent first; only
    then are the uploads completed, in one burst with signals held (the DCP `.metadata`, index and
    manifest files last: a reader that finds them finds everything they name). Ctrl-C (or any
    failure) before that aborts every upload: nothing appears. `--overwrite` deletes the old objects
    under the prefix that the new output does not replace, after the commit.
  - `hf://[datasets/]org/name[@branch]/path`: one Hub commit holding every file (`HfApi.create_commit`):
    the file contents are uploaded first, the commit is made last; an interruption commits nothing.
  - `gs://bucket/prefix`: every file a resumable upload, all data sent first but each file's last piece,
    then the uploads ended in one burst with signals held, the markers last (`remote_gcs.GcsWriter`).
  - any other fsspec protocol that writes (az://, ...): `put` inside an fsspec transaction (files
    committed when it closes, discarded on failure).

`stage_output(url)` gives the command its local OUT; `commit_pending()` (the CLI's `finish`) uploads
what the command wrote there; `discard_pending()` removes the staging dirs (atexit too).
`upload_tree(local, url)` uploads one finished local tree the same way (gc's `--slim-to`, one commit
per step), every failure a CkptError naming the URL.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import CkptError, OutputExistsError, UsageError
from .remote import RemoteUrl, parse_url
from .signals import Terminated, signals_deferred

__all__ = ["stage_output", "pending", "commit_pending", "discard_pending", "upload_tree", "check_writable",
           "Uploaded", "COMMIT_LAST"]

UPLOAD_PART_BYTES = 64 << 20
# written last: what a reader opens first, and that names the other files
COMMIT_LAST = (".metadata", "model.safetensors.index.json", "ckpt-slim-manifest.json", "adapter_config.json",
               "config.json")


@dataclass(frozen=True)
class Uploaded:
    url: str
    files: int
    bytes: int
    method: str

    def to_json(self) -> dict:
        return {"url": self.url, "files": self.files, "bytes": self.bytes, "method": self.method}


_PENDING: list[tuple[RemoteUrl, Path]] = []
_DIRS: list[Path] = []


def check_writable(value) -> RemoteUrl:
    """`value` as a URL an output can be uploaded to, else a UsageError naming what can."""
    url = parse_url(value)
    if url is None:
        raise UsageError(f"not a URL: {value!r}", hint="give a URL to upload to: s3://BUCKET/PREFIX, "
                                                        "hf://ORG/REPO/DIR or gs://BUCKET/PREFIX")
    if url.scheme in ("http", "https"):
        raise UsageError(f"cannot write to {url.scheme}:// (plain HTTP has no upload)", path=url.text,
                         hint="write to s3://, hf:// or gs://, or to a local path")
    if url.scheme == "hf" and url.path.startswith("buckets/"):
        raise UsageError("writing to an hf:// bucket is not supported: bucket uploads go through Xet "
                         "(HfApi.batch_bucket_files), which ckpt does not drive", path=url.text,
                         hint="write to an hf:// model or dataset repo (one commit), or to s3://")
    return url


def stage_output(value) -> Path:
    """The local path a command writes the output bound for the URL `value` to."""
    url = check_writable(value)
    from . import remote
    d = Path(tempfile.mkdtemp(prefix="ckpt-upload-", dir=os.environ.get("CKPT_UPLOAD_STAGING")))
    _DIRS.append(d)
    if len(_DIRS) == 1:
        atexit.register(discard_pending)
    local = d / url.name
    _PENDING.append((url, local))
    remote.add_display(local, url.text)
    return local


def pending() -> bool:
    return bool(_PENDING)


def _files(root: Path) -> list[tuple[str, Path, int]]:
    out = []
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            p = Path(dirpath) / n
            out.append((p.relative_to(root).as_posix(), p, p.stat().st_size))
    return sorted(out, key=lambda f: (f[0].rsplit("/", 1)[-1] in COMMIT_LAST, f[0]))


def commit_pending(*, overwrite: bool) -> list[Uploaded]:
    """Upload every staged output that its command wrote (a dry run wrote none: nothing to do)."""
    done = []
    try:
        for url, local in list(_PENDING):
            if not local.exists():
                continue
            files = _files(local) if local.is_dir() else [("", local, local.stat().st_size)]
            writer = _writer(url)
            try:
                done.append(writer.upload(url, files, overwrite=overwrite))
            except BaseException as exc:   # an interrupt held through the commit arrives after it
                if getattr(writer, "committed", False) and isinstance(exc, (KeyboardInterrupt, Terminated)):
                    exc.summary = (f"{url.text} had been uploaded and committed, complete, when the interrupt "
                                   "arrived")
                raise
    finally:
        discard_pending()
    return done


def upload_tree(local: Path, value, *, overwrite: bool = False) -> Uploaded:
    """Upload the finished local file or tree `local` to the URL `value`, committed in one step (as
    `commit_pending` does). A failure (the server gone, 5xx after the client's retries, refused
    credentials) is a CkptError naming the URL; nothing is committed then."""
    url = check_writable(value)
    files = _files(local) if local.is_dir() else [("", local, local.stat().st_size)]
    writer = None
    try:
        writer = _writer(url)
        return writer.upload(url, files, overwrite=overwrite)
    except CkptError:
        raise
    except BaseException as exc:
        if isinstance(exc, (KeyboardInterrupt, Terminated)):   # say whether the commit was made
            if getattr(writer, "committed", False):
                exc.summary = f"{url.text} had been uploaded and committed, complete, when the interrupt arrived"
            raise
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise CkptError(f"uploading to {url.text} failed: {type(exc).__name__}: {first}", path=url.text,
                        hint="nothing was committed there; check the endpoint and credentials, then rerun") from None


def discard_pending() -> None:
    _PENDING.clear()
    while _DIRS:
        shutil.rmtree(_DIRS.pop(), ignore_errors=True)


def _writer(url: RemoteUrl):
    if url.scheme == "s3":
        return _S3Writer()
    if url.scheme == "hf":
        return _HfWriter()
    if url.scheme in ("gs", "gcs"):
        from .remote_gcs import GcsWriter
        return GcsWriter()
    return _FsspecWriter(url.scheme)


class _S3Writer:
    def __init__(self):
        from .remote_backends import S3Backend
        self.b = S3Backend()
        self.client = self.b._client()

    def _call(self, coro):
        from .remote import RemoteDenied
        from .remote_backends import s3_error, run_sync
        try:
            return run_sync(self.b.fs.loop, coro, 600)
        except Exception as exc:
            err = s3_error(exc, "")
            if isinstance(err, RemoteDenied):
                raise UsageError(str(err)) from None
            raise

    def _existing(self, bucket: str, prefix: str) -> list[str]:
        keys, token = [], None
        while True:
            kw = {"Bucket": bucket, "Prefix": prefix + "/"}
            if token:
                kw["ContinuationToken"] = token
            page = self._call(self.client.list_objects_v2(**kw))
            keys += [o["Key"] for o in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return keys
            token = page["NextContinuationToken"]

    def upload(self, url: RemoteUrl, files, *, overwrite: bool) -> Uploaded:
        bucket, _, prefix = url.path.partition("/")
        prefix = prefix.strip("/")
        old = self._existing(bucket, prefix) if prefix else []
        if old and not overwrite:
            raise OutputExistsError("already exists (objects under this prefix)", path=url.text,
                                    hint="pass --overwrite to replace it, or another output path")
        started: list[tuple[str, str | None, list]] = []
        total = 0
        try:
            for rel, path, size in files:
                key = f"{prefix}/{rel}" if rel else prefix
                if size == 0:
                    started.append((key, None, []))
                    continue
                uid = self._call(self.client.create_multipart_upload(Bucket=bucket, Key=key))["UploadId"]
                started.append((key, uid, []))
                with open(path, "rb") as fh:
                    n = 1
                    while True:
                        chunk = fh.read(UPLOAD_PART_BYTES)
                        if not chunk:
                            break
                        r = self._call(self.client.upload_part(Bucket=bucket, Key=key, UploadId=uid, PartNumber=n,
                                                               Body=chunk))
                        started[-1][2].append({"PartNumber": n, "ETag": r["ETag"]})
                        total += len(chunk)
                        n += 1
        except BaseException:
            with signals_deferred():
                for key, uid, _ in started:
                    if uid is not None:
                        try:
                            self._call(self.client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=uid))
                        except Exception:
                            pass
            raise
        with signals_deferred():   # the commit: every upload completed, the markers last
            for key, uid, parts in started:
                if uid is None:
                    self._call(self.client.put_object(Bucket=bucket, Key=key, Body=b""))
                else:
                    self._call(self.client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=uid,
                                                                     MultipartUpload={"Parts": parts}))
            new = {k for k, _, _ in started}
            for key in old:
                if key not in new:
                    self._call(self.client.delete_object(Bucket=bucket, Key=key))
            self.committed = True
        return Uploaded(url.text, len(files), total, "s3 multipart, completed at the end")


class _HfWriter:
    def upload(self, url: RemoteUrl, files, *, overwrite: bool) -> Uploaded:
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfFileSystem
        fs = HfFileSystem(skip_instance_cache=True, endpoint=os.environ.get("HF_ENDPOINT") or None)
        try:
            res = fs.resolve_path(url.path)
        except FileNotFoundError:
            raise UsageError("the Hub repo (or its branch) does not exist", path=url.text,
                             hint="create it first: hf repo create ORG/NAME") from None
        prefix = res.path_in_repo.strip("/")
        if not prefix:
            raise UsageError("name a directory inside the repo (hf://org/name/DIR)", path=url.text)
        old = [o for o in fs.find(res.unresolve(), detail=False)] if fs.exists(res.unresolve()) else []
        if old and not overwrite:
            raise OutputExistsError("already exists in the repo", path=url.text,
                                    hint="pass --overwrite to replace it, or another output path")
        ops = [CommitOperationAdd(path_in_repo=f"{prefix}/{rel}" if rel else prefix, path_or_fileobj=str(p))
               for rel, p, _ in files]
        new = {o.path_in_repo for o in ops}
        from .remote_backends import in_repo
        ops += [CommitOperationDelete(path_in_repo=in_repo(o)) for o in old if in_repo(o) not in new]
        adds = [o for o in ops if isinstance(o, CommitOperationAdd)]
        # the contents first (LFS/Xet uploads; interruptible: nothing is committed), then the commit itself,
        # which holds the small files inline, with Ctrl-C held: it is made whole or not at all
        fs._api.preupload_lfs_files(res.repo_id, adds, repo_type=res.repo_type, revision=res.revision)
        with signals_deferred():
            fs._api.create_commit(res.repo_id, ops, repo_type=res.repo_type, revision=res.revision,
                                  commit_message=f"ckpt: write {prefix}")
            self.committed = True
        return Uploaded(url.text, len(files), sum(s for _, _, s in files), "one Hub commit")


class _FsspecWriter:
    def __init__(self, scheme: str):
        from .remote_backends import FsspecBackend
        self.fs = FsspecBackend(scheme).fs

    def upload(self, url: RemoteUrl, files, *, overwrite: bool) -> Uploaded:
        target = f"{url.scheme}://{url.path}"
        if self.fs.exists(target) and not overwrite:
            raise OutputExistsError("already exists", path=url.text,
                                    hint="pass --overwrite to replace it, or another output path")
        with self.fs.transaction:
            for rel, p, _ in files:
                self.fs.put_file(str(p), f"{target}/{rel}" if rel else target)
        return Uploaded(url.text, len(files), sum(s for _, _, s in files), "fsspec transaction")
