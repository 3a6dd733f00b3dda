"""`--download`: a hub id missing from the local HF cache (or holding only part of what a command needs)
fetched into that cache, only the files the command needs, through huggingface_hub's own
`snapshot_download` (the cache layout, refs and blobs exactly as `hf download` writes them).

The revision is resolved to its commit once; the files are chosen from that commit's listing by the
caller (`formats.hf_dir.hub` decides which files a command needs; it may read a small file such as the
shard index first, through `fetch_one`) and downloaded at that commit. Off unless a command's
`--download` (or the API's `download=True`) turned it on for its duration (`allowing`); what was
fetched is logged for the report (`fetched`). Credentials and the endpoint are huggingface_hub's own
(HF_TOKEN / `hf auth login`, HF_ENDPOINT)."""

from __future__ import annotations

import contextlib
import contextvars
import os
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import CkptError, MissingFileError, UsageError

__all__ = ["Fetched", "allowing", "download", "enabled", "fetched", "reset_log"]

_ON: contextvars.ContextVar[bool] = contextvars.ContextVar("ckpt_download", default=False)
_LOG: list[Fetched] = []
_HF_VARS = "set HF_TOKEN (or run `hf auth login`) with a token that can read this repo"


@dataclass(frozen=True)
class Fetched:
    """One hub id fetched into the cache: the files it needed that were not there before, and their size."""

    repo: str
    revision: str
    commit: str
    files: tuple[str, ...]
    bytes: int
    snapshot: str

    def to_json(self) -> dict:
        return {
            "repo": self.repo,
            "revision": self.revision,
            "commit": self.commit,
            "files": list(self.files),
            "bytes": self.bytes,
            "snapshot": self.snapshot,
        }


def enabled() -> bool:
    return _ON.get()


@contextlib.contextmanager
def allowing(on: bool = True):
    """Downloads allowed (or not) inside the block."""
    token = _ON.set(bool(on))
    try:
        yield
    finally:
        _ON.reset(token)


def fetched() -> list[Fetched]:
    return list(_LOG)


def reset_log() -> None:
    _LOG.clear()


def _escape(name: str) -> str:
    """`name` as an fnmatch pattern (snapshot_download filters with fnmatch) matching only itself."""
    return "".join(f"[{c}]" if c in "*?[]" else c for c in name)


def download(repo: str, revision: str | None, choose, *, cache_dir: Path | None = None) -> Path:
    """Fetch into the HF cache the files `choose(names, fetch_one)` picks (names: every file of the repo at
    the resolved commit; `fetch_one(name)` downloads one file into the cache and gives its path) and return
    the snapshot dir. Files already in the cache are not fetched again."""
    try:
        import huggingface_hub as hf
        from huggingface_hub import errors
    except ImportError:  # a dependency; only a broken install lacks it
        raise UsageError("--download needs huggingface_hub", hint="pip install huggingface_hub") from None
    rev = revision or "main"
    where = f"{repo}@{rev}" if revision else repo
    hub = _Hub(hf, repo, None if cache_dir is None else str(cache_dir))
    try:
        sha, before, wanted, got = hub.fetch(rev, choose)
        if revision != sha:  # record the branch or tag as `hf download` does (refs/<rev>)
            _write_ref(got.parent.parent, rev, sha)
    except (errors.HfHubHTTPError, errors.OfflineModeIsEnabled, OSError) as exc:
        raise _hub_error(exc, where, hub.api.endpoint) from None
    new = [n for n in wanted if n not in before]
    size = sum((got / n).stat().st_size for n in new if (got / n).is_file())
    _LOG.append(Fetched(repo, rev, sha, tuple(new), size, str(got)))
    return got


