#!/usr/bin/env python3
"""Issue 21's byte ratios at size: `ckpt` on a 126 GB-shaped checkpoint served over a throttled HTTP link,
beside `curl` fetching exactly the same byte ranges with the same concurrency.

    MALLOC_MMAP_THRESHOLD_=65536 torchrun --nproc-per-node 4 bench/sparse_ckpt.py --size 32b --root /tmp/big
    python bench/remote_size.py measure --root /tmp/big --results bench/results/DATE-HOST-remote-126gb.json
    python bench/remote_size.py report bench/results/DATE-HOST-remote-126gb.json   # docs/bench/remote-126gb.md

measure:
- serves ROOT with bench/throttled_http.py (`--rate-mb` 200 MB/s for the whole link, `--latency-ms` 20
  before each response), in its own process, which counts every GET's body bytes and range;
- cases: `ckpt inspect URL`, `ckpt extract-adapter URL OUT`, `ckpt slim URL OUT --base BASE` (BASE the
  generator's sparse bf16 HF dir, local, under `ckpt --allow-sparse`), `CKPT_REMOTE_CONCURRENCY` =
  `--concurrency`;
- a warm-up run of each case records the GETs it made; the `curl` contender replays that list (the same
  URLs and ranges, bodies to /dev/null) with `curl --parallel --parallel-max CONCURRENCY`: the time the link
  itself needs for the bytes the command chose;
- `--repeat` repetitions, every (case, contender) pair in a new shuffled order each (the seed is
  recorded); each run through bench/launch.py (wall, peak RSS), the server's counters reset before it;
- each case's bound of issue 21 checked on every ckpt run (so "met" holds across the spread):
  inspect <= .metadata + 64 KiB, extract-adapter <= (LoRA items + .metadata) x 1.02,
  slim <= (unique items + .metadata) x 1.02, item sizes from the checkpoint's own .metadata;
- the warm-up's extract-adapter output compared file by file (sha256) with a local run's;
- downloading the whole checkpoint is computed from the throttle (its bytes / the rate), not run.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
sys.path[:0] = [str(BENCH), str(REPO)]

from harness import tree_digest  # noqa: E402
from runner import run_measured, tree_digests  # noqa: E402

SCHEMA = "ckpt-remote-size/1"
KIB = 1024


def item_bytes(ckpt: Path) -> dict:
    """.metadata bytes and the items' bytes by kind, from the checkpoint's own metadata (torch's reader)."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(ckpt)).read_metadata()
    lora = frozen = total = 0
    for idx, info in md.storage_data.items():
        total += info.length
        if idx.fqn.startswith("app.model."):
            if ".lora_A." in idx.fqn or ".lora_B." in idx.fqn:
                lora += info.length
            else:
                frozen += info.length
    return {"metadata": (ckpt / ".metadata").stat().st_size, "items": total, "lora_items": lora,
            "frozen_items": frozen, "unique_items": total - frozen}


def bounds(b: dict) -> dict:
    return {"inspect": b["metadata"] + 64 * KIB,
            "extract-adapter": int((b["lora_items"] + b["metadata"]) * 1.02),
            "slim --base": int((b["unique_items"] + b["metadata"]) * 1.02)}


class Server:
    def __init__(self, root: Path, rate_mb: float, latency_ms: float, work: Path):
        port_file = work / "port"
        port_file.unlink(missing_ok=True)
        self.proc = subprocess.Popen([sys.executable, str(BENCH / "throttled_http.py"), str(root), "--rate-mb",
                                      str(rate_mb), "--latency-ms", str(latency_ms), "--port-file", str(port_file)])
        for _ in range(200):
            if port_file.exists() and port_file.read_text():
                break
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port_file.read_text()}"

    def stats(self, reset=False) -> dict:
        with urllib.request.urlopen(self.url + ("/__reset__" if reset else "/__stats__")) as r:
            return json.loads(r.read())

    def close(self):
        self.proc.terminate()
        self.proc.wait(10)


