"""Shared helpers for the hardening tests (hostile pickles, fuzzing, faults, full disk, concurrency).

- Hostile payloads: objects whose unpickling would create a *canary* file, so a test proves that
  nothing ran by the canary's absence (and, with --trust-remote-pickle, that the payload is live).
- Editing copies of the genuine fixture: rewrite `.metadata`, point a key at a crafted item.
- Running the CLI three ways: in-process (CliRunner, fast), in a forked child of the test process
  (a real process to SIGKILL/SIGINT, without paying torch's import again), and as a real
  subprocess (`python -m ckpt_tools`, end to end).
- Kill points: in a forked child, writer entry points are wrapped so the child stops at its N-th
  write event and reports it on a pipe; the parent then kills it, interrupts it or lets it go.
- Figures for docs/reliability.md: `record(section, **counts)`; when CKPT_HARDENING_COUNTS names a
  file, the totals are written there as JSON at exit (`bench/fuzz_long.py --summarize` reads it).
"""
from __future__ import annotations

import atexit
import builtins
import contextlib
import functools
import hashlib
import importlib
import io
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .conftest import FIXTURE, REPO

# ------------------------------------------------------------------------------------------------
# counts for docs/reliability.md

_COUNTS: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
_COUNTS_LOCK = threading.Lock()


def record(section: str, **counts: int) -> None:
    """Add to the figures of `section` (e.g. record("hostile", tried=1, executed=0))."""
    with _COUNTS_LOCK:
        for k, v in counts.items():
            _COUNTS[section][k] += int(v)


def counts() -> dict[str, dict[str, int]]:
    with _COUNTS_LOCK:
        return {s: dict(v) for s, v in _COUNTS.items()}


def _dump_counts() -> None:
    dest = os.environ.get("CKPT_HARDENING_COUNTS")
    if not dest or os.getpid() != _MAIN_PID:
        return
    prev = {}
    p = Path(dest)
    if p.is_file():
        with contextlib.suppress(ValueError):
            prev = json.loads(p.read_text())
    for s, vals in counts().items():
        for k, v in vals.items():
            prev.setdefault(s, {})
            # "max_*" figures are maxima over runs, everything else a count
            prev[s][k] = max(prev[s].get(k, 0), v) if k.startswith("max_") else prev[s].get(k, 0) + v
    p.write_text(json.dumps(prev, indent=2, sort_keys=True) + "\n")


_MAIN_PID = os.getpid()
atexit.register(_dump_counts)

# ------------------------------------------------------------------------------------------------
# hostile payloads


class _Reduce:
    """Pickles as `func(*args)`: the unpickler would call func. `func` may itself be a _Reduce
    (nested REDUCE: the callable is computed while unpickling)."""

    def __init__(self, func, args):
        self.func, self.args = func, args

    def __reduce__(self):
        return (self.func, self.args)

    def __call__(self, *a):  # pickle checks callable(func) when a _Reduce is used as one
        raise AssertionError("never called")


def _touch_code(canary: Path) -> str:
    return f"open({str(canary)!r}, 'w').close()"


def payload_objects(canary: Path, *, plant: bool = True) -> dict[str, object]:
    """Picklable objects, each of which creates `canary` when unpickled by a plain unpickler.
    `plant` writes the file the torch.load payload loads (next to the canary)."""
    c = str(canary)
    inner = pickle.dumps(_Reduce(os.system, (f"touch {c}",)), protocol=2)
    planted = canary.parent / (canary.name + ".planted.pt")
    if plant:
        planted.write_bytes(torch_save_bytes(_Reduce(os.system, (f"touch {c}",))))
    getattr_os_system = _Reduce(builtins.getattr, (_Reduce(importlib.import_module, ("os",)), "system"))
    return {
        "os.system": _Reduce(os.system, (f"touch {c}",)),
        "subprocess.check_call": _Reduce(subprocess.check_call, (["touch", c],)),
        "subprocess.getoutput": _Reduce(subprocess.getoutput, (f"touch {c}",)),
        "builtins.eval": _Reduce(builtins.eval, (_touch_code(canary),)),
        "builtins.exec": _Reduce(builtins.exec, (_touch_code(canary),)),
        "getattr(import_module('os'),'system')": _Reduce(getattr_os_system, (f"touch {c}",)),
        "pathlib.Path.touch via getattr": _Reduce(_Reduce(builtins.getattr, (Path(c), "touch")), ()),
        "pickle.loads of a nested payload": _Reduce(pickle.loads, (inner,)),
        "torch.load(weights_only=False) of a planted file": _Reduce(
            functools.partial(torch.load, weights_only=False), (str(planted),)),
    }


