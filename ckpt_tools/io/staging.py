"""Safe outputs: nothing appears at OUT until it is complete.

`AtomicOutputDir(out)` hands out a hidden sibling temp directory `.OUT.tmp-<pid>-<hex>` (same
filesystem, so the final `os.rename` is atomic), holds the lock `.OUT.lock` while it is in use, and
on a clean exit fsyncs everything and renames the temp directory to OUT. On any exception
(KeyboardInterrupt, and SIGTERM once `install_signal_handlers()` ran, included) it deletes the
temp directory and the lock. SIGKILL cannot be caught: then a `.OUT.tmp-*` directory is left
behind, never a partial OUT, and the next run for the same OUT deletes it (its pid is dead).

The lock is `lock.OutputLock` on `.OUT.lock`. Every file written inside the temp dir is created
fresh (`files.create_new`); what is copied from an input is read through `inputs.open_input`
(`copy.copy_input_file`, `copy.copy_input_tree`). OUT, and every other output path
(`check_output_file`), may not be, contain or be inside any input: the explicit `inputs=` and every
path the command has read (`registered_inputs()`). `preflight()` runs those checks (and the free-disk
check) before any input byte is read, for commands that plan long before they write. An input is
compared by identity too, (st_dev, st_ino) of it and of every directory above OUT (`inputs.ancestry`):
another mount of the input (a bind mount) has other names but the same inodes.

`--overwrite` replaces only an earlier output of ckpt-tools: every committed OUT carries the marker
`owned.OUTPUT_MARKER`, written into the temp dir before the rename; anything else at OUT is refused,
naming what would be deleted (`owned.replace_check`). `describe()` is what a dry run reports: what
writing OUT would replace, after the same refusals as the real run.
"""

from __future__ import annotations

import contextvars
import errno
import logging
import os
import re
import secrets
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from ..core.errors import DiskSpaceError, OutputExistsError, RankFailed, UsageError
from ..core.units import human_bytes
from . import remote
from .files import exchange_paths, fsync_path, fsync_tree, link_entry, make_dirs, remove_path
from .inputs import ancestry, identity, is_url
from .inputs import registered as registered_inputs
from .lock import OutputLock, lock_path_for, pid_alive
from .owned import check_not_cwd, replace_check, write_marker
from .signals import signals_deferred

__all__ = [
    "OVERWRITE_HINT",
    "AtomicOutputDir",
    "InPlaceDir",
    "SharedOutputDir",
    "check_against_inputs",
    "check_output_file",
    "clean_stale_temps",
    "committed_outputs",
    "describe_output",
    "mount_point",
    "note_committed",
    "reset_committed",
]

# every command that writes OUT takes --overwrite: the one message when OUT is already there
OVERWRITE_HINT = "pass --overwrite to replace it, or another output path"

log = logging.getLogger(__name__)

# The outputs this command has put in place, complete: a Ctrl-C that lands after one was committed says so
# (the CLI's error edge), instead of "nothing was written".
_COMMITTED: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("ckpt_committed", default=())


def committed_outputs() -> tuple[str, ...]:
    """The outputs committed (renamed into place, complete) since `reset_committed`."""
    return _COMMITTED.get()


def note_committed(out: str | os.PathLike) -> None:
    """Record `out` as committed: complete and in place (an OUT renamed in, an in-place edit swapped in)."""
    _COMMITTED.set(_COMMITTED.get() + (str(out),))


def reset_committed() -> None:
    """Forget the committed outputs (a new command starts)."""
    _COMMITTED.set(())


def mount_point(path: Path) -> Path:
    p = path
    while not os.path.ismount(p) and p.parent != p:
        p = p.parent
    return p


def _is_within(inner: Path, outer: Path) -> bool:
    return inner == outer or outer in inner.parents


def _sidecar_re(out: Path, kind: str) -> re.Pattern:
    return re.compile(rf"^\.{re.escape(out.name)}\.{kind}-(\d+)-[0-9a-f]+$")


