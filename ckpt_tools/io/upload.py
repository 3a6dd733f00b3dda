"""Outputs to a URL: written locally first (the op's own atomic output dir, in a private temp dir), then put
in place at the URL with the local contract: nothing appears there until the output is complete,
`--overwrite` replaces only an earlier output of ckpt-tools (the marker rule of io/owned.py), and a
failure or Ctrl-C at any point leaves the earlier output intact or the new one complete
(docs/remote.md, "Writing to a URL").

  - `s3://bucket/prefix`, `gs://bucket/prefix`, `hf://buckets/ns/name/path`, any other fsspec protocol
    that writes (az://, ...): a bucket prefix, put in place in the staged steps of io/upload_commit.py,
    through each store's own client (upload_s3.py, upload_fsspec.py: gcsfs for GCS, upload_bucket.py).
  - `hf://[datasets/]org/name[@branch]/path`: one Hub commit holding every file (`HfApi.create_commit`):
    the contents are uploaded first, the commit made last; a Hub commit is atomic.

A file of the output that is a remote input's object unchanged (set-lr's data files, recorded by
`copy_later`) is not uploaded from here: the store copies it server-side where it
can (S3 to S3, GCS to GCS, bucket to bucket), else it is streamed by range (or fetched first, for a Hub
commit and a bucket, which take local files).

`output_at(url)` (each `ckpt_tools.api` function with an OUT at a URL) checks the URL first, gives the op its
local OUT, and puts what the op wrote there at the URL when the call returns (`take_uploaded()`: what was
put, for the CLI's `remote.uploaded`); `upload_tree(local, url)` puts one finished local tree at a URL the
same way (gc's `--slim-to`); `discard_pending()` removes the staging dirs (atexit too).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.errors import CkptError, OutputExistsError, UsageError
from ..core.units import human_bytes
from .files import create_new
from .owned import OUTPUT_MARKER, judge
from .remote_display import add_display
from .remote_url import RemoteUrl, parse_url
from .signals import Terminated, signals_deferred
from .upload_commit import COMMIT_LAST, OVERWRITE_HINT, OutFile, describe, put_output

__all__ = [
    "COMMIT_LAST",
    "Uploaded",
    "bound_for_url",
    "check_writable",
    "copy_later",
    "describe_at",
    "discard_pending",
    "is_staged",
    "output_at",
    "stage_output",
    "take_uploaded",
    "upload_tree",
]


@dataclass(frozen=True)
class Uploaded:
    url: str
    files: int
    bytes: int  # sent from this machine
    method: str
    copied_bytes: int = 0  # copied by the store itself from a remote input, never sent from here
    left_behind: tuple[str, ...] = ()  # staged or backed-up objects the cleanup could not remove

    def to_json(self) -> dict:
        return {
            "url": self.url,
            "files": self.files,
            "bytes": self.bytes,
            "method": self.method,
            "copied_bytes": self.copied_bytes,
            "left_behind": list(self.left_behind),
        }


_PENDING: list[tuple[RemoteUrl, Path]] = []
_DIRS: list[Path] = []
# a staged file's (st_dev, st_ino) -> (its st_mtime_ns, its staging dir, the remote input's object it holds
# unchanged) (by inode: the file is made in an AtomicOutputDir's temp dir, renamed into place before the
# upload; the mtime and its staying empty tell it from a later file given the same inode)
_LATER: dict[tuple[int, int], tuple[int, str, object]] = {}
_UPLOADED: list[Uploaded] = []  # put at their URLs by `output_at`, for `take_uploaded`
_BOUND: set[str] = set()  # every local OUT handed out for a URL (kept after its staging dir is gone)


def check_writable(value) -> RemoteUrl:
    """`value` as a URL an output can be put at, else a UsageError naming what can."""
    url = parse_url(value)
    if url is None:
        raise UsageError(
            f"not a URL: {value!r}",
            hint="give a URL to upload to: s3://BUCKET/PREFIX, hf://ORG/REPO/DIR, hf://buckets/NS/NAME/DIR "
            "or gs://BUCKET/PREFIX",
        )
    if url.userinfo or url.query:
        raise UsageError(
            "an output URL takes no credentials nor query string",
            path=url.shown,
            hint="give the store its credentials its own way (AWS_PROFILE, GOOGLE_APPLICATION_CREDENTIALS, "
            "HF_TOKEN)",
        )
    if url.scheme in ("http", "https"):
        raise UsageError(
            f"cannot write to {url.scheme}:// (plain HTTP has no upload)",
            path=url.shown,
            hint="write to s3://, hf:// or gs://, or to a local path",
        )
    return url


def stage_output(value) -> Path:
    """The local path a command writes the output bound for the URL `value` to."""
    url = check_writable(value)
    local = _staging_dir("ckpt-upload-") / url.name
    _PENDING.append((url, local))
    _BOUND.add(os.path.realpath(local))
    add_display(local, url.shown)
    return local


def is_staged(path) -> bool:
    """Whether `path` lies in a staging dir of an output bound for a URL (`stage_output`)."""
    real = os.path.realpath(path)
    return any(real == os.path.realpath(d) or real.startswith(os.path.realpath(d) + os.sep) for d in _DIRS)


def bound_for_url(out) -> bool:
    """Whether `out` is a local OUT `stage_output` handed out: committed only when its upload is."""
    return os.path.realpath(out) in _BOUND


def copy_later(dst, source) -> None:
    """`dst` (new, in a staged OUT) is the remote input's object `source` unchanged: an empty file is made
    there, and the upload takes `source` for it (copied server-side where the store can)."""
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    real = os.path.realpath(dst)
    where = next((str(d) for d in _DIRS if real.startswith(os.path.realpath(d) + os.sep)), "")
    _LATER[(st.st_dev, st.st_ino)] = (st.st_mtime_ns, where, source)


def _staging_dir(prefix: str) -> Path:
    d = Path(tempfile.mkdtemp(prefix=prefix, dir=os.environ.get("CKPT_UPLOAD_STAGING")))
    _DIRS.append(d)
    if len(_DIRS) == 1:
        atexit.register(discard_pending)
    return d


def _source_of(path: Path):
    """The remote input's object the staged file `path` holds unchanged, else None."""
    st = os.stat(path)
    found = _LATER.get((st.st_dev, st.st_ino))
    if found is None or st.st_size != 0 or st.st_mtime_ns != found[0]:
        return None  # a file of its own (an inode used again after a carried file was removed)
    return found[2]


