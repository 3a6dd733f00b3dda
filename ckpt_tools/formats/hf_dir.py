"""Hugging Face model directories: open one by its headers only, plan and index new shards.

`HFModelDir.open` reads config.json, the shard index and every shard's safetensors header (a few
KB each), validates them against each other, and reads no tensor bytes; tensors are then read one
at a time by name. `plan_shards` is pure and reproduces huggingface_hub's greedy shard split, so a
model we write is sharded (and named, and indexed) the way `save_pretrained` would shard it.
"""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Iterable, Sequence

import torch

from ..atomic import atomic_write_text
from ..errors import FormatError, MissingFileError, UsageError
from ..inputs import check_input, open_input, read_json, register
from .safetensors_io import ByteCounter, SafetensorsHeader, TensorInfo, read_header, read_raw, read_tensor

__all__ = [
    "WEIGHTS_NAME", "INDEX_NAME", "resolve_model_dir", "HFModelDir", "ShardSpec", "ShardPlan",
    "plan_shards", "parse_size", "write_index", "shard_file_name",
]

log = logging.getLogger(__name__)

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# Files that hold weights in some format. Never "non-weight" files to carry into a merged model:
# a stale pickle or an extra safetensors file next to new weights would be loaded by someone.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
_MAX_LISTED = 20


def _listing(problems: Sequence[str]) -> str:
    shown = "; ".join(problems[:_MAX_LISTED])
    if len(problems) > _MAX_LISTED:
        shown += f"; and {len(problems) - _MAX_LISTED} more"
    return shown


# --------------------------------------------------------------------------------------------
# locating a model


def resolve_model_dir(name_or_dir: str | os.PathLike, *, cache_dir: str | os.PathLike | None = None) -> Path:
    """A local directory, or a hub id (`org/name`) resolved from the local HF cache only (no
    network, ever). `cache_dir` overrides the cache location (default: HF_HUB_CACHE)."""
    p = Path(name_or_dir).expanduser()
    if p.is_dir():
        return p
    if p.exists():
        raise UsageError(f"{p} is a file; expected a model directory or a hub id")
    text = str(name_or_dir)
    if not _HUB_ID.match(text):
        raise MissingFileError("no such directory", path=p, hint="pass an existing model directory or a hub id")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        snap = snapshot_download(text, local_files_only=True, cache_dir=cache_dir)
    except HFValidationError as e:
        raise UsageError(f"{text!r} is neither an existing directory nor a valid hub id ({e})") from None
    except (LocalEntryNotFoundError, FileNotFoundError):
        where = cache_dir if cache_dir is not None else _default_cache()
        raise MissingFileError(
            f"{text!r} is not a local directory and not in the local HF cache ({where})",
            hint=f"download it with `hf download {text}` or pass a directory") from None
    return Path(snap)


def _default_cache() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


# --------------------------------------------------------------------------------------------
# reading a model directory


def _is_plain_file_name(name: str) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name
            and "\0" not in name and not os.path.isabs(name))


def _is_weight_like(name: str) -> bool:
    return name.endswith(_WEIGHT_SUFFIXES) or name.endswith(".index.json")


