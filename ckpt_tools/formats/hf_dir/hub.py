"""Where a model is: a local directory, or a hub id resolved from the local HF cache only (no network,
ever)."""
from __future__ import annotations

import os
import re
from pathlib import Path

from ...core.errors import CkptError, FormatError, MissingFileError, MissingPathError, UsageError
from ...io.inputs import check_input, read_text

__all__ = ["resolve_model_dir", "is_hub_id", "split_revision", "locate_model"]

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?(@[\w./-]+)?$")


def is_hub_id(text: str) -> bool:
    """`org/name`, `name`, or either with `@revision` (a branch, tag or commit, as `hf download` takes)."""
    return bool(_HUB_ID.match(text))


def split_revision(text: str) -> tuple[str, str | None]:
    """`org/name@rev` -> (`org/name`, `rev`); no `@`: (text, None)."""
    repo, sep, rev = text.partition("@")
    return (repo, rev) if sep else (text, None)


def resolve_model_dir(name_or_dir: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None) -> Path:
    """A local directory, or a hub id (`org/name`, `org/name@revision`) resolved from the local HF cache
    only (no network, ever). `cache_dir` overrides the cache location (default: HF_HUB_CACHE)."""
    p = Path(name_or_dir).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise UsageError(f"{p} is a file; expected a model directory or a hub id")
    text = str(name_or_dir)
    if not is_hub_id(text):
        raise MissingPathError(p, hint="pass an existing model directory or a hub id (org/name[@revision]) in the local HF cache")
    repo, revision = split_revision(text)
    snap = _cached_snapshot(text, repo, revision, Path(cache_dir) if cache_dir is not None else None)
    if snap is None:
        where = cache_dir if cache_dir is not None else _default_cache()
        raise MissingFileError(
            f"{text!r} is not a local directory and not in the local HF cache ({where})",
            hint=f"download it with `hf download {repo}" + (f" --revision {revision}" if revision else "")
                 + "` or pass a directory")
    return snap


_COMMIT = re.compile(r"^[0-9a-f]{40}$")
MAX_REF_BYTES = 1024


def _cached_snapshot(text: str, repo: str, revision: str | None, cache: Path | None) -> Path | None:
    """The snapshot dir of `repo` at `revision` (default `main`) in the HF cache, as huggingface_hub's
    `snapshot_download(local_files_only=True)` finds it (a commit hash names its snapshot; anything else
    is read from `refs/<revision>`), but read through `io.inputs`: the ref must be a regular file
    inside the repo's cache dir (a FIFO there blocked every hub-id command inside huggingface_hub's own
    open), hold a commit hash, and the snapshot must be a directory inside the repo's cache dir.
    None where the cache has no such repo or revision."""
    if "--" in repo or ".." in repo or repo.endswith(".git") or len(repo) > 96:
        raise UsageError(f"{text!r} is neither an existing directory nor a valid hub id (a repo id has no '--' "
                         "or '..' and is at most 96 characters)")
    rev = revision or "main"
    if rev.startswith("/") or any(part in ("", ".", "..") for part in rev.split("/")):
        raise UsageError(f"{text!r}: revision {rev!r} is not a branch, tag or commit (no '.', '..' or empty "
                         "path components: a revision may not leave the cache)",
                         hint="pass a branch, tag or commit hash, e.g. org/name@main")
    folder = (cache if cache is not None else Path(_default_cache())) / ("models--" + repo.replace("/", "--"))
    if not folder.is_dir():
        return None
    ref = folder / "refs" / rev
    if os.path.lexists(ref):
        raw = read_text(ref, root=folder, what="HF cache ref", max_bytes=MAX_REF_BYTES)
        commit = raw.strip()
        if not _COMMIT.match(commit):
            raise FormatError(f"HF cache ref holds {commit[:80]!r}, not a commit hash", path=ref,
                              hint="the cache is damaged or crafted; re-download the model with `hf download`")
    elif _COMMIT.match(rev):
        commit = rev
    else:
        return None
    snap = folder / "snapshots" / commit
    if not os.path.lexists(snap):
        return None
    check_input(snap, root=folder, what="HF cache snapshot", want="dir", register_as_input=False)
    return snap


def _default_cache() -> str:
    # lazy: importing huggingface_hub's constants is paid only when a name is not a local directory;
    # read at each call (HF_HUB_CACHE / HF_HOME, as `hf download` wrote there)
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def locate_model(name: str | None, *, run_root: Path | None = None) -> tuple[Path | None, str | None]:
    """Find a model dir from a name or path: as given (a local dir, or a hub id in the local HF cache,
    offline). With `run_root` (the name came from a run's config), a relative name is first looked up in
    the run's launch dir, where prime-rl resolved it. Returns (dir, None) or (None, why not)."""
    if not name:
        return None, "no base model named"
    if run_root is not None and not Path(name).is_absolute() and (run_root / name).is_dir():
        return run_root / name, None
    try:
        return resolve_model_dir(name), None
    except CkptError as exc:
        return None, exc.message