def curl_config(server_url: str, log: list, path: Path) -> None:
    """A curl config with one transfer per GET of `log`: its URL, its range, the body to /dev/null."""
    lines = []
    for p, rng, _n in log:
        lines.append(f'url = "{server_url}{p}"')
        lines.append('output = "/dev/null"')
        if rng:
            lines.append(f'range = "{rng.removeprefix("bytes=")}"')
        lines.append("next")
    path.write_text("\n".join(lines[:-1]) + "\n")


def measure(a) -> int:
    root = Path(a.root).resolve()
    info = json.loads((root / "sparse_ckpt.json").read_text())
    ckpt, base = root / info["checkpoint"], root / info["base"]
    work = Path(a.workdir).resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    sizes = item_bytes(ckpt)
    digest = tree_digest()   # the code measured, as it is now
    limit = bounds(sizes)
    py = [sys.executable, "-m", "ckpt_tools", "--allow-sparse"]   # the local base is sparse (remote: no effect)
    env = {"PYTHONPATH": str(REPO), "CKPT_REMOTE_CONCURRENCY": str(a.concurrency)}
    alpha = str(info["lora_alpha"])
    server = Server(root, a.rate_mb, a.latency_ms, work)
    url = f"{server.url}/{info['checkpoint']}"
    out = work / "out"
    cases = {
        "inspect": lambda: py + ["inspect", url, "--json"],
        "extract-adapter": lambda: py + ["extract-adapter", url, str(out), "--alpha", alpha, "--base", str(base),
                                             "--json"],
        "slim --base": lambda: py + ["slim", url, str(out), "--base", str(base), "--json"],
    }
    unknown = sorted(set(a.cases.split(",")) - set(cases))
    if unknown:   # (an empty run would write a results file that measured nothing)
        server.close()
        raise SystemExit(f"unknown case(s) {unknown}: choose from {sorted(cases)}")
    cases = {k: v for k, v in cases.items() if k in a.cases.split(",")}
    runs, warm = [], {}

    def one(case, contender, rep, log_name):
        shutil.rmtree(out, ignore_errors=True)
        server.stats(reset=True)
        argv = cases[case]() if contender == "ckpt" else \
            ["curl", "-s", "-S", "--fail", "--parallel", "--parallel-max", str(a.concurrency), "-K",
             str(work / f"{case.replace(' ', '_')}.curl")]
        rec = run_measured(argv, work / "logs", log_name, a.timeout_s, env=env, cwd=REPO)
        st = server.stats()
        row = {"case": case, "contender": contender, "rep": rep, "status": rec["status"],
               "wall_s": rec.get("wall_s"), "peak_rss_bytes": rec.get("peak_rss_bytes"),
               "cpu_s": rec.get("cpu_s"), "bytes_served": st["bytes"], "requests": st["requests"]}
        if rec["status"] != "ok":
            row["reason"] = rec.get("reason")
            row["stderr_tail"] = rec.get("stderr_tail", "")[-1500:]
        if contender == "ckpt":
            row["within_bound"] = st["bytes"] <= limit[case]
        print(json.dumps(row), flush=True)
        return row, st

    res = {"schema": SCHEMA, "date": datetime.date.today().isoformat(),
           "machine": {"host": a.host, "cpu_count": os.cpu_count(), "kernel": platform.release(),
                       "python": platform.python_version(), "curl": subprocess.run(
                           ["curl", "--version"], capture_output=True, text=True).stdout.split("\n")[0],
                       "loadavg_start": os.getloadavg()},
           "commit": subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip(),
           "tree_sha256": digest,
           "link": {"rate_bytes_per_s": a.rate_mb * 1e6, "latency_s": a.latency_ms / 1000,
                    "concurrency": a.concurrency},
           "order_seed": None, "repeat": a.repeat, "checkpoint": info, "sizes": sizes, "bounds": limit,
           "whole_download_s": round(info["checkpoint_bytes"] / (a.rate_mb * 1e6), 1),
           "warmup": warm, "runs": runs}

    def save():   # after every run: a run cut short keeps what it measured
        res["loadavg_now"] = os.getloadavg()
        Path(a.results).write_text(json.dumps(res, indent=1))
    try:
        for case in cases:   # warm-up: the GETs each command makes, for curl to replay
            row, st = one(case, "ckpt", -1, f"warm-{case.replace(' ', '_')}")
            warm[case] = row
            curl_config(server.url, st["log"], work / f"{case.replace(' ', '_')}.curl")
            if case == "extract-adapter" and row["status"] == "ok":
                remote_tree = tree_digests(out)
                local = work / "local-extract"
                subprocess.run(py + ["extract-adapter", str(ckpt), str(local), "--alpha", alpha, "--base", str(base)],
                               env=dict(os.environ, **env), cwd=REPO, check=True, capture_output=True)
                warm[case]["identical_to_local_run"] = remote_tree == tree_digests(local)
                shutil.rmtree(local)
        seed = a.seed if a.seed is not None else random.randrange(2**31)
        res["order_seed"] = seed
        rng = random.Random(seed)
        pairs = [(c, k) for c in cases for k in ("ckpt", "curl")]
        for rep in range(a.repeat):
            order = pairs[:]
            rng.shuffle(order)
            for case, contender in order:
                runs.append(one(case, contender, rep, f"{case.replace(' ', '_')}-{contender}-{rep}")[0])
                save()
    finally:
        server.close()
        shutil.rmtree(out, ignore_errors=True)
    save()
    shutil.rmtree(work, ignore_errors=True)
    return 0 if all(r["status"] == "ok" for r in runs) else 1