def raw_payload_pickles(canary: Path) -> dict[str, bytes]:
    """Hand-assembled pickles using opcodes a Python pickler never emits for these objects."""
    c = str(canary).encode()
    return {
        # protocol 0: GLOBAL + REDUCE
        "p0 GLOBAL os.system": b"cos\nsystem\n(S'touch " + c + b"'\ntR.",
        # protocol 0: INST (find_class + call in one opcode)
        "p0 INST os.system": b"(S'touch " + c + b"'\nios\nsystem\n.",
        # protocol 1: OBJ
        "p1 OBJ builtins.exec": b"(cbuiltins\nexec\nX" + len(_touch_code(canary)).to_bytes(4, "little")
        + _touch_code(canary).encode() + b"o.",
        # protocol 4 dotted name inside an allowed module: torch.serialization's `os.system`
        "p4 STACK_GLOBAL dotted torch.serialization/os.system": b"\x80\x04"
        + b"\x8c\x13torch.serialization" + b"\x8c\x09os.system" + b"\x93"
        + b"\x8c" + bytes([len(b"touch " + c)]) + b"touch " + c + b"\x85R.",
        # GLOBAL by the module's real name
        "p2 posix.system + BINUNICODE": b"\x80\x02cposix\nsystem\nq\x00X" + len(b"touch " + c).to_bytes(4, "little")
        + b"touch " + c + b"\x85R.",
    }


def payload_bytes(canary: Path, *, plant: bool = True) -> dict[str, bytes]:
    """Every payload as pickle bytes: the objects at protocols 2 and 4, plus the raw ones."""
    out = {}
    for name, obj in payload_objects(canary, plant=plant).items():
        for proto in (2, 4):
            out[f"{name} (p{proto})"] = pickle.dumps(obj, protocol=proto)
    out.update(raw_payload_pickles(canary))
    return out


def assert_payloads_are_live(tmp: Path) -> int:
    """Self-check of the corpus: a plain pickle.loads of every payload does create its canary
    (so the canary's absence elsewhere means something). Returns how many were checked."""
    n = 0
    for name, data in payload_bytes(tmp / "selfcheck-canary").items():
        canary = tmp / "selfcheck-canary"
        canary.unlink(missing_ok=True)
        with contextlib.suppress(Exception):
            pickle.loads(data)
        assert canary.exists(), f"payload {name!r} does not create its canary when unpickled"
        n += 1
    return n


def payload_names() -> list[str]:
    return list(payload_bytes(Path("/nonexistent/canary"), plant=False))


def torch_save_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def torch_item_with_pickle(pkl: bytes) -> bytes:
    """A torch.save zip archive (as DCP stores one item) whose data.pkl is `pkl`."""
    import zipfile

    src = zipfile.ZipFile(io.BytesIO(torch_save_bytes(0)))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = pkl if info.filename.endswith("/data.pkl") else src.read(info)
            dst.writestr(info.filename, data)
    return buf.getvalue()


def pad_item(raw: bytes, min_len: int) -> bytes:
    """`raw` (a torch.save zip) with an extra stored record of zeros, so the item is at least
    `min_len` bytes: a tensor chunk's item must hold the bytes its metadata declares (the reader
    refuses a shorter one before reading it), and a payload test wants the pickle to be reached."""
    import zipfile

    if len(raw) >= min_len:
        return raw
    src = zipfile.ZipFile(io.BytesIO(raw))
    prefix = src.infolist()[0].filename.split("/", 1)[0]
    pad = min_len - len(raw)
    while True:
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as dst:
            for info in src.infolist():
                dst.writestr(info.filename, src.read(info))
            dst.writestr(f"{prefix}/pad", b"\0" * pad)
        if len(buf.getvalue()) >= min_len:
            return buf.getvalue()
        pad += min_len - len(buf.getvalue())


def chunk_bytes(trainer: Path, key: str, chunk: int | None) -> int:
    """Bytes of the elements chunk `chunk` of tensor `key` declares (0 for a byte item)."""
    if chunk is None:
        return 0
    md = load_metadata(trainer)
    item = md.state_dict_metadata[key]
    import math
    return math.prod(item.chunks[chunk].sizes) * item.properties.dtype.itemsize


# ------------------------------------------------------------------------------------------------
# editing copies of the fixture