class HFModelDir:
    """An opened model directory: headers and config in memory, tensor bytes on disk.

    `keys()` lists tensors in disk order (shard files by name, then data offset). Shard files are
    opened on first read and kept open until `close()` (or the end of a `with` block)."""

    def __init__(self, path: Path, config: dict | None, headers: dict[str, SafetensorsHeader],
                 index_metadata: dict | None):
        self.path = path
        self.config = config                      # parsed config.json, None when absent
        self.headers = headers                    # shard file name -> header, sorted by name
        self.index_metadata = index_metadata      # the index's "metadata", None when unsharded
        self._tensors: dict[str, TensorInfo] = {}
        for header in headers.values():
            self._tensors.update(header.tensors)
        self._fds: dict[Path, int] = {}

    # -- construction
    @classmethod
    def open(cls, path: str | os.PathLike) -> "HFModelDir":
        path = Path(path)
        if not path.is_dir():
            raise MissingFileError("not a directory", path=path, hint="pass an HF model directory")
        register(path)   # the whole model dir is an input: no OUT inside it
        config = None
        cfg_path = path / "config.json"
        # lexists, not is_file: a config, shard or index that is a FIFO or a symlink out of the
        # model dir belongs to it and is refused by name when read (inputs.open_input)
        if os.path.lexists(cfg_path):
            config = _load_json(cfg_path, root=path)
            if not isinstance(config, dict):
                raise FormatError("config.json is not a JSON object", path=cfg_path)
        single, index = path / WEIGHTS_NAME, path / INDEX_NAME
        if os.path.lexists(single) and os.path.lexists(index):
            raise FormatError(f"has both {WEIGHTS_NAME} and {INDEX_NAME}; loaders disagree on which wins",
                              path=path, hint="delete the stale one")
        if os.path.lexists(single):
            return cls(path, config, {WEIGHTS_NAME: read_header(single)}, None)
        if os.path.lexists(index):
            headers, metadata = _open_index(path, index)
            return cls(path, config, headers, metadata)
        pickles = sorted(n for n in os.listdir(path) if n.endswith(".bin"))
        hint = (f"it only has pickle weights ({', '.join(pickles[:3])}); convert them to safetensors first"
                if pickles else "is this a Hugging Face model directory?")
        raise MissingFileError(f"no {WEIGHTS_NAME} or {INDEX_NAME}", path=path, hint=hint)

    # -- metadata (no tensor bytes)
    def keys(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __len__(self) -> int:
        return len(self._tensors)

    def info(self, name: str) -> TensorInfo:
        try:
            return self._tensors[name]
        except KeyError:
            raise FormatError("no such tensor in the model", path=self.path, key=name) from None

    @property
    def weight_files(self) -> list[Path]:
        return [self.path / n for n in self.headers]

    @property
    def total_bytes(self) -> int:
        """Sum of tensor data bytes (what an index's `metadata.total_size` records)."""
        return sum(t.nbytes for t in self._tensors.values())

    def non_weight_files(self) -> list[Path]:
        """Regular top-level files to carry into a derived model: config, generation config,
        tokenizer, chat template, README, ... Excludes our weights and index, any other weight-like
        file (see `skipped_entries`), hidden files and subdirectories. Sorted by name. Each is
        checked as an input now (a symlink out of the model dir is refused before anything runs)."""
        files = [self.path / n for n, kind in self._classify() if kind == "carry"]
        for f in files:
            check_input(f, root=self.path, what="model file")
        return files

    def skipped_entries(self) -> list[str]:
        """Top-level names neither weights of this model nor carried by `non_weight_files`
        (extra weight files, subdirectories, hidden entries), for callers to report."""
        return [n for n, kind in self._classify() if kind == "skip"]

    def _classify(self) -> list[tuple[str, str]]:
        ours = set(self.headers) | ({INDEX_NAME} if self.index_metadata is not None else set())
        out = []
        with os.scandir(self.path) as it:
            entries = sorted(it, key=lambda e: e.name)
        for entry in entries:
            if entry.name in ours:
                continue
            # is_file() follows symlinks: an HF cache snapshot is all symlinks into blobs/.
            carry = entry.is_file() and not entry.name.startswith(".") and not _is_weight_like(entry.name)
            out.append((entry.name, "carry" if carry else "skip"))
        return out

    # -- tensor bytes
    def fd(self, name: str) -> int:
        """An open read-only fd for the file holding tensor `name` (owned by this object)."""
        file = self.info(name).path
        fd = self._fds.get(file)
        if fd is None:
            if not os.path.lexists(file):
                raise MissingFileError("shard disappeared after the model was opened", path=file)
            fd = open_input(file, root=self.path, what="safetensors shard")
            self._fds[file] = fd
        return fd

    def read_tensor(self, name: str, *, counter: ByteCounter | None = None) -> torch.Tensor:
        return read_tensor(self.info(name), self.fd(name), counter=counter)

    def read_raw(self, name: str, *, counter: ByteCounter | None = None) -> bytearray:
        return read_raw(self.info(name), self.fd(name), counter=counter)

    def close(self) -> None:
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __enter__(self) -> "HFModelDir":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"HFModelDir({str(self.path)!r}, {len(self)} tensors in {len(self.headers)} file(s))"


def _load_json(path: Path, *, root: Path):
    return read_json(path, root=root, what=path.name)


def _open_index(root: Path, index_path: Path) -> tuple[dict[str, SafetensorsHeader], dict]:
    index = _load_json(index_path, root=root)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise FormatError("has no non-empty 'weight_map' object", path=index_path)
    metadata = index.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise FormatError("'metadata' is not an object", path=index_path)

    # 1. names: plain file names inside the directory, checked before any file is touched.
    unsafe = sorted({repr(f) for f in weight_map.values() if not _is_plain_file_name(f)})
    if unsafe:
        raise FormatError(f"weight_map points outside the model directory or at non-file names: {_listing(unsafe)}",
                          path=index_path, hint="weight_map values must be plain shard file names")
    # 2. files exist.
    files = sorted(set(weight_map.values()))
    missing = [f for f in files if not os.path.lexists(root / f)]
    if missing:
        raise MissingFileError(f"{len(missing)} shard(s) listed in the index are missing: {_listing(missing)}",
                               path=index_path, hint="re-download the model or restore the missing shards")
    # 3. headers agree with the index both ways.
    headers = {f: read_header(root / f) for f in files}
    problems = []
    for key, f in weight_map.items():
        if key not in headers[f].tensors:
            problems.append(f"index maps {key!r} to {f}, which has no such tensor")
    for f, header in headers.items():
        for key in header.tensors:
            mapped = weight_map.get(key)
            if mapped is None:
                problems.append(f"{f} holds {key!r}, which the index does not list")
            elif mapped != f:
                problems.append(f"{f} holds {key!r}, which the index maps to {mapped}")
    if problems:
        raise FormatError(f"index and shard headers disagree: {_listing(problems)}", path=index_path,
                          hint="the directory mixes files from different saves; re-download or re-export it")
    return headers, metadata


# --------------------------------------------------------------------------------------------
# planning and indexing new shards (pure)


_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes for "5GB" (HF convention: GB = 10**9), "500MB", "4GiB", "1.5GB", "123" or an int."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise UsageError(f"size {text} is negative")
        return text
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).upper() if m else None
    if not m or unit not in _SIZE_UNITS:
        raise UsageError(f"cannot parse size {text!r}",
                         hint="use e.g. 5GB (10**9 bytes), 500MB, 4GiB (2**30 bytes) or a number of bytes")
    try:
        return int(Decimal(m.group(1)) * _SIZE_UNITS[unit])
    except InvalidOperation:  # pragma: no cover - the regex admits only decimal numerals
        raise UsageError(f"cannot parse size {text!r}") from None


