"""The long, on-demand fuzz run (CI runs the same fuzzers bounded to 40 derandomized examples).

    .venv/bin/python bench/fuzz_long.py --minutes 30            # ~5 min per fuzzer, fresh seeds
    .venv/bin/python bench/fuzz_long.py --minutes 5 --fuzzer metadata_bytes
    .venv/bin/python bench/fuzz_long.py --summarize counts.json  # print a counts file

It runs tests/test_fuzz.py's hypothesis fuzzers (`.metadata` bytes and structure, `.distcp`
items, safetensors headers, adapter_config.json, index.json) with a huge example cap, random
seeds (CKPT_FUZZ_RANDOM=1) and a wall-clock budget per fuzzer (CKPT_FUZZ_SECONDS), and prints how
many iterations ran and how many raised anything but one of our typed errors (any such example
fails the run and hypothesis prints the shrunk input and its reproduction blob). Every example
also runs under a SIGALRM guard, so a hang fails too. Figures go to docs/reliability.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FUZZERS = ("metadata_bytes", "metadata_structure", "distcp_items", "safetensors_header", "adapter_config",
           "index_json")


def summarize(path: Path) -> dict:
    data = json.loads(path.read_text()) if path.is_file() else {}
    fz = data.get("fuzz", {})
    print(f"fuzz iterations: {fz.get('iterations', 0)}   uncaught: {fz.get('uncaught', 0)}")
    for k in FUZZERS:
        if k in fz:
            print(f"  {k:<20} {fz[k]}")
    for section, vals in sorted(data.items()):
        if section != "fuzz":
            print(f"{section}: " + ", ".join(f"{k} {v}" for k, v in sorted(vals.items())))
    return data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0, help="total wall-clock budget")
    ap.add_argument("--fuzzer", choices=FUZZERS, action="append", help="run only these (repeatable)")
    ap.add_argument("--counts", type=Path, help="where to write the counts JSON (default: a temp file)")
    ap.add_argument("--summarize", type=Path, metavar="COUNTS_JSON", help="only print a counts file")
    a = ap.parse_args()
    if a.summarize:
        summarize(a.summarize)
        return 0
    fuzzers = a.fuzzer or list(FUZZERS)
    counts = a.counts or Path(tempfile.mkdtemp()) / "fuzz-counts.json"
    counts.unlink(missing_ok=True)
    per = a.minutes * 60 / len(fuzzers)
    env = dict(os.environ, OMP_NUM_THREADS="1", CKPT_FUZZ_EXAMPLES="100000000", CKPT_FUZZ_RANDOM="1",
               CKPT_FUZZ_SECONDS=str(per), CKPT_HARDENING_COUNTS=str(counts))
    sel = " or ".join(f"test_fuzz_{f}" for f in fuzzers)
    t0 = time.monotonic()
    # hypothesis stops an example run at its own limits too; --hypothesis-seed is random here
    rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                          "-W", "ignore::UserWarning", str(REPO / "tests" / "test_fuzz.py"), "-k", sel],
                         cwd=REPO, env=env)
    print(f"\n{time.monotonic() - t0:.0f} s, pytest exit {rc}; counts in {counts}")
    summarize(counts)
    return rc


if __name__ == "__main__":
    sys.exit(main())
