#!/usr/bin/env python3
"""What each command fetches of the genuine verl and torchtitan fixtures over HTTP (docs/reference/verl-format.md,
torchtitan-format.md): the body bytes and GET requests the tests' range-capable HTTP server
(tests/remote_servers.py) counted, per command, over `--repeat` runs (min-max), beside each checkpoint's size.
The commands run in this process through the CLI. Needs the `remote` and `remote-test` extras.
With `--latency-ms L` the server is bench/throttled_http.py's (L ms before each response, 200 MB/s): the
seconds of each command too (a far object store's round trips).

    .venv/bin/python bench/remote_fetch_trainers.py --repeat 3 [--latency-ms 20]
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from click.testing import CliRunner  # noqa: E402

from ckpt_tools.cli import main  # noqa: E402
from tests.remote_servers import HttpServer  # noqa: E402
from throttled_http import ThrottledHttpServer  # noqa: E402

FX = REPO / "tests" / "fixtures"
VERL, TITAN = FX / "verl-fsdp2-lora", FX / "torchtitan-llama3-debug"
ACTOR = VERL / "checkpoints" / "global_step_2" / "actor"
STEP = TITAN / "checkpoint" / "step-3"


def cases(url: str, out: Path) -> dict[str, list]:
    verl, titan = f"{url}/{VERL.name}/checkpoints", f"{url}/{TITAN.name}"
    return {
        "verl inspect": ["inspect", verl],
        "verl verify": ["verify", verl],
        "verl verify --deep": ["verify", "--deep", verl],
        "verl extract-adapter": ["extract-adapter", verl, out / "a"],
        "verl merge BASE URL": ["merge", VERL / "base", verl, out / "m"],
        "verl export": ["export", verl, out / "e"],
        "torchtitan inspect": ["inspect", titan],
        "torchtitan verify --deep": ["verify", "--deep", titan],
        "torchtitan export": ["export", titan, out / "t", "--config-from", TITAN / "hf_assets"],
    }


def span(v) -> str:
    fmt = (lambda x: f"{x:,}") if isinstance(v[0], int) else (lambda x: f"{x:.2f}")
    return fmt(min(v)) if min(v) == max(v) else f"{fmt(min(v))}-{fmt(max(v))}"


def main_(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--latency-ms", type=float, default=0.0)
    args = ap.parse_args(argv)
    srv = ThrottledHttpServer(FX, 200e6, args.latency_ms / 1000) if args.latency_ms else HttpServer(FX)
    work = Path(tempfile.mkdtemp(prefix="remote-fetch-trainers-"))
    seen: dict[str, list[tuple[int, int, float]]] = {}
    try:
        for i in range(args.repeat):
            out = work / f"run{i}"
            for name, cmd in cases(srv.url, out).items():
                srv.counter.reset()
                t = time.perf_counter()
                r = CliRunner().invoke(main, [str(a) for a in cmd])
                took = time.perf_counter() - t
                if r.exit_code != 0:
                    raise SystemExit(f"{name}: exit {r.exit_code}\n{r.output}")
                gets = sum(1 for m, _p, _n in srv.counter.requests if m == "GET")
                seen.setdefault(name, []).append((srv.counter.bytes, gets, took))
            shutil.rmtree(out, ignore_errors=True)
    finally:
        srv.close()
        shutil.rmtree(work, ignore_errors=True)
    size = {"verl": sum(p.stat().st_size for p in ACTOR.iterdir() if p.is_file()),
            "torchtitan": sum(p.stat().st_size for p in STEP.iterdir())}
    print(f"verl-fsdp2-lora role dir: {size['verl']:,} bytes; torchtitan-llama3-debug step-3: "
          f"{size['torchtitan']:,} bytes; {args.repeat} runs each, {args.latency_ms:g} ms per request\n")
    print("| command | bytes fetched | GET requests | of the checkpoint | seconds |\n|---|---:|---:|---:|---:|")
    for name, runs in seen.items():
        b, n, t = ([r[i] for r in runs] for i in range(3))
        print(f"| `{name}` | {span(b)} | {span(n)} | {max(b) / size[name.split()[0]]:.0%} | {span(t)} |")


if __name__ == "__main__":
    main_()
