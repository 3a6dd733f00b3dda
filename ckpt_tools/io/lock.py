"""The lock that makes one ckpt command the only writer of an output path.

`OutputLock(lock_path, out)` is an `flock` on a lock file created fresh (O_EXCL|O_NOFOLLOW) beside
OUT, `.OUT.lock` (`lock_path_for(out)`): released by the kernel when its holder dies, however it
dies; the file holds the holder's pid for the error message. Where the filesystem has no flock, the
lock is the file's existence (O_CREAT|O_EXCL), taking over a lock whose pid is dead. A lock file left
by a dead holder is replaced, never reused; a symlink or non-regular file at the lock path is refused.
`staging.AtomicOutputDir(out)` and in-place editors of `out` take the same lock.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import time
from pathlib import Path

from ..core.errors import LockedError, UnsafeInputError
from . import inputs
from .files import create_new

__all__ = ["OutputLock", "lock_holder", "lock_path_for", "pid_alive"]

log = logging.getLogger(__name__)


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def lock_path_for(out: Path) -> Path:
    """`.OUT.lock` beside OUT: the lock every writer of OUT takes."""
    out = Path(out)
    return out.parent / f".{out.name}.lock"


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
        return LockedError(
            f"another ckpt command (pid {pid}) is writing {self.out}",
            hint=f"wait for it to finish; if no such process exists, delete {self.path}",
        )

    def _not_ours(self, what: str) -> UnsafeInputError:
        return UnsafeInputError(
            f"the lock path is {what}, not a lock file ckpt-tools made: refusing to open or write it",
            path=self.path,
            hint="delete it if no ckpt command is running (a checkpoint must not ship one)",
        )

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
                fd = os.open(
                    self.path,
                    os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0),
                    0o644,
                )
            except FileExistsError:
                created = False
                try:
                    fd = os.open(
                        self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
                    )
                except FileNotFoundError:
                    continue  # released meanwhile: try to create it again
                except OSError as e:
                    if e.errno == errno.ELOOP:
                        raise self._not_ours("a symlink") from None
                    raise
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                os.close(fd)
                raise self._not_ours(inputs.kind_of(st.st_mode))
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
                    rfd = os.open(
                        self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
                    )
                except FileNotFoundError:
                    continue
                except OSError:  # ELOOP: a symlink
                    raise self._not_ours("a symlink") from None
                try:
                    if not stat.S_ISREG(os.fstat(rfd).st_mode):
                        raise self._not_ours(inputs.kind_of(os.fstat(rfd).st_mode))
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


def lock_holder(lock: Path) -> str | None:
    """The pid text of a live holder of an flock lock file, None when nobody holds it (read-only
    probe: creates nothing)."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
        except OSError:
            return None
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)
