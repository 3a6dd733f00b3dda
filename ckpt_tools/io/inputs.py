"""The read side: every file a command reads is checked and opened here.

A checkpoint, model or adapter is a tree of files from a stranger. Before anything is opened:
  - an entry of a tree (a `.distcp` of a checkpoint, a shard or `config.json` of a model dir, the
    `orch.toml` found next to a run) must resolve inside that tree: a symlink that leaves it is
    refused (`--follow-symlinks` allows it). A Hugging Face cache snapshot's tree is the repo's
    cache dir, since its files are symlinks into `../../blobs/`. A path the user typed is theirs:
    only the entries inside it are checked;
  - it must be a regular file (or a directory where one is wanted): FIFOs, devices and sockets are
    refused by `stat`, never opened (an `open()` of a FIFO blocks until a writer appears);
  - a file that is mostly holes (over 64 MiB with under 1/64 of it allocated) is refused: no
    genuine checkpoint, model or config file is sparse, and a header there can claim gigabytes
    that cost nothing on disk (`--allow-sparse` allows it, for filesystems that report no blocks);
  - a file read whole (metadata, configs, a `.bin` adapter) has a size limit for what it is.
The file is then opened O_NOFOLLOW|O_NONBLOCK and must be the inode that was checked.

Every path read is also recorded as an INPUT of the command (`tracking()`, opened by the CLI for
each command): every file opened here, and every tree opened as a whole (a checkpoint dir by
`DcpCheckpoint.open`, a model dir by `HFModelDir.open`, an adapter dir by `open_peft_adapter`).
`atomic.AtomicOutputDir` refuses an OUT that is, contains or is inside any of them, whatever option
named it. (A config found in a run's outputs dir is an input; the outputs dir is not, so OUT may be
written beside the checkpoint in it.)

A URL is read in place (`io.remote`): `as_input` makes a URL string a `RemotePath`, whose files open here
as `RemoteObject`s (checked as a local file is: a regular file, not a directory; its identity pinned),
read by range. What `open_input` returns is a *range reader*: a local file's fd (an int, read by
`pread`), or a remote object (its `read_into`); `io.pread` reads either, `close_input` closes either. A
format or op holds readers without asking which they are.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import shutil
import stat
import threading
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

from ..core.errors import (
    FormatError,
    MissingFileError,
    MissingPathError,
    TruncatedFileError,
    UnsafeInputError,
    UsageError,
)
from . import remote
from .pread import RangeReader, pread_exact, pread_into
from .remote import RemotePath, as_input
from .remote_object import RemoteObject

__all__ = [
    "IDENTITY_EDGE_BYTES",
    "MAX_CONFIG_VALUES",
    "MAX_JSON_BYTES",
    "MAX_JSON_DEPTH",
    "MAX_METADATA_BYTES",
    "MAX_TABLE_VALUES",
    "MAX_TOML_BYTES",
    "OpenFiles",
    "ReadPolicy",
    "ReadStats",
    "ancestry",
    "as_input",
    "bounded",
    "check_input",
    "close_input",
    "existing_urls",
    "free_bytes",
    "identity",
    "input_identity",
    "input_tree",
    "is_plain_file_name",
    "is_url",
    "kind_of",
    "lexists",
    "list_names",
    "local_dir",
    "mtime_of",
    "open_input",
    "policy",
    "read_input",
    "read_json",
    "read_text",
    "read_toml",
    "reader_size",
    "real_name",
    "register",
    "registered",
    "registered_urls",
    "remote_source",
    "scan_tree",
    "search_top",
    "set_policy",
    "tracking",
]

# Whole-file read limits, each far above what a genuine file of that kind holds: a DCP `.metadata`
# of a 126 GB Qwen3-32B checkpoint is ~2 MB; configs, indexes and manifests are KBs to a few MB.
MAX_METADATA_BYTES = 1 << 30
MAX_JSON_BYTES = 256 << 20
MAX_TOML_BYTES = 16 << 20
MAX_JSON_DEPTH = 64
# Values (containers and scalars) a JSON/TOML file may hold, counted on its text before it is parsed
# (`_values_ok`): parsing is ~140 bytes of RSS per value (39 MB of `{}`: 13M dicts, 1.85 GiB, 18 s).
# A run config, `config.json` or `adapter_config.json` holds hundreds; an `index.json` or a slim
# manifest holds a few per tensor (the largest public models have ~10^5 tensors).
MAX_CONFIG_VALUES = 200_000
MAX_TABLE_VALUES = 4_000_000
SPARSE_MIN_BYTES = 64 << 20  # files below this are never called sparse
SPARSE_RATIO = 64  # allocated * SPARSE_RATIO < size: mostly holes


@dataclass
class ReadPolicy:
    follow_symlinks: bool = False
    allow_sparse: bool = False


_POLICY = ReadPolicy()


def set_policy(*, follow_symlinks: bool = False, allow_sparse: bool = False) -> None:
    """Set by the CLI from `ckpt --follow-symlinks / --allow-sparse` (default: both off)."""
    _POLICY.follow_symlinks = bool(follow_symlinks)
    _POLICY.allow_sparse = bool(allow_sparse)


def policy() -> ReadPolicy:
    return _POLICY


# ------------------------------------------------------------------------------------ inputs
_INPUTS: contextvars.ContextVar[set | None] = contextvars.ContextVar("ckpt_inputs", default=None)
AnyPath = str | os.PathLike | RemotePath


@contextlib.contextmanager
def tracking() -> Iterator[set]:
    """Record every path read inside the block (the CLI opens one per command), in one remote session
    (`io.remote.session`: the command's listings, pinned objects and bytes fetched)."""
    token = _INPUTS.set(set())
    try:
        with remote.session():
            yield _INPUTS.get() or set()
    finally:
        _INPUTS.reset(token)


def register(path: AnyPath) -> None:
    """Record `path` (a file, or the root of a tree) as an input of the running command."""
    seen = _INPUTS.get()
    if seen is not None:
        seen.add(path if isinstance(path, RemotePath) else os.path.realpath(path))


def registered() -> tuple[Path, ...]:
    """The local inputs of the running command (real paths)."""
    seen = _INPUTS.get()
    return tuple(Path(p) for p in sorted(p for p in seen if isinstance(p, str))) if seen else ()


def registered_urls() -> list[str]:
    """The URLs (shown, without credentials) of the running command's remote inputs."""
    seen = _INPUTS.get()
    return sorted({str(p) for p in seen if isinstance(p, RemotePath)}) if seen else []


def remote_source(path) -> RemoteObject | None:
    """The opened remote object a URL input's file is (what a writer copies server-side), None for a
    local file."""
    p = as_input(path)
    return p.open(what="file") if isinstance(p, RemotePath) else None


def bounded(found, given):
    """`found` (a file or dir a resolver found around the input `given`), or None where `given` is a URL
    and `found` lies above it: what surrounds a URL is no part of the input the user named."""
    if found is None or not isinstance(given, RemotePath):
        return found
    return found if isinstance(found, RemotePath) and found.within_given(given) else None


def existing_urls(*values) -> None:
    """Every URL among `values` (or in a list of them) names something: else `no such file or directory:
    URL` (MissingPathError, exit 2), the same words as a missing local path's (the CLI's and the api's
    one check of a URL input)."""
    for v in values:
        for one in v if isinstance(v, (list, tuple)) else (v,):
            if one is not None and is_url(one):
                p = as_input(one)
                if not p.exists():
                    raise MissingPathError(str(p))


def lexists(path) -> bool:
    """Whether anything is at `path` (a dangling symlink too; a URL's file or dir)."""
    p = as_input(path)
    return p.exists() if isinstance(p, RemotePath) else os.path.lexists(p)


def free_bytes(path) -> int | None:
    """The free space of the filesystem holding `path`; None for a URL (a store's is not ours to tell)."""
    p = as_input(path)
    return None if isinstance(p, RemotePath) else shutil.disk_usage(p).free


def mtime_of(path) -> float | None:
    """When the file at `path` was last written; None when it is not there, and for a URL's file (a store's
    times are not asked: a listing's clock is not this machine's)."""
    p = as_input(path)
    if isinstance(p, RemotePath):
        return None
    try:
        return os.stat(p).st_mtime
    except OSError:
        return None


def list_names(path) -> list[str]:
    """The names in the directory `path` (a URL's too), sorted."""
    p = as_input(path)
    return [c.name for c in p.iterdir()] if isinstance(p, RemotePath) else sorted(os.listdir(p))


def real_name(path) -> str:
    """`path` as one name per file, for telling two names of one file apart: the real path, or the URL."""
    p = as_input(path)
    return str(p) if isinstance(p, RemotePath) else os.path.realpath(p)


def local_dir(path, why: str, *, hint: str | None = None) -> Path:
    """`path` as a local Path, for what only a local file or dir can be (changed in place, locked); a URL
    is a UsageError: `why`, and this one is at a URL."""
    if isinstance(path, RemotePath) or remote.is_url(path):
        raise UsageError(f"{why}, and this one is at a URL", path=str(as_input(path)), hint=hint)
    return Path(path)


def search_top(given):
    """Where a resolver climbing from the input `given` must stop: the URL the user gave, None locally."""
    return given.given() if isinstance(given, RemotePath) else None


# ------------------------------------------------------------------------------------ identity
def identity(path: str | os.PathLike) -> tuple[int, int] | None:
    """(st_dev, st_ino) of what `path` names (links followed), None when nothing is there. Two paths
    that reach one directory through another mount of it (a bind mount, as in containers) or a
    symlink have the same identity, whatever their names."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino


def ancestry(path: str | os.PathLike) -> set[tuple[int, int]]:
    """The identities of `path` and of every directory above it, walked both by its spelling (up
    through a bind mount's own parents) and by its real path (up through a symlink's target's): a
    path lies inside a directory D exactly when identity(D) is in this set."""
    p = Path(os.path.abspath(Path(path).expanduser()))
    out = set()
    for chain in (p, Path(os.path.realpath(p))):
        for d in (chain, *chain.parents):
            i = identity(d)
            if i is not None:
                out.add(i)
    return out


IDENTITY_EDGE_BYTES = 64 << 10


def _identity_name(real: str) -> str:
    """A path as ranks on different nodes can compare it: inside a Hugging Face cache, from the repo's
    `models--org--name` on (blobs are named by their content's hash, snapshots by their commit), so
    two nodes' caches at different places agree where they hold the same revision; elsewhere the
    real path (multi-rank outputs and inputs live on a filesystem every node sees at one path)."""
    parts = Path(real).parts
    for i in range(len(parts) - 1, 0, -1):
        if (
            parts[i].startswith(("models--", "datasets--", "spaces--"))
            and i + 1 < len(parts)
            and parts[i + 1] in ("blobs", "snapshots", "refs")
        ):
            return "hf-cache:" + "/".join(parts[i:])
    return real


def input_identity() -> list[list]:
    """The identity of every input read so far (`registered`), JSON-able, for ranks to compare before
    work: [name, size, sha256 of the first and last IDENTITY_EDGE_BYTES] per file (the headers of
    safetensors and zip items are at the start), [name, "dir"] per tree root."""
    import hashlib

    out: list[list] = []
    seen = _INPUTS.get() or set()
    for rp in sorted((p for p in seen if isinstance(p, RemotePath)), key=str):
        if rp.is_dir():
            out.append([str(rp), "dir"])
        else:
            obj = rp.open(what="input")
            out.append([str(rp), obj.size, str(obj.identity)])
    for p in registered():
        real = str(p)
        name = _identity_name(real)
        try:
            st = os.stat(real)
        except OSError:
            out.append([name, "gone"])
            continue
        if stat.S_ISDIR(st.st_mode):
            out.append([name, "dir"])
            continue
        fd = open_input(real, what="input")
        try:
            h = hashlib.sha256(pread_exact(fd, 0, min(st.st_size, IDENTITY_EDGE_BYTES), path=real))
            if st.st_size > IDENTITY_EDGE_BYTES:
                tail = max(IDENTITY_EDGE_BYTES, st.st_size - IDENTITY_EDGE_BYTES)
                h.update(pread_exact(fd, tail, st.st_size - tail, path=real))
        finally:
            close_input(fd)
        out.append([name, st.st_size, h.hexdigest()])
    return out


# ------------------------------------------------------------------------------------ checks
def is_plain_file_name(name) -> bool:
    """A name that can only mean a file directly inside its directory (no separator, no `..`, no NUL):
    what an index or a checkpoint's metadata may name, and nothing that leaves the tree."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
        and not os.path.isabs(name)
    )


def _within(inner: str, outer: str) -> bool:
    return inner == outer or inner.startswith(outer.rstrip(os.sep) + os.sep)


def input_tree(root: str | os.PathLike) -> str:
    """The real path of the tree `root` belongs to: `root` itself, or for a directory inside a
    Hugging Face cache snapshot (`.../models--org--name/snapshots/<rev>/...`) the repo's cache dir,
    whose `blobs/` the snapshot's symlinks point into."""
    real = os.path.realpath(root)
    parts = Path(real).parts
    for i in range(len(parts) - 2, 0, -1):
        if parts[i] == "snapshots" and parts[i - 1].startswith(("models--", "datasets--", "spaces--")):
            return str(Path(*parts[:i]))
    return real


_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISLNK, "a symlink"),
)