def clean_stale_temps(out: str | os.PathLike) -> list[Path]:
    """Remove what dead runs for `out` left beside it: `.OUT.tmp-<pid>-*` directories, and
    `.OUT.old-<pid>-*` (the previous OUT moved aside by an overwrite), which is moved back if the
    run died before its replacement arrived. Entries of live pids are left alone. Returns what
    was removed or restored."""
    out = Path(out)
    parent = out.parent
    if not parent.is_dir():
        return []
    tmp_re, old_re = _sidecar_re(out, "tmp"), _sidecar_re(out, "old")
    handled = []
    for entry in sorted(parent.iterdir()):
        for kind, rx in (("tmp", tmp_re), ("old", old_re)):
            m = rx.match(entry.name)
            if not m or pid_alive(int(m.group(1))):
                continue
            if kind == "old" and not os.path.lexists(out):
                log.warning("restoring %s from %s (a previous overwrite died midway)", out, entry)
                os.rename(entry, out)
            else:
                log.info("removing %s left by dead process %s", entry, m.group(1))
                remove_path(entry)
            handled.append(entry)
    return handled


class AtomicOutputDir:
    """`with AtomicOutputDir(out, inputs=[...], need_bytes=n) as tmp:` write into `tmp`; on
    success it becomes `out`. See the module docstring for the guarantees.

    Refuses (before creating anything but the lock) when: `out` is inside an input or an input
    inside `out` (UsageError); another process holds the lock (LockedError); `out` exists and
    not `overwrite` (OutputExistsError); fewer than `need_bytes` are free (DiskSpaceError).
    With `overwrite`, the old `out` is moved aside, the new one renamed in, then the old removed;
    only an earlier output of ckpt-tools is replaced (module docstring). `marker=False`: no marker in
    the output (gc's in-place slims: a training checkpoint is never "an earlier output")."""

    def __init__(
        self,
        out: str | os.PathLike,
        *,
        inputs: Iterable[str | os.PathLike] = (),
        need_bytes: int = 0,
        overwrite: bool = False,
        marker: bool = True,
    ):
        out = Path(out).expanduser()
        if out.name in ("", ".", ".."):
            raise UsageError(f"output path {str(out)!r} does not name a new directory")
        self.out = out.parent.resolve() / out.name
        # a URL input never holds a local OUT (an OUT bound for a URL: io.upload checks it)
        self.inputs = [Path(p).expanduser().resolve() for p in inputs if not is_url(p)]
        self.need_bytes = need_bytes
        self.overwrite = overwrite
        self.marker = marker
        self.lock_path = lock_path_for(self.out)
        self.tmp: Path | None = None
        self._lock = OutputLock(self.lock_path, self.out)

    def preflight(self) -> None:
        """Refuse now what `__enter__` would refuse when writing starts: OUT inside an input (or an
        input inside OUT), OUT already there (without `overwrite`), too little free disk."""
        self._check_paths()
        self._check_replace()
        if self.out.parent.is_dir():
            self._check_space()

    def describe(self) -> dict:
        """What a dry run says about OUT, after the refusals the real run makes (but the disk check):
        {"out", "exists", "replaces": None or what `--overwrite` would delete}."""
        self._check_paths()
        return {"out": str(self.out), "exists": os.path.lexists(self.out), "replaces": self._check_replace()}

    def _check_paths(self) -> None:
        check_against_inputs(self.out, self.inputs)
        check_not_cwd(self.out)

    def _check_replace(self) -> dict | None:
        """None when OUT is free; else what replacing it deletes, or the refusal."""
        if not os.path.lexists(self.out):
            return None
        if not self.overwrite:
            raise OutputExistsError("already exists", path=self.out, hint=OVERWRITE_HINT)
        return replace_check(self.out)

    def _check_space(self) -> None:
        if self.need_bytes <= 0:
            return
        free = shutil.disk_usage(self.out.parent).free
        if free < self.need_bytes:
            raise DiskSpaceError(
                f"need {human_bytes(self.need_bytes)}, {human_bytes(free)} free on "
                f"{mount_point(self.out.parent)}",
                path=self.out,
                hint="free some space or write the output to another filesystem",
            )

    def __enter__(self) -> Path:
        self._check_paths()
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self._lock.acquire()
        try:
            clean_stale_temps(self.out)
            self._check_replace()
            self._check_space()
            self.tmp = self.out.parent / f".{self.out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
            self.tmp.mkdir()
        except BaseException:
            self._lock.release()
            raise
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        assert self.tmp is not None
        if exc_type is not None:
            full = self._disk_full(exc)
            with signals_deferred():
                self._abort()
            if full is not None:
                raise full from exc
            return False
        try:
            if self.marker:
                write_marker(self.tmp)
            fsync_tree(self.tmp)
            remote.check_unchanged()  # a remote input rewritten while we read it: no OUT (io.remote)
            with signals_deferred():
                self._commit()
        except BaseException as e:
            full = self._disk_full(e)
            with signals_deferred():
                self._abort()
            if full is not None:
                raise full from e
            raise
        return False

    # A write into a full disk surfaces as OSError(ENOSPC) from our own writes, but as other
    # errors from library writers (torch.save's zip writer: "RuntimeError: [enforce fail at
    # inline_container.cc] unexpected pos"). Either way the user needs to hear "disk full".
    _FULL_BYTES = 1 << 20

    def _disk_full(self, exc: BaseException | None) -> DiskSpaceError | None:
        tmp = self.tmp
        if tmp is None or not isinstance(exc, (OSError, RuntimeError)):  # (ENOSPC and EDQUOT are OSErrors)
            return None
        try:
            free = shutil.disk_usage(tmp).free  # before the temp dir is removed
        except OSError:
            return None
        if (
            not (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT))
            and free >= self._FULL_BYTES
        ):
            return None
        need = f"; this output needs about {human_bytes(self.need_bytes)}" if self.need_bytes else ""
        return DiskSpaceError(
            f"no space left on {mount_point(self.out.parent)} while writing ({human_bytes(free)} free at "
            f"the failure: {type(exc).__name__}: {exc}); nothing was written",
            path=self.out,
            hint=f"free some space or write the output to another filesystem{need}",
        )

    def _abort(self) -> None:
        try:
            if self.tmp is not None:
                remove_path(self.tmp)
        finally:
            self._lock.release()

    def _commit(self) -> None:
        assert self.tmp is not None
        aside = None
        if os.path.lexists(self.out):
            if not self.overwrite:  # appeared while we worked, by a writer that ignores our lock
                raise OutputExistsError(
                    "appeared while the output was being written",
                    path=self.out,
                    hint="pass a new output path",
                )
            replace_check(self.out)  # again, under the lock: what is there now
            aside = self.out.parent / f".{self.out.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
            os.rename(self.out, aside)
        try:
            os.rename(self.tmp, self.out)
        except BaseException:
            if aside is not None:
                os.rename(aside, self.out)
            raise
        self.tmp = None
        if (
            self.marker
        ):  # an OUT the user named (gc's staged slims are its own business: their steps' summary)
            note_committed(self.out)
        fsync_path(self.out.parent)
        try:
            if aside is not None:
                remove_path(aside)
        finally:
            self._lock.release()