def writable_copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    os.chmod(dst, 0o755)
    for p in dst.rglob("*"):
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    return dst


def load_metadata(trainer: Path):
    """The genuine (torch) metadata of a trusted fixture copy, for editing and writing back: the
    library's loader gives torch-free stand-ins, which refuse to be pickled again."""
    return pickle.loads((trainer / ".metadata").read_bytes())


def write_metadata(trainer: Path, md) -> None:
    (trainer / ".metadata").write_bytes(pickle.dumps(md, protocol=4))


def storage_index(md, key: str, offsets: tuple | None = None):
    for idx in md.storage_data:
        if idx.fqn == key and (offsets is None or idx.offset is None or tuple(idx.offset) == tuple(offsets)):
            return idx
    raise KeyError(key)


def point_item_at(trainer: Path, key: str, raw_item: bytes, *, chunk: int | None = None,
                  file: str = "__9_0.distcp", md=None) -> None:
    """Append `raw_item` to `file` in `trainer` and point `key` (its `chunk`-th chunk for a
    tensor) at it by rewriting `.metadata` (from `md`, default: the current one)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    md = load_metadata(trainer) if md is None else md
    item = md.state_dict_metadata[key]
    offs = None
    if chunk is not None:
        offs = tuple(item.chunks[chunk].offsets)
    idx = storage_index(md, key, offs)
    p = trainer / file
    start = p.stat().st_size if p.exists() else 0
    with open(p, "ab") as f:
        f.write(raw_item)
    md.storage_data[idx] = _StorageInfo(file, start, len(raw_item))
    write_metadata(trainer, md)


# ------------------------------------------------------------------------------------------------
# snapshots: inputs are never modified


def snapshot(*roots: Path) -> dict[str, tuple]:
    """(size, sha256, mode, inode) of every file under the roots, and the set of entries."""
    out = {}
    for root in roots:
        root = Path(root)
        paths = [root] if root.is_file() else sorted(root.rglob("*"))
        for p in paths:
            st = p.lstat()
            if p.is_file() and not p.is_symlink():
                h = hashlib.sha256(p.read_bytes()).hexdigest()
                out[str(p)] = (st.st_size, h, st.st_mode, st.st_ino)
            else:
                out[str(p)] = ("dir" if p.is_dir() else "other", st.st_mode)
    return out


def diff_snapshots(before: dict, after: dict) -> list[str]:
    changed = [k for k in before if after.get(k) != before[k]]
    added = [k for k in after if k not in before]
    return sorted(changed + added)


# ------------------------------------------------------------------------------------------------
# running the CLI


@dataclass
class Result:
    exit_code: int
    stdout: str
    stderr: str
    exc: BaseException | None = None

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def commands() -> set[str]:
    from ckpt_tools.cli import main

    return set(main.list_commands(None))


def invoke(args: list[str]) -> Result:
    """In-process, through the real click group (its error edge included)."""
    from click.testing import CliRunner

    from ckpt_tools.cli import main

    r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=True)
    exc = r.exception if r.exception and not isinstance(r.exception, SystemExit) else None
    return Result(r.exit_code, r.stdout, r.stderr, exc)


def assert_clean_error(r: Result, *, expect: str | None = None, code: int | tuple = (1, 2)) -> str:
    """Non-zero exit, stderr's last line is `error: ...`, no traceback, no internal error.
    Returns the error line."""
    codes = code if isinstance(code, tuple) else (code,)
    assert r.exc is None, f"uncaught {type(r.exc).__name__}: {r.exc}\n" + "".join(
        traceback.format_exception(r.exc))
    assert r.exit_code in codes, f"exit {r.exit_code}, expected {codes}:\n{r.output}"
    assert "Traceback" not in r.output, r.output
    assert "internal error" not in r.output, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith("WARNING")]
    assert lines, f"no error message:\n{r.output}"
    if lines[-1].startswith("Error:"):  # click's own usage errors (exit 2) print a Usage: block
        return lines[-1]
    assert len(lines) == 1 and lines[0].startswith("error: "), f"not a one-line error:\n{r.stderr}"
    if expect:
        assert re.search(expect, lines[0]), f"{expect!r} not in {lines[0]!r}"
    return lines[0]


def assert_refused(r: Result, *, expect: str | None = None, code: int | tuple = (1, 2)) -> str:
    """Like assert_clean_error, but a reporting command (verify) may instead print its report of
    problems and exit non-zero; `expect` must then match the report."""
    if r.stderr.strip() and any(ln.startswith("error: ") for ln in r.stderr.splitlines()):
        return assert_clean_error(r, expect=expect, code=code)
    codes = code if isinstance(code, tuple) else (code,)
    assert r.exc is None, f"uncaught {type(r.exc).__name__}: {r.exc}"
    assert r.exit_code in codes, f"exit {r.exit_code}, expected {codes}:\n{r.output}"
    assert "Traceback" not in r.output and "internal error" not in r.output, r.output
    if expect:
        assert re.search(expect, r.output), f"{expect!r} not in:\n{r.output}"
    return r.output


def run_subprocess(args: list[str], *, timeout: float = 120, env: dict | None = None) -> Result:
    """`python -m ckpt_tools ARGS` in a real process."""
    e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    e.update(env or {})
    p = subprocess.run([sys.executable, "-m", "ckpt_tools", *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, env=e, cwd=REPO)
    return Result(p.returncode, p.stdout, p.stderr)


@dataclass
class Measured(Result):
    """A real `python -m ckpt_tools` run: its result, peak RSS (wait4's ru_maxrss) and wall time."""
    rss_bytes: int = 0
    wall_s: float = 0.0
    timed_out: bool = False


class MeasuredRun:
    """`python -m ckpt_tools ARGS` started now; `.result()` waits (killing it at `timeout`) and
    returns a Measured. stdout/stderr go to files, so nothing blocks on a full pipe."""

    def __init__(self, args: list, *, workdir: Path, timeout: float = 60, env: dict | None = None):
        e = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        e.update(env or {})
        workdir.mkdir(parents=True, exist_ok=True)
        tag = f"{os.getpid()}-{time.monotonic_ns()}"
        self.out_path, self.err_path = workdir / f"run-{tag}.out", workdir / f"run-{tag}.err"
        self.timeout = timeout
        self.args = [str(a) for a in args]
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.t0 = time.monotonic()
            self.proc = subprocess.Popen([sys.executable, "-m", "ckpt_tools", *self.args], stdout=out, stderr=err,
                                         stdin=subprocess.DEVNULL, env=e, cwd=REPO)
        # Sampled from the start, not only once result() is called: a run that ends before the caller
        # waits (a torch-free command is done in 0.3 s) would otherwise leave only ru_maxrss, which is
        # the test process's own high-water mark (see _own_peak).
        self._peak = 0
        self._done = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)
        self._sampler.start()

    def _sample(self) -> None:
        while not self._done.is_set():
            self._peak = max(self._peak, self._own_peak())
            self._done.wait(0.005)

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, sig)

    def blocked(self) -> int | None:
        """The signals the child's main thread blocks now (a mask, bit N-1 for signal N; /proc's SigBlk), None
        once it has exited: where it is in its start-up, read from the kernel, whatever the machine's load."""
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("State:") and line.split()[1] in ("Z", "X"):
                        return None
                    if line.startswith("SigBlk:"):
                        return int(line.split()[1], 16)
        except (OSError, ValueError):
            pass
        return None

    def wait_until(self, ok, timeout: float = 60.0) -> bool:
        """Poll `ok(self.blocked())` every millisecond until it holds (True) or the child exits (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            mask = self.blocked()
            if mask is None:
                return False
            if ok(mask):
                return True
            time.sleep(0.001)
        return False

    def _own_peak(self) -> int:
        """The child's own peak RSS so far (VmHWM of its current address space): the kernel's ru_maxrss of
        a child carries the parent's high-water mark across fork+exec, so a test process that has grown
        past the bound (pytest after many in-process tests) would be charged to every command it starts."""
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError):
            pass
        return 0

    def result(self) -> Measured:
        timed_out = False
        while True:
            pid, status, ru = os.wait4(self.proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - self.t0 > self.timeout:
                timed_out = True
                self.signal(signal.SIGKILL)
                pid, status, ru = os.wait4(self.proc.pid, 0)
                break
            time.sleep(0.02)
        self._done.set()
        self._sampler.join()
        own = self._peak
        self.proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - self.t0
        return Measured(self.proc.returncode, self.out_path.read_text(errors="replace"),
                        self.err_path.read_text(errors="replace"), None,
                        # the sampled peak (every 5 ms from the start until exit); ru_maxrss when nothing could be sampled
                        own or ru.ru_maxrss * 1024, wall, timed_out)


# A warm runner: one process that imported ckpt_tools (torch and click included) ONCE, then forks a
# child per run that executes `ckpt_tools.entry.main(argv)`, exactly what the `ckpt` executable runs
# after its imports, with its own stdout/stderr files, environment and exit status. It saves torch's
# ~2 s of import per run (there are ~60 runs). The server waits for each child and reports its
# wait4 rusage, so peak RSS is the child's own (it starts from the server's ~0.3 GB, imports done).
# Start-up behaviour (signals during the imports) is tested with fresh interpreters (MeasuredRun).
_WARM_SERVER = r"""
import json, os, select, signal, sys
os.environ.setdefault("OMP_NUM_THREADS", "1")
import ckpt_tools.entry, ckpt_tools.cli   # the heavy imports, once
reqs, reps = int(sys.argv[1]), int(sys.argv[2])
children, buf, closed = {}, b"", False

