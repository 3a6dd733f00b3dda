#!/usr/bin/env python3
"""Benchmark checkpoint surgery: `ckpt slim`, `ckpt rehydrate`, `ckpt set-lr` (not in CI).

    python bench/surgery.py [--workdir /tmp/ckpt-bench-surgery] [--preset qwen3-1.7b|tiny]
                            [--cold] [--record docs/benchmarks.md] [--from-results]

Input (built once, cached in --workdir): a prime-rl-layout run from the factory
(`ckpt_tools.fixtures.factory.make_run`): a random bf16 HF base of the preset's shapes and a DCP
checkpoint written by `dcp.save` from 4 gloo FSDP2 ranks after 2 AdamW steps of LoRA r=32 on all 7
projections, with a warmup + decay SequentialLR.

Each operation runs as `python -m ckpt_tools ...` in a fresh process, inputs in the page cache
(`--cold` evicts them first with posix_fadvise(DONTNEED)). Measured: wall time (imports included),
peak RSS (the child's VmHWM), bytes through read()/write() syscalls (/proc/<pid>/io rchar/wchar,
sampled at exit by a wrapper) and output bytes. Results go to --workdir/results.json and, with
--record, between the surgery markers of docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _doc import record_section  # noqa: E402  (bench/ is sys.path[0] when run as a script)

REPO = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- surgery:begin -->", "<!-- surgery:end -->"

# Runs the CLI in-process and prints the process's I/O counters and peak RSS (VmHWM) after it, so
# the parent can read them (/proc/<pid> of a dead child is gone; wait4's ru_maxrss is polluted by
# the parent's own high-water mark, inherited across fork+exec).
WRAPPER = """
import json, sys, runpy
sys.argv = ["ckpt"] + sys.argv[1:]
code = 0
try:
    from ckpt_tools.cli import main
    main(standalone_mode=False)
except SystemExit as e:
    code = e.code or 0
except Exception as e:
    print(f"error: {e}", file=sys.stderr); code = 1
io = dict(l.split(": ") for l in open("/proc/self/io").read().splitlines())
hwm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print("@@IO " + json.dumps({"rchar": int(io["rchar"]), "wchar": int(io["wchar"]), "hwm_kb": hwm, "code": code}),
      file=sys.stderr)
