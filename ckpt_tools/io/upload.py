"""Outputs to a URL: written locally first (the op's own atomic output dir, in a private temp dir),
then uploaded and committed in one step, so that a reader never sees half an output.

  - `s3://bucket/prefix`: every file is a multipart upload whose parts are all sent first; only
    then are the uploads completed, in one burst with signals held (the DCP `.metadata`, index and
    manifest files last: a reader that finds them finds everything they name). Ctrl-C (or any
    failure) before that aborts every upload: nothing appears. `--overwrite` deletes the old objects
    under the prefix that the new output does not replace, after the commit.
  - `hf://[datasets/]org/name[@branch]/path`: one Hub commit holding every file (`HfApi.create_commit`):
    the file contents are uploaded first, the commit is made last; an interruption commits nothing.
  - `hf://buckets/ns/name/path`: a bucket has no commits: uploaded under a staging prefix, then copied
    into place by Xet hash, the marker files last (io/upload_bucket.py).
  - `gs://bucket/prefix`: every file a resumable upload, all data sent first but each file's last piece,
    then the uploads ended in one burst with signals held, the markers last (`remote_gcs.GcsWriter`).
  - any other fsspec protocol that writes (az://, ...): `put` inside an fsspec transaction (files
    committed when it closes, discarded on failure).

A file of the output that is a remote input's object unchanged (a stand-in, `remote.link_stand_in`:
set-lr's data files) is not uploaded from here: S3 to S3 copies it server-side (UploadPartCopy into the
same multipart upload, the source pinned by `CopySourceIfMatch` and its ETag re-checked before the
commit), any other source is streamed by range into the upload parts; a Hub commit or an fsspec `put`
takes a local file, so there it is fetched into the staging dir first (the Hub copies no file across
repos).

`stage_output(url)` gives the command its local OUT; `commit_pending()` (the CLI's `finish`) uploads
what the command wrote there; `discard_pending()` removes the staging dirs (atexit too).
`upload_tree(local, url)` uploads one finished local tree the same way (gc's `--slim-to`, one commit
per step), every failure a CkptError naming the URL.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import CkptError, DiskSpaceError, FormatError, OutputExistsError, UsageError
from ..core.units import human_bytes
from . import remote
from .files import create_new
from .remote import RemoteUrl, parse_url
from .signals import Terminated, signals_deferred

__all__ = [
    "COMMIT_LAST",
    "Uploaded",
    "check_writable",
    "commit_pending",
    "discard_pending",
    "is_staged",
    "pending",
    "stage_output",
    "upload_tree",
]

UPLOAD_PART_BYTES = 64 << 20
COPY_PART_BYTES = 1 << 30  # an UploadPartCopy part (S3 takes 5 MiB to 5 GiB; the last one may be smaller)
# what an S3-compatible store answers when it has no UploadPartCopy: the object is streamed instead
_NO_SERVER_COPY = ("NotImplemented", "XNotImplemented", "501")
# written last: what a reader opens first, and that names the other files
COMMIT_LAST = (
    ".metadata",
    "model.safetensors.index.json",
    "ckpt-slim-manifest.json",
    "adapter_config.json",
    "config.json",
)


@dataclass(frozen=True)
class Uploaded:
    url: str
    files: int
    bytes: int  # sent from this machine
    method: str
    copied_bytes: int = 0  # copied by the store itself, server-side (S3 UploadPartCopy), never sent from here

    def to_json(self) -> dict:
        return {
            "url": self.url,
            "files": self.files,
            "bytes": self.bytes,
            "method": self.method,
            "copied_bytes": self.copied_bytes,
        }


_PENDING: list[tuple[RemoteUrl, Path]] = []
_DIRS: list[Path] = []


def check_writable(value) -> RemoteUrl:
    """`value` as a URL an output can be uploaded to, else a UsageError naming what can."""
    url = parse_url(value)
    if url is None:
        raise UsageError(
            f"not a URL: {value!r}",
            hint="give a URL to upload to: s3://BUCKET/PREFIX, "
            "hf://ORG/REPO/DIR, hf://buckets/NS/NAME/DIR or "
            "gs://BUCKET/PREFIX",
        )
    if url.scheme in ("http", "https"):
        raise UsageError(
            f"cannot write to {url.scheme}:// (plain HTTP has no upload)",
            path=url.text,
            hint="write to s3://, hf:// or gs://, or to a local path",
        )
    return url


def stage_output(value) -> Path:
    """The local path a command writes the output bound for the URL `value` to."""
    url = check_writable(value)
    local = _staging_dir("ckpt-upload-") / url.name
    _PENDING.append((url, local))
    remote.add_display(local, url.text)
    return local


def is_staged(path) -> bool:
    """Whether `path` lies in a staging dir of an output bound for a URL (`stage_output`)."""
    real = os.path.realpath(path)
    return any(real == os.path.realpath(d) or real.startswith(os.path.realpath(d) + os.sep) for d in _DIRS)


def pending() -> bool:
    return bool(_PENDING)


def _staging_dir(prefix: str) -> Path:
    d = Path(tempfile.mkdtemp(prefix=prefix, dir=os.environ.get("CKPT_UPLOAD_STAGING")))
    _DIRS.append(d)
    if len(_DIRS) == 1:
        atexit.register(discard_pending)
    return d


def _object_of(path: Path):
    """The remote object `path` stands in for (`remote.link_stand_in`), else None."""
    return remote.object_of_stat(os.stat(path)) if remote.active() else None


def fetched_locally(files) -> tuple[list, int]:
    """`files` with every stand-in for a remote object replaced by a local copy of it, fetched by range into
    a staging dir (for writers that take local files only: every writer but S3's, which copies them
    server-side). Returns the files and the bytes fetched. A writer that skipped it would upload the
    stand-in itself: a placeholder of zeros."""
    out, fetched, where = [], 0, None
    for rel, path, size in files:
        obj = _object_of(path)
        if obj is None:
            out.append((rel, path, size))
            continue
        where = where or _staging_dir("ckpt-fetched-")
        free = shutil.disk_usage(where).free
        if free < size:
            raise DiskSpaceError(
                f"uploading {obj.url} here means fetching it first: need {human_bytes(size)}, "
                f"{human_bytes(free)} free",
                path=str(where),
                hint="set CKPT_UPLOAD_STAGING to a dir with room, or write OUT to s3://",
            )
        local = where / str(len(out))
        fd = create_new(local)
        try:
            for off in range(0, size, UPLOAD_PART_BYTES):
                buf = bytearray(min(UPLOAD_PART_BYTES, size - off))
                obj.read_into(buf, off)
                os.write(fd, buf)
        finally:
            os.close(fd)
        out.append((rel, local, size))
        fetched += size
    return out, fetched


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
            _check_not_an_input(url)
            files = _files(local) if local.is_dir() else [("", local, local.stat().st_size)]
            writer = _writer(url)
            try:
                done.append(writer.upload(url, files, overwrite=overwrite))
            except BaseException as exc:  # an interrupt held through the commit arrives after it
                if getattr(writer, "committed", False) and isinstance(exc, (KeyboardInterrupt, Terminated)):
                    exc.summary = (
                        f"{url.text} had been uploaded and committed, complete, when the interrupt arrived"
                    )
                raise
    finally:
        discard_pending()
    return done


def _check_not_an_input(url: RemoteUrl) -> None:
    """OUT may not be, hold or lie inside an input the command read (as a local OUT may not:
    `staging.check_against_inputs`): `set-lr s3://b/x s3://b/x --overwrite` would patch x with no way back."""
    from .inputs import registered

    for path in registered():
        read = parse_url(remote.display(str(path)))
        if read is None or read.scheme != url.scheme:
            continue
        a, b = read.path.rstrip("/"), url.path.rstrip("/")
        if a == b or a.startswith(b + "/") or b.startswith(a + "/"):
            raise UsageError(
                f"OUT is an input of this command, or holds or lies inside one ({read.text})",
                path=url.text,
                hint="write OUT to another prefix; an input is never replaced",
            )


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
        if isinstance(exc, (KeyboardInterrupt, Terminated)):  # say whether the commit was made
            if getattr(writer, "committed", False):
                exc.summary = (
                    f"{url.text} had been uploaded and committed, complete, when the interrupt arrived"
                )
            raise
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise CkptError(
            f"uploading to {url.text} failed: {type(exc).__name__}: {first}",
            path=url.text,
            hint="nothing was committed there; check the endpoint and credentials, then rerun",
        ) from None


def discard_pending() -> None:
    _PENDING.clear()
    while _DIRS:
        d = _DIRS.pop()
        remote.forget_under(d)
        shutil.rmtree(d, ignore_errors=True)


def _writer(url: RemoteUrl):
    if url.scheme == "s3":
        return _S3Writer()
    if url.scheme == "hf" and url.path.startswith("buckets/"):
        from .upload_bucket import HfBucketWriter

        return HfBucketWriter()
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
        self.no_server_copy = False

    def _call(self, coro):
        from .remote import RemoteDenied
        from .remote_backends import run_sync, s3_error

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
            raise OutputExistsError(
                "already exists (objects under this prefix)",
                path=url.text,
                hint="pass --overwrite to replace it, or another output path",
            )
        started: list[tuple[str, str | None, list]] = []
        sent = copied = 0
        pinned = []  # the objects copied server-side: their ETags re-checked before the commit
        try:
            for rel, path, size in files:
                key = f"{prefix}/{rel}" if rel else prefix
                if size == 0:
                    started.append((key, None, []))
                    continue
                uid = self._call(self.client.create_multipart_upload(Bucket=bucket, Key=key))["UploadId"]
                started.append((key, uid, []))
                obj = _object_of(path)
                if obj is not None and self._copy_object(obj, bucket, key, uid, started[-1][2]):
                    copied += size
                    pinned.append(obj)
                    continue
                sent += self._send(obj, path, size, bucket, key, uid, started[-1][2])
            for (
                obj
            ) in pinned:  # a store that ignores CopySourceIfMatch: the source must still be the one read
                now = obj.backend.version_now(obj)
                if now is not None and now != obj.version:
                    raise FormatError(
                        f"the object changed while it was being copied (ETag {obj.version} at open, "
                        f"{now} now); nothing was written",
                        path=obj.url,
                        hint="rerun once the writer has finished",
                    )
        except BaseException:
            with signals_deferred():
                for key, uid, _ in started:
                    if uid is not None:
                        try:
                            self._call(
                                self.client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=uid)
                            )
                        except Exception:
                            pass
            raise
        with signals_deferred():  # the commit: every upload completed, the markers last
            for key, uid, parts in started:
                if uid is None:
                    self._call(self.client.put_object(Bucket=bucket, Key=key, Body=b""))
                else:
                    self._call(
                        self.client.complete_multipart_upload(
                            Bucket=bucket, Key=key, UploadId=uid, MultipartUpload={"Parts": parts}
                        )
                    )
            new = {k for k, _, _ in started}
            for key in old:
                if key not in new:
                    self._call(self.client.delete_object(Bucket=bucket, Key=key))
            self.committed = True
        method = "s3 multipart, completed at the end" + (
            f"; {len(pinned)} file(s) copied server-side (UploadPartCopy)" if pinned else ""
        )
        return Uploaded(url.text, len(files), sent, method, copied)

    def _send(self, obj, path: Path, size: int, bucket: str, key: str, uid: str, parts: list) -> int:
        """The file's parts sent from here: a local file read, or a remote object streamed by range."""
        with open(path, "rb") if obj is None else contextlib.nullcontext() as fh:
            for n, off in enumerate(range(0, size, UPLOAD_PART_BYTES), 1):
                if obj is None:
                    chunk = fh.read(UPLOAD_PART_BYTES)
                else:
                    chunk = bytearray(min(UPLOAD_PART_BYTES, size - off))
                    obj.read_into(chunk, off)
                r = self._call(
                    self.client.upload_part(
                        Bucket=bucket, Key=key, UploadId=uid, PartNumber=n, Body=bytes(chunk)
                    )
                )
                parts.append({"PartNumber": n, "ETag": r["ETag"]})
        return size

    def _copy_object(self, obj, bucket: str, key: str, uid: str, parts: list) -> bool:
        """The remote object copied into this upload by the store itself (UploadPartCopy), pinned by its
        ETag; False where it cannot be (not an S3 object; a store without UploadPartCopy): stream it."""
        from .remote_backends import S3Backend, run_sync, s3_error

        if not isinstance(obj.backend, S3Backend) or self.no_server_copy:
            return False
        src_bucket, src_key = obj.ref
        cap = asyncio.Semaphore(remote.settings()["concurrency"])

        async def part(n: int, start: int, end: int) -> dict:
            async with cap:
                r = await self.client.upload_part_copy(
                    Bucket=bucket,
                    Key=key,
                    UploadId=uid,
                    PartNumber=n,
                    CopySource={"Bucket": src_bucket, "Key": src_key},
                    CopySourceRange=f"bytes={start}-{end - 1}",
                    CopySourceIfMatch=obj.version,
                )
                return {"PartNumber": n, "ETag": r["CopyPartResult"]["ETag"]}

        async def every_part() -> list:
            return await asyncio.gather(
                *[
                    part(n, off, min(off + COPY_PART_BYTES, obj.size))
                    for n, off in enumerate(range(0, obj.size, COPY_PART_BYTES), 1)
                ]
            )

        try:  # the store copies at its own speed: a floor of 10 MiB/s is patience enough
            parts += run_sync(self.b.fs.loop, every_part(), 600 + obj.size / (10 << 20))
        except Exception as exc:
            err = s3_error(exc, obj.url)
            code = str((getattr(exc, "response", None) or {}).get("Error", {}).get("Code", ""))
            if code in _NO_SERVER_COPY:
                self.no_server_copy = True
                parts.clear()
                return False
            if isinstance(err, remote.RemoteChanged):
                raise FormatError(
                    f"the object changed while it was being copied (ETag {obj.version} at open)",
                    path=obj.url,
                    hint="rerun once the writer has finished",
                ) from None
            if isinstance(err, remote.RemoteDenied):
                raise UsageError(str(err)) from None
            raise CkptError(
                f"the store's copy of it into {key} failed: {err}",
                path=obj.url,
                hint="nothing was committed; retry later",
            ) from None
        return True