def kind_of(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def check_input(
    path: AnyPath,
    *,
    root: AnyPath | None = None,
    what: str = "file",
    want: str = "file",
    register_as_input: bool = True,
) -> tuple[str, os.stat_result]:
    """Check, without opening it, that `path` may be read: inside its tree `root` (when given),
    and a regular file (`want="file"`) or a directory (`want="dir"`). Returns (real path, stat).
    Raises MissingFileError / UnsafeInputError naming `path`. A URL's file is checked by its listing
    (a URL's tree holds no links)."""
    if is_url(path):
        return _check_remote(as_input(path), what, want, register_as_input)
    p = Path(_local(path))
    if "\0" in str(p):
        raise MissingFileError(f"{what} name holds a NUL byte", path=repr(str(p)))
    real = os.path.realpath(p)
    if root is not None:
        tree = input_tree(_local(root))
        if not _POLICY.follow_symlinks and not _within(real, tree):
            raise UnsafeInputError(
                f"{what} resolves to {real}, outside {tree}: a symlink that leaves the directory it belongs "
                f"to; "
                "refusing to read through it",
                path=p,
                hint="if you made this link yourself, pass `ckpt --follow-symlinks ...`; otherwise delete it",
            )
    try:
        st = os.stat(real)
    except FileNotFoundError:
        if os.path.lexists(p):
            raise MissingFileError(f"{what} is a dangling symlink (to {real})", path=p) from None
        raise MissingFileError(f"no such {what}", path=p) from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the name
        raise MissingFileError(
            f"cannot stat {what}: {getattr(exc, 'strerror', None) or exc}", path=p
        ) from None
    ok = stat.S_ISREG(st.st_mode) if want == "file" else stat.S_ISDIR(st.st_mode)
    if not ok:
        expected = "a regular file" if want == "file" else "a directory"
        raise UnsafeInputError(
            f"{what} is {kind_of(st.st_mode)}, expected {expected}; refusing to open it",
            path=p,
            hint="replace it with the real file (a FIFO or device would block or never end)",
        )
    if register_as_input:
        register(real)  # the file itself; readers of a whole tree (a checkpoint, a model dir) register it
    return real, st


def _check_remote(p, what: str, want: str, register_as_input: bool):
    if not p.exists():
        raise MissingFileError(f"no such {what}", path=p)
    if p.is_dir() != (want == "dir"):
        expected = "a regular file" if want == "file" else "a directory"
        raise UnsafeInputError(
            f"{what} is {'a directory' if p.is_dir() else 'a regular file'}, expected {expected}; "
            "refusing to open it",
            path=p,
        )
    if register_as_input:
        register(p)
    return str(p), p.stat()


def _local(path: AnyPath) -> str | os.PathLike:
    """`path`, known here not to be a URL (the caller has branched on `is_url`)."""
    assert not isinstance(path, RemotePath)
    return path


def is_url(value) -> bool:
    return remote.is_url(value)


def _check_sparse(p: Path, st: os.stat_result, what: str) -> None:
    allocated = getattr(st, "st_blocks", None)
    if allocated is None or _POLICY.allow_sparse or st.st_size < SPARSE_MIN_BYTES:
        return
    allocated *= 512
    if allocated * SPARSE_RATIO < st.st_size:
        raise UnsafeInputError(
            f"{what} is a sparse file: {st.st_size:,} bytes long but only {allocated:,} allocated on disk; a "
            f"genuine "
            "checkpoint or model file is never mostly holes (crafted, or an interrupted download), and its "
            "header could claim sizes that cost nothing on disk",
            path=p,
            hint="re-download it; if your filesystem reports no allocated blocks, pass `ckpt --allow-sparse "
            "...`",
        )


def open_input(path: AnyPath, *, root: AnyPath | None = None, what: str = "file") -> int | RemoteObject:
    """The range reader of `path` after `check_input` (the caller closes it: `close_input`): a local
    file's read-only fd, opened O_NOFOLLOW and O_NONBLOCK, so a FIFO swapped in after the check cannot
    block, and the fd must be the checked inode; a URL's file as its RemoteObject, its identity pinned."""
    if is_url(path):
        rp = cast(RemotePath, as_input(path))
        _check_remote(rp, what, "file", True)
        return rp.open(what=what)
    p = Path(_local(path))
    real, st = check_input(p, root=root, what=what)
    _check_sparse(p, st, what)
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(real, flags)
    except OSError as exc:
        raise MissingFileError(f"cannot open {what}: {exc.strerror}", path=p) from None
    now = os.fstat(fd)
    if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(now.st_mode):
        os.close(fd)
        raise UnsafeInputError(f"{what} changed while it was being opened", path=p, hint="retry")
    return fd


def close_input(reader: int | RangeReader) -> None:
    """Close what `open_input` returned (a remote object holds nothing open)."""
    if isinstance(reader, int):
        os.close(reader)


def reader_size(reader: int | RangeReader) -> int:
    """The size of the file behind a range reader (as checked when it was opened, for a remote one)."""
    return os.fstat(reader).st_size if isinstance(reader, int) else reader.size


def read_input(path: AnyPath, *, root: AnyPath | None = None, what: str = "file", max_bytes: int) -> bytes:
    """The whole file, refused (before any byte is read) above `max_bytes`."""
    p = as_input(path)
    fd = open_input(p, root=root, what=what)
    try:
        size = reader_size(fd)
        if size > max_bytes:
            raise UnsafeInputError(
                f"{what} is {size:,} bytes; a genuine one is far below the {max_bytes:,}-byte "
                "limit, so it is not read",
                path=p,
                hint="the file is crafted or damaged",
            )
        return pread_exact(fd, 0, size, path=p)
    finally:
        close_input(fd)


def read_text(
    path: AnyPath, *, root: AnyPath | None = None, what: str = "file", max_bytes: int = MAX_JSON_BYTES
) -> str:
    p = as_input(path)
    data = read_input(p, root=root, what=what, max_bytes=max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FormatError(f"{what} is not UTF-8 text ({exc.reason} at byte {exc.start})", path=p) from None


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _depth_ok(obj, limit: int) -> bool:
    todo = [(obj, 1)]
    while todo:
        o, d = todo.pop()
        if d > limit:
            return False
        if isinstance(o, dict):
            todo.extend((v, d + 1) for v in o.values())
        elif isinstance(o, list):
            todo.extend((v, d + 1) for v in o)
    return True


def _values_ok(text: str, p, what: str, limit: int, seps: str) -> None:
    """Refuse, before parsing, text that could hold more than `limit` values: every container opens with
    `{` or `[` and every further value follows a separator (`,`, or a newline in TOML). An upper bound:
    the characters are counted inside strings too."""
    n = text.count("{") + text.count("[") + sum(text.count(c) for c in seps)
    if n > limit:
        raise FormatError(
            f"{what} could hold {n:,} values (a genuine one holds far fewer than {limit:,}); it is "
            "not parsed",
            path=p,
            hint="the file is crafted or damaged; use an intact copy",
        )


def read_json(
    path: AnyPath,
    *,
    root: AnyPath | None = None,
    what: str = "JSON file",
    max_bytes: int = MAX_JSON_BYTES,
    max_values: int = MAX_CONFIG_VALUES,
):
    """Parse a JSON file: valid UTF-8 JSON, no NaN/Infinity, at most MAX_JSON_DEPTH levels deep
    (a 100,000-deep array is a RecursionError in every walk of it), at most `max_values` values
    (MAX_TABLE_VALUES for an index of tensors), else a FormatError."""
    p = as_input(path)
    text = read_text(p, root=root, what=what, max_bytes=max_bytes)
    _values_ok(text, p, what, max_values, ",")
    try:
        obj = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise FormatError(
            f"not valid JSON: nested too deeply (over {MAX_JSON_DEPTH} levels)", path=p
        ) from None
    except ValueError as exc:
        raise FormatError(f"not valid JSON: {exc}", path=p) from None
    if not _depth_ok(obj, MAX_JSON_DEPTH):
        raise FormatError(
            f"not valid JSON for a {what}: nested more than {MAX_JSON_DEPTH} levels deep", path=p
        )
    return obj


def read_toml(
    path: AnyPath, *, root: AnyPath | None = None, what: str = "TOML file", max_bytes: int = MAX_TOML_BYTES
) -> tuple[dict, str]:
    """(parsed, text) of a TOML file; a FormatError for anything that is not valid, shallow TOML of at
    most MAX_CONFIG_VALUES values, integers within Python's 4,300 digits."""
    p = as_input(path)
    text = read_text(p, root=root, what=what, max_bytes=max_bytes)
    _values_ok(text, p, what, MAX_CONFIG_VALUES, ",\n")
    try:
        data = tomllib.loads(text)
    except RecursionError:
        raise FormatError(
            f"not valid TOML: nested too deeply (over {MAX_JSON_DEPTH} levels)", path=p
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise FormatError(f"not valid TOML: {exc}", path=p) from None
    except ValueError as exc:  # an integer past sys.get_int_max_str_digits() (4,300 digits)
        raise FormatError(
            f"not valid TOML: {str(exc).split(';')[0]}",
            path=p,
            hint="the file is crafted or damaged; use an intact copy",
        ) from None
    if not _depth_ok(data, MAX_JSON_DEPTH):
        raise FormatError(
            f"not valid TOML for a {what}: nested more than {MAX_JSON_DEPTH} levels deep", path=p
        )
    return data, text


def scan_tree(top: AnyPath, *, root: AnyPath, what: str = "entry") -> list[tuple]:
    """Every regular file under `top` (a file or a directory of the tree `root`) with its size,
    after checking each entry as `check_input` does (directories too): what a copy of `top` will
    read. Raises on the first entry that may not be read."""
    if is_url(top):
        return _scan_remote(as_input(top), what)
    top = Path(_local(top))
    out: list[tuple] = []
    real, st = check_input(top, root=root, what=what, want="dir" if os.path.isdir(top) else "file")
    if stat.S_ISREG(st.st_mode):
        return [(top, st.st_size)]
    todo, seen = [top], {real}
    while todo:
        d = todo.pop()
        for name in sorted(os.listdir(d)):
            p = d / name
            real, st = check_input(
                p, root=root, what=what, want="dir" if os.path.isdir(p) else "file", register_as_input=False
            )
            if stat.S_ISDIR(st.st_mode):
                if real in seen:  # a symlink to a directory already walked: a loop
                    raise UnsafeInputError(
                        f"{what} is a symlink back to {real}: a directory loop",
                        path=p,
                        hint="delete the link",
                    )
                seen.add(real)
                todo.append(p)
            else:
                out.append((p, st.st_size))
    return sorted(out)


def _scan_remote(top, what: str) -> list[tuple]:
    """`scan_tree` of a URL: its files (a URL's tree holds no links, so no loops)."""
    _, st = _check_remote(top, what, "dir" if top.is_dir() else "file", True)
    if not top.is_dir():
        return [(top, st.st_size)]
    out, todo = [], [top]
    while todo:
        d = todo.pop()
        for p in d.iterdir():
            if p.is_dir():
                todo.append(p)
            else:
                out.append((p, p.stat().st_size))
    return sorted(out)


# ------------------------------------------------------------------------------------ open trees
@dataclass
class ReadStats:
    """Every byte range read from data files, for tests and benchmarks."""

    bytes_read: int = 0
    ranges: list[tuple[str, int, int]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, file: str, offset: int, length: int) -> None:
        with self._lock:
            self.bytes_read += length
            self.ranges.append((file, offset, length))


class OpenFiles:
    """The data files of one input tree `root`, by name relative to it: each opened once through the
    read side's checks (no symlink out of the tree, no FIFO or device, not sparse), kept open until
    `close()`. Reads are range-checked against the size seen at open and counted in `stats`.
    Thread-safe: preads on shared fds need no lock. `root` may be a URL's `RemotePath`: its files are
    then remote objects (`fd()` gives each file's range reader, an fd or a RemoteObject)."""

    def __init__(
        self,
        root: AnyPath,
        *,
        what: str = "data file",
        missing_hint: str | None = None,
        truncated_hint: str = "the file is truncated (disk full or an interrupted copy?)",
    ):
        self.root = as_input(root)
        self.what = what
        self.missing_hint = missing_hint
        self.truncated_hint = truncated_hint
        self.stats = ReadStats()
        self._fds: dict[str, int | RemoteObject] = {}
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()

    def fd(self, rel: str, key: str = "") -> int | RemoteObject:
        """The range reader of `rel` (opened once)."""
        with self._lock:
            fd = self._fds.get(rel)
            if fd is None:
                p = self.root / rel
                if not (p.exists() if isinstance(p, RemotePath) else os.path.lexists(p)):
                    raise MissingFileError(f"{self.what} is missing", path=p, key=key, hint=self.missing_hint)
                try:  # symlinks out of the tree, FIFOs, devices, sparse files: refused here
                    fd = open_input(p, root=self.root, what=self.what)
                except (MissingFileError, FormatError) as exc:
                    raise type(exc)(
                        exc.message, path=p, key=key, hint=exc.hint or self.missing_hint
                    ) from None
                self._sizes[rel] = reader_size(fd)
                self._fds[rel] = fd
            return fd

    def size(self, rel: str, key: str = "") -> int:
        self.fd(rel, key)
        return self._sizes[rel]

    def check_range(self, rel: str, offset: int, length: int, key: str = "") -> int | RemoteObject:
        """The range reader of `rel` once `[offset, offset + length)` is known to lie inside it."""
        fd = self.fd(rel, key)
        size = self._sizes[rel]
        if offset < 0 or length < 0 or offset + length > size:
            raise TruncatedFileError(
                f"item [{offset}, {offset + length}) lies beyond the end of the file ({size} bytes)",
                path=self.root / rel,
                key=key,
                hint=self.truncated_hint,
            )
        return fd

    def read(self, rel: str, offset: int, length: int, key: str = "") -> bytes:
        fd = self.check_range(rel, offset, length, key)
        data = pread_exact(fd, offset, length, path=self.root / rel, key=key, hint=self.truncated_hint)
        self.stats.add(rel, offset, length)
        return data

    def read_into(self, rel: str, offset: int, buf, key: str = "") -> None:
        n = len(memoryview(buf).cast("B"))
        fd = self.check_range(rel, offset, n, key)
        pread_into(fd, buf, offset, path=self.root / rel, key=key, hint=self.truncated_hint)
        self.stats.add(rel, offset, n)

    def kernel_copy(self, rel: str) -> bool:
        """Whether a range of `rel` can be copied file to file in the kernel (`io.copy.copy_range`) after
        it was read to check it, at no second cost: a local file's (its pages are cached); a remote
        object's bytes come over the network, so a reader holds what it read once instead."""
        return isinstance(self.fd(rel), int)

    def hint(self, ranges) -> None:
        """`ranges` ([(rel, offset, length)]) are about to be read, roughly in this order: a remote file
        (`io.remote`) fetches adjacent ones in one request. Nothing for a local file."""
        if not isinstance(self.root, RemotePath):
            return
        by_file: dict[str, list[tuple[int, int]]] = {}
        for rel, offset, length in ranges:
            by_file.setdefault(rel, []).append((offset, length))
        for rel, spans in by_file.items():
            obj = self.fd(rel)
            if isinstance(obj, RemoteObject):
                obj.hint(spans)

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            close_input(fd)
