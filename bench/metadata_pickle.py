#!/usr/bin/env python3
"""What writing `.metadata` without torch saves: `ckpt slim` as shipped (torch-free: its `.metadata` is
encoded by `formats/dcp/metadata_pickle.py`) beside the same command in an interpreter that first imports
what torch's own pickler needs (`torch.distributed.checkpoint`, whose `Metadata` classes it would pickle),
and that import alone, beside `python -c pass`.

    .venv/bin/python bench/metadata_pickle.py [--repeat 7] [--results bench/results/X.json]

Each contender runs `--repeat` times, interleaved in a shuffled order per round (a busy neighbour slows
all of them alike), in a fresh interpreter, after one unmeasured warm-up run each (page cache, .pyc files).
The slim is of the repository's genuine fixture (tests/fixtures/primerl-tiny, `--base` its base model)
into a fresh temp dir each run. Reports the median and range of wall time, interpreter start included,
and each one's ratio to the shipped slim.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "tests" / "fixtures" / "primerl-tiny"
TRAINER = TINY / "outputs" / "checkpoints" / "step_3" / "trainer"
BASE = TINY / "base_model"
SLIM = "import sys; from ckpt_tools.entry import run; sys.argv = ['ckpt', *sys.argv[1:]]; run()"


def contenders(py: str) -> dict[str, list[str]]:
    slim_args = ["slim", str(TRAINER), "{out}", "--base", str(BASE)]
    return {
        "ckpt slim (torch-free, shipped)": [py, "-c", SLIM, *slim_args],
        "ckpt slim after import torch.distributed.checkpoint": [
            py, "-c", "import torch.distributed.checkpoint; " + SLIM, *slim_args,
        ],
        "python -c 'import torch.distributed.checkpoint'": [py, "-c", "import torch.distributed.checkpoint"],
        "python -c pass": [py, "-c", "pass"],
    }


def run_once(argv: list[str], env: dict) -> float:
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-") as tmp:
        argv = [a.replace("{out}", str(Path(tmp) / "slim")) for a in argv]
        t0 = time.perf_counter()
        r = subprocess.run(argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {r.returncode}: {r.stderr.decode()[-500:]}")
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--results", type=Path, help="also write the walls as JSON here")
    a = ap.parse_args()
    if a.repeat < 5:
        raise SystemExit("--repeat must be at least 5")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    rows = contenders(a.python)
    for argv in rows.values():  # warm: page cache and .pyc files, unmeasured
        run_once(argv, env)
    walls: dict[str, list[float]] = {name: [] for name in rows}
    rng = random.Random(0)
    for _ in range(a.repeat):
        order = list(rows)
        rng.shuffle(order)
        for name in order:
            walls[name].append(run_once(rows[name], env))
    med = {n: statistics.median(w) for n, w in walls.items()}
    ref = med["ckpt slim (torch-free, shipped)"]
    cores = len(os.sched_getaffinity(0))
    print(f"{cores} cores, median of {a.repeat} runs (range), wall s, interpreter start included")
    for name, w in walls.items():
        print(f"  {name:<56} {med[name]:7.3f} s ({min(w):.3f}-{max(w):.3f})  {med[name] / ref:5.2f}x shipped slim")
    if a.results is not None:
        doc = {"bench": "metadata_pickle", "cores": cores, "repeat": a.repeat, "python": a.python,
               "torch": _torch_version(a.python), "walls_s": walls, "median_s": med}
        a.results.write_text(json.dumps(doc, indent=1) + "\n")


def _torch_version(py: str) -> str:
    r = subprocess.run([py, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    return r.stdout.strip()


if __name__ == "__main__":
    main()
