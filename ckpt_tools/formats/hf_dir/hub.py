"""Where a model is: a local directory, or a hub id resolved from the local HF cache (no network), or,
under `--download` (`io.hub_fetch.allowing`), fetched into that cache first when the cache lacks it or
holds only part of what the command needs: `need="config"` (the top-level non-weight files: config,
tokenizer, chat template, ...) or `need="weights"` (those, the safetensors index and every shard it
names, or the top-level `*.safetensors` where there is no index; never the pickle, GGUF or other
weight formats, nothing in subfolders)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from ...core.errors import CkptError, FormatError, MissingFileError, MissingPathError, UsageError
from ...io import hub_fetch
from ...io.inputs import as_input, check_input, read_json, read_text
from .names import CONFIG_NAME, INDEX_NAME, is_weight_like

__all__ = ["NEEDS", "files_needed", "is_hub_id", "locate_model", "resolve_model_dir", "split_revision"]

NEEDS = ("config", "weights")
MAX_INDEX_VALUES = 4_000_000

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?(@[\w./-]+)?$")


def is_hub_id(text: str) -> bool:
    """`org/name`, `name`, or either with `@revision` (a branch, tag or commit, as `hf download` takes)."""
    return bool(_HUB_ID.match(text))


def split_revision(text: str) -> tuple[str, str | None]:
    """`org/name@rev` -> (`org/name`, `rev`); no `@`: (text, None)."""
    repo, sep, rev = text.partition("@")
    return (repo, rev) if sep else (text, None)


def resolve_model_dir(
    name_or_dir: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None, need: str = "weights"
) -> Path:
    """A local directory, or a hub id (`org/name`, `org/name@revision`) resolved from the local HF cache
    (no network), or under `--download` fetched into it first (the files `need` names, module doc) when
    the cache lacks them. `cache_dir` overrides the cache location (default: HF_HUB_CACHE)."""
    p = as_input(name_or_dir).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise UsageError(f"{p} is a file; expected a model directory or a hub id")
    text = str(name_or_dir)
    if not is_hub_id(text):
        raise MissingPathError(
            p, hint="pass an existing model directory or a hub id (org/name[@revision]) in the local HF cache"
        )
    repo, revision = split_revision(text)
    cache = Path(cache_dir) if cache_dir is not None else None
    snap = _cached_snapshot(text, repo, revision, cache)
    if hub_fetch.enabled() and (snap is None or not _holds(snap, need)):
        hub_fetch.download(
            repo,
            revision,
            lambda names, fetch_one: files_needed(names, need, fetch_one, text),
            cache_dir=cache,
        )
        snap = _cached_snapshot(text, repo, revision, cache)
    if snap is None:
        where = cache_dir if cache_dir is not None else _default_cache()
        raise MissingFileError(
            f"{text!r} is not a local directory and not in the local HF cache ({where})",
            hint="pass --download to fetch only the files this command needs into the cache, or download it "
            f"with `hf download {repo}" + (f" --revision {revision}" if revision else "") + "`, or pass a "
            "directory",
        )
    return snap


def _holds(snap: Path, need: str) -> bool:
    """Whether a cached snapshot already has what `need` asks (then --download fetches nothing)."""
    if need not in NEEDS:
        raise ValueError(f"need={need!r}: one of {NEEDS}")
    if not os.path.lexists(snap / CONFIG_NAME) and not os.path.lexists(snap / "adapter_config.json"):
        return False
    if need == "config":
        return True
    if os.path.lexists(snap / INDEX_NAME):
        try:
            index = read_json(
                snap / INDEX_NAME, root=snap.parent.parent, what=INDEX_NAME, max_values=MAX_INDEX_VALUES
            )
        except CkptError:
            return False
        shards = set((index.get("weight_map") or {}).values()) if isinstance(index, dict) else set()
        return bool(shards) and all(isinstance(f, str) and os.path.lexists(snap / f) for f in shards)
    return any(p.name.endswith(".safetensors") for p in snap.iterdir())


def files_needed(names: list[str], need: str, fetch_one, text: str) -> list[str]:
    """Which of a repo's files (`names`, paths in the repo) a command needing `need` fetches: the top-level
    non-weight files, and for "weights" the safetensors index and the shards it names (read through
    `fetch_one(INDEX_NAME)`, the index's path once in the cache) or the top-level `*.safetensors`."""
    top = [n for n in names if "/" not in n]
    out = [n for n in top if not is_weight_like(n)]
    if need == "config":
        return out
    if INDEX_NAME in top:
        path = fetch_one(INDEX_NAME)
        index = read_json(path, root=path.parent.parent.parent, what=INDEX_NAME, max_values=MAX_INDEX_VALUES)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise FormatError("has no non-empty 'weight_map' object", path=f"{text}/{INDEX_NAME}")
        shards = sorted({f for f in weight_map.values() if isinstance(f, str)})
        bad = [f for f in shards if "/" in f or f not in top]
        if bad:
            raise MissingFileError(
                f"the index names shard(s) the repo does not hold at the top level: {', '.join(bad[:5])}",
                path=f"{text}/{INDEX_NAME}",
                hint="the repo is incomplete or not a transformers model dir",
            )
        return out + [INDEX_NAME] + shards
    weights = [n for n in top if n.endswith(".safetensors")]
    if not weights:
        others = [n for n in top if is_weight_like(n)]
        raise FormatError(
            "the Hub repo has no safetensors weights"
            + (f" (only {', '.join(others[:3])})" if others else ""),
            path=text,
            hint="ckpt reads safetensors only; convert the weights first",
        )
    return out + weights


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
        raise UsageError(
            f"{text!r} is neither an existing directory nor a valid hub id (a repo id has no '--' "
            "or '..' and is at most 96 characters)"
        )
    rev = revision or "main"
    if rev.startswith("/") or any(part in ("", ".", "..") for part in rev.split("/")):
        raise UsageError(
            f"{text!r}: revision {rev!r} is not a branch, tag or commit (no '.', '..' or empty "
            "path components: a revision may not leave the cache)",
            hint="pass a branch, tag or commit hash, e.g. org/name@main",
        )
    folder = (cache if cache is not None else Path(_default_cache())) / ("models--" + repo.replace("/", "--"))
    if not folder.is_dir():
        return None
    ref = folder / "refs" / rev
    if os.path.lexists(ref):
        raw = read_text(ref, root=folder, what="HF cache ref", max_bytes=MAX_REF_BYTES)
        commit = raw.strip()
        if not _COMMIT.match(commit):
            raise FormatError(
                f"HF cache ref holds {commit[:80]!r}, not a commit hash",
                path=ref,
                hint="the cache is damaged or crafted; re-download the model with `hf download`",
            )
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
    fetched under --download). With `run_root` (the name came from a run's config), a relative name is first
    looked up in
    the run's launch dir, where prime-rl resolved it. Returns (dir, None) or (None, why not)."""
    if not name:
        return None, "no base model named"
    if run_root is not None and not Path(name).is_absolute() and (run_root / name).is_dir():
        return run_root / name, None
    try:
        return resolve_model_dir(name), None
    except CkptError as exc:
        return None, exc.message