sys.exit(code)
"""


def build_inputs(work: Path, preset: str):
    sys.path.insert(0, str(REPO))
    from ckpt_tools.fixtures.factory import FactorySpec, RunPaths, make_run

    run = work / "run"
    stamp = work / "inputs.json"
    want = {"preset": preset}
    spec_kw = dict(scheduler="sequential", decay="linear", steps=2, warmup_steps=1, max_steps=10, decay_steps=5)
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        truth = json.loads((run / "truth.json").read_text())
        p = {k: run / v for k, v in truth["paths"].items()}
        return RunPaths(root=run, **p)
    shutil.rmtree(run, ignore_errors=True)
    spec = FactorySpec.qwen3_1_7b(**spec_kw) if preset == "qwen3-1.7b" else FactorySpec.tiny(**spec_kw)
    print(f"building a {preset} prime-rl run in {run} (4 gloo FSDP2 ranks) ...", flush=True)
    t = time.perf_counter()
    paths = make_run(run, spec)
    print(f"  built in {time.perf_counter() - t:.0f}s", flush=True)
    stamp.write_text(json.dumps(want))
    return paths


def tree_bytes(p: Path) -> int:
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def evict(paths) -> None:
    for root in paths:
        for f in ([root] if root.is_file() else [x for x in root.rglob("*") if x.is_file()]):
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd) if os.access(f, os.W_OK) else None
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def warm(paths) -> None:
    for root in paths:
        for f in ([root] if root.is_file() else [x for x in root.rglob("*") if x.is_file()]):
            with open(f, "rb") as fh:
                while fh.read(64 << 20):
                    pass


def measure(label: str, args: list, out: Path | None, inputs: list[Path], cold: bool) -> dict:
    if out is not None and out.exists():
        shutil.rmtree(out)
    (evict if cold else warm)(inputs)
    for stale in out.parent.glob(f".{out.name}.*") if out is not None else ():
        shutil.rmtree(stale, ignore_errors=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", WRAPPER, *map(str, args)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    stdout, stderr = proc.communicate()   # read while it runs: a big --json report fills a pipe
    wall = time.perf_counter() - t0
    io = next((json.loads(ln[5:]) for ln in stderr.splitlines() if ln.startswith("@@IO ")), {})
    if io.get("code", 1) != 0:
        raise SystemExit(f"{label} failed:\n{stdout}\n{stderr}")
    res = {"label": label, "wall_s": round(wall, 2), "peak_rss_mb": round(io.get("hwm_kb", 0) / 1024),
           "read_bytes": io.get("rchar"), "write_bytes": io.get("wchar"),
           "out_bytes": tree_bytes(out) if out is not None and out.exists() else None}
    try:
        res["report"] = json.loads(stdout)
    except ValueError:
        pass
    rep = res.get("report") or {}
    r2 = rep.get("result") or {}
    secs = r2.get("seconds")
    res["work_s"] = secs.get("total") if isinstance(secs, dict) else secs
    print(f"  {label:<28} {res['wall_s']:>8.2f} s  {res['peak_rss_mb']:>6} MB RSS  "
          f"read {res['read_bytes'] / 1e9:7.3f} GB  write {res['write_bytes'] / 1e9:7.3f} GB", flush=True)
    return res


def machine() -> dict:
    import torch
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "mem_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30),
            "python": platform.python_version(), "torch": torch.__version__,
            "load_avg_at_start": os.getloadavg()[0]}


def gb(n) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB" if n >= 1e5 else f"{n / 1e3:.1f} KB"


def render(res: dict) -> str:
    m = res["machine"]
    rows = []
    for r in res["runs"]:
        base = res["runs"][0]
        net_r = r["read_bytes"] - base["read_bytes"] if r is not base else r["read_bytes"]
        net_w = r["write_bytes"] - base["write_bytes"] if r is not base else r["write_bytes"]
        work = f"{r['work_s']:.2f} s" if r.get("work_s") is not None else "-"
        outb = gb(r["out_bytes"]) if r["out_bytes"] else "-"
        if r["label"].startswith("set-lr") and r["out_bytes"]:
            outb += f" (hard links; {gb(max(0, net_w))} new)"
        rows.append(f"| {r['label']} | {work} | {r['wall_s']:.2f} s | {r['peak_rss_mb']} MB | {gb(max(0, net_r))} | "
                    f"{gb(max(0, net_w))} | {outb} |")
    src = res["source_bytes"]
    slim_b = next(r["out_bytes"] for r in res["runs"] if r["label"] == "slim")
    setlr = next(r for r in res["runs"] if r["label"].startswith("set-lr"))
    sr = setlr.get("report", {}).get("result", {})
    lines = [
        f"Input: `{res['preset']}`-shaped prime-rl checkpoint written by the factory (4 gloo FSDP2 ranks, "
        f"`dcp.save`): {gb(src)} in {res['data_files']} data files, {res['keys']} keys; base "
        f"{gb(res['base_bytes'])} bf16. Cache: {'cold (posix_fadvise DONTNEED before each run)' if res['cold'] else 'warm'}. "
        f"Machine: {m['cores']} cores, {m['mem_gb']} GiB, torch {m['torch']}, load average "
        f"{m['load_avg_at_start']:.1f} at start (a shared machine: wall times are noisy, bytes and RSS are not).",
        "",
        "| operation | work (in the command) | wall (process, imports included) | peak RSS | read() beyond startup "
        "| write() beyond startup | output |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"- slim: {gb(src)} -> {gb(slim_b)} (**{src / slim_b:.0f}x smaller**); every dropped tensor is read once "
        f"and hashed (sha256 + the zip CRC-32 check).",
        f"- set-lr: {', '.join(f'{n} data files {m}ed' for m, n in sorted(sr.get('linked', {}).items()))}, "
        f"{gb(sr.get('bytes_written', 0))} written (patch file + `.metadata`), {sr.get('seconds', 0):.3f} s to "
        "link, write and swap (after the metadata is opened).",
    ]
    return "\n".join(lines)


def record(doc: Path, body: str) -> None:
    record_section(doc, body, BEGIN, END, "Surgery: slim, rehydrate, set-lr")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ckpt-bench-surgery"))
    ap.add_argument("--preset", choices=["qwen3-1.7b", "tiny"], default="qwen3-1.7b")
    ap.add_argument("--cold", action="store_true", help="evict inputs from the page cache before each run")
    ap.add_argument("--record", type=Path, help="write the results table into this markdown file")
    ap.add_argument("--from-results", action="store_true", help="re-render --workdir/results.json, run nothing")
    a = ap.parse_args(argv)
    if a.from_results:
        body = render(json.loads((a.workdir / "results.json").read_text()))
        print(body)
        if a.record:
            record(a.record, body)
        return 0
    work = a.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    paths = build_inputs(work, a.preset)
    ckpt, base = paths.checkpoint, paths.base_model
    sys.path.insert(0, str(REPO))
    from ckpt_tools.dcp.reader import DcpCheckpoint
    with DcpCheckpoint.open(ckpt) as ck:
        keys, files = len(ck.entries), len(ck.data_files())
    res = {"preset": a.preset, "cold": a.cold, "machine": machine(), "source_bytes": tree_bytes(ckpt),
           "base_bytes": tree_bytes(base), "keys": keys, "data_files": files, "runs": []}
    out = work / "out"
    out.mkdir(exist_ok=True)
    runs = res["runs"]
    runs.append(measure("startup (`ckpt --version`)", ["--version"], None, [], a.cold))
    runs.append(measure("slim", ["slim", ckpt, out / "slim", "--json"], out / "slim", [ckpt], a.cold))
    runs.append(measure("slim --base (checked)", ["slim", ckpt, out / "slim-b", "--base", base, "--json"],
                        out / "slim-b", [ckpt, base], a.cold))
    runs.append(measure("rehydrate (original layout)", ["rehydrate", out / "slim", out / "full", "--base", base,
                                                         "--json"], out / "full", [out / "slim", base], a.cold))
    runs.append(measure("set-lr --scale 0.5", ["set-lr", ckpt, out / "lr", "--scale", "0.5", "--json"], out / "lr",
                        [ckpt], a.cold))
    runs.append(measure("set-lr --in-place (on a copy)", ["set-lr", out / "lr", "--in-place", "--scale", "2",
                                                           "--json"], None, [out / "lr"], a.cold))
    runs.append(measure("inspect", ["inspect", out / "lr", "--json"], None, [out / "lr"], a.cold))
    for r in runs:
        if r["label"] != "set-lr --scale 0.5":
            r.pop("report", None)
    (work / "results.json").write_text(json.dumps(res, indent=1))
    body = render(res)
    print(body)
    if a.record:
        record(a.record, body)
    for name in ("slim-b", "full", "lr"):
        shutil.rmtree(out / name, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