def reply(obj):
    os.write(reps, (json.dumps(obj) + "\n").encode())

def child(req):
    try:
        os.setpgid(0, 0)
        for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, req["out"], os.O_WRONLY | os.O_CREAT),
                               (2, req["err"], os.O_WRONLY | os.O_CREAT)):
            f = os.open(path, mode, 0o644)
            os.dup2(f, fd)
            os.close(f)
        os.close(reqs)
        os.close(reps)
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        sys.argv = ["ckpt", *req["args"]]
        code = ckpt_tools.entry.main(req["args"])
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    except SystemExit as e:
        os._exit(e.code if isinstance(e.code, int) else 1)
    except BaseException:
        import traceback
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(99)

while not (closed and not children):
    ready, _, _ = select.select([] if closed else [reqs], [], [], 0.01)
    if ready:
        chunk = os.read(reqs, 65536)
        closed = not chunk
        buf += chunk
    while b"\n" in buf:
        line, buf = buf.split(b"\n", 1)
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            child(req)
        children[pid] = req["id"]
        reply({"id": req["id"], "pid": pid})
    for pid in list(children):
        done, status, ru = os.wait4(pid, os.WNOHANG)
        if done:
            reply({"id": children.pop(pid), "status": status, "maxrss": ru.ru_maxrss * 1024})
