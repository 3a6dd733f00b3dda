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
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
import stat
import threading
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import FormatError, MissingFileError, TruncatedFileError, UnsafeInputError
from . import remote
from .pread import pread_exact, pread_into

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
    "check_input",
    "identity",
    "input_identity",
    "input_tree",
    "is_plain_file_name",
    "kind_of",
    "open_input",
    "policy",
    "read_input",
    "read_json",
    "read_text",
    "read_toml",
    "register",
    "registered",
    "scan_tree",
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
_INPUTS: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar("ckpt_inputs", default=None)


@contextlib.contextmanager
def tracking() -> Iterator[set[str]]:
    """Record every path read inside the block (the CLI opens one per command)."""
    token = _INPUTS.set(set())
    try:
        yield _INPUTS.get()
    finally:
        _INPUTS.reset(token)


def register(path: str | os.PathLike) -> None:
    """Record `path` (a file, or the root of a tree) as an input of the running command."""
    seen = _INPUTS.get()
    if seen is not None:
        seen.add(os.path.realpath(path))


def registered() -> tuple[Path, ...]:
    seen = _INPUTS.get()
    return tuple(Path(p) for p in sorted(seen)) if seen else ()


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

    out = []
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
            os.close(fd)
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
    path: str | os.PathLike,
    *,
    root: str | os.PathLike | None = None,
    what: str = "file",
    want: str = "file",
    register_as_input: bool = True,
) -> tuple[str, os.stat_result]:
    """Check, without opening it, that `path` may be read: inside its tree `root` (when given),
    and a regular file (`want="file"`) or a directory (`want="dir"`). Returns (real path, stat).
    Raises MissingFileError / UnsafeInputError naming `path`."""
    p = Path(path)
    if "\0" in str(p):
        raise MissingFileError(f"{what} name holds a NUL byte", path=repr(str(p)))
    real = os.path.realpath(p)
    if root is not None:
        tree = input_tree(root)
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


def _check_sparse(p: Path, st: os.stat_result, what: str) -> None:
    allocated = getattr(st, "st_blocks", None)
    if allocated is None or _POLICY.allow_sparse or st.st_size < SPARSE_MIN_BYTES:
        return
    if remote.object_of_stat(st) is not None:  # a remote object's placeholder: its bytes are fetched by range
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


def open_input(path: str | os.PathLike, *, root: str | os.PathLike | None = None, what: str = "file") -> int:
    """A read-only fd of `path` after `check_input` (the caller closes it). Opened O_NOFOLLOW and
    O_NONBLOCK, so a FIFO swapped in after the check cannot block; the fd must be the checked inode."""
    p = Path(path)
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


def read_input(
    path: str | os.PathLike, *, root: str | os.PathLike | None = None, what: str = "file", max_bytes: int
) -> bytes:
    """The whole file, refused (before any byte is read) above `max_bytes`."""
    p = Path(path)
    fd = open_input(p, root=root, what=what)
    try:
        size = os.fstat(fd).st_size
        if size > max_bytes:
            raise UnsafeInputError(
                f"{what} is {size:,} bytes; a genuine one is far below the {max_bytes:,}-byte "
                "limit, so it is not read",
                path=p,
                hint="the file is crafted or damaged",
            )
        return pread_exact(fd, 0, size, path=p)
    finally:
        os.close(fd)


def read_text(
    path: str | os.PathLike,
    *,
    root: str | os.PathLike | None = None,
    what: str = "file",
    max_bytes: int = MAX_JSON_BYTES,
) -> str:
    p = Path(path)
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


def _values_ok(text: str, p: Path, what: str, limit: int, seps: str) -> None:
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
    path: str | os.PathLike,
    *,
    root: str | os.PathLike | None = None,
    what: str = "JSON file",
    max_bytes: int = MAX_JSON_BYTES,
    max_values: int = MAX_CONFIG_VALUES,
):
    """Parse a JSON file: valid UTF-8 JSON, no NaN/Infinity, at most MAX_JSON_DEPTH levels deep
    (a 100,000-deep array is a RecursionError in every walk of it), at most `max_values` values
    (MAX_TABLE_VALUES for an index of tensors), else a FormatError."""
    p = Path(path)
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
    path: str | os.PathLike,
    *,
    root: str | os.PathLike | None = None,
    what: str = "TOML file",
    max_bytes: int = MAX_TOML_BYTES,
) -> tuple[dict, str]:
    """(parsed, text) of a TOML file; a FormatError for anything that is not valid, shallow TOML of at
    most MAX_CONFIG_VALUES values, integers within Python's 4,300 digits."""
    p = Path(path)
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


def scan_tree(
    top: str | os.PathLike, *, root: str | os.PathLike, what: str = "entry"
) -> list[tuple[Path, int]]:
    """Every regular file under `top` (a file or a directory of the tree `root`) with its size,
    after checking each entry as `check_input` does (directories too): what a copy of `top` will
    read. Raises on the first entry that may not be read."""
    top = Path(top)
    out: list[tuple[Path, int]] = []
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
    Thread-safe: preads on shared fds need no lock."""

    def __init__(
        self,
        root: Path,
        *,
        what: str = "data file",
        missing_hint: str | None = None,
        truncated_hint: str = "the file is truncated (disk full or an interrupted copy?)",
    ):
        self.root = Path(root)
        self.what = what
        self.missing_hint = missing_hint
        self.truncated_hint = truncated_hint
        self.stats = ReadStats()
        self._fds: dict[str, int] = {}
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()

    def fd(self, rel: str, key: str = "") -> int:
        with self._lock:
            fd = self._fds.get(rel)
            if fd is None:
                p = self.root / rel
                if not os.path.lexists(p):
                    raise MissingFileError(f"{self.what} is missing", path=p, key=key, hint=self.missing_hint)
                try:  # symlinks out of the tree, FIFOs, devices, sparse files: refused here
                    fd = open_input(p, root=self.root, what=self.what)
                except (MissingFileError, FormatError) as exc:
                    raise type(exc)(
                        exc.message, path=p, key=key, hint=exc.hint or self.missing_hint
                    ) from None
                self._sizes[rel] = os.fstat(fd).st_size
                self._fds[rel] = fd
            return fd

    def size(self, rel: str, key: str = "") -> int:
        self.fd(rel, key)
        return self._sizes[rel]

    def check_range(self, rel: str, offset: int, length: int, key: str = "") -> int:
        """The fd of `rel` once `[offset, offset + length)` is known to lie inside it."""
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

    def hint(self, ranges) -> None:
        """`ranges` ([(rel, offset, length)]) are about to be read, roughly in this order: a remote file
        (`io.remote`) fetches adjacent ones in one request. Nothing for a local file."""
        if not remote.active():
            return
        by_file: dict[str, list[tuple[int, int]]] = {}
        for rel, offset, length in ranges:
            by_file.setdefault(rel, []).append((offset, length))
        for rel, spans in by_file.items():
            obj = remote.object_of_fd(self.fd(rel))
            if obj is not None:
                obj.hint(spans)

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)