def _files(root: Path) -> list[OutFile]:
    if not root.is_dir():
        return [OutFile("", root, root.stat().st_size, _source_of(root))]
    out = []
    for dirpath, _dirs, names in os.walk(root):
        for n in names:
            p = Path(dirpath) / n
            src = _source_of(p)
            out.append(OutFile(p.relative_to(root).as_posix(), p, src.size if src else p.stat().st_size, src))
    return sorted(out, key=lambda f: f.rel)


@contextlib.contextmanager
def output_at(
    value, *, overwrite: bool, dry_run: bool = False, single: bool = False, inputs=()
) -> Iterator[Path]:
    """An OUT at the URL `value` for one call of the library (`ckpt_tools.api`): the URL checked now, before
    anything is computed (`describe_at`: what is there, and whether `overwrite` may replace it), the local
    OUT the op writes yielded, and on a clean exit (not a dry run) the output put at the URL, its
    `Uploaded` kept for `take_uploaded()`. The local staging dir is removed either way. `single`: the
    output is one file (a page, a config); `inputs`: what the call reads (OUT may be none of them)."""
    url = check_writable(value)
    _check_not_an_input(url, [i for i in inputs if i is not None])
    describe_at(url, overwrite=overwrite, single=single)
    local = stage_output(url)
    try:
        yield local
        if not dry_run and local.exists():
            _check_not_an_input(url)
            _UPLOADED.append(_put(url, local, overwrite=overwrite))
    finally:
        _drop(url, local)