class InPlaceDir:
    """`with InPlaceDir(d, backup=name, need_bytes=n) as tmp:` write the new contents of the directory `d`
    into `tmp` (a hidden sibling, `.d.tmp-<pid>-<hex>`); on a clean exit `d` holds them, switched in one
    atomic step, and the old `d` stays whole as the sibling `backup` (a directory of hard links to its
    files, made before the switch: no byte copied). A reader of `d` sees the old tree or the new one.

    The switch is `files.exchange_paths` (renameat2 RENAME_EXCHANGE); where the kernel or filesystem lacks
    it, `d` is renamed aside (`.d.old-<pid>-<hex>`) and `tmp` into place, which `clean_stale_temps`
    undoes if the run dies between the two. Holds `d`'s lock (`.d.lock`, the one AtomicOutputDir(d)
    takes) throughout, and first removes what dead runs left. On any exception `tmp` is removed and `d`
    is untouched. `d` itself must be a real directory (never a symlink to one)."""

    def __init__(self, d: str | os.PathLike, *, backup: str, need_bytes: int = 0):
        d = Path(d).expanduser()
        self.dir = d.parent.resolve() / d.name
        self.backup = self.dir.parent / backup
        self.need_bytes = need_bytes
        self._lock = OutputLock(lock_path_for(self.dir), self.dir)
        self.tmp: Path | None = None

    def __enter__(self) -> Path:
        if self.dir.is_symlink() or not self.dir.is_dir():
            raise UsageError(
                "is not a directory of its own (a symlink or missing): it cannot be changed in place",
                path=self.dir,
                hint="pass the real directory, or write a new one (OUT)",
            )
        self._lock.acquire()
        try:
            clean_stale_temps(self.dir)
            if os.path.lexists(self.backup):
                raise OutputExistsError("already exists", path=self.backup, hint="retry in a second")
            free = shutil.disk_usage(self.dir.parent).free
            if free < self.need_bytes:
                raise DiskSpaceError(
                    f"need {human_bytes(self.need_bytes)}, {human_bytes(free)} free on "
                    f"{mount_point(self.dir.parent)}",
                    path=self.dir,
                    hint="free some space",
                )
            self.tmp = self._sibling("tmp")
            self.tmp.mkdir()
        except BaseException:
            self._lock.release()
            raise
        return self.tmp

    def _sibling(self, kind: str) -> Path:
        return self.dir.parent / f".{self.dir.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        assert self.tmp is not None
        switched = False
        try:
            if exc_type is None:
                fsync_tree(self.tmp)
                with signals_deferred():
                    self._backup()
                    try:
                        self._switch()
                        switched = True
                    finally:
                        if not switched:  # the backup of a tree that stays: not a backup of anything
                            remove_path(self.backup)
        finally:
            with signals_deferred():
                try:
                    remove_path(self.tmp)  # the new tree before a switch; the old one (all linked) after
                finally:
                    self._lock.release()
        return False

    def _backup(self) -> None:
        """The old tree as hard links, built under a temp name and renamed to `backup` once whole."""
        part = self._sibling("tmp")
        try:
            for dirpath, dirnames, filenames in os.walk(self.dir):
                rel = Path(dirpath).relative_to(self.dir)
                make_dirs(part / rel)
                for n in dirnames:
                    make_dirs(part / rel / n)
                for n in filenames:
                    link_entry(Path(dirpath) / n, part / rel / n)
            fsync_tree(part)
            os.rename(part, self.backup)
            fsync_path(self.dir.parent)
        except BaseException:
            remove_path(part)
            raise

    def _switch(self) -> None:
        assert self.tmp is not None
        try:
            exchange_paths(self.tmp, self.dir)
            return
        except OSError as exc:
            if exc.errno not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
        aside = self._sibling("old")
        os.rename(self.dir, aside)
        try:
            os.rename(self.tmp, self.dir)
        except BaseException:
            os.rename(aside, self.dir)
            raise
        fsync_path(self.dir.parent)
        self.tmp = aside


