"""Safe outputs: nothing appears at OUT until it is complete.

`AtomicOutputDir(out)` hands out a hidden sibling temp directory `.OUT.tmp-<pid>-<hex>` (same
filesystem, so the final `os.rename` is atomic), holds the lock `.OUT.lock` while it is in use, and
on a clean exit fsyncs everything and renames the temp directory to OUT. On any exception
(KeyboardInterrupt, and SIGTERM once `install_signal_handlers()` ran, included) it deletes the
temp directory and the lock. SIGKILL cannot be caught: then a `.OUT.tmp-*` directory is left
behind, never a partial OUT, and the next run for the same OUT deletes it (its pid is dead).

The lock is an `flock` on `.OUT.lock` (released by the kernel when its holder dies, however it
dies); the file holds the holder's pid for the error message. Where the filesystem has no flock,
it falls back to O_CREAT|O_EXCL creation, taking over a lock whose pid is dead.

The write side's one rule: every file we write is created fresh, `O_CREAT|O_EXCL|O_NOFOLLOW`
(`create_new`), in a directory we created (the temp dir) or checked; nothing is ever opened for
writing if it exists, so nothing is written through a symlink or a hard link someone planted
(a lock file left by a dead holder is replaced, never reused). What we copy from an input is read
through `inputs.open_input` (`copy_input_file`, `copy_input_tree`). OUT, and every other output
path (`check_output_file`), may not be, contain or be inside any input: the explicit `inputs=`
and every path the command has read (`inputs.registered()`).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import secrets
import shutil
import signal
import stat
import time
from pathlib import Path
from typing import Iterable

from . import inputs as _inputs
from .errors import DiskSpaceError, LockedError, OutputExistsError, UnsafeInputError, UsageError
from .units import human_bytes

__all__ = [
    "AtomicOutputDir", "OutputLock", "Terminated", "install_signal_handlers", "clean_stale_temps",
    "atomic_write_bytes", "atomic_write_text", "human_bytes", "fsync_tree", "create_new", "open_new",
    "write_new_file", "check_output_file", "copy_input_file", "copy_input_tree", "pid_alive", "exchange_paths",
]

_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def create_new(path: str | os.PathLike, mode: int = 0o644) -> int:
    """A write fd of a NEW file at `path` (O_CREAT|O_EXCL|O_NOFOLLOW): fails with FileExistsError
    if anything, a symlink included, is there. Every file ckpt-tools writes is created here."""
    return os.open(path, _NEW_FILE_FLAGS, mode)


def open_new(path: str | os.PathLike):
    """`create_new` as a buffered binary file object."""
    return os.fdopen(create_new(path), "wb")


def write_new_file(path: str | os.PathLike, data: bytes | str) -> int:
    """Write `data` (str: UTF-8) into a new file at `path`; returns its size."""
    raw = data.encode("utf-8") if isinstance(data, str) else data
    fd = create_new(path)
    try:
        view = memoryview(raw).cast("B")
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])
    finally:
        os.close(fd)
    return len(raw)

log = logging.getLogger(__name__)


class Terminated(BaseException):
    """Raised in the main thread on SIGTERM (after `install_signal_handlers()`), so `with` blocks
    clean up as for Ctrl-C. A BaseException, like KeyboardInterrupt: `except Exception` won't eat it."""

    def __init__(self, signum: int = signal.SIGTERM):
        self.signum = signum
        self.exit_code = 128 + signum   # the shell's convention for death by signal
        super().__init__(f"terminated by signal {signal.Signals(signum).name}")


def _raise_terminated(signum, frame):
    raise Terminated(signum)


def install_signal_handlers() -> None:
    """Make SIGTERM raise `Terminated` in the main thread (call once, from the CLI entry point)."""
    signal.signal(signal.SIGTERM, _raise_terminated)