@dataclass(frozen=True)
class ShardSpec:
    file_name: str
    tensor_names: tuple[str, ...]      # in plan (input) order
    nbytes: int                        # tensor data bytes, header excluded


@dataclass(frozen=True)
class ShardPlan:
    shards: tuple[ShardSpec, ...]
    weight_map: dict[str, str]         # tensor name -> shard file name, in shard order
    total_size_bytes: int
    max_shard_bytes: int

    @property
    def is_sharded(self) -> bool:
        return len(self.shards) > 1

    def metadata(self) -> dict[str, int]:
        return {"total_size": self.total_size_bytes}


def shard_file_name(index: int, count: int) -> str:
    """`model-00001-of-00003.safetensors` (1-based), or `model.safetensors` when count == 1."""
    if count == 1:
        return WEIGHTS_NAME
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def plan_shards(entries: Iterable[tuple[str, int]], max_shard_bytes: int) -> ShardPlan:
    """Split (name, nbytes) entries into shards of at most `max_shard_bytes` of tensor data,
    exactly as huggingface_hub's `split_state_dict_into_shards_factory` does (what
    `save_pretrained` uses): walk in order; a tensor larger than the limit gets a shard of its
    own, appended when met; otherwise a tensor that would overflow the current shard closes it.
    No tensor is split, so a shard exceeds the limit only when one tensor does."""
    if not isinstance(max_shard_bytes, int) or isinstance(max_shard_bytes, bool) or max_shard_bytes <= 0:
        raise UsageError(f"max shard size must be a positive number of bytes, got {max_shard_bytes!r}")
    groups: list[list[tuple[str, int]]] = []
    current: list[tuple[str, int]] = []
    current_bytes = 0
    seen: set[str] = set()
    for name, nbytes in entries:
        if name in seen:
            raise UsageError(f"tensor {name!r} appears twice in the shard plan")
        if not isinstance(nbytes, int) or nbytes < 0:
            raise UsageError(f"tensor {name!r} has invalid size {nbytes!r}")
        seen.add(name)
        if nbytes > max_shard_bytes:
            groups.append([(name, nbytes)])
            continue
        if current_bytes + nbytes > max_shard_bytes:
            groups.append(current)
            current, current_bytes = [], 0
        current.append((name, nbytes))
        current_bytes += nbytes
    if current:
        groups.append(current)
    if not groups:
        raise UsageError("no tensors to write")
    shards = tuple(ShardSpec(shard_file_name(i + 1, len(groups)), tuple(n for n, _ in g), sum(b for _, b in g))
                   for i, g in enumerate(groups))
    weight_map = {n: s.file_name for s in shards for n in s.tensor_names}
    return ShardPlan(shards=shards, weight_map=weight_map, total_size_bytes=sum(s.nbytes for s in shards),
                     max_shard_bytes=max_shard_bytes)


def write_index(directory: str | os.PathLike, plan: ShardPlan, *, total_parameters: int | None = None) -> Path | None:
    """Write `model.safetensors.index.json` for a sharded plan the way transformers does
    (indent 2, sorted keys, trailing newline; `total_parameters` included when given, as
    transformers >= 4.56 writes it). Returns its path; for a one-shard plan writes nothing and
    returns None (transformers writes no index then)."""
    if not plan.is_sharded:
        return None
    metadata: dict[str, int] = dict(plan.metadata())
    if total_parameters is not None:
        metadata["total_parameters"] = total_parameters
    index = {"metadata": metadata, "weight_map": plan.weight_map}
    path = Path(directory) / INDEX_NAME
    atomic_write_text(path, json.dumps(index, indent=2, sort_keys=True) + "\n")
    return path