def describe_output(
    out: str | os.PathLike, *, overwrite: bool = False, inputs: Iterable[str | os.PathLike] = ()
) -> dict:
    """A dry run's account of OUT (`AtomicOutputDir.describe`): refuses what the real run refuses
    (a name that is no new directory, OUT inside or holding an input, the current directory, an
    existing OUT without `overwrite`, or one that is not an earlier output) and says what
    `--overwrite` would delete."""
    return AtomicOutputDir(out, inputs=inputs, overwrite=overwrite).describe()


def check_against_inputs(out: str | os.PathLike, inputs: Iterable[str | os.PathLike] = ()) -> Path:
    """Refuse an output path that is, contains or is inside an input: the `inputs` given and every
    path this command has read so far (`registered_inputs()`). Returns OUT's absolute path."""
    out = Path(out).expanduser()
    out = out.parent.resolve() / out.name
    real_out = out.resolve()  # `out` may itself be a symlink to somewhere inside an input
    every = {Path(os.path.realpath(Path(p).expanduser())) for p in inputs if not is_url(p)} | set(
        registered_inputs()
    )
    for inp in sorted(every):
        for o in {out, real_out}:
            if _is_within(o, inp):  # (equal counts as inside)
                raise UsageError(
                    f"output {out} is inside input {inp}",
                    hint="write the output somewhere outside the inputs",
                )
            if _is_within(inp, o):
                raise UsageError(
                    f"input {inp} is inside output {out}", hint="choose an output path that contains no input"
                )
    # by identity: another mount of an input (a bind mount) reaches the same inodes by other names
    above_out, out_id = ancestry(out), identity(out)
    seen: dict = {}
    for inp in sorted(every):
        i = identity(inp)
        if i is not None and i in above_out:
            raise UsageError(
                f"output {out} is inside input {inp}: the same directory reached by another path "
                "(a bind mount or another mount of it)",
                hint="write the output somewhere outside the inputs",
            )
        if out_id is not None and out_id in _ancestry_cached(inp, seen):
            raise UsageError(
                f"input {inp} is inside output {out}: the same directory reached by another path "
                "(a bind mount or another mount of it)",
                hint="choose an output path that contains no input",
            )
    return out