def summarize(res: dict) -> list[dict]:
    out = []
    for case, limit in res["bounds"].items():
        rows = {k: [r for r in res["runs"] if r["case"] == case and r["contender"] == k and r["status"] == "ok"]
                for k in ("ckpt", "curl")}
        if not rows["ckpt"]:
            continue
        ck, cu = rows["ckpt"], rows["curl"]
        t_ck, t_cu = [r["wall_s"] for r in ck], [r["wall_s"] for r in cu]
        b = [r["bytes_served"] for r in ck]
        out.append({"case": case, "runs": len(ck), "bytes_max": max(b), "bytes_min": min(b), "bound": limit,
                    "met": all(r["within_bound"] for r in ck) and len(ck) == res["repeat"],
                    "within_all": all(r["within_bound"] for r in ck),
                    "warmup_within": (res["warmup"].get(case) or {}).get("within_bound"),
                    "share_of_checkpoint": max(b) / res["checkpoint"]["checkpoint_bytes"],
                    "curl_bytes": max((r["bytes_served"] for r in cu), default=None),
                    "requests": statistics.median(r["requests"] for r in ck),
                    "ckpt_s": (statistics.median(t_ck), min(t_ck), max(t_ck)),
                    "curl_s": (statistics.median(t_cu), min(t_cu), max(t_cu)) if t_cu else None,
                    "ratio": statistics.median(t_ck) / statistics.median(t_cu) if t_cu else None,
                    "ratio_worst": max(t_ck) / min(t_cu) if t_cu else None,
                    "rss": max(r["peak_rss_bytes"] or 0 for r in ck),
                    "whole_ratio": res["whole_download_s"] / statistics.median(t_ck)})
    return out


def verdict(s: dict, repeat: int) -> str:
    if s["met"]:
        return "met"
    if s["within_all"]:   # a run cut short: say what was measured, never "met"
        n = s["runs"]
        return (f"within on {'all ' if n > 1 else 'its '}{n} run{'s' if n > 1 else ''}"
                + (" and the warm-up" if s["warmup_within"] else "")
                + f" ({repeat} planned: **not met**)")
    return "**not met**"


