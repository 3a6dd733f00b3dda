#!/usr/bin/env python3
"""What each command fetches of the genuine `primerl-tiny` fixture over gs:// and HTTP (docs/remote.md):
the body bytes and media requests each server counted, per command, over `--repeat` runs (min-max), and
the write requests of putting a slim at gs:// (uploads, server-side copies, deletes). The servers are the tests' own (tests/remote_servers.py: the
range-capable HTTP server, fake-gcs-server behind its counting proxy), on 127.0.0.1; the commands run in
this process through the CLI. Needs the `remote` and `remote-test` extras.

    .venv/bin/python bench/remote_fetch.py --repeat 3 --results bench/results/DATE-2core-remote-fetch.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from click.testing import CliRunner  # noqa: E402

from ckpt_tools.cli import main  # noqa: E402
from ckpt_tools.io import upload  # noqa: E402
from tests.remote_servers import GcsServer, HttpServer  # noqa: E402

FX = REPO / "tests" / "fixtures" / "primerl-tiny"
TRAINER = FX / "outputs" / "checkpoints" / "step_3" / "trainer"
BASE = FX / "base_model"


def cases(url: str, out: Path) -> dict:
    return {"inspect": ["inspect", url],
            "extract-adapter": ["extract-adapter", url, out / "a", "--alpha", "16"],
            "slim --base BASE": ["slim", url, out / "s", "--base", BASE],
            "slim": ["slim", url, out / "s2"],
            "merge BASE URL": ["merge", BASE, url, out / "m", "--alpha", "16"],
            "export": ["export", url, out / "e", "--alpha", "16", "--config-from", BASE],
            "verify": ["verify", url],
            "verify --deep": ["verify", url, "--deep"],
            "diff-vs-base URL BASE": ["diff-vs-base", url, BASE]}


def measure(url: str, counter, work: Path, repeat: int) -> dict:
    seen: dict[str, list[tuple[int, int]]] = {}
    for i in range(repeat):
        out = work / f"run{i}"
        for name, args in cases(url, out).items():
            counter.reset()
            r = CliRunner().invoke(main, [str(a) for a in args])
            upload.discard_pending()
            if r.exit_code not in (0, 3):   # diff-vs-base: 3 = identical weights
                raise SystemExit(f"{name} on {url}: exit {r.exit_code}\n{r.output}")
            seen.setdefault(name, []).append((counter.bytes, len(counter.requests)))
        shutil.rmtree(out, ignore_errors=True)
    return seen


def span(values) -> str:
    lo, hi = min(values), max(values)
    return f"{lo:,}" if lo == hi else f"{lo:,}-{hi:,}"


def main_() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--results", type=Path, help="also write the figures here (JSON)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ckpt-remote-fetch-"))
    http = HttpServer(FX / "outputs" / "checkpoints" / "step_3")
    gcs = GcsServer()
    try:
        gcs.create_bucket("runs")
        for p in sorted(TRAINER.iterdir()):
            gcs.put("runs", f"step_3/trainer/{p.name}", p.read_bytes())
        adc = work / "adc.json"   # what `gcloud auth application-default login` writes, with a valid token
        adc.write_text(json.dumps({"type": "authorized_user", "client_id": "bench", "client_secret": "s",
                                   "refresh_token": "r", "token": "bench-token", "expiry": "2099-01-01T00:00:00Z"}))
        os.environ.update(STORAGE_EMULATOR_HOST=gcs.url, GOOGLE_APPLICATION_CREDENTIALS=str(adc),
                          GOOGLE_CLOUD_PROJECT="bench", NO_GCE_CHECK="true", CLOUDSDK_CONFIG=str(work / "gcloud"))
        gcs.faults["require_token"] = "bench-token"
        got = {"gs://": measure("gs://runs/step_3/trainer", gcs.counter, work, args.repeat),
               "http://": measure(f"{http.url}/trainer", http.counter, work, args.repeat)}
        n = len(gcs.writes)
        r = CliRunner().invoke(main, ["slim", str(TRAINER), "gs://runs/bench-slim", "--base", str(BASE)])
        upload.discard_pending()
        assert r.exit_code == 0, r.output
        writes = gcs.writes[n:]   # (method, path, query names, object name)
        kinds = {"uploads": sum(1 for m, p, _q, _n in writes if p.startswith("/upload/")),
                 "copies": sum(1 for _m, p, _q, _n in writes if "/rewriteTo/" in p or "/copyTo/" in p),
                 "deletes": sum(1 for m, _p, _q, _n in writes if m == "DELETE")}
    finally:
        http.close()
        gcs.close()
        shutil.rmtree(work, ignore_errors=True)
    print(f"{args.repeat} run(s) each; bytes and media requests counted by the servers\n")
    print("| command | gs:// bytes | gs:// requests | http:// bytes | http:// requests |")
    print("|---|---:|---:|---:|---:|")
    for name in got["gs://"]:
        g, h = got["gs://"][name], got["http://"][name]
        print(f"| `{name}` | {span([b for b, _ in g])} | {span([q for _, q in g])} | {span([b for b, _ in h])} | "
              f"{span([q for _, q in h])} |")
    print(f"\nslim put at gs://: {len(writes)} write requests ({kinds['uploads']} uploads, {kinds['copies']} "
          f"server-side copies into place, {kinds['deletes']} deletes of the staging prefix)")
    if args.results:
        commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        doc = {"bench": "remote_fetch", "date": time.strftime("%Y-%m-%d"), "commit": commit,
               "repeat": args.repeat, "fixture": str(TRAINER.relative_to(REPO)),
               "fixture_bytes": sum(p.stat().st_size for p in TRAINER.iterdir()),
               "runs": {server: {name: [{"bytes": b, "requests": q} for b, q in runs]
                                 for name, runs in by_cmd.items()} for server, by_cmd in got.items()},
               "slim_to_gs": {"write_requests": len(writes), **kinds}}
        args.results.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main_()