def describe_at(value, *, overwrite: bool, single: bool = False) -> dict:
    """A dry run's account of an OUT at the URL `value` (`staging.describe_output`'s, for a URL): what is
    there and what `overwrite` would replace, after the refusals the real run makes."""
    url = check_writable(value)
    if url.scheme == "hf" and not url.path.startswith("buckets/"):
        fs, res, _prefix = _hub_repo(url)
        listed, replaces = _hub_existing(fs, res, url.shown, overwrite=overwrite, single=single)
        return {"out": url.shown, "exists": bool(listed), "replaces": replaces}
    store, prefix, _how = _store(url)
    return describe(store, url.shown, prefix, overwrite=overwrite, single=single)


def take_uploaded() -> list[Uploaded]:
    """The outputs `output_at` has put at URLs since the last call (the CLI's `remote.uploaded`)."""
    done = list(_UPLOADED)
    _UPLOADED.clear()
    return done


def _drop(url: RemoteUrl, local: Path) -> None:
    """One staged output forgotten, its staging dir removed."""
    with contextlib.suppress(ValueError):
        _PENDING.remove((url, local))
    d = local.parent
    for key in [k for k, (_m, where, _s) in _LATER.items() if where == str(d)]:
        del _LATER[key]  # its files are gone: their inodes may be given to others
    if d in _DIRS:
        _DIRS.remove(d)
        shutil.rmtree(d, ignore_errors=True)


def upload_tree(local: Path, value, *, overwrite: bool = False) -> Uploaded:
    """Put the finished local file or tree `local` at the URL `value`, as `output_at` does. A failure is
    a CkptError naming the URL and saying what is there."""
    return _put(check_writable(value), local, overwrite=overwrite)


def _put(url: RemoteUrl, local: Path, *, overwrite: bool) -> Uploaded:
    files = _files(local)
    committed = [False]
    before = len(_DIRS)  # the dirs of remote sources fetched for it go when it is done
    try:
        return _to_store(url, files, overwrite=overwrite, committed=committed)
    except (KeyboardInterrupt, Terminated) as exc:  # an interrupt held through the commit arrives after it
        if committed[0]:
            exc.summary = f"{url.shown} had been uploaded and committed, complete, when the interrupt arrived"  # type: ignore[union-attr]
        raise
    except CkptError:
        raise
    except Exception as exc:  # a client's failure outside the stores' own mapping (the Hub's commit)
        raise _hub_failure(exc, url) from None
    finally:
        while len(_DIRS) > before:
            shutil.rmtree(_DIRS.pop(), ignore_errors=True)


def _to_store(url: RemoteUrl, files: list[OutFile], *, overwrite: bool, committed: list) -> Uploaded:
    """The output `files` put at `url` by its store (module docstring)."""
    if url.scheme == "hf" and not url.path.startswith("buckets/"):
        return _hub_commit(url, files, overwrite=overwrite, committed=committed)
    store, prefix, method = _store(url)
    fetched = 0
    if url.scheme == "hf":  # a bucket takes local files but for another bucket's, which it copies itself
        from .upload_bucket import takes_as_is

        files, fetched = _fetched(files, keep=takes_as_is)
    sent, left = put_output(
        store, url.shown, prefix, files, overwrite=overwrite, done=lambda: committed.__setitem__(0, True)
    )
    copied = store.copied_bytes
    if copied:
        method += f"; {store.copied_files} file(s) copied server-side ({store.copy_how})"
    streamed = fetched + sum(f.size for f in files if f.source is not None) - copied
    if streamed:
        method += f"; {human_bytes(streamed)} of it fetched from the inputs first (no server-side copy there)"
    return Uploaded(url.shown, len(files), sent, method, copied, tuple(left))


