"""The inputs of one model size: where each kind lives, built once (cached across runs by a stamp file),
adopted from a measured run's output when that output is the input, and freed when asked.

Kinds and how each is made when missing:
- base, dcp with `--dcp factory`: one `make_run` of the factory (a genuine gloo FSDP2 `dcp.save`);
- base otherwise: `prep.py base`; adapter: `prep.py adapter` (PEFT);
- merged: `ckpt merge base adapter`; dcp with `--dcp ckpt`: `ckpt adapter-to-dcp adapter --base base`;
- slim: `ckpt slim dcp`.
"""
from __future__ import annotations

import dataclasses
import json
import math
import shutil
import subprocess
import time
from pathlib import Path

from runner import tree_bytes
from sizes import ModelSize

PREP_VERSION = 1  # bump when a builder changes what it writes: cached inputs are then rebuilt
BENCH = Path(__file__).resolve().parent
DISK_MARGIN_BYTES = 512 << 20


class InputError(Exception):
    """An input could not be made; the message says why (disk, time, a failed builder)."""


def free_bytes(path: Path) -> int:
    p = path
    while not p.exists():
        p = p.parent
    return shutil.disk_usage(p).free


def need_bytes(nbytes: int) -> int:
    return int(nbytes * 1.05) + DISK_MARGIN_BYTES


