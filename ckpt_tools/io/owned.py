"""What `--overwrite` may replace: only an earlier output of ckpt-tools.

Every OUT that `staging.AtomicOutputDir` commits carries a small marker file, `.ckpt-tools-output`
(JSON: the tool, its version, the command, and the top-level entries it wrote), written into the
staging dir just before the rename, so it appears with the output, atomically. `--overwrite`
replaces a directory only when that marker is there, is ours, and the directory holds nothing the
marker does not list; anything else is refused, naming what would have been deleted:
  - a folder of unrelated files, a home-like dir (dotfiles, `.git`), a downloaded model, a training
    checkpoint: no marker;
  - an earlier output someone added files to: the added entries are named;
  - a symlink or a plain file at OUT;
(an empty directory is replaced: there is nothing in it to lose)
  - `/`, the current directory or any directory above it (however it is spelled: `X/.`, `..`, an
    absolute path): compared by (st_dev, st_ino), never by name.
Outputs written before the marker existed are refused too (their layout alone cannot tell them
from a genuine checkpoint or model, which is exactly what must never be deleted): delete such an
OUT yourself, or write a new one. The marker is a hidden file, so every reader of our outputs
(DCP loaders, `from_pretrained`, PEFT, `ckpt verify`) ignores it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import json
import os
import stat
from pathlib import Path

from ..core.errors import OutputExistsError, UsageError
from ..core.units import human_bytes
from .files import write_new_file

__all__ = [
    "OUTPUT_MARKER",
    "TOOL",
    "check_not_cwd",
    "command_scope",
    "judge",
    "marker_text",
    "replace_check",
    "set_command",
    "tool_version",
    "write_marker",
]

OUTPUT_MARKER = ".ckpt-tools-output"
TOOL = "ckpt-tools"  # the distribution's name (pyproject.toml), whose version the marker records
_MAX_MARKER_BYTES = 1 << 20
_SHOWN = 8

_COMMAND: contextvars.ContextVar[str | None] = contextvars.ContextVar("ckpt_output_command", default=None)


@functools.cache
def tool_version() -> str:
    """The installed package's version (pyproject.toml's, from its metadata: written once); "unknown" for a
    source tree run without being installed."""
    from importlib.metadata import PackageNotFoundError, version  # lazy: ~20-90 ms, paid by writers only

    try:
        return version(TOOL)
    except PackageNotFoundError:
        return "unknown"


def set_command(name: str | None) -> None:
    """The command whose outputs are being written (recorded in their markers; set by the CLI)."""
    _COMMAND.set(name)


@contextlib.contextmanager
def command_scope(name: str):
    """`set_command(name)` for the duration (the library's functions: each is its command)."""
    token = _COMMAND.set(name)
    try:
        yield
    finally:
        _COMMAND.reset(token)


def write_marker(staging_dir: Path) -> None:
    """Write the marker into a finished staging dir, listing what is in it."""
    entries = sorted(n for n in os.listdir(staging_dir) if n != OUTPUT_MARKER)
    write_new_file(Path(staging_dir) / OUTPUT_MARKER, marker_text(entries))


def marker_text(entries: list[str], **extra) -> str:
    """The marker's content for an output whose top-level entries are `entries` (`extra`: more fields)."""
    doc = {
        "tool": TOOL,
        "version": tool_version(),
        "command": _COMMAND.get() or "library",
        "entries": entries,
    }
    return json.dumps({**doc, **extra}, indent=1) + "\n"


def _identity(p: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(p)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def check_not_cwd(out: Path) -> None:
    """Refuse an OUT that is `/`, the current directory or a directory above it, by identity."""
    me = _identity(out)
    if me is None:
        return
    here = Path(os.getcwd())
    for d in (here, *here.parents):
        if _identity(d) == me:
            what = (
                "the root directory"
                if d == Path(d.anchor)
                else "the current directory"
                if d == here
                else f"a directory above the current one ({here})"
            )
            raise UsageError(
                f"output {out} is {what}: writing OUT replaces the whole directory",
                hint="pass a new directory name for the output",
            )


def _listing(out: Path) -> list[str]:
    try:
        return sorted(os.listdir(out))
    except OSError as exc:
        raise OutputExistsError(
            f"already exists and cannot be listed ({exc.strerror})", path=out, hint="pass another output path"
        ) from None


def _tree_bytes(out: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(out):
        for n in files:
            try:
                total += os.lstat(os.path.join(root, n)).st_size
            except OSError:
                pass
    return total


def _named(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def _read_marker(out: Path) -> bytes | None:
    try:
        fd = os.open(
            out / OUTPUT_MARKER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        )
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_MARKER_BYTES:
            return None
        return os.read(fd, _MAX_MARKER_BYTES + 1)
    finally:
        os.close(fd)


def _parse_marker(raw: bytes | None) -> dict | None:
    """The marker's document when `raw` is one of ours, else None."""
    if raw is None or len(raw) > _MAX_MARKER_BYTES:
        return None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if (
        not isinstance(doc, dict)
        or doc.get("tool") != TOOL
        or not isinstance(doc.get("entries"), list)
        or not all(isinstance(e, str) for e in doc["entries"])
    ):
        return None
    return doc


def replace_check(out: Path) -> dict:
    """What `--overwrite` would delete at the existing path `out`, if it may: {"command", "version",
    "entries", "bytes"}. Raises OutputExistsError naming what is there when it is not an earlier
    output of ckpt-tools (see the module docstring)."""
    refuse = "--overwrite replaces only an earlier output of ckpt-tools"
    st = os.lstat(out)
    if stat.S_ISLNK(st.st_mode):
        raise OutputExistsError(
            f"is a symbolic link (to {os.readlink(out)}), not an earlier output; {refuse}",
            path=out,
            hint="remove the link yourself, or pass another output path",
        )
    if not stat.S_ISDIR(st.st_mode):
        raise OutputExistsError(
            f"is a file ({human_bytes(st.st_size)}), not an earlier output; {refuse}",
            path=out,
            hint="delete it yourself if you mean to, or pass another output path",
        )
    names = _listing(out)
    if not names:  # an empty directory (`mkdir OUT` first): nothing to lose
        return {"command": None, "version": None, "entries": 0, "bytes": 0}
    return judge(out, names, _read_marker(out), lambda: _tree_bytes(out))


def judge(where, names: list[str], marker: bytes | None, nbytes) -> dict:
    """The rule of `replace_check` over a listing: `names` the top-level entries at `where` (a local dir,
    or a bucket prefix: io.upload applies it there), `marker` the raw content of its `OUTPUT_MARKER`
    (None: not there), `nbytes()` its total size. Returns what `--overwrite` would delete, or raises."""
    doc = _parse_marker(marker)
    if doc is None:
        hidden = [n for n in names if n.startswith(".")]
        what = f"{len(names)} entries ({_named(names)})" + (
            f", {len(hidden)} of them hidden" if hidden else ""
        )
        raise OutputExistsError(
            f"is not an output of ckpt-tools (no {OUTPUT_MARKER} in it); --overwrite would delete "
            f"{what}; refusing",
            path=where,
            hint="pass a new output path, or delete it yourself if it is to go; outputs of ckpt-tools "
            "versions that wrote no marker are refused too",
        )
    extra = [n for n in names if n != OUTPUT_MARKER and n not in set(doc["entries"])]
    if extra:
        raise OutputExistsError(
            f"is an earlier output of `ckpt {doc.get('command')}`, but holds entries it did not write: "
            f"{_named(extra)}; --overwrite would delete them; refusing",
            path=where,
            hint="move those entries out first, or pass another output path",
        )
    return {
        "command": doc.get("command"),
        "version": doc.get("version"),
        "entries": len(names) - (OUTPUT_MARKER in names),
        "bytes": nbytes(),
    }