class _HfWriter:
    def upload(self, url: RemoteUrl, files, *, overwrite: bool) -> Uploaded:
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfFileSystem

        fs = HfFileSystem(skip_instance_cache=True, endpoint=os.environ.get("HF_ENDPOINT") or None)
        try:
            res = fs.resolve_path(url.path)
        except FileNotFoundError:
            raise UsageError(
                "the Hub repo (or its branch) does not exist",
                path=url.text,
                hint="create it first: hf repo create ORG/NAME",
            ) from None
        prefix = res.path_in_repo.strip("/")
        if not prefix:
            raise UsageError("name a directory inside the repo (hf://org/name/DIR)", path=url.text)
        old = list(fs.find(res.unresolve(), detail=False)) if fs.exists(res.unresolve()) else []
        if old and not overwrite:
            raise OutputExistsError(
                "already exists in the repo",
                path=url.text,
                hint="pass --overwrite to replace it, or another output path",
            )
        files, fetched = fetched_locally(files)
        ops = [
            CommitOperationAdd(path_in_repo=f"{prefix}/{rel}" if rel else prefix, path_or_fileobj=str(p))
            for rel, p, _ in files
        ]
        new = {o.path_in_repo for o in ops}
        from .remote_backends import in_repo

        ops += [CommitOperationDelete(path_in_repo=in_repo(o)) for o in old if in_repo(o) not in new]
        adds = [o for o in ops if isinstance(o, CommitOperationAdd)]
        # the contents first (LFS/Xet uploads; interruptible: nothing is committed), then the commit itself,
        # which holds the small files inline, with Ctrl-C held: it is made whole or not at all
        fs._api.preupload_lfs_files(res.repo_id, adds, repo_type=res.repo_type, revision=res.revision)
        with signals_deferred():
            fs._api.create_commit(
                res.repo_id,
                ops,
                repo_type=res.repo_type,
                revision=res.revision,
                commit_message=f"ckpt: write {prefix}",
            )
            self.committed = True
        return Uploaded(
            url.text, len(files), sum(s for _, _, s in files), "one Hub commit" + fetched_note(fetched)
        )


class _FsspecWriter:
    def __init__(self, scheme: str):
        from .remote_backends import FsspecBackend

        self.fs = FsspecBackend(scheme).fs

    def upload(self, url: RemoteUrl, files, *, overwrite: bool) -> Uploaded:
        target = f"{url.scheme}://{url.path}"
        if self.fs.exists(target) and not overwrite:
            raise OutputExistsError(
                "already exists", path=url.text, hint="pass --overwrite to replace it, or another output path"
            )
        files, fetched = fetched_locally(files)
        with self.fs.transaction:
            for rel, p, _ in files:
                self.fs.put_file(str(p), f"{target}/{rel}" if rel else target)
        return Uploaded(
            url.text, len(files), sum(s for _, _, s in files), "fsspec transaction" + fetched_note(fetched)
        )


def fetched_note(fetched: int) -> str:
    return (
        f"; {human_bytes(fetched)} of it fetched from the inputs first (no server-side copy there)"
        if fetched
        else ""
    )
