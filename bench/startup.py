#!/usr/bin/env python3
"""Start-up of the metadata commands, side by side with `python -c pass` and `hf --help` in one run.

    .venv/bin/python bench/startup.py [--repeat 7] [--dcp DIR ...] [--markdown]

Each contender runs `--repeat` times, interleaved (so a busy neighbour slows all of them alike), in a
fresh interpreter with the shell's environment, bytecode caches warmed by one unmeasured run first
(PYTHONDONTWRITEBYTECODE is dropped: a user's install has its .pyc files). Reports the median and
range of wall time, interpreter start included, and the ratio to `python -c pass` and `hf --help`.
Inputs: the repository's genuine fixtures (DCP, HEAD MoE DCP, HF dir, PEFT adapter, broadcast) and
any `--dcp` given (a checkpoint with many keys shows that inspect's cost follows the metadata, never
the tensor bytes). The issue-13 target: inspect of any checkpoint under 0.5 s on 2 cores.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIX = REPO / "tests" / "fixtures"
TINY = FIX / "primerl-tiny"
TRAINER = TINY / "outputs" / "checkpoints" / "step_3" / "trainer"
TARGET_S = 0.5


def contenders(py: str, extra_dcps: list[Path]) -> list[tuple[str, list[str]]]:
    ckpt = [py, "-m", "ckpt_tools"]
    hf = shutil.which("hf", path=str(Path(py).parent)) or shutil.which("hf")
    rows = [("python -c pass", [py, "-c", "pass"])]
    if hf:
        rows.append(("hf --help", [hf, "--help"]))
    rows += [
        ("ckpt --version", [*ckpt, "--version"]),
        ("ckpt --help", [*ckpt, "--help"]),
        ("ckpt inspect DCP (tiny, 4 ranks)", [*ckpt, "inspect", str(TRAINER)]),
        ("ckpt inspect DCP --json", [*ckpt, "inspect", str(TRAINER), "--json"]),
        ("ckpt inspect DCP (HEAD MoE, EP=2)",
         [*ckpt, "inspect", str(FIX / "primerl-head" / "F_head_moe" / "outputs" / "checkpoints" / "step_3" / "trainer")]),
        ("ckpt inspect HF dir", [*ckpt, "inspect", str(TINY / "base_model")]),
        ("ckpt inspect PEFT adapter", [*ckpt, "inspect", str(TINY / "reference_peft_adapter")]),
        ("ckpt inspect prime-rl broadcast", [*ckpt, "inspect", str(TINY / "outputs" / "run_default" / "broadcasts" / "step_3")]),
        ("ckpt verify DCP", [*ckpt, "verify", str(TRAINER)]),
        ("ckpt verify PEFT --base", [*ckpt, "verify", str(TINY / "reference_peft_adapter"), "--base", str(TINY / "base_model")]),
    ]
    for d in extra_dcps:
        meta = (d / ".metadata").stat().st_size if (d / ".metadata").exists() else 0
        rows.append((f"ckpt inspect {d.name} ({meta / 2**20:.1f} MiB .metadata)", [*ckpt, "inspect", str(d)]))
        rows.append((f"ckpt verify {d.name}", [*ckpt, "verify", str(d)]))
    return rows


def run_once(argv: list[str], env: dict, cwd: Path = REPO) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {r.returncode}: {r.stderr.decode()[-500:]}")
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--dcp", type=Path, action="append", default=[], help="another DCP checkpoint to inspect")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--markdown", action="store_true", help="print a markdown table (for docs/benchmarks.md)")
    ap.add_argument("--tree", type=Path, default=REPO,
                    help="the source tree whose ckpt_tools runs (`python -m` imports from the working dir): "
                         "an older tree side by side with this one")
    a = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    rows = contenders(a.python, a.dcp)
    tree = a.tree.resolve()
    for _, argv in rows:            # warm: page cache and .pyc files, unmeasured
        run_once(argv, env, tree)
    walls: dict[str, list[float]] = {name: [] for name, _ in rows}
    for _ in range(a.repeat):
        for name, argv in rows:
            walls[name].append(run_once(argv, env, tree))
    med = {n: statistics.median(w) for n, w in walls.items()}
    base, hf = med["python -c pass"], med.get("hf --help")
    print(f"tree {tree}; {len(os.sched_getaffinity(0))} cores, median of {a.repeat} runs, wall s, interpreter start included; target: "
          f"inspect < {TARGET_S} s")
    if a.markdown:
        print("\n| command | wall s (range) | x python -c pass | x hf --help | < 0.5 s |\n|---|---|---|---|---|")
    for name, w in walls.items():
        ratio_hf = f"{med[name] / hf:.2f}x" if hf else "-"
        ok = "" if not name.startswith("ckpt") else ("yes" if med[name] < TARGET_S else "NO")
        if a.markdown:
            print(f"| {name} | {med[name]:.3f} ({min(w):.3f}-{max(w):.3f}) | {med[name] / base:.1f}x | {ratio_hf} | {ok} |")
        else:
            print(f"  {name:<48} {med[name]:7.3f} s ({min(w):.3f}-{max(w):.3f})  {med[name] / base:6.1f}x pass  "
                  f"{ratio_hf:>7} hf --help  {ok}")


if __name__ == "__main__":
    main()