@contextlib.contextmanager
def _signals_deferred():
    """Hold SIGINT/SIGTERM while a rename sequence or cleanup runs, so a second Ctrl-C cannot
    leave it half done; they are delivered (and raise) right after."""
    sigs = {signal.SIGINT, signal.SIGTERM}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:   # exists, owned by someone else
        return True
    return True


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory by path (a directory's fsync makes renames in it durable)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every regular file and directory under `root` (cheap for files already fsynced)."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            p = os.path.join(dirpath, name)
            if not os.path.islink(p):
                fsync_path(p)
        fsync_path(dirpath)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _mount_point(path: Path) -> Path:
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
                _remove(entry)
            handled.append(entry)
    return handled


class OutputLock:
    """Exclusive lock on `lock_path` between `acquire()` and `release()` (see module docstring).
    `AtomicOutputDir(out)` takes `OutputLock(out.parent / f".{out.name}.lock", out)`; in-place
    editors of `out` take the same one."""

    def __init__(self, lock_path: Path, out: Path):
        self.path = lock_path
        self.out = out
        self.fd: int | None = None

    def _locked(self, pid_text: str) -> LockedError:
        pid = pid_text.strip() or "unknown"
        return LockedError(f"another ckpt command (pid {pid}) is writing {self.out}",
                           hint=f"wait for it to finish; if no such process exists, delete {self.path}")

    def _not_ours(self, what: str) -> UnsafeInputError:
        return UnsafeInputError(f"the lock path is {what}, not a lock file ckpt-tools made: refusing to open "
                                "or write it", path=self.path,
                                hint="delete it if no ckpt command is running (a checkpoint must not ship one)")

    @staticmethod
    def _holder_pid(fd: int) -> str:
        """The holder writes its pid right after it takes the flock; a loser that looks in that
        instant sees an empty file, so give the holder a moment (at most ~0.2 s) to name itself."""
        for _ in range(20):
            text = os.pread(fd, 64, 0).decode("ascii", "replace")
            if text.strip():
                return text
            time.sleep(0.01)
        return text

    def acquire(self) -> None:
        """Lock protocol: create `.OUT.lock` fresh (O_EXCL|O_NOFOLLOW) and flock it. An existing
        file is opened read-only (never written: it may be a planted link) to flock-test it; if its
        holder is alive we report it, if not (a SIGKILLed run's leftover) it is unlinked and a
        fresh one created. A symlink or non-regular file at the lock path is refused."""
        for _ in range(100):
            created = True
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                             | getattr(os, "O_CLOEXEC", 0), 0o644)
            except FileExistsError:
                created = False
                try:
                    fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
                except FileNotFoundError:
                    continue          # released meanwhile: try to create it again
                except OSError as e:
                    if e.errno == errno.ELOOP:
                        raise self._not_ours("a symlink") from None
                    raise
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                os.close(fd)
                raise self._not_ours(_inputs.kind_of(st.st_mode))
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                text = self._holder_pid(fd)
                os.close(fd)
                raise self._locked(text) from None
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                    if created:
                        with contextlib.suppress(FileNotFoundError):
                            self.path.unlink()
                    self._acquire_exclusive_create()
                    return
                raise
            # The holder we waited on may have unlinked the file as it released it: then our lock
            # is on an orphan inode and a third process may lock a new file. Retry on a new inode.
            try:
                same = os.lstat(self.path).st_ino == st.st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            if not created:
                # a lock file nobody holds: a killed run's leftover. Replace it, never write into it.
                log.info("removing stale lock %s", self.path)
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
                os.close(fd)
                continue
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            self.fd = fd
            return
        raise LockedError(f"could not lock {self.path}: it keeps being replaced", hint="retry")

    def _acquire_exclusive_create(self) -> None:
        # No flock here (some network filesystems): the lock is the file's existence.
        for _ in range(3):
            try:
                fd = create_new(self.path)
            except FileExistsError:
                try:
                    rfd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
                except FileNotFoundError:
                    continue
                except OSError:   # ELOOP: a symlink
                    raise self._not_ours("a symlink") from None
                try:
                    if not stat.S_ISREG(os.fstat(rfd).st_mode):
                        raise self._not_ours(_inputs.kind_of(os.fstat(rfd).st_mode))
                    text = os.pread(rfd, 64, 0).decode("ascii", "replace")
                finally:
                    os.close(rfd)
                pid = int(text) if text.strip().isdigit() else -1
                if pid == -1 or pid_alive(pid):
                    # unreadable pid: maybe being written this instant; treat as held
                    raise self._locked(text) from None
                log.warning("taking over stale lock %s of dead pid %d", self.path, pid)
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
                continue
            os.write(fd, f"{os.getpid()}\n".encode())
            self.fd = fd
            return
        raise LockedError(f"could not lock {self.path}", hint="retry")

    def release(self) -> None:
        if self.fd is None:
            return
        # unlink before unlocking: a waiter then sees the inode change and retries
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        os.close(self.fd)
        self.fd = None


_Lock = OutputLock  # the name other modules imported first


