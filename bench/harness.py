#!/usr/bin/env python3
"""Benchmark every ckpt command beside its floors and peers, over model sizes and rank counts, in one run.

    python bench/harness.py --sizes tiny,0.6b --ranks 1 --repeat 3            # here
    python bench/harness.py --sizes 8b --ranks 1,2,4,8 --budget-s 480         # bench/device_run.sh
    python bench/report.py RESULTS.json --record docs/benchmarks.md           # tables, plots, projection

For each size it makes the inputs once (cached in --workdir: a bf16 HF base in --shards shards, a PEFT
adapter r=32 on the 7 projections, a merged model, a prime-rl DCP checkpoint and its slim form), then for
each case in bench/cases.py runs the ckpt command and its floors and peers side by side, interleaved,
--repeat times, each in its own process through bench/launch.py (wall, peak RSS, CPU, /proc/<pid>/io).
For each N > 1 in --ranks it runs the command under `torchrun --standalone --nproc-per-node N -m
ckpt_tools ...`, once a probe on tiny inputs shows the command supports it (2 ranks exit 0 and stdout is
one --json report, not one per rank); otherwise the rows are n/a with the probe's reason.

Every record goes into one JSON file (--results), rewritten after each run, so a run stopped by its
time budget (--budget-s) keeps what it measured. Nothing here is timed in CI.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from cases import CASES, INPUT_KINDS, Case, Contender, Paths, case_by_name, ckpt_contender, mergekit_config_text
from inputs import InputError, SizeInputs, free_bytes, need_bytes
from runner import run_measured, tree_bytes
from sizes import SIZES, parse_sizes
from stats import MIN_RUNS_FOR_VERDICT

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
SCHEMA = "ckpt-bench/1"
PROBE_RANKS = 2
WARM_CHUNK = 16 << 20
KEEP_FOR_FLOORS_BYTES = 2 * 10**9  # --free-inputs keeps inputs up to this size for later floors and peers


def skipped(pattern: str, label: str) -> bool:
    """Whether --skip-contenders' `pattern` names `label`: `=LABEL` exactly, else as a substring."""
    return label == pattern[1:] if pattern.startswith("=") else pattern in label


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--sizes", default="0.6b", help="comma list of " + ",".join(s for s in SIZES if s != "32b"))
    ap.add_argument("--ranks", default="1", help="comma list of rank counts; 1 is the plain process")
    ap.add_argument("--repeat", type=int, default=MIN_RUNS_FOR_VERDICT,
                    help=f"runs of each contender (median, min-max); a target's verdict needs {MIN_RUNS_FOR_VERDICT}")
    ap.add_argument("--order-seed", type=int, default=None,
                    help="seed of the contenders' shuffled order in each repetition (default: random, recorded)")
    ap.add_argument("--cases", help="comma list of case names (default: all); see bench/cases.py")
    ap.add_argument("--skip-cases", default="", help="comma list of case names to leave out")
    ap.add_argument("--skip-contenders", default="", help="comma list of contender labels to leave out: substrings, or =LABEL for exactly that label")
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ckpt-bench"))
    ap.add_argument("--dcp-dir", type=Path, help="where DCP inputs live (default: --workdir); e.g. /dev/shm")
    ap.add_argument("--results", type=Path, help="results JSON (default: WORKDIR/results.json)")
    ap.add_argument("--append", action="store_true",
                    help="add to an existing results file of the same machine (another size, a missed case)")
    ap.add_argument("--dcp", choices=["auto", "factory", "ckpt", "none"], default="auto",
                    help="DCP input: the factory's gloo FSDP2 dcp.save (auto: up to 2B params), or "
                         "`ckpt adapter-to-dcp` (auto: above), or none")
    ap.add_argument("--shards", type=int, default=4, help="shards of the bf16 base")
    ap.add_argument("--cache", choices=["warm", "cold"], default="warm",
                    help="warm: inputs read before they are used (see --warm); cold: caches dropped before each "
                         "run (root)")
    ap.add_argument("--warm", choices=["once", "case"], default="once",
                    help="read each input once per size (default), or again before each command (when the "
                         "outputs written in between may evict the inputs from a small page cache)")
    ap.add_argument("--budget-s", type=float, default=0, help="stop starting work after this many seconds")
    ap.add_argument("--run-timeout-s", type=float, default=1800)
    ap.add_argument("--free-inputs", action="store_true", help="delete each input once no later case needs it")
    ap.add_argument("--defer-peers", action="store_true",
                    help="run the peers after every ckpt command and floor of a size (a time budget then cuts "
                         "peers first)")
    ap.add_argument("--ranks-only", action="store_true",
                    help="run only the ckpt commands (at each N in --ranks), no floors or peers")
    ap.add_argument("--no-share", action="store_true",
                    help="rerun a floor or peer that an earlier command of the run already measured with the "
                         "same command line (by default its records are shared)")
    ap.add_argument("--python", default=sys.executable, help="interpreter for ckpt and the Python peers")
    ap.add_argument("--mergekit", default=os.environ.get("MERGEKIT_YAML", "/tmp/mk-venv/bin/mergekit-yaml"),
                    help="mergekit-yaml executable (skipped when absent)")
    a = ap.parse_args(argv)
    a.sizes = parse_sizes(a.sizes)
    a.ranks = sorted({int(x) for x in a.ranks.split(",") if x.strip()})
    if not a.ranks or min(a.ranks) < 1:
        ap.error("--ranks needs positive integers")
    names = [c.name for c in CASES] if not a.cases else [n.strip() for n in a.cases.split(",") if n.strip()]
    skip = {n.strip() for n in a.skip_cases.split(",") if n.strip()}
    try:
        a.cases = [case_by_name(n) for n in names if n not in skip]
    except KeyError as e:
        ap.error(str(e))
    a.skip_contenders = [s.strip() for s in a.skip_contenders.split(",") if s.strip()]
    python = shutil.which(a.python)
    if python is None:
        ap.error(f"--python {a.python}: no such interpreter")
    a.python = str(Path(python).absolute())  # the runs' working directory is the size's input folder
    a.workdir = a.workdir.resolve()
    a.dcp_dir = (a.dcp_dir or a.workdir).resolve()
    a.results = (a.results or a.workdir / "results.json").resolve()
    return a


