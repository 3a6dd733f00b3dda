#!/usr/bin/env python3
"""Is a revision slower? The same ckpt commands from several source trees, interleaved, on the same inputs.

    git archive e262f01 ckpt_tools | tar -x -C .trees/pre-redesign      # a tree = a checkout's ckpt_tools/
    python bench/revs.py --tree pre-redesign=.trees/pre-redesign --tree now=. --size 0.6b --repeat 3

The inputs are the harness's (bench/inputs.py, cached in --workdir), made once by this checkout. Each
repeat runs every (case, tree) pair in turn, each in its own process through bench/launch.py, with
PYTHONPATH set to that tree, so the trees see the same page cache and machine load. Prints, per case, the
median wall and peak RSS of each tree and its ratio to the first tree; writes the records to --results.
Cases: merge (HF base + PEFT adapter), slim, rehydrate, the three the refactors promised not to slow; slim --base
and extract-adapter (issue 22: the byte movers without torch); diff (diff-vs-base merged base), diff-adapter (with
--adapter) and diff-adapter-cuda (--device cuda: a tree without it fails that case). Records wall, CPU and peak RSS.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

from inputs import SizeInputs
from runner import run_measured
from sizes import SIZES

REPO = Path(__file__).resolve().parents[1]

CASES = {
    "merge": (("base", "adapter"), lambda p, out, shard: ["merge", p["base"], p["adapter"], out,
                                                          "--max-shard-size", shard, "--json"]),
    "slim": (("dcp",), lambda p, out, shard: ["slim", p["dcp"], out, "--json"]),
    "slim --base": (("dcp", "base"), lambda p, out, shard: ["slim", p["dcp"], out, "--base", p["base"], "--json"]),
    "extract-adapter": (("dcp",), lambda p, out, shard: ["extract-adapter", p["dcp"], out, "--alpha", "64", "--json"]),
    "rehydrate": (("slim", "base"), lambda p, out, shard: ["rehydrate", p["slim"], out, "--base", p["base"],
                                                           "--json"]),
    "diff": (("merged", "base"), lambda p, out, shard: ["diff-vs-base", p["merged"], p["base"], "--json"]),
    "diff-adapter": (("merged", "base", "adapter"), lambda p, out, shard: [
        "diff-vs-base", p["merged"], p["base"], "--adapter", p["adapter"], "--json"]),
    "diff-adapter-cuda": (("merged", "base", "adapter"), lambda p, out, shard: [
        "diff-vs-base", p["merged"], p["base"], "--adapter", p["adapter"], "--device", "cuda", "--json"]),
}


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tree", action="append", required=True, metavar="LABEL=PATH",
                    help="a source tree holding ckpt_tools/ (the first is the reference)")
    ap.add_argument("--size", default="0.6b", choices=sorted(SIZES))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ckpt-bench"))
    ap.add_argument("--results", type=Path, default=None)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--timeout-s", type=float, default=900.0)
    a = ap.parse_args(argv)
    a.trees = []
    for t in a.tree:
        label, _, path = t.partition("=")
        root = Path(path).resolve()
        if not label or not (root / "ckpt_tools" / "__init__.py").is_file():
            ap.error(f"--tree {t}: want LABEL=PATH with PATH/ckpt_tools/__init__.py")
        a.trees.append((label, root))
    a.cases = [c for c in a.cases.split(",") if c]
    unknown = [c for c in a.cases if c not in CASES]
    if unknown:
        ap.error(f"unknown cases {unknown}; known: {sorted(CASES)}")
    a.workdir = a.workdir.resolve()
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    site = os.environ.get("PYTHONPATH")           # e.g. the device host's carried wheels
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), site]))  # inputs: this checkout's ckpt
    size = SIZES[a.size]
    needs_dcp = any(kind in ("dcp", "slim") for case in a.cases for kind in CASES[case][0])
    dcp_mode = ("factory" if size.params <= 2e9 else "ckpt") if needs_dcp else "none"   # (the harness's --dcp none)
    inputs = SizeInputs(size, a.workdir, a.workdir, dcp_mode, 4, a.python, None, {})
    for case in a.cases:
        for kind in CASES[case][0]:
            inputs.ensure(kind)
    runs = []
    for rep in range(a.repeat):
        for case in a.cases:
            for label, root in a.trees:
                out = inputs.root / "out" / f"rev-{label}"
                argv = [a.python, "-m", "ckpt_tools",
                        *map(str, CASES[case][1](inputs.paths, out, inputs.shard_bytes))]
                # cwd outside every tree: `python -m` puts the cwd first on sys.path
                rec = run_measured(argv, inputs.root / "logs", f"rev-{case}-{label}-{rep}", a.timeout_s,
                                   env={"PYTHONPATH": os.pathsep.join(filter(None, [str(root), site]))},
                                   cwd=inputs.root)
                _remove(out)
                runs.append({"case": case, "tree": label, "rep": rep, **{k: rec.get(k) for k in
                             ("status", "reason", "wall_s", "cpu_s", "user_s", "sys_s", "peak_rss_bytes",
                                                     "stderr_tail")}})
                print(f"{case:15s} {label:14s} rep {rep}: {rec.get('status')} {rec.get('wall_s') or 0:.2f} s "
                      f"(CPU {rec.get('cpu_s') or 0:.1f} s), {(rec.get('peak_rss_bytes') or 0) / 2**20:.0f} MiB",
                      flush=True)
                save(a, runs)   # after every run: a run cut short keeps what it measured
    print(save(a, runs))
    return 0 if all(r["status"] == "ok" for r in runs) else 1


def save(a, runs: list[dict]) -> str:
    table = summarize(runs, a.trees, a.cases)
    results = a.results or a.workdir / a.size / "revs.json"
    results.write_text(json.dumps({"size": a.size, "trees": [[l, str(r)] for l, r in a.trees],
                                   "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "runs": runs,
                                   "nproc": os.cpu_count(), "table": table}, indent=1))
    return table


def summarize(runs: list[dict], trees, cases) -> str:
    lines = ["| case | " + " | ".join(f"{l} wall, CPU (RSS)" for l, _ in trees) + " | " +
             " | ".join(f"{l}/{trees[0][0]}" for l, _ in trees[1:]) + " |",
             "|---" * (1 + 2 * len(trees) - 1) + "|"]
    for case in cases:
        med = {}
        for label, _ in trees:
            ok = [r for r in runs if r["case"] == case and r["tree"] == label and r["status"] == "ok"]
            med[label] = (statistics.median(r["wall_s"] for r in ok) if ok else None,
                          max(r["peak_rss_bytes"] or 0 for r in ok) if ok else None,
                          statistics.median(r.get("cpu_s") or 0 for r in ok) if ok else None)
        ref = med[trees[0][0]][0]
        cells = [f"{w:.2f} s, cpu {c:.2f} s ({m / 2**20:.0f} MiB)" if w else "failed" for w, m, c in med.values()]
        ratios = [f"{med[l][0] / ref:.2f}x" if ref and med[l][0] else "n/a" for l, _ in trees[1:]]
        lines.append(f"| {case} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