class AtomicOutputDir:
    """`with AtomicOutputDir(out, inputs=[...], need_bytes=n) as tmp:` write into `tmp`; on
    success it becomes `out`. See the module docstring for the guarantees.

    Refuses (before creating anything but the lock) when: `out` is inside an input or an input
    inside `out` (UsageError); another process holds the lock (LockedError); `out` exists and
    not `overwrite` (OutputExistsError); fewer than `need_bytes` are free (DiskSpaceError).
    With `overwrite`, the old `out` is moved aside, the new one renamed in, then the old removed."""

    def __init__(self, out: str | os.PathLike, *, inputs: Iterable[str | os.PathLike] = (),
                 need_bytes: int = 0, overwrite: bool = False):
        out = Path(out).expanduser()
        if out.name in ("", ".", ".."):
            raise UsageError(f"output path {str(out)!r} does not name a new directory")
        self.out = out.parent.resolve() / out.name
        self.inputs = [Path(p).expanduser().resolve() for p in inputs]
        self.need_bytes = need_bytes
        self.overwrite = overwrite
        self.lock_path = self.out.parent / f".{self.out.name}.lock"
        self.tmp: Path | None = None
        self._lock = OutputLock(self.lock_path, self.out)

    def _check_paths(self) -> None:
        check_against_inputs(self.out, self.inputs)

    def _check_space(self) -> None:
        if self.need_bytes <= 0:
            return
        free = shutil.disk_usage(self.out.parent).free
        if free < self.need_bytes:
            raise DiskSpaceError(
                f"need {human_bytes(self.need_bytes)}, {human_bytes(free)} free on "
                f"{_mount_point(self.out.parent)}", path=self.out,
                hint="free some space or write the output to another filesystem")

    def __enter__(self) -> Path:
        self._check_paths()
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self._lock.acquire()
        try:
            clean_stale_temps(self.out)
            if os.path.lexists(self.out) and not self.overwrite:
                raise OutputExistsError("already exists", path=self.out,
                                        hint="pass a new output path, or overwrite it explicitly")
            self._check_space()
            self.tmp = self.out.parent / f".{self.out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
            self.tmp.mkdir()
        except BaseException:
            self._lock.release()
            raise
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> bool:
        assert self.tmp is not None
        if exc_type is not None:
            full = self._disk_full(exc)
            with _signals_deferred():
                self._abort()
            if full is not None:
                raise full from exc
            return False
        try:
            fsync_tree(self.tmp)
            with _signals_deferred():
                self._commit()
        except BaseException as e:
            full = self._disk_full(e)
            with _signals_deferred():
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
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            pass
        elif not isinstance(exc, (OSError, RuntimeError)) or self.tmp is None:
            return None
        try:
            free = shutil.disk_usage(self.tmp).free   # before the temp dir is removed
        except OSError:
            return None
        if not (isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)) and free >= self._FULL_BYTES:
            return None
        need = f"; this output needs about {human_bytes(self.need_bytes)}" if self.need_bytes else ""
        return DiskSpaceError(
            f"no space left on {_mount_point(self.out.parent)} while writing ({human_bytes(free)} free at "
            f"the failure: {type(exc).__name__}: {exc}); nothing was written", path=self.out,
            hint=f"free some space or write the output to another filesystem{need}")

    def _abort(self) -> None:
        try:
            if self.tmp is not None:
                _remove(self.tmp)
        finally:
            self._lock.release()

    def _commit(self) -> None:
        assert self.tmp is not None
        aside = None
        if os.path.lexists(self.out):
            if not self.overwrite:   # appeared while we worked, by a writer that ignores our lock
                raise OutputExistsError("appeared while the output was being written", path=self.out,
                                        hint="pass a new output path")
            aside = self.out.parent / f".{self.out.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
            os.rename(self.out, aside)
        try:
            os.rename(self.tmp, self.out)
        except BaseException:
            if aside is not None:
                os.rename(aside, self.out)
            raise
        self.tmp = None
        fsync_path(self.out.parent)
        try:
            if aside is not None:
                _remove(aside)
        finally:
            self._lock.release()