class _Hub:
    """One repo on the Hub (huggingface_hub's client, its endpoint) and the cache it is fetched into."""

    def __init__(self, hf, repo: str, cache: str | None):
        self.hf, self.repo, self.cache = hf, repo, cache
        self.endpoint = os.environ.get("HF_ENDPOINT") or None
        self.api = hf.HfApi(endpoint=self.endpoint)

    def fetch(self, rev: str, choose) -> tuple[str, set[str], list[str], Path]:
        """(the commit `rev` names, the files its snapshot held before, those chosen, the snapshot dir)."""
        info = self.api.model_info(self.repo, revision=rev)
        sha = info.sha
        if sha is None:
            raise CkptError(f"the Hub named no commit for {self.repo}@{rev}", hint="retry later")
        names = sorted(s.rfilename for s in (info.siblings or []))
        before = self._cached(sha)
        wanted = sorted(set(choose(names, lambda name: self._one(name, sha))))
        got = self.hf.snapshot_download(
            self.repo,
            revision=sha,
            cache_dir=self.cache,
            endpoint=self.endpoint,
            allow_patterns=[_escape(n) for n in wanted],
        )
        return sha, before, wanted, Path(got)

    def _cached(self, sha: str) -> set[str]:
        """The files the cache's snapshot of commit `sha` holds already."""
        from huggingface_hub import constants

        root = Path(self.cache) if self.cache else Path(constants.HF_HUB_CACHE)
        snap_dir = root / ("models--" + self.repo.replace("/", "--")) / "snapshots" / sha
        if not snap_dir.is_dir():
            return set()
        return {p.relative_to(snap_dir).as_posix() for p in snap_dir.rglob("*") if p.is_file()}

    def _one(self, name: str, sha: str) -> Path:
        got = self.hf.hf_hub_download(
            self.repo, name, revision=sha, cache_dir=self.cache, endpoint=self.endpoint
        )
        return Path(got)


def _hub_error(exc: BaseException, where: str, endpoint: str) -> CkptError:
    """What the Hub (or the network, or the disk) refused, as the error that names it and the fix."""
    from huggingface_hub import errors

    if isinstance(exc, errors.GatedRepoError):
        return UsageError(f"the Hub refused access to {where} (a gated repo): {_HF_VARS}")
    if isinstance(exc, errors.RevisionNotFoundError):
        return MissingFileError(
            f"{where!r}: no such revision on the Hub ({endpoint})",
            hint="pass an existing branch, tag or commit: org/name@REV",
        )
    if isinstance(
        exc, errors.RepositoryNotFoundError
    ):  # the Hub says this for a private repo without a token too
        return MissingFileError(
            f"{where!r} is not in the local HF cache and the Hub ({endpoint}) has no such "
            "model repo (or it is private)",
            hint=f"check the id; a private repo needs a token: {_HF_VARS}",
        )
    if isinstance(exc, errors.OfflineModeIsEnabled):
        return UsageError(
            f"--download cannot fetch {where}: HF_HUB_OFFLINE is set",
            hint="unset HF_HUB_OFFLINE, or download it elsewhere with `hf download`",
        )
    if isinstance(exc, errors.HfHubHTTPError):
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status in (401, 403):
            return UsageError(f"the Hub refused access to {where}: {_HF_VARS}")
        return CkptError(
            f"downloading {where} failed: {str(exc).splitlines()[0]}",
            hint="retry later; what was fetched stays in the cache",
        )
    return CkptError(  # a connection refused, a timeout, a full disk
        f"downloading {where} failed: {type(exc).__name__}: {exc}",
        hint=f"check the network and HF_ENDPOINT ({endpoint}); what was fetched stays in the cache",
    )


def _write_ref(folder: Path, rev: str, sha: str) -> None:
    """refs/<rev> holds `sha`, replaced atomically (as huggingface_hub writes it)."""
    ref = folder / "refs" / rev
    try:
        if ref.is_file() and ref.read_text().strip() == sha:
            return
    except OSError:
        pass
    ref.parent.mkdir(parents=True, exist_ok=True)
    tmp = ref.with_name(f".{ref.name}.ckpt-tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        os.write(fd, sha.encode())
    finally:
        os.close(fd)
    os.replace(tmp, ref)
