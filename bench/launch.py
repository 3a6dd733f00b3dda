"""Run one command and measure it: wall time, peak RSS, CPU, and the bytes its process tree moved.

    python3 -S -E -s bench/launch.py RESULT.json TIMEOUT_S -- ARGV...

The harness starts every measured command through this small process, never directly, because the
kernel's peak-RSS figure for a child (wait4's ru_maxrss) starts at the RSS of the process that forked
it (exec records the old address space's high-water mark). Started with -S and stdlib imports only,
this launcher is about 9 MB; the harness, holding results, would be several times that. The floor is
measured (`python -c pass` through this launcher) and stated beside every table.

Measured, for the command and all its descendants:
- wall: spawn to exit, from a blocking waitid (no polling error);
- peak_rss_bytes: ru_maxrss of the tree (the largest single process; the kernel folds each reaped
  child's peak into its parent's);
- peak_tree_rss_bytes: the largest sum of RSS over the live tree, sampled every INTERVAL s (what N
  ranks hold together; a sample can miss a peak shorter than the interval);
- cpu_s: user + system time of the tree;
- io: /proc/<pid>/io of the exited, not yet reaped child (WNOWAIT), which includes every descendant it
  reaped: rchar/wchar (read()/write() bytes, page-cache hits included, mmap reads not) and
  read_bytes/write_bytes (what went to or will go to the block layer).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

from procfs import parse_io, parse_stat  # bench/ is sys.path[0]

INTERVAL_S = 0.1
PAGE = os.sysconf("SC_PAGE_SIZE")


def _scan() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, rss bytes) of every process we can read."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid, _sid, rss = parse_stat(f.read())
            except (OSError, ValueError, IndexError):
                continue  # exited between listdir and open
            out[int(name)] = (ppid, rss * PAGE)
    return out


def _tree(root: int, procs: dict[int, tuple[int, int]]) -> list[int]:
    """root and its descendants (torchrun starts its ranks in new sessions, so follow ppid links)."""
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _rss) in procs.items():
        kids.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in procs:
            found.append(pid)
        todo.extend(kids.get(pid, ()))
    return found


class Sampler(threading.Thread):
    """Samples the tree's RSS sum; past the deadline, stops the tree (SIGTERM, then SIGKILL)."""

    def __init__(self, root: int, deadline: float):
        super().__init__(daemon=True)
        self.root, self.deadline = root, deadline
        self.done = threading.Event()
        self.peak_tree_rss = 0
        self.peak_procs = 0
        self.samples = 0
        self.killed_at_deadline = False
        self.last_tree: list[int] = []

    def run(self) -> None:
        term_sent = None
        while not self.done.wait(INTERVAL_S if self.samples > 10 else INTERVAL_S / 4):
            procs = _scan()
            tree = _tree(self.root, procs)
            if tree:
                self.last_tree = tree
            total = sum(procs[p][1] for p in tree)
            self.samples += 1
            if total > self.peak_tree_rss:
                self.peak_tree_rss, self.peak_procs = total, len(tree)
            now = time.monotonic()
            if now > self.deadline and term_sent is None:
                self.killed_at_deadline = True
                term_sent = now
                _signal_all(tree, signal.SIGTERM)
            elif term_sent is not None and now - term_sent > 10:
                _signal_all(tree, signal.SIGKILL)


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def main(argv: list[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 2
    result_path, timeout_s, cmd = argv[0], float(argv[1]), argv[3:]
    t0 = time.perf_counter()
    try:
        pid = os.posix_spawnp(cmd[0], cmd, os.environ, setsid=True)
    except OSError as e:
        _write(result_path, {"rc": 127, "wall_s": 0.0, "killed_at_deadline": False, "spawn_error": str(e)})
        print(f"launch.py: cannot start {cmd[0]!r}: {e}", file=sys.stderr)
        return 0
    sampler = Sampler(pid, time.monotonic() + timeout_s)
    sampler.start()
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: /proc/<pid>/io still there
    wall = time.perf_counter() - t0
    sampler.done.set()
    sampler.join()
    try:
        with open(f"/proc/{pid}/io") as f:
            io = parse_io(f.read())
    except (OSError, ValueError) as e:
        io = {"error": str(e)}
    stragglers = [p for p in _tree(pid, _scan()) if p != pid]  # descendants that outlived the command
    _signal_all(stragglers, signal.SIGKILL)
    _, status, ru = os.wait4(pid, 0)
    rc = os.waitstatus_to_exitcode(status)
    result = {
        "rc": rc, "wall_s": wall, "cpu_s": ru.ru_utime + ru.ru_stime, "user_s": ru.ru_utime, "sys_s": ru.ru_stime,
        "peak_rss_bytes": ru.ru_maxrss * 1024,  # Linux reports KiB
        "peak_tree_rss_bytes": sampler.peak_tree_rss, "peak_tree_procs": sampler.peak_procs,
        "rss_samples": sampler.samples, "minor_faults": ru.ru_minflt, "major_faults": ru.ru_majflt,
        "io": io, "killed_at_deadline": sampler.killed_at_deadline, "stragglers_killed": len(stragglers),
    }
    _write(result_path, result)
    return 0


def _write(result_path: str, result: dict) -> None:
    tmp = result_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, result_path)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