def check_against_inputs(out: str | os.PathLike, inputs: Iterable[str | os.PathLike] = ()) -> Path:
    """Refuse an output path that is, contains or is inside an input: the `inputs` given and every
    path this command has read so far (`inputs.registered()`). Returns OUT's absolute path."""
    out = Path(out).expanduser()
    out = out.parent.resolve() / out.name
    real_out = out.resolve()   # `out` may itself be a symlink to somewhere inside an input
    every = {Path(os.path.realpath(Path(p).expanduser())) for p in inputs} | set(_inputs.registered())
    for inp in sorted(every):
        for o in {out, real_out}:
            if _is_within(o, inp):   # (equal counts as inside)
                raise UsageError(f"output {out} is inside input {inp}",
                                 hint="write the output somewhere outside the inputs")
            if _is_within(inp, o):
                raise UsageError(f"input {inp} is inside output {out}",
                                 hint="choose an output path that contains no input")
    return out


def check_output_file(path: str | os.PathLike, inputs: Iterable[str | os.PathLike] = (), *,
                      what: str = "output file") -> Path:
    """Check an output FILE (a patched config, a report) before anything is committed: its directory
    exists, nothing is at the path yet (not even a dangling symlink), and it is not, does not
    contain and is not inside any input. Returns its absolute path."""
    p = check_against_inputs(path, inputs)
    if not p.parent.is_dir():
        raise UsageError(f"the directory of the {what} does not exist", path=p.parent,
                         hint="create it first, or pass another path")
    if os.path.lexists(p):
        raise OutputExistsError("already exists", path=p, hint=f"remove it or pass another {what} path")
    return p


def copy_input_file(src: str | os.PathLike, dst: str | os.PathLike, *, root: str | os.PathLike | None,
                    what: str = "file") -> int:
    """Copy the regular file `src` (of the tree `root`, checked by `inputs.open_input`) into a NEW
    file `dst` (`create_new`). Returns the bytes copied."""
    fd = _inputs.open_input(src, root=root, what=what)
    try:
        out = create_new(dst)
        try:
            done = 0
            while True:
                n = os.sendfile(out, fd, done, 1 << 30) if hasattr(os, "sendfile") else 0
                if n == 0:
                    break
                done += n
            if done != os.fstat(fd).st_size:   # no sendfile here (or it stopped short): plain copy
                while True:
                    b = os.pread(fd, 1 << 24, done)
                    if not b:
                        break
                    os.write(out, b)
                    done += len(b)
        finally:
            os.close(out)
    finally:
        os.close(fd)
    return done


def copy_input_tree(src: str | os.PathLike, dst: str | os.PathLike, *, root: str | os.PathLike,
                    what: str = "entry") -> int:
    """Copy a file or directory `src` of the tree `root` to the new path `dst`: directories are
    created, regular files copied by content (`copy_input_file`; a symlink inside the tree is copied
    as the file it names). Every entry is checked first (`inputs.scan_tree`): one that leaves the
    tree or is not a regular file/directory refuses the whole copy. Returns the bytes copied."""
    src, dst = Path(src), Path(dst)
    files = _inputs.scan_tree(src, root=root, what=what)
    if os.path.isdir(src):
        os.mkdir(dst)
        for dirpath, dirnames, _ in os.walk(src, followlinks=True):
            rel = Path(dirpath).relative_to(src)
            for d in sorted(dirnames):
                os.mkdir(dst / rel / d)
    total = 0
    for f, _size in files:
        target = dst if f == src else dst / f.relative_to(src)
        total += copy_input_file(f, target, root=root, what=what)
    return total


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` via a temp file in the same directory, fsync, rename (replacing
    `path` if it exists), fsync the directory. Readers see the old file or the new one."""
    path = Path(path)
    tmp = path.parent / f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    fd = create_new(tmp)
    try:
        try:
            view = memoryview(data).cast("B")
            done = 0
            while done < len(view):
                done += os.write(fd, view[done:])
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    fsync_path(path.parent)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


_RENAME_EXCHANGE = 2   # linux/fs.h
_AT_FDCWD = -100


def exchange_paths(a: str | os.PathLike, b: str | os.PathLike) -> None:
    """Swap two existing paths of one filesystem atomically (Linux `renameat2(RENAME_EXCHANGE)`):
    at every instant each name holds one of the two entries, never neither. Raises OSError
    (ENOSYS/EINVAL/ENOTSUP) where the kernel, libc or filesystem cannot do it; callers decide how
    to fall back."""
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except AttributeError:
        raise OSError(errno.ENOSYS, "renameat2 is not available in this libc") from None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"cannot exchange {a} and {b}: {os.strerror(e)}")
    for d in {Path(a).parent, Path(b).parent}:
        fsync_path(d)
