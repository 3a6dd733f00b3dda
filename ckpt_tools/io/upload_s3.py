"""s3://bucket/prefix as a store of `upload_commit.put_output`, through s3fs's aiobotocore client (its
credentials, AWS_ENDPOINT_URL and retries are botocore's own: AWS_MAX_ATTEMPTS, AWS_RETRY_MODE).

Staging is S3's own: each file of the output is a multipart upload at its final key, all its parts sent
first; the object appears only when the upload is completed, which is the commit's "put in place" (no copy
of the new output). A file that is a remote S3 input's object unchanged (set-lr's data files) is copied
into its upload by the store itself (UploadPartCopy, pinned by `CopySourceIfMatch`, its ETag re-checked
before the commit); any other remote source is streamed by range into the parts. Backups are server-side
copies (CopyObject; UploadPartCopy above 5 GiB). An interrupt or a failure aborts every open upload.
"""

from __future__ import annotations

import asyncio
import contextlib

from ..core.errors import FormatError
from .upload_commit import Counted, Denied, Keys, OutFile, StoreError, client, run_async

__all__ = ["AWS_HINT", "S3Store"]

AWS_HINT = (
    "set AWS_PROFILE (or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY; AWS_ENDPOINT_URL for another endpoint)"
)
PART_BYTES = 64 << 20
COPY_PART_BYTES = 1 << 30  # an UploadPartCopy part (S3 takes 5 MiB to 5 GiB; the last one may be smaller)
COPY_OBJECT_MAX = 5 << 30  # CopyObject's limit
# what an S3-compatible store answers when it has no UploadPartCopy: the object is streamed instead
_NO_PART_COPY = ("NotImplemented", "XNotImplemented", "501")
_DENIED = ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken")


def _failure(exc: BaseException, request: str, key: str) -> StoreError:
    """A botocore failure as the server's code (`503 SlowDown`), credentials refused as Denied."""
    name = type(exc).__name__
    if name in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError"):
        return Denied("no credentials found", request, key, hint=AWS_HINT)
    resp = getattr(exc, "response", None) or {}
    code = str(resp.get("Error", {}).get("Code", ""))
    status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
    text = " ".join([str(status)] * bool(status) + [code] * bool(code and code != str(status)))
    if not text:
        first = str(exc).splitlines()[0] if str(exc) else ""
        text = f"{name}: {first}" if first else name
    if status in (401, 403) or code in _DENIED:
        return Denied(text, request, key, hint=AWS_HINT)
    return StoreError(text, request, key)