def _ancestry_cached(p: Path, seen: dict) -> set:
    """`inputs.ancestry`, each directory stat'ed once over the many files of one input tree."""
    key = str(Path(p).parent)
    if key not in seen:
        seen[key] = ancestry(Path(p).parent)
    return seen[key] | ({identity(p)} - {None})


def check_output_file(
    path: str | os.PathLike, inputs: Iterable[str | os.PathLike] = (), *, what: str = "output file"
) -> Path:
    """Check an output FILE (a patched config, a report) before anything is committed: its directory
    exists, nothing is at the path yet (not even a dangling symlink), and it is not, does not
    contain and is not inside any input. Returns its absolute path."""
    p = check_against_inputs(path, inputs)
    if not p.parent.is_dir():
        raise UsageError(
            f"the directory of the {what} does not exist",
            path=p.parent,
            hint="create it first, or pass another path",
        )
    if os.path.lexists(p):
        raise OutputExistsError("already exists", path=p, hint=f"remove it or pass another {what} path")
    return p


class SharedOutputDir:
    """`AtomicOutputDir` shared by the ranks of a group (`dist.Group`): the leader (rank 0) creates the
    staging dir, locks OUT and broadcasts the path; every rank writes its own files into it; on a
    clean exit all ranks meet at a barrier, then the leader fsyncs and renames it into place and tells
    the others. A rank that fails skips the barrier, so the leader never commits (see `ckpt_tools.dist`).
    With one process it is exactly `AtomicOutputDir`."""

    def __init__(self, out: str | os.PathLike, group, **kwargs):
        self.group = group
        self.out = Path(out)
        self._dir = AtomicOutputDir(out, **kwargs) if group.leader else None
        self.tmp: Path | None = None

    def __enter__(self) -> Path:
        if self.group.part.world == 1:
            assert self._dir is not None  # one process: the leader's
            self.tmp = self._dir.__enter__()
            return self.tmp
        tmp, error = None, None
        if self._dir is not None:
            try:
                tmp = self._dir.__enter__()
            except BaseException as exc:  # the others must hear of it, not wait forever
                error = str(exc)
                self.group.broadcast({"tmp": None, "error": error}, "the staging directory")
                raise
            self.group.broadcast({"tmp": str(tmp), "error": None}, "the staging directory")
            self.tmp = tmp
            return tmp
        msg = self.group.broadcast(None, "the staging directory")
        if not msg or not msg.get("tmp"):
            raise RankFailed(
                f"rank 0 could not start the output ({(msg or {}).get('error')}); nothing was written",
                path=self.out,
                hint="see rank 0's error",
            )
        tmp = Path(msg["tmp"])
        if not tmp.is_dir():
            raise UsageError(
                f"rank {self.group.part.rank} does not see rank 0's staging directory {tmp}",
                path=self.out,
                hint="with --nnodes > 1, OUT must be on a filesystem every node sees at the same path",
            )
        self.tmp = tmp
        return tmp

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        if self.group.part.world == 1:
            assert self._dir is not None  # one process: the leader's
            return self._dir.__exit__(exc_type, exc, tb)
        if exc_type is not None:  # no barrier: the leader must not commit; torchrun stops the others
            if self._dir is not None:
                return self._dir.__exit__(exc_type, exc, tb)
            return False
        if self._dir is None:
            self.group.barrier("the end of the writes")
            if not self.group.broadcast(None, "the commit"):
                raise RankFailed(
                    "rank 0 could not commit the output; nothing was written",
                    path=self.out,
                    hint="see rank 0's error",
                )
            return False
        try:
            self.group.barrier("the end of the writes")
        except BaseException as e:
            self._dir.__exit__(type(e), e, e.__traceback__)
            raise
        try:
            self._dir.__exit__(None, None, None)
        except BaseException:
            self.group.broadcast(False, "the commit")
            raise
        self.group.broadcast(True, "the commit")
        return False