def _store(url: RemoteUrl):
    """(store, the output's prefix in its key space, how it is put in place) for a bucket URL."""
    head, _, rest = url.path.partition("/")
    if url.scheme == "hf":  # hf://buckets/NS/NAME/PATH
        parts = url.path.split("/")
        if len(parts) < 4 or not parts[1] or not parts[2] or not "/".join(parts[3:]).strip("/"):
            raise UsageError(
                "name a folder inside the bucket (hf://buckets/NAMESPACE/NAME/PATH)", path=url.shown
            )
        from .upload_bucket import HfBucketStore

        bucket = HfBucketStore(f"{parts[1]}/{parts[2]}", url.shown)
        return bucket, "/".join(parts[3:]).strip("/"), "hf bucket: staged, then copied into place by Xet hash"
    if not rest.strip("/"):
        raise UsageError(f"name a prefix inside the bucket ({url.scheme}://BUCKET/PREFIX)", path=url.shown)
    if url.scheme == "s3":
        from .upload_s3 import S3Store

        return S3Store(head), rest.strip("/"), "s3 multipart uploads, completed at the commit"
    from .upload_fsspec import FsspecStore

    fs = FsspecStore(url.scheme)
    return fs, fs.path_of(url.path), f"{fs.name}: staged, then copied into place server-side"


def _hub_commit(url: RemoteUrl, files: list[OutFile], *, overwrite: bool, committed: list) -> Uploaded:
    """One Hub commit: the earlier output (same rule as local) deleted and the new one added at once."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    fs, res, prefix = _hub_repo(url)
    old, _replaces = _hub_existing(fs, res, url.shown, overwrite=overwrite, single=files[0].rel == "")
    files, fetched = _fetched(files)
    adds = [
        CommitOperationAdd(path_in_repo=f"{prefix}/{f.rel}" if f.rel else prefix, path_or_fileobj=str(f.path))
        for f in files
    ]
    new = {o.path_in_repo for o in adds}
    dels = [CommitOperationDelete(path_in_repo=p) for p in old if p not in new]
    # the contents first (LFS/Xet uploads; interruptible: nothing is committed), then the commit itself, which
    # holds the small files inline, with Ctrl-C held: it is made whole or not at all
    fs._api.preupload_lfs_files(res.repo_id, adds, repo_type=res.repo_type, revision=res.revision)
    with signals_deferred():
        ops: list = [*adds, *dels]
        fs._api.create_commit(
            res.repo_id,
            ops,
            repo_type=res.repo_type,
            revision=res.revision,
            commit_message=f"ckpt: write {prefix}",
        )
        committed[0] = True
    note = (
        f"; {human_bytes(fetched)} of it fetched from the inputs first (no server-side copy there)"
        if fetched
        else ""
    )
    return Uploaded(url.shown, len(files), sum(f.size for f in files), "one Hub commit" + note)


def _hub_failure(exc: Exception, url: RemoteUrl) -> CkptError:
    """A Hub client's failure as one line: the status and reason the Hub answered, else the exception."""
    resp = getattr(exc, "response", None)
    status, reason = getattr(resp, "status_code", None), getattr(resp, "reason_phrase", "")
    if status in (401, 403):
        return UsageError(
            f"the Hub refused access to {url.shown} ({status})",
            hint="set HF_TOKEN (or run `hf auth login`) with a token that can write to this repo",
        )
    first = (str(exc).splitlines() or [""])[0]
    said = f"the Hub answered {status} {reason}".rstrip() if status else f"{type(exc).__name__}: {first}"
    return CkptError(
        f"uploading to {url.shown} failed: {said}; nothing was committed there",
        hint="rerun when the Hub answers" if status else "check the endpoint, then rerun",
    )