class S3Store(Counted):
    name = "S3"
    copy_how = "UploadPartCopy"

    def __init__(self, bucket: str):
        super().__init__()
        self.fs = client("s3fs", "s3").S3FileSystem(skip_instance_cache=True)
        self.bucket = bucket
        self.create_hint = f"create it first: aws s3 mb s3://{bucket}"
        self.client = self._run(self.fs.set_session(), "connecting to the endpoint", "")
        self.uploads: dict[str, tuple[str, str, list]] = {}  # rel -> (key, upload id, parts)
        self.empty: dict[str, str] = {}  # rel -> key of a zero-byte file (no multipart upload: one PUT)
        self.no_part_copy = False
        self.started: set[str] = set()  # keys whose multipart upload was asked for

    def _run(self, coro, request: str, key: str):
        try:
            return run_async(self.fs.loop, coro)
        except Exception as exc:
            raise _failure(exc, request, key) from None

    def url_of(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def listing(self, prefix: str, *, single: bool) -> dict[str, int]:
        if single:
            try:
                head = run_async(self.fs.loop, self.client.head_object(Bucket=self.bucket, Key=prefix))
                return {"": int(head["ContentLength"])}
            except Exception as exc:
                err = _failure(exc, "HeadObject", prefix)
                if err.code.startswith("404"):
                    return {}
                raise err from None
        out, token = {}, None
        while True:
            kw = {
                "Bucket": self.bucket,
                "Prefix": prefix + "/",
                **({"ContinuationToken": token} if token else {}),
            }
            page = self._run(self.client.list_objects_v2(**kw), "ListObjectsV2", prefix + "/")
            out.update({o["Key"][len(prefix) + 1 :]: int(o["Size"]) for o in page.get("Contents", [])})
            if not page.get("IsTruncated"):
                return out
            token = page["NextContinuationToken"]

    def read_small(self, key: str) -> bytes:
        async def get() -> bytes:
            resp = await self.client.get_object(Bucket=self.bucket, Key=key)
            async with resp["Body"] as body:
                return await body.read()

        return self._run(get(), "GetObject", key)

    # ---- staging: open multipart uploads at the final keys
    def stage(self, files: list[OutFile], keys: Keys) -> int:
        sent, pinned = 0, []
        for f in files:
            key = keys.dest(f.rel)
            if f.size == 0:
                self.empty[f.rel] = key
                continue
            self.started.add(key)
            uid = self._run(
                self.client.create_multipart_upload(Bucket=self.bucket, Key=key), "CreateMultipartUpload", key
            )["UploadId"]
            parts: list = []
            self.uploads[f.rel] = (key, uid, parts)
            if f.source is not None and self._copy_source(f.source, key, uid, parts):
                self.copied(f.size)
                pinned.append(f.source)
                continue
            sent += self._send(f, key, uid, parts)
        for src in pinned:  # a store that ignores CopySourceIfMatch: the source must still be the one read
            _check_unchanged(src)
        return sent

    def _send(self, f: OutFile, key: str, uid: str, parts: list) -> int:
        """The file's parts sent from here: the local file read, or a remote object streamed by range."""
        with open(f.path, "rb") if f.source is None else contextlib.nullcontext() as fh:
            for n, off in enumerate(range(0, f.size, PART_BYTES), 1):
                if fh is not None:
                    chunk = fh.read(PART_BYTES)
                else:
                    buf = bytearray(min(PART_BYTES, f.size - off))
                    f.source.read_into(buf, off)
                    chunk = bytes(buf)
                r = self._run(
                    self.client.upload_part(
                        Bucket=self.bucket, Key=key, UploadId=uid, PartNumber=n, Body=chunk
                    ),
                    "UploadPart",
                    key,
                )
                parts.append({"PartNumber": n, "ETag": r["ETag"]})
        return f.size

    def _copy_source(self, src, key: str, uid: str, parts: list) -> bool:
        """A remote S3 input's object copied into this upload by the store (UploadPartCopy), pinned by its
        ETag; False where it cannot be (not an S3 object; a store without UploadPartCopy): stream it."""
        ref = _s3_ref(src)
        if ref is None or self.no_part_copy:
            return False
        try:
            parts += self._part_copies(ref[0], ref[1], src.size, key, uid, if_match=src.version)
        except StoreError as exc:
            if exc.code.split()[-1] in _NO_PART_COPY:
                self.no_part_copy = True
                parts.clear()
                return False
            if exc.code.split()[0] == "412" or exc.code.endswith("PreconditionFailed"):
                raise FormatError(
                    f"the object changed while it was being copied (ETag {src.version} at open)",
                    path=src.url,
                    hint="rerun once the writer has finished",
                ) from None
            raise
        return True

    def _part_copies(self, bucket: str, src: str, size: int, key: str, uid: str, *, if_match=None) -> list:
        """Every part of `bucket/src` copied into the upload `uid` of `key`, up to 8 at once."""
        cap = asyncio.Semaphore(8)
        pin = {"CopySourceIfMatch": if_match} if if_match else {}

        async def part(n: int, start: int, end: int) -> dict:
            async with cap:
                r = await self.client.upload_part_copy(
                    Bucket=self.bucket,
                    Key=key,
                    UploadId=uid,
                    PartNumber=n,
                    CopySource={"Bucket": bucket, "Key": src},
                    CopySourceRange=f"bytes={start}-{end - 1}",
                    **pin,
                )
                return {"PartNumber": n, "ETag": r["CopyPartResult"]["ETag"]}

        async def every_part() -> list:
            offsets = range(0, size, COPY_PART_BYTES)
            return list(
                await asyncio.gather(
                    *[part(n, o, min(o + COPY_PART_BYTES, size)) for n, o in enumerate(offsets, 1)]
                )
            )

        return self._run(every_part(), "UploadPartCopy", key)

    # ---- the commit's requests
    def place(self, rels: list[str], keys: Keys) -> None:
        for rel in rels:
            if rel in self.empty:
                self._run(
                    self.client.put_object(Bucket=self.bucket, Key=self.empty.pop(rel), Body=b""),
                    "PutObject",
                    rel,
                )
                continue
            key, uid, parts = self.uploads[rel]
            self._run(
                self.client.complete_multipart_upload(
                    Bucket=self.bucket, Key=key, UploadId=uid, MultipartUpload={"Parts": parts}
                ),
                "CompleteMultipartUpload",
                key,
            )
            del self.uploads[rel]

    def copy(self, pairs: list[tuple[str, str]]) -> None:
        for src, dst in pairs:
            head = self._run(self.client.head_object(Bucket=self.bucket, Key=src), "HeadObject", src)
            size = int(head["ContentLength"])
            if size <= COPY_OBJECT_MAX:
                req = self.client.copy_object(
                    Bucket=self.bucket, Key=dst, CopySource={"Bucket": self.bucket, "Key": src}
                )
                self._run(req, "CopyObject", dst)
                continue
            uid = self._run(
                self.client.create_multipart_upload(Bucket=self.bucket, Key=dst), "CreateMultipartUpload", dst
            )["UploadId"]
            try:
                parts = self._part_copies(self.bucket, src, size, dst, uid)
                done = self.client.complete_multipart_upload(
                    Bucket=self.bucket, Key=dst, UploadId=uid, MultipartUpload={"Parts": parts}
                )
                self._run(done, "CompleteMultipartUpload", dst)
            except BaseException:
                self._abort(dst, uid)
                raise

    def put(self, key: str, data: bytes) -> None:
        self._run(self.client.put_object(Bucket=self.bucket, Key=key, Body=data), "PutObject", key)

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            self._run(self.client.delete_object(Bucket=self.bucket, Key=key), "DeleteObject", key)

    def discard(self, keys: Keys) -> None:
        """Every upload still open aborted, and any other open upload of the output's keys (one whose
        creation an interrupt cut off, carried out by the server all the same); the first failure raised
        after every one was tried."""
        failed = None
        listed = self._run(
            self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=keys.prefix + "/"),
            "ListMultipartUploads",
            keys.prefix,
        ).get("Uploads", [])
        ours = {key for key, _uid, _parts in self.uploads.values()} | self.started
        stray = [(u["Key"], u["UploadId"]) for u in listed if u["Key"] in ours]
        for key, uid in [(k, u) for k, u, _p in self.uploads.values()] + stray:
            try:
                self._abort(key, uid, quiet=False)
            except StoreError as exc:
                failed = failed or exc
        self.uploads.clear()
        self.empty.clear()
        if failed is not None:
            raise failed

    def _abort(self, key: str, uid: str, *, quiet: bool = True) -> None:
        try:
            self._run(
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=uid),
                "AbortMultipartUpload",
                key,
            )
        except StoreError:
            if not quiet:
                raise


def _s3_ref(src) -> tuple[str, str] | None:
    """(bucket, key) of a remote input's object when it is in S3 (the same endpoint: the one configured)."""
    if getattr(src, "store", None) == "s3":
        return src.bucket, src.key
    if getattr(getattr(src, "backend", None), "scheme", None) == "s3":
        return tuple(src.ref)
    return None


def _check_unchanged(src) -> None:
    now = src.version_now() if hasattr(src, "version_now") and callable(src.version_now) else None
    if now is None and hasattr(src, "backend"):
        now = src.backend.version_now(src)
    if now is not None and now != src.version:
        raise FormatError(
            f"the object changed while it was being copied (ETag {src.version} at open, {now} now); "
            "nothing was written",
            path=src.url,
            hint="rerun once the writer has finished",
        )
