"""Where a model is: a local directory, or a hub id resolved from the local HF cache only (no network,
ever)."""
from __future__ import annotations

import os
import re
from pathlib import Path

from ...core.errors import CkptError, MissingFileError, MissingPathError, UsageError

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
    # lazy: importing huggingface_hub costs ~0.18 s (measured on the 2-core test machine), paid only
    # when a name is not a local directory
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    repo, revision = split_revision(text)
    try:
        snap = snapshot_download(repo, revision=revision, local_files_only=True, cache_dir=cache_dir)
    except HFValidationError as e:
        raise UsageError(f"{text!r} is neither an existing directory nor a valid hub id ({e})") from None
    except (LocalEntryNotFoundError, FileNotFoundError):
        where = cache_dir if cache_dir is not None else _default_cache()
        raise MissingFileError(
            f"{text!r} is not a local directory and not in the local HF cache ({where})",
            hint=f"download it with `hf download {repo}" + (f" --revision {revision}" if revision else "")
                 + "` or pass a directory") from None
    return Path(snap)


def _default_cache() -> str:
    from huggingface_hub import constants   # lazy: see resolve_model_dir (imported there already)

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