def report(a) -> int:
    """The markdown table of one or more results files (the same checkpoint and link)."""
    all_res = [json.loads(Path(p).read_text()) for p in a.results]
    res = all_res[0]
    info, link = res["checkpoint"], res["link"]
    gb = 1e9

    def secs(t):
        med, lo, hi = t
        return f"{med:.1f} ({lo:.1f}-{hi:.1f})" if hi - lo >= 0.05 else f"{med:.1f}"
    runs_of = "; ".join(
        f"{', '.join(sorted({r['case'] for r in x['runs']}))}: "
        f"{len({r['rep'] for r in x['runs'] if r['contender'] == 'ckpt'})} of {x['repeat']} repetitions, "
        f"seed {x['order_seed']}, "
        f"commit {x['commit']}, files sha256 {x['tree_sha256'][:16]}, load average "
        f"{x['machine']['loadavg_start'][0]:.1f} at the start" for x in all_res)
    lines = [
        f"Checkpoint: Qwen3-{info['size'].upper()}-shaped prime-rl LoRA DCP (r={info['lora_rank']}, alpha "
        f"{info['lora_alpha']:g}, {len(info['targets'])} targets, {info['layers']} layers, hidden {info['hidden']}, "
        f"{info['world_size']} FSDP2 ranks), {info['checkpoint_bytes']:,} B = {info['checkpoint_bytes'] / gb:.1f} GB "
        f"({info['checkpoint_allocated_bytes'] / gb:.2f} GB on disk: the zero fp32 masters are holes); "
        f".metadata {res['sizes']['metadata']:,} B, LoRA items {res['sizes']['lora_items']:,} B, unique items "
        f"{res['sizes']['unique_items']:,} B. Link: {link['rate_bytes_per_s'] / 1e6:g} MB/s shared by all "
        f"connections, {link['latency_s'] * 1000:g} ms before each response, {link['concurrency']} requests in "
        f"flight (ckpt and curl). Every (case, contender) pair in a new shuffled order each repetition ({runs_of}); "
        f"{res['machine']['host']} ({res['machine']['cpu_count']} cores, shared). Times are medians (min-max), "
        f"seconds, of the whole process (ckpt's includes its ~1 s start-up); a bound is met only when every run "
        f"is within it. Downloading the whole checkpoint at this rate: {res['whole_download_s']:.0f} s "
        f"(computed, not run).",
        "",
        "| command | runs | bytes fetched (max) | bound | met | of checkpoint | requests | ckpt s "
        "| curl s (same ranges) "
        "| ckpt / curl (worst) | whole download / ckpt | peak RSS |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for x in all_res:
        for s in summarize(x):
            lines.append(
                f"| `{s['case']}` | {s['runs']} | {s['bytes_max']:,} | {s['bound']:,} "
                f"| {verdict(s, x['repeat'])} | {100 * s['share_of_checkpoint']:.3f}% "
                f"| {s['requests']:.0f} | {secs(s['ckpt_s'])} | {secs(s['curl_s']) if s['curl_s'] else 'n/a'} "
                f"| {s['ratio']:.2f}x ({s['ratio_worst']:.2f}x) | {s['whole_ratio']:.0f}x "
                f"| {s['rss'] / 2**30:.2f} GiB |")
    for x in all_res:
        w = x["warmup"].get("extract-adapter", {})
        if "identical_to_local_run" in w:
            lines += ["", "The remote extract-adapter's output is " +
                      ("byte-identical" if w["identical_to_local_run"] else "**not** identical") +
                      " to a local run's on the same files (sha256 of every file)."]
    print("\n".join(lines))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--root", required=True, help="a bench/sparse_ckpt.py output")
    m.add_argument("--results", required=True)
    m.add_argument("--workdir", default="/tmp/ckpt-remote-size")
    m.add_argument("--rate-mb", type=float, default=200.0)
    m.add_argument("--latency-ms", type=float, default=20.0)
    m.add_argument("--concurrency", type=int, default=8)
    m.add_argument("--repeat", type=int, default=5)
    m.add_argument("--seed", type=int, default=None)
    m.add_argument("--cases", default="inspect,extract-adapter,slim --base")
    m.add_argument("--host", default=platform.node())
    m.add_argument("--timeout-s", type=float, default=1800)
    r = sub.add_parser("report")
    r.add_argument("results", nargs="+")
    a = ap.parse_args(argv)
    return measure(a) if a.cmd == "measure" else report(a)


if __name__ == "__main__":
    sys.exit(main())
