#!/usr/bin/env python3
"""Is a revision slower? The same ckpt commands from several source trees, interleaved, on the same inputs.

    git archive e262f01 ckpt_tools | tar -x -C .trees/pre-redesign      # a tree = a checkout's ckpt_tools/
    python bench/revs.py --tree pre-redesign=.trees/pre-redesign --tree now=. --size 0.6b --repeat 3

The inputs are the harness's (bench/inputs.py, cached in --workdir), made once by this checkout. Each
repeat runs every (case, tree) pair, and with --floors each case's floor and `python -c 'import torch'`,
in a new shuffled order (the seed is recorded), each in its own process through bench/launch.py, with
PYTHONPATH set to that tree, so the trees see the same page cache and machine load. Prints, per case, the
median wall and peak RSS of each tree and its ratio to the first tree, and with --floors each tree's ratio
to (floor + import torch), median and worst (the slowest run over the fastest floor and import); writes the
records (wall, CPU, RSS, and the sha256 of each output's SHA256SUMS: whether the trees wrote the same bytes) to
--results. Cases: merge (HF base + PEFT adapter), slim, rehydrate, the three the refactors promised not to
slow; slim --base and extract-adapter (issue 22: the byte movers without torch); diff (diff-vs-base merged
base), diff-adapter (with --adapter) and diff-adapter-cuda (--device cuda: a tree without it fails that case);
merge-fp8, export and export-fp8 (issue 35: `--dtype fp8` beside the bf16 commands, all four held to `cp -r
base && sync`, whose runs they share).

    python bench/revs.py --tree main=.trees/main --tree now=. --size 1.7b --dcp ckpt \
        --cases merge,merge-fp8,export,export-fp8 --floors --repeat 5

    python bench/revs.py --tree main=.trees/main --tree now=. --size 1.7b --dcp ckpt --cases rehydrate \
        --floors --repeat 5
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

from inputs import SizeInputs
from runner import run_measured
from sizes import SIZES

REPO = Path(__file__).resolve().parents[1]

# each case's floor (issue 22's): what the same bytes cost without ckpt (a shell command on the inputs)
FLOORS = {
    "merge": ("cp -r base && sync", lambda p, out: ["sh", "-c", 'cp -r "$1" "$2" && sync', "sh", p["base"], out]),
    # issue 35: an FP8 output (half the bytes) and the export's bf16 tree are held to the same floor
    "merge-fp8": ("cp -r base && sync", lambda p, out: ["sh", "-c", 'cp -r "$1" "$2" && sync', "sh", p["base"], out]),
    "export": ("cp -r base && sync", lambda p, out: ["sh", "-c", 'cp -r "$1" "$2" && sync', "sh", p["base"], out]),
    "export-fp8": ("cp -r base && sync", lambda p, out: ["sh", "-c", 'cp -r "$1" "$2" && sync', "sh", p["base"],
                                                          out]),
    "slim": ("cat dcp", lambda p, out: ["sh", "-c", 'find "$1" -type f -exec cat {} + >/dev/null', "sh", p["dcp"]]),
    "rehydrate": ("cp -r dcp && sync", lambda p, out: ["sh", "-c", 'cp -r "$1" "$2" && sync', "sh", p["dcp"], out]),
}
IMPORT_TORCH = "python -c 'import torch'"

CASES = {
    "merge": (("base", "adapter"), lambda p, out, shard: ["merge", p["base"], p["adapter"], out,
                                                          "--max-shard-size", shard, "--json"]),
    "merge-fp8": (("base", "adapter"), lambda p, out, shard: ["merge", p["base"], p["adapter"], out,
                                                              "--max-shard-size", shard, "--dtype", "fp8", "--json"]),
    "export": (("dcp", "base"), lambda p, out, shard: ["export", p["dcp"], out, "--config-from", p["base"],
                                                       "--alpha", "64", "--allow-zero-delta", "--json"]),
    "export-fp8": (("dcp", "base"), lambda p, out, shard: ["export", p["dcp"], out, "--config-from", p["base"],
                                                           "--alpha", "64", "--allow-zero-delta", "--dtype", "fp8",
                                                           "--json"]),
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
    ap.add_argument("--dcp", choices=("auto", "factory", "ckpt"), default="auto",
                    help="the DCP input: the factory's (auto: up to 2B params) or `ckpt adapter-to-dcp`'s")
    ap.add_argument("--dcp-dir", type=Path, default=None, help="where the DCP input lives (default: --workdir); "
                    "e.g. /dev/shm, where the disk holds the base and the output but not the checkpoint too")
    ap.add_argument("--floors", action="store_true",
                    help="also run each case's floor and `python -c 'import torch'` in the shuffled order")
    ap.add_argument("--order-seed", type=int, default=None, help="seed of the shuffled order (default: random)")
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
    needs_dcp = any(kind in ("dcp", "slim") for case in a.cases for kind in CASES[case][0]) or a.floors
    dcp_mode = a.dcp if a.dcp != "auto" else ("factory" if size.params <= 2e9 else "ckpt")
    dcp_mode = dcp_mode if needs_dcp else "none"   # (the harness's --dcp none: no DCP input is built)
    a.order_seed = a.order_seed if a.order_seed is not None else random.randrange(1 << 30)
    order = random.Random(a.order_seed)
    inputs = SizeInputs(size, a.workdir, (a.dcp_dir or a.workdir).resolve(), dcp_mode, 4, a.python, None, {})
    for case in a.cases:
        for kind in CASES[case][0] + (("dcp", "base") if a.floors else ()):
            inputs.ensure(kind)
    runs = []
    contenders = [(case, label, root) for case in a.cases for label, root in a.trees]
    if a.floors:  # each floor once (cases that share one, e.g. merge and merge-fp8, share its runs)
        firsts = {FLOORS[case][0]: case for case in reversed(a.cases) if case in FLOORS}
        contenders += [(case, label, None) for label, case in reversed(firsts.items())]
        contenders.append((None, IMPORT_TORCH, None))
    (inputs.root / "out").mkdir(parents=True, exist_ok=True)
    for rep in range(a.repeat):
        turn = list(contenders)
        order.shuffle(turn)
        for case, label, root in turn:
            out = inputs.root / "out" / f"rev-{contenders.index((case, label, root))}"
            env = None
            if root is not None:
                argv = [a.python, "-m", "ckpt_tools",
                        *map(str, CASES[case][1](inputs.paths, out, inputs.shard_bytes))]
                env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(root), site]))}
            elif case is not None:
                argv = FLOORS[case][1]({k: str(v) for k, v in inputs.paths.items()}, str(out))
            else:
                argv = [a.python, "-c", "import torch"]
            # cwd outside every tree: `python -m` puts the cwd first on sys.path
            rec = run_measured(argv, inputs.root / "logs", f"rev-{case}-{contenders.index((case, label, root))}-{rep}", a.timeout_s,
                               env=env, cwd=inputs.root)
            sums = out / "SHA256SUMS"     # every output file's sha256, as the command wrote them: trees compared
            digest = hashlib.sha256(sums.read_bytes()).hexdigest() if root is not None and sums.is_file() else None
            _remove(out)
            runs.append({"case": case, "tree": label, "rep": rep, "out_sums_sha256": digest, **{k: rec.get(k) for k in
                         ("status", "reason", "wall_s", "cpu_s", "user_s", "sys_s", "peak_rss_bytes", "stderr_tail")}})
            print(f"{case or '-':10s} {label:20s} rep {rep}: {rec.get('status')} {rec.get('wall_s') or 0:.2f} s, "
                  f"CPU {rec.get('cpu_s') or 0:.1f} s, {(rec.get('peak_rss_bytes') or 0) / 2**20:.0f} MiB", flush=True)
            save(a, runs)   # after every run: a run cut short keeps what it measured
    print(save(a, runs))
    return 0 if all(r["status"] == "ok" for r in runs) else 1


def save(a, runs: list[dict]) -> str:
    table = summarize(runs, a.trees, a.cases)
    results = a.results or a.workdir / a.size / "revs.json"
    results.write_text(json.dumps({"size": a.size, "trees": [[l, str(r)] for l, r in a.trees],
                                   "order_seed": a.order_seed, "floors": a.floors,
                                   "when": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "runs": runs,
                                   "nproc": os.cpu_count(), "table": table}, indent=1))
    return table


def summarize(runs: list[dict], trees, cases) -> str:
    lines = ["| case | " + " | ".join(f"{l} wall, CPU (RSS)" for l, _ in trees) + " | " +
             " | ".join(f"{l}/{trees[0][0]}" for l, _ in trees[1:]) + " |",
             "|---" * (1 + 2 * len(trees) - 1) + "|"]

    def ok(case, label):
        return [r for r in runs if r["case"] == case and r["tree"] == label and r["status"] == "ok"]
    for case in cases:
        med = {}
        for label, _ in trees:
            got = ok(case, label)
            med[label] = (statistics.median(r["wall_s"] for r in got) if got else None,
                          max(r["peak_rss_bytes"] or 0 for r in got) if got else None,
                          statistics.median(r.get("cpu_s") or 0 for r in got) if got else None)
        ref = med[trees[0][0]][0]
        cells = [f"{w:.2f} s, cpu {c:.2f} s ({m / 2**20:.0f} MiB)" if w else "failed" for w, m, c in med.values()]
        ratios = [f"{med[l][0] / ref:.2f}x" if ref and med[l][0] else "n/a" for l, _ in trees[1:]]
        lines.append(f"| {case} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    floor_lines = []
    torch_runs = ok(None, IMPORT_TORCH)
    for case in cases:
        floor = [r for r in runs if r["case"] is not None and r["tree"] == FLOORS[case][0] and r["status"] == "ok"] \
            if case in FLOORS else []
        if not floor or not torch_runs:
            continue
        fmed = statistics.median(r["wall_s"] for r in floor)
        tmed = statistics.median(r["wall_s"] for r in torch_runs)
        fmin, tmin = min(r["wall_s"] for r in floor), min(r["wall_s"] for r in torch_runs)
        floor_lines.append(f"{case}: floor `{FLOORS[case][0]}` {fmed:.2f} s ({fmin:.2f}-"
                           f"{max(r['wall_s'] for r in floor):.2f}), CPU {statistics.median(r['cpu_s'] for r in floor):.1f} s;"
                           f" `import torch` {tmed:.2f} s ({tmin:.2f}-{max(r['wall_s'] for r in torch_runs):.2f})")
        for label, _ in trees:
            got = ok(case, label)
            if got:
                w = [r["wall_s"] for r in got]
                floor_lines.append(
                    f"  {label}: {statistics.median(w):.2f} s ({min(w):.2f}-{max(w):.2f}), CPU "
                    f"{statistics.median(r['cpu_s'] for r in got):.1f} s, RSS {max(r['peak_rss_bytes'] for r in got) / 2**20:.0f} MiB: "
                    f"{statistics.median(w) / (fmed + tmed):.2f}x (floor + import torch), worst "
                    f"{max(w) / (fmin + tmin):.2f}x")
    same = []
    for case in cases:  # the outputs' SHA256SUMS, per tree: a change that should not move a byte must not
        digests = {r["out_sums_sha256"] for r in runs if r["case"] == case and r.get("out_sums_sha256")}
        if digests:
            same.append(f"{case}: {'the same output bytes from every tree and run' if len(digests) == 1 else f'{len(digests)} different outputs'}")
    return "\n".join(lines + floor_lines + same)


def _remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