"""


class _Warm:
    def __init__(self):
        req_r, self._req_w = os.pipe()
        self._rep_r, rep_w = os.pipe()
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen([sys.executable, "-c", _WARM_SERVER, str(req_r), str(rep_w)],
                                     pass_fds=(req_r, rep_w), env=env, cwd=REPO)
        os.close(req_r)
        os.close(rep_w)
        self._buf = b""
        self._replies: dict[int, list[dict]] = defaultdict(list)
        self._next = 0
        self._lock = threading.Lock()

    def _read_until(self, rid: int, key: str, timeout: float) -> dict | None:
        import select

        deadline = time.monotonic() + timeout
        while True:
            for rep in self._replies[rid]:
                if key in rep:
                    self._replies[rid].remove(rep)
                    return rep
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self._rep_r], [], [], min(left, 0.2))
            if ready:
                chunk = os.read(self._rep_r, 65536)
                if not chunk:
                    raise RuntimeError("the warm runner died")
                self._buf += chunk
                while b"\n" in self._buf:
                    line, self._buf = self._buf.split(b"\n", 1)
                    rep = json.loads(line)
                    self._replies[rep["id"]].append(rep)

    def start(self, args, out: Path, err: Path, env: dict) -> tuple[int, int]:
        with self._lock:
            rid = self._next
            self._next += 1
            req = {"id": rid, "args": [str(a) for a in args], "out": str(out), "err": str(err),
                   "env": {**env, "OMP_NUM_THREADS": "1"}, "cwd": str(REPO)}
            os.write(self._req_w, (json.dumps(req) + "\n").encode())
            rep = self._read_until(rid, "pid", 60)
        if rep is None:
            raise RuntimeError("the warm runner did not start the run")
        return rid, rep["pid"]

    def wait(self, rid: int, timeout: float) -> dict | None:
        with self._lock:
            return self._read_until(rid, "status", timeout)


_WARM: _Warm | None = None


def _warm() -> _Warm:
    global _WARM
    if _WARM is None or _WARM.proc.poll() is not None:
        _WARM = _Warm()
        atexit.register(_stop_warm, _WARM)
    return _WARM


def _stop_warm(w: _Warm) -> None:
    with contextlib.suppress(OSError):
        os.close(w._req_w)
    with contextlib.suppress(Exception):
        w.proc.wait(timeout=10)


class WarmRun:
    """Like MeasuredRun, through the warm runner (a forked child that runs `entry.main`)."""

    def __init__(self, args: list, *, workdir: Path, timeout: float = 60, env: dict | None = None):
        workdir.mkdir(parents=True, exist_ok=True)
        tag = f"{os.getpid()}-{time.monotonic_ns()}"
        self.out_path, self.err_path = workdir / f"run-{tag}.out", workdir / f"run-{tag}.err"
        self.timeout = timeout
        self.t0 = time.monotonic()
        self.rid, self.pid = _warm().start(args, self.out_path, self.err_path, env or {})

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def result(self) -> Measured:
        left = self.timeout - (time.monotonic() - self.t0)
        rep = _warm().wait(self.rid, max(left, 0.1))
        timed_out = rep is None
        if timed_out:
            self.signal(signal.SIGKILL)
            rep = _warm().wait(self.rid, 30)
        wall = time.monotonic() - self.t0
        code = os.waitstatus_to_exitcode(rep["status"])
        return Measured(code, self.out_path.read_text(errors="replace"), self.err_path.read_text(errors="replace"),
                        None, rep["maxrss"], wall, timed_out)


def run_measured(args: list, *, workdir: Path, timeout: float = 60, env: dict | None = None,
                 fresh: bool = False) -> Measured:
    """One run of the CLI in its own process: through the warm runner, or (`fresh`) a new
    `python -m ckpt_tools` interpreter."""
    cls = MeasuredRun if fresh else WarmRun
    return cls(args, workdir=workdir, timeout=timeout, env=env).result()


def run_measured_many(cases: dict[str, list], *, workdir: Path, timeout: float = 60, parallel: int = 2,
                      env: dict | None = None, fresh: bool = False) -> dict[str, Measured]:
    """Several independent runs, `parallel` at a time (CI has 2 cores: the wall time halves)."""
    cls = MeasuredRun if fresh else WarmRun
    todo = list(cases.items())
    running: list[tuple[str, MeasuredRun | WarmRun]] = []
    done: dict[str, Measured] = {}
    while todo or running:
        while todo and len(running) < parallel:
            name, args = todo.pop(0)
            running.append((name, cls(args, workdir=workdir, timeout=timeout, env=env)))
        name, run = running.pop(0)
        done[name] = run.result()
    return done


MAX_RSS_BYTES = 1 << 30
MAX_WALL_S = 30.0


def assert_safe_refusal(r: Measured, *, names=(), expect: str | None = None, code: int | tuple = (1, 2)) -> str:
    """The safe behaviour of a hostile input: a clean one-line refusal (`assert_clean_error`) that
    names each of `names` (files, keys), within MAX_WALL_S and under MAX_RSS_BYTES of peak RSS."""
    assert not r.timed_out, f"hung: killed after {r.wall_s:.0f}s:\n{r.output}"
    line = assert_clean_error(r, expect=expect, code=code)
    for n in ([names] if isinstance(names, (str, Path)) else names):
        assert str(n) in line, f"{n} not named in {line!r}"
    assert len(line) < 4000, f"an error line of {len(line)} characters"
    assert_bounded(r)
    record("hostile_files", refused=1)
    return line


def assert_bounded(r: Measured) -> None:
    assert r.rss_bytes < MAX_RSS_BYTES, f"peak RSS {r.rss_bytes / 2**20:.0f} MiB"
    assert r.wall_s < MAX_WALL_S, f"took {r.wall_s:.1f}s"
    record("hostile_files", runs=1)
    with _COUNTS_LOCK:
        sect = _COUNTS["hostile_files"]
        sect["max_rss_mib"] = max(sect.get("max_rss_mib", 0), r.rss_bytes >> 20)
        sect["max_wall_ms"] = max(sect.get("max_wall_ms", 0), int(r.wall_s * 1000))


def sha256_file(p: Path) -> str:
    return hashlib.sha256(Path(p).read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------------------
# a forked child running the CLI, with kill points

# Writer entry points: each call is one "write event" (the child can stop at the N-th). Resolved
# lazily: a name that does not exist (yet) is skipped.
WRITE_EVENTS = (
    ("ckpt_tools.formats.dcp.writer", "DcpWriter", "_append"),
    ("ckpt_tools.formats.dcp.writer", "DcpWriter", "finish"),
    ("ckpt_tools.formats.safetensors.writer", "StreamingSafetensorsWriter", "write"),
    ("ckpt_tools.formats.safetensors.writer", "StreamingSafetensorsWriter", "write_chunk"),
    ("ckpt_tools.formats.safetensors.writer", "StreamingSafetensorsWriter", "close"),
    ("ckpt_tools.io.files", None, "atomic_write_bytes"),
    ("ckpt_tools.io.staging", "AtomicOutputDir", "_commit"),
)


def _patch_write_events(on_event) -> None:
    for modname, cls, name in WRITE_EVENTS:
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        owner = getattr(mod, cls, None) if cls else mod
        fn = getattr(owner, name, None) if owner is not None else None
        if fn is None:
            continue
        label = f"{cls + '.' if cls else ''}{name}"

        def wrapper(*a, __fn=fn, __label=label, **kw):
            on_event(__label)
            return __fn(*a, **kw)

        setattr(owner, name, wrapper)
        if not cls:  # `from ..atomic import atomic_write_bytes` copies: patch those too
            for m in list(sys.modules.values()):
                if getattr(m, "__name__", "").startswith("ckpt_tools") and getattr(m, name, None) is fn:
                    setattr(m, name, wrapper)


class Forked:
    """The CLI running in a forked child. `stop_at=N` makes it stop before its N-th write event
    (1-based), report on a pipe and wait for `resume()`; `count_events=True` only counts them."""

    def __init__(self, args: list[str], workdir: Path, *, stop_at: int | None = None, env: dict | None = None,
                 on_stop=None, stop_when=None):
        self.args = [str(a) for a in args]
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        tag = f"{os.getpid()}-{time.monotonic_ns()}"
        self.out_path = self.workdir / f"child-{tag}.out"
        self.err_path = self.workdir / f"child-{tag}.err"
        self.events_path = self.workdir / f"child-{tag}.events"
        self.stop_at = stop_at
        self.stop_when = stop_when   # or: stop at the first write event for which stop_when(label)
        self.returncode: int | None = None
        self.stopped_at: str | None = None
        r_stop, w_stop = os.pipe()     # child -> parent: "stopped at <event>"
        r_go, w_go = os.pipe()         # parent -> child: "go on"
        self.pid = os.fork()
        if self.pid == 0:  # ---- child
            code = 99
            try:
                os.close(r_stop)
                os.close(w_go)
                self._child(w_stop, r_go, env or {}, on_stop)
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:
                with contextlib.suppress(Exception):
                    traceback.print_exc()
            finally:
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(code)
        os.close(w_stop)
        os.close(r_go)
        self._r_stop, self._w_go = r_stop, w_go

    def _child(self, w_stop: int, r_go: int, env: dict, on_stop) -> None:
        for fd, path in ((1, self.out_path), (2, self.err_path)):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(f, fd)
            os.close(f)
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
        sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
        sys.stdin = io.TextIOWrapper(io.FileIO(os.open(os.devnull, os.O_RDONLY), "r"))
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.update(env)
        events = []

        def on_event(label: str) -> None:
            if threading.current_thread() is not threading.main_thread():
                return  # worker threads: stopping one would not stop the command
            events.append(label)
            with open(self.events_path, "a") as f:
                f.write(label + "\n")
            stop = (self.stop_at is not None and len(events) == self.stop_at) or (
                self.stop_when is not None and not getattr(on_event, "stopped", False) and self.stop_when(label))
            if stop:
                on_event.stopped = True
                if on_stop is not None:
                    on_stop(label)
                os.write(w_stop, (label + "\n").encode())
                # wait for the parent: it kills us, interrupts us (KeyboardInterrupt raises
                # out of this read) or lets us go on
                os.read(r_go, 1)

        _patch_write_events(on_event)
        from ckpt_tools.cli import main

        main(args=self.args, prog_name="ckpt", standalone_mode=True)

    # ---- parent side
    def wait_stopped(self, timeout: float = 120) -> str | None:
        """Wait until the child stops at its kill point (returns the event) or exits (None)."""
        import select

        deadline = time.monotonic() + timeout
        buf = b""
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self._r_stop], [], [], 0.2)
            if ready:
                chunk = os.read(self._r_stop, 256)
                if not chunk:  # child exited without stopping
                    self.wait()
                    return None
                buf += chunk
                if buf.endswith(b"\n"):
                    self.stopped_at = buf.decode().strip()
                    return self.stopped_at
        self.kill(signal.SIGKILL)
        raise TimeoutError(f"child {self.args} neither stopped nor exited within {timeout}s (a hang?)")

    def resume(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._w_go, b"g")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def wait(self, timeout: float = 120) -> int:
        if self.returncode is not None:
            return self.returncode
        deadline = time.monotonic() + timeout
        while True:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
                raise TimeoutError(f"child {self.args} did not exit within {timeout}s (a hang?)")
            time.sleep(0.02)
        for fd in (self._r_stop, self._w_go):
            with contextlib.suppress(OSError):
                os.close(fd)
        return self.returncode

    def result(self, timeout: float = 120) -> Result:
        code = self.wait(timeout)
        return Result(code, self.out_path.read_text(), self.err_path.read_text())

    def events(self) -> list[str]:
        return self.events_path.read_text().splitlines() if self.events_path.exists() else []


def run_forked(args, workdir: Path, **kw) -> tuple[Result, list[str]]:
    f = Forked(args, workdir, **kw)
    r = f.result()
    return r, f.events()


# ------------------------------------------------------------------------------------------------
# outputs


def sidecars(out: Path) -> list[str]:
    """Names beside OUT that belong to it: `.OUT.tmp-*`, `.OUT.old-*`, `.OUT.lock`."""
    out = Path(out)
    if not out.parent.is_dir():
        return []
    return sorted(n for n in os.listdir(out.parent) if n.startswith(f".{out.name}."))


def temp_dirs(out: Path) -> list[str]:
    return [n for n in sidecars(out) if re.match(rf"^\.{re.escape(Path(out).name)}\.tmp-\d+-[0-9a-f]+$", n)]


# ------------------------------------------------------------------------------------------------
# a small filesystem of our own (ENOSPC tests)


@contextlib.contextmanager
def small_filesystem(path: Path, size_bytes: int):
    """Mount a tmpfs of `size_bytes` at `path` (root only). Yields the path; raises
    pytest.skip with the reason when mounting is not possible here."""
    import pytest

    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("ENOSPC test needs root to mount a small tmpfs (CI runs as root)")
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({p.stderr.strip() or p.returncode}); ENOSPC untested")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fixture_and_slim(root: Path) -> tuple[Path, Path]:
    """A writable copy of the genuine fixture under `root` and a slim checkpoint made from it
    (rehydrate's input): the inputs every writing-command hardening test starts from."""
    fx = writable_copy(FIXTURE, root / "fixture")
    slim = root / "slim-input"
    r = invoke(["slim", fx / "outputs/checkpoints/step_3/trainer", slim])
    assert r.exit_code == 0, r.output
    return fx, slim


def hf_cache(base: Path, cache: Path, commit: str, repo: str = "org/tiny") -> Path:
    """`base` laid out as `hf download` leaves it in the HF cache `cache`: blobs/, snapshots/<commit>/ of
    symlinks into blobs, refs/main holding the commit. Returns the repo's cache dir."""
    folder = cache / ("models--" + repo.replace("/", "--"))
    snap = folder / "snapshots" / commit
    (folder / "blobs").mkdir(parents=True)
    (folder / "refs").mkdir()
    snap.mkdir(parents=True)
    for f in sorted(base.iterdir()):
        blob = folder / "blobs" / f"{commit[:8]}-{f.name}"
        blob.write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (folder / "refs" / "main").write_text(commit)
    return folder


def resave_dcp(src: Path, dst: Path, edit) -> Path:
    """`src` (a DCP checkpoint) loaded with torch.distributed.checkpoint into its nested state dict (the
    trainer's shape, by planner path), passed through `edit(sd)`, and saved at `dst` by
    `torch.distributed.checkpoint.save` (one process): a genuine checkpoint holding what `edit` made."""
    import torch
    import torch.distributed.checkpoint as dcp

    md = dcp.FileSystemReader(str(src)).read_metadata()
    sd: dict = {}
    for k, v in md.state_dict_metadata.items():
        *parents, leaf = md.planner_data[k]
        d = sd
        for name in parents:
            d = d.setdefault(name, {})
        d[leaf] = torch.empty(v.size, dtype=v.properties.dtype) if hasattr(v, "size") else None

    def lists(d):  # an int-indexed level (param_groups) back to the list it was
        if isinstance(d, dict):
            d = {k: lists(v) for k, v in d.items()}
            return [d[i] for i in range(len(d))] if d and all(isinstance(k, int) for k in d) else d
        return d

    sd = lists(sd)
    dcp.load(sd, checkpoint_id=str(src), no_dist=True)
    edit(sd)
    dcp.save(sd, checkpoint_id=str(dst), no_dist=True)
    return dst