def _hub_repo(url: RemoteUrl) -> tuple[Any, Any, str]:
    """(HfFileSystem, the resolved path, the directory in the repo) of an `hf://org/name[@rev]/DIR` OUT."""
    from huggingface_hub import HfFileSystem

    fs = HfFileSystem(skip_instance_cache=True, endpoint=os.environ.get("HF_ENDPOINT") or None)
    try:
        res: Any = fs.resolve_path(url.path)  # a repo path: buckets go to io.upload_bucket
    except FileNotFoundError:
        raise UsageError(
            "the Hub repo (or its branch) does not exist",
            path=url.shown,
            hint="create it first: hf repo create ORG/NAME",
        ) from None
    prefix = res.path_in_repo.strip("/")
    if not prefix:
        raise UsageError("name a directory inside the repo (hf://org/name/DIR)", path=url.shown)
    return fs, res, prefix


def _hub_existing(fs, res, where: str, *, overwrite: bool, single: bool) -> tuple[list[str], dict | None]:
    """The paths in the repo of the earlier output at `res` and what replacing it deletes, after the
    refusals of `--overwrite`'s rule."""
    root = res.unresolve()
    found = fs.find(root, detail=True) if fs.exists(root) else {}
    head = len(root.rstrip("/")) + 1
    listed = {n[head:]: int(i.get("size") or 0) for n, i in found.items() if i.get("type") == "file"}
    if not listed:
        return [], None
    if not overwrite:
        raise OutputExistsError("already exists", path=where, hint=OVERWRITE_HINT)
    replaces = {"command": None, "version": None, "entries": 1, "bytes": sum(listed.values())}
    if not single:
        marker = fs.cat_file(f"{root}/{OUTPUT_MARKER}") if OUTPUT_MARKER in listed else None
        replaces = judge(
            where, sorted({r.split("/", 1)[0] for r in listed}), marker, lambda: replaces["bytes"]
        )
    base = res.path_in_repo.strip("/")
    return [f"{base}/{r}" if r else base for r in listed], replaces


def _fetched(files: list[OutFile], keep=lambda src: False) -> tuple[list[OutFile], int]:
    """`files` with each remote source (but those `keep` keeps) fetched by range into a local file (a Hub
    commit and a bucket's upload take local files), and the bytes fetched."""
    out, fetched, where = [], 0, None
    for f in files:
        if f.source is None or keep(f.source):
            out.append(f)
            continue
        where = where or _staging_dir("ckpt-fetched-")
        free = shutil.disk_usage(where).free
        if free < f.size:
            raise CkptError(
                f"uploading {f.source.url} here means fetching it first: need {human_bytes(f.size)}, "
                f"{human_bytes(free)} free",
                path=str(where),
                hint="set CKPT_UPLOAD_STAGING to a dir with room",
            )
        path = where / str(len(out))
        fd = create_new(path)
        try:
            for off in range(0, f.size, 16 << 20):
                buf = bytearray(min(16 << 20, f.size - off))
                f.source.read_into(buf, off)
                os.write(fd, buf)
        finally:
            os.close(fd)
        out.append(OutFile(f.rel, path, f.size))
        fetched += f.size
    return out, fetched


def _check_not_an_input(url: RemoteUrl, given=()) -> None:
    """OUT may not be, hold or lie inside an input (as a local OUT may not: `staging.check_against_inputs`):
    the inputs `given` to the call, and every one the command read. `set-lr s3://b/x s3://b/x --overwrite`
    would patch x with no way back."""
    from .inputs import registered_urls

    for value in [*(str(p) for p in given if p is not None), *registered_urls()]:
        read = parse_url(value)
        if read is None or read.scheme != url.scheme:
            continue
        a, b = read.path.rstrip("/"), url.path.rstrip("/")
        if a == b or a.startswith(b + "/") or b.startswith(a + "/"):
            raise UsageError(
                f"OUT is an input of this command, or holds or lies inside one ({read.shown})",
                path=url.shown,
                hint="write OUT to another prefix; an input is never replaced",
            )


def discard_pending() -> None:
    _PENDING.clear()
    _LATER.clear()
    while _DIRS:
        d = _DIRS.pop()
        shutil.rmtree(d, ignore_errors=True)