class SizeInputs:
    def __init__(self, size: ModelSize, workdir: Path, dcp_dir: Path, dcp_mode: str, shards: int, python: str,
                 deadline: float | None, record: dict):
        self.size, self.python, self.deadline, self.dcp_mode = size, python, deadline, dcp_mode
        self.root = workdir / size.name
        self.record = record  # results["sizes"][name], updated in place
        self.shard_bytes = max(1, math.ceil(size.base_bytes / shards))
        self.want = {"size": dataclasses.asdict(size), "shards": shards, "dcp_mode": dcp_mode, "v": PREP_VERSION}
        dcp_root = dcp_dir / size.name
        if dcp_mode == "factory":
            self.run_root = dcp_root / "run"
            self.paths = {"base": self.run_root / "base_model",
                          "dcp": self.run_root / "outputs" / "checkpoints" / "step_1" / "trainer"}
        else:
            self.run_root = None
            self.paths = {"base": self.root / "base", "dcp": dcp_root / "dcp"}
        self.paths.update(adapter=self.root / "adapter", merged=self.root / "merged", slim=self.root / "slim")
        self.out = self.root / "out" / "o"
        self.freed: set[str] = set()
        self.logs = self.root / "logs"

    # ---- state ----
    def _stamp(self, kind: str) -> Path:
        if self.dcp_mode == "factory" and kind in ("base", "dcp"):
            kind = "run"
        return self.root / "stamps" / f"{kind}.json"

    def ready(self, kind: str) -> bool:
        stamp = self._stamp(kind)
        try:
            return json.loads(stamp.read_text())["want"] == self.want and self.paths[kind].exists()
        except (OSError, ValueError, KeyError):
            return False

    def _mark(self, kind: str, how: str, seconds: float | None) -> None:
        stamp = self._stamp(kind)
        stamp.parent.mkdir(parents=True, exist_ok=True)
        kinds = ("base", "dcp") if stamp.stem == "run" else (kind,)
        info = {"want": self.want, "how": how, "seconds": seconds,
                "bytes": {k: tree_bytes(self.paths[k]) for k in kinds},
                "files": {k: _count_files(self.paths[k]) for k in kinds}}
        stamp.write_text(json.dumps(info, indent=1))
        self.describe()

    def describe(self) -> None:
        """Copy what is known of each input into the results record."""
        info = self.record.setdefault("inputs", {})
        for kind, path in self.paths.items():
            stamp = self._stamp(kind)
            if self.ready(kind):
                s = json.loads(stamp.read_text())
                info[kind] = {"path": str(path), "bytes": s["bytes"][kind], "files": s["files"][kind],
                              "how": s["how"], "build_s": s["seconds"], "predicted_bytes": self.size.bytes_of(kind)}
        self.record["shard_bytes"] = self.shard_bytes

    # ---- making ----
    def ensure(self, kind: str) -> None:
        if self.ready(kind):
            return
        if kind in self.freed:
            raise InputError(f"the {kind} input was deleted to make room (--free-inputs)")
        if kind == "dcp" and self.dcp_mode == "none":
            raise InputError("no DCP input at this size (--dcp none)")
        if kind in ("base", "dcp") and self.dcp_mode == "factory":
            self._build_run()
        elif kind == "base":
            self._build("base", [self.python, str(BENCH / "prep.py"), "base", str(self.paths["base"]),
                                 "--size", self.size.name, "--shard-bytes", str(self.shard_bytes)],
                        self.size.base_bytes, "prep.py base (factory write_base_model, save_pretrained)")
        elif kind == "adapter":
            self.ensure("base")
            self._build("adapter", [self.python, str(BENCH / "prep.py"), "adapter", str(self.paths["base"]),
                                    str(self.paths["adapter"])], self.size.adapter_bytes,
                        "prep.py adapter (PEFT save_pretrained)")
        elif kind == "merged":
            self.ensure("base")
            self.ensure("adapter")
            self._build("merged", self._ckpt("merge", self.paths["base"], self.paths["adapter"],
                                             self.paths["merged"], "--max-shard-size", self.shard_bytes),
                        self.size.base_bytes, "ckpt merge base adapter")
        elif kind == "dcp":
            self.ensure("base")
            self.ensure("adapter")
            self._build("dcp", self._ckpt("adapter-to-dcp", self.paths["adapter"], self.paths["dcp"],
                                          "--base", self.paths["base"], "--lr", "1e-5"),
                        self.size.dcp_bytes, "ckpt adapter-to-dcp adapter --base base (world size 4)")
        elif kind == "slim":
            self.ensure("dcp")
            self._build("slim", self._ckpt("slim", self.paths["dcp"], self.paths["slim"]), self.size.slim_bytes,
                        "ckpt slim dcp")
        else:
            raise KeyError(kind)

    def adopt(self, kind: str, produced: Path, how: str, seconds: float | None) -> bool:
        """Make a measured run's output this input kind, if that kind is still missing."""
        if self.ready(kind) or not produced.exists() or (kind == "dcp" and self.dcp_mode != "ckpt"):
            return False
        dest = self.paths[kind]
        _remove(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(produced), str(dest))
        self._mark(kind, how, seconds)
        return True

    def release(self, kind: str) -> None:
        if self.dcp_mode == "factory" and kind in ("base", "dcp"):
            return  # one run holds both: freed with the size (see release_all)
        if self.ready(kind):
            self.freed.add(kind)
        self._stamp(kind).unlink(missing_ok=True)
        _remove(self.paths[kind])

    def release_all(self) -> None:
        for kind in self.paths:
            self._stamp(kind).unlink(missing_ok=True)
            _remove(self.paths[kind])
        if self.run_root is not None:
            self._stamp("base").unlink(missing_ok=True)
            _remove(self.run_root)

    def _ckpt(self, *args) -> list[str]:
        return [self.python, "-m", "ckpt_tools", *map(str, args), "--json"]

    def _check_room(self, kind: str, nbytes: int, path: Path) -> float | None:
        free = free_bytes(path)
        if free < need_bytes(nbytes):
            raise InputError(f"not enough disk for the {kind} input: needs ~{need_bytes(nbytes) / 1e9:.1f} GB at "
                             f"{path.parent}, {free / 1e9:.1f} GB free")
        if self.deadline is None:
            return None
        left = self.deadline - time.monotonic()
        if left < 5:
            raise InputError(f"the time budget ran out before the {kind} input was made")
        return left

    def _build(self, kind: str, argv: list[str], nbytes: int, how: str) -> None:
        dest = self.paths[kind]
        timeout = self._check_room(kind, nbytes, dest)
        _remove(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        self._run(kind, argv, timeout)
        self._mark(kind, how, self.record["prep_s"][kind])

    def _build_run(self) -> None:
        timeout = self._check_room("factory run", self.size.base_bytes + self.size.dcp_bytes, self.run_root)
        _remove(self.run_root)
        self.run_root.parent.mkdir(parents=True, exist_ok=True)
        self._run("run", [self.python, str(BENCH / "prep.py"), "run", str(self.run_root), "--size", self.size.name,
                          "--shard-bytes", str(self.shard_bytes)], timeout)
        self._mark("base", "factory make_run (4 gloo FSDP2 ranks, 1 AdamW step, dcp.save)", self.record["prep_s"]["run"])

    def _run(self, kind: str, argv: list[str], timeout: float | None) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"prep-{kind}.log"
        print(f"  [{self.size.name}] making the {kind} input ...", flush=True)
        t0 = time.perf_counter()
        with open(log, "wb") as f:
            try:
                proc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, check=False)
            except subprocess.TimeoutExpired:
                raise InputError(f"making the {kind} input ran past the time budget (log: {log})") from None
        seconds = round(time.perf_counter() - t0, 2)
        self.record.setdefault("prep_s", {})[kind] = seconds
        if proc.returncode != 0:
            tail = log.read_text(errors="replace")[-1500:]
            raise InputError(f"making the {kind} input failed (exit {proc.returncode}; log {log}):\n{tail}")
        print(f"  [{self.size.name}] {kind} made in {seconds:.1f} s", flush=True)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _count_files(path: Path) -> int:
    return 1 if path.is_file() else sum(1 for p in path.rglob("*") if p.is_file())