class Harness:
    def __init__(self, a):
        self.a = a
        self.t0 = time.monotonic()
        self.deadline = self.t0 + a.budget_s if a.budget_s else None
        # ckpt_tools runs from this checkout whether or not it is installed (the GPU host has no install)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        if a.cache == "cold" and not os.access("/proc/sys/vm/drop_caches", os.W_OK):
            raise SystemExit("--cache cold needs root (it writes /proc/sys/vm/drop_caches)")
        self.hf_cli = shutil.which("hf", path=os.pathsep.join([str(Path(a.python).parent), os.environ["PATH"]]))
        self.mergekit = a.mergekit if a.mergekit and os.access(a.mergekit, os.X_OK) else None
        seed = a.order_seed if a.order_seed is not None else random.SystemRandom().randrange(2**32)
        self.order = random.Random(seed)
        self.results = {
            "schema": SCHEMA, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv,
            "options": {"sizes": [s.name for s in a.sizes], "ranks": a.ranks, "repeat": a.repeat, "cache": a.cache,
                        "order_seed": seed,
                        "warm": a.warm,
                        "dcp": a.dcp, "shards": a.shards, "budget_s": a.budget_s,
                        "cases": [c.name for c in a.cases], "workdir": str(a.workdir), "dcp_dir": str(a.dcp_dir)},
            "machine": machine_info(a.python, a.workdir, a.dcp_dir),
            "ckpt_commands": ckpt_subcommands(a.python),
            "mergekit": self.mergekit, "hf_cli": self.hf_cli,
            "sizes": {}, "probes": {}, "runs": [],
        }
        floor = run_measured(["true"], a.workdir / "logs", "launcher-floor", 30)
        self.results["launcher_floor_rss_bytes"] = floor.get("peak_rss_bytes")
        if a.append and a.results.exists():
            self.results = merge_into(json.loads(a.results.read_text()), self.results)
        self.probe_inputs: SizeInputs | None = None
        self.measured: dict[tuple, list[dict]] = {}  # (size, argv) of floors and peers -> their records
        self.warmed: dict[str, set[str]] = {}  # size -> input kinds read into the page cache

    # ---------------------------------------------------------------- bookkeeping
    def left_s(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def save(self) -> None:
        self.a.results.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.a.results.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.results, indent=1))
        os.replace(tmp, self.a.results)

    def record(self, rec: dict) -> dict:
        self.results["runs"].append(rec)
        self.save()
        shown = f"{rec['wall_s']:.2f} s, {rec.get('peak_rss_bytes', 0) / 2**20:.0f} MiB" if rec["status"] == "ok" \
            else f"{rec['status']}: {rec.get('reason', '')}"
        print(f"  [{rec['size']}] {rec['case']} | {rec['contender']} (x{rec['ranks']}, rep {rec['rep']}): {shown}",
              flush=True)
        return rec

    # ---------------------------------------------------------------- driver
    def run(self) -> int:
        try:
            for size in self.a.sizes:
                self.run_size(size)
        finally:
            self.results["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
            self.results["elapsed_s"] = round(time.monotonic() - self.t0, 1)
            self.results["machine"]["loadavg_end"] = os.getloadavg()
            self.save()
        print(f"results: {self.a.results}")
        return 0

    def dcp_mode(self, size) -> str:
        if self.a.dcp != "auto":
            return self.a.dcp
        return "factory" if size.params <= 2_000_000_000 else "ckpt"

    def run_size(self, size) -> None:
        rec = self.results["sizes"].setdefault(size.name, {})
        rec.update(params=size.params, lora_params=size.lora_params, dcp_mode=self.dcp_mode(size),
                   predicted_bytes={k: size.bytes_of(k) for k in INPUT_KINDS})
        inputs = SizeInputs(size, self.a.workdir, self.a.dcp_dir, self.dcp_mode(size), self.a.shards, self.a.python,
                            self.deadline, rec)
        inputs.describe()
        deferred: list[tuple[Case, Contender]] = []
        for i, case in enumerate(self.a.cases):
            deferred += self.run_case(size, inputs, case)
            if self.a.free_inputs:
                # keep what later ckpt commands read, and what their floors and peers read when it is small;
                # a big input (the 8B DCP) goes, and a floor that needed it is skipped (or shared)
                later = {k for c in self.a.cases[i + 1:] for k in c.reads}
                later |= {k for c in self.a.cases[i + 1:] for k in c.needs if size.bytes_of(k) <= KEEP_FOR_FLOORS_BYTES}
                if self.a.defer_peers:
                    later |= {k for c in self.a.cases for p in c.peers for k in p.reads}
                for kind in INPUT_KINDS:
                    if kind not in later:
                        inputs.release(kind)
        # --defer-peers: the peers after every ckpt command and floor, so a time budget cuts them first;
        # mergekit, the slowest and the one a user of this tool is least likely to pick, last of all
        for case, c in sorted(deferred, key=lambda cc: cc[1].label.startswith("mergekit")):
            print(f"[{size.name}] {case.name} (deferred peer)", flush=True)
            warmed = self.warmed.setdefault(size.name, set()) if self.a.warm == "once" else set()
            for rep in range(self.a.repeat):
                self.run_one(size, inputs, case, c, 1, rep, self.paths(inputs), warmed)
        inputs.describe()
        if self.a.free_inputs:
            inputs.release_all()

    def paths(self, inputs: SizeInputs) -> Paths:
        p = Paths(python=self.a.python, bench=BENCH, out=inputs.out, shard_bytes=inputs.shard_bytes,
                  hf_cli=self.hf_cli, mergekit_yaml=self.mergekit, mergekit_config=inputs.root / "mergekit.yml",
                  **{k: inputs.paths[k] for k in INPUT_KINDS})
        if self.mergekit:
            inputs.root.mkdir(parents=True, exist_ok=True)
            p.mergekit_config.write_text(mergekit_config_text(p))
        return p

    def run_case(self, size, inputs: SizeInputs, case: Case) -> list[tuple[Case, Contender]]:
        """Run one case; return the peers left for later (--defer-peers)."""
        base = {"size": size.name, "case": case.name}
        if case.subcommand and case.subcommand not in self.results["ckpt_commands"]:
            self.record({**base, "contender": f"ckpt {case.name}", "role": "ckpt", "ranks": 1, "rep": 0,
                         "status": "n/a", "reason": f"ckpt has no `{case.subcommand}` command yet"})
            return []
        print(f"[{size.name}] {case.name}", flush=True)
        paths = self.paths(inputs)
        warmed = self.warmed.setdefault(size.name, set()) if self.a.warm == "once" else set()
        others = [] if self.a.ranks_only else [*case.floors, *case.peers]
        others = [c for c in others if not any(skipped(s, c.label) for s in self.a.skip_contenders)]
        deferred = [(case, c) for c in others if self.a.defer_peers and c.role == "peer"]
        contenders = [ckpt_contender(case, 1)] + [c for c in others if (case, c) not in deferred]
        for rep in range(self.a.repeat):
            # a new order each repetition: no contender always runs first (cold caches, turbo, a neighbour's
            # load) or always right after the same other one
            for c in self.order.sample(contenders, len(contenders)):
                self.run_one(size, inputs, case, c, 1, rep, paths, warmed)
        multi = [n for n in self.a.ranks if n > 1]
        if not (case.multi_rank and multi):
            return deferred
        probe = self.probe(case)
        if not probe["supported"]:
            for n in multi:
                self.record({**base, "contender": ckpt_contender(case, n).label, "role": "ckpt", "ranks": n,
                             "rep": 0, "status": "n/a", "reason": probe["reason"]})
            return deferred
        # The sweep: torchrun with 1 rank (the same launcher as N > 1: its start-up is not the ranks' doing)
        # and each N, in a new shuffled order each repetition.
        sweep = [(1, ckpt_contender(case, 1, torchrun=True))] + [(n, ckpt_contender(case, n)) for n in multi]
        for rep in range(self.a.repeat):
            for n, c in self.order.sample(sweep, len(sweep)):
                self.run_one(size, inputs, case, c, n, rep, paths, warmed)
        return deferred

    def run_one(self, size, inputs: SizeInputs, case: Case, c: Contender, ranks: int, rep: int, paths: Paths,
                warmed: set[str]) -> dict:
        rec = {"size": size.name, "case": case.name, "contender": c.label, "role": c.role, "ranks": ranks,
               "rep": rep, "reads": list(c.reads), "writes": c.writes, "volume": list(c.volume_kinds),
               "cache": self.a.cache}
        reason = c.unavailable(paths)
        if reason:
            return self.record({**rec, "status": "n/a", "reason": reason}) if rep == 0 else rec
        argv = [str(x) for x in c.argv(paths)]
        key = (size.name, tuple(argv))
        earlier = self.measured.get(key, [])
        if c.role != "ckpt" and not self.a.no_share and rep < len(earlier) and earlier[rep]["case"] != case.name:
            # the same floor or peer, same inputs, already measured for another command of this run
            return self.record({**earlier[rep], "case": case.name, "shared_from": earlier[rep]["case"]})
        try:
            for kind in c.reads:
                inputs.ensure(kind)
        except InputError as e:
            return self.record({**rec, "status": "skipped", "reason": str(e)})
        rec["read_bytes_inputs"] = sum(inputs.record["inputs"][k]["bytes"] for k in c.reads)
        if c.writes:
            nbytes = size.bytes_of(c.writes) if c.writes in INPUT_KINDS else 0
            free = free_bytes(inputs.out)
            if free < need_bytes(nbytes):
                return self.record({**rec, "status": "skipped", "reason": f"not enough disk: needs "
                                    f"~{need_bytes(nbytes) / 1e9:.1f} GB, {free / 1e9:.1f} GB free"})
        left = self.left_s()
        if left is not None and left < 5:
            return self.record({**rec, "status": "skipped", "reason": "time budget spent"})
        self.prepare_run(inputs, c, warmed)
        name = f"{_slug(case.name)}-{_slug(c.label)}-x{ranks}-r{rep}"
        timeout = min(self.a.run_timeout_s, left) if left is not None else self.a.run_timeout_s
        rec["argv"] = argv
        rec.update(run_measured(argv, inputs.logs, name, timeout, cwd=inputs.root))
        rec["out_bytes"] = tree_bytes(inputs.out)
        if c.role == "ckpt" and ranks == 1 and rec["status"] == "ok" and case.provides:
            rec["adopted_as"] = case.provides if inputs.adopt(
                case.provides, inputs.out, f"the output of a measured `ckpt {case.name}`", rec["wall_s"]) else None
        _clear(inputs.out.parent)
        if c.role != "ckpt":
            self.measured.setdefault(key, []).append(rec)
        return self.record(rec)

    def prepare_run(self, inputs: SizeInputs, c: Contender, warmed: set[str]) -> None:
        """Leave no output or dirty page of an earlier run behind, then set the page cache as stated."""
        _clear(inputs.out.parent)
        inputs.out.parent.mkdir(parents=True, exist_ok=True)
        os.sync()
        if self.a.cache == "cold":
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
            return
        for kind in c.reads:
            if kind not in warmed:
                warm(inputs.paths[kind])
                warmed.add(kind)

    # ---------------------------------------------------------------- multi-rank probe
    def probe(self, case: Case) -> dict:
        """Does `torchrun ... -m ckpt_tools <command>` work for this command? Asked once, on tiny inputs."""
        if case.name in self.results["probes"]:
            return self.results["probes"][case.name]
        if self.probe_inputs is None:
            self.probe_inputs = SizeInputs(SIZES["tiny"], self.a.workdir / "probe", self.a.workdir / "probe",
                                           "none" if self.a.dcp == "none" else "ckpt", 1, self.a.python,
                                           self.deadline, {})
        inputs = self.probe_inputs
        c = ckpt_contender(case, PROBE_RANKS)
        try:
            for kind in case.reads:
                inputs.ensure(kind)
        except InputError as e:
            res = {"supported": False, "reason": f"the probe's tiny inputs could not be made: {e}"}
        else:
            paths = self.paths(inputs)
            _clear(inputs.out.parent)
            inputs.out.parent.mkdir(parents=True, exist_ok=True)
            left = self.left_s()
            m = run_measured([str(x) for x in c.argv(paths)], inputs.logs, f"probe-{_slug(case.name)}",
                             min(300.0, left) if left is not None else 300.0, cwd=inputs.root)
            _clear(inputs.out.parent)
            if m["status"] != "ok":
                res = {"supported": False, "reason": f"torchrun --nproc-per-node {PROBE_RANKS} on tiny inputs: "
                                                     f"{m.get('reason')}: {first_error(m)[:300]}"}
            elif not m["stdout_is_one_json"]:
                res = {"supported": False, "reason": f"ran under torchrun --nproc-per-node {PROBE_RANKS}, but stdout "
                       f"holds {m['json_reports']} --json reports, not one: each rank ran the whole command alone"}
            else:
                res = {"supported": True, "reason": None, "probe_wall_s": m["wall_s"]}
        self.results["probes"][case.name] = res
        self.save()
        return res


# -------------------------------------------------------------------------------------- helpers


def warm(path: Path) -> None:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while fh.read(WARM_CHUNK):
                pass


def merge_into(old: dict, new: dict) -> dict:
    """`--append`: the earlier results file with this invocation's options and machine state added."""
    if old.get("schema") != SCHEMA:
        raise SystemExit(f"--append: the results file has schema {old.get('schema')!r}, not {SCHEMA!r}")
    if (old["machine"]["cpu"], old["machine"]["cores"]) != (new["machine"]["cpu"], new["machine"]["cores"]):
        raise SystemExit("--append: the results file was measured on another machine")
    old.setdefault("more_invocations", []).append({k: new[k] for k in ("started", "argv", "options", "machine")})
    o = old["options"]
    o["sizes"] += [s for s in new["options"]["sizes"] if s not in o["sizes"]]
    o["cases"] += [c for c in new["options"]["cases"] if c not in o["cases"]]
    return old


def first_error(m: dict) -> str:
    """The first `error:` line a failed run printed (ckpt's own message), else its last non-blank line."""
    lines = [ln.strip() for ln in (m.get("stderr_tail", "") + "\n" + m.get("stdout_tail", "")).splitlines()]
    errors = [ln for ln in lines if ln.startswith("error:")]
    rest = [ln for ln in lines if ln and set(ln) - set("=-*")]
    return (errors or rest[-1:] or [""])[0]


def _clear(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in text).strip("_")[:60]


def ckpt_subcommands(python: str) -> list[str]:
    """The subcommands of the measured tree's CLI (so a case whose command has not landed yet is n/a):
    click's own list where the tree has it, else the names `ckpt --help` lists (a command's row is
    indented by two spaces; a help text wrapped onto the next line is indented further)."""
    code = "from ckpt_tools.cli import main; print('\\n'.join(main.list_commands(None)))"
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    if proc.returncode == 0 and proc.stdout.strip():
        return proc.stdout.split()
    proc = subprocess.run([python, "-m", "ckpt_tools", "--help"], capture_output=True, text=True, check=False)
    names, in_commands = [], False
    for line in proc.stdout.splitlines():
        if line.strip() == "Commands:":
            in_commands = True
        elif in_commands and re.match(r"^  [a-z][a-z0-9-]*(  |$)", line):
            names.append(line.split()[0])
    return names


def tree_digest(root: Path = REPO) -> str:
    """sha256 over the measured code as it is on disk (committed or not): every file git tracks or would
    track under ckpt_tools/, bench/, scripts/ and the build files, path and content. A commit hash alone
    names a stale tree when the run measured uncommitted changes."""
    listed = subprocess.run(["git", "-C", str(root), "ls-files", "-co", "--exclude-standard", "--", "ckpt_tools",
                             "bench", "scripts", "setup.py", "pyproject.toml"],
                            capture_output=True, text=True, check=False).stdout.split()
    h = hashlib.sha256()
    for rel in sorted(listed):
        f = root / rel
        if f.is_file():
            h.update(rel.encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()


def machine_info(python: str, workdir: Path, dcp_dir: Path) -> dict:
    def meminfo(field: str) -> int:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    with open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), platform.machine())
    code = ("import json, platform, torch, transformers, peft, safetensors; print(json.dumps({'python': "
            "platform.python_version(), 'torch': torch.__version__, 'torch_threads': torch.get_num_threads(), "
            "'transformers': transformers.__version__, 'peft': peft.__version__, 'safetensors': safetensors.__version__}))")
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    libs = json.loads(proc.stdout) if proc.returncode == 0 else {"error": proc.stderr[-500:]}
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            check=False).stdout.strip() or None
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True, check=False).stdout.strip()
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_bytes": meminfo("MemTotal"), "kernel": platform.release(),
            "root": os.geteuid() == 0, "loadavg_start": os.getloadavg(), **libs,
            "workdir_fs": _fs_type(workdir), "dcp_dir_fs": _fs_type(dcp_dir),
            "workdir_free_bytes": free_bytes(workdir), "commit": commit, "dirty": bool(dirty),
            "tree_sha256": tree_digest(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), "gpus_used": 0}


def _fs_type(path: Path) -> str:
    """The filesystem type of the mount holding path (longest mount-point prefix in /proc/mounts)."""
    path = path.resolve()
    best, kind = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 2 and (str(path) == parts[1] or str(path).startswith(parts[1].rstrip("/") + "/")):
                if len(parts[1]) > len(best):
                    best, kind = parts[1], parts[2]
    return kind


def main(argv=None) -> int:
    return Harness(parse_args(argv)).run()


if __name__ == "__main__":
    sys.exit(main())
