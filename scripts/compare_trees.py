#!/usr/bin/env python3
"""Run every ckpt command on the same inputs with two source trees and compare what they produce.

    python scripts/compare_trees.py --old DIR --new DIR --work DIR [--inputs DIR]

Each tree runs as `python -m ckpt_tools` with PYTHONPATH=<tree> (the interpreter's packages otherwise:
torch, safetensors, ...), one command after another, in the same working directory and with the same
output paths (the outputs of the first tree are moved aside before the second tree runs), so every path
printed is the same for both. For every command compared:

- the exit code;
- stdout and stderr, with timings and free disk blanked (`0.52s`, `68.00 GiB free`) and, for `--json`
  output, the keys that hold a duration or the free disk dropped;
- every file under the command's output: its sha256, except DCP `.metadata` files, which hold a random
  save id (`storage_meta.save_id`, a uuid4 per save) and are compared by their decoded content without
  it (state_dict_metadata, planner_data, storage_data sorted by key, storage_meta's other fields, version).
  The names of `.metadata.bak-<UTC time>` backups are compared with the time blanked.

Inputs, built once and shared: a factory run (4 gloo FSDP2 ranks, `python -m ... factory`, from the OLD
tree: its factory is the reference), the genuine fixtures of the NEW tree's tests/fixtures (primerl-tiny and
the HEAD fixtures), a PEFT adapter saved by PEFT. Exit status 0 when everything matches, 1 otherwise.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

# what differs between two runs of the same command: durations, free disk, the UTC time in a backup's name
TIMING_KEYS = {"seconds", "elapsed_s", "probe_wall_s", "free_bytes"}
_TIME_TEXT = re.compile(r"\b\d+(\.\d+)?\s?s\b")
_FREE_TEXT = re.compile(r"\b\d+(\.\d+)? [KMGT]?i?B free\b")
_BAK = re.compile(r"\.bak-\d{8}T\d{6}(-\d+)?")


@dataclass
class Step:
    """One command line. `out` names the path it writes (a dir or file, relative to the work dir), or
    None for read-only commands; `copy`: (source, dest) pairs copied first, for commands that edit in place."""
    name: str
    args: list[str]
    out: str | None = None
    copy: tuple[tuple[str, str], ...] = ()
    json_stdout: bool = False


@dataclass
class Outcome:
    rc: int
    stdout: str
    stderr: str
    files: dict[str, str] = field(default_factory=dict)


def steps(i: Path) -> list[Step]:
    """The command list: the demo workflow (scripts/demo.sh) on the factory run and on the genuine
    primerl-tiny fixture, then the HEAD fixtures through the commands that accept them today (average,
    resize-adapter, export and report on those: they need a run of several steps, a full fine-tune)."""
    fac, tiny, head = i / "run", i / "primerl-tiny", i / "primerl-head"
    out: list[Step] = []
    for label, root in (("factory", fac), ("tiny", tiny)):
        t = next(iter(sorted((root / "outputs" / "checkpoints").glob("step_*/trainer"))))
        n = t.parent.name.removeprefix("step_")
        base = root / "base_model"
        bc = root / "outputs" / "run_default" / "broadcasts" / f"step_{n}"
        o = f"out/{label}"
        s = [
            Step("inspect", ["inspect", t]),
            Step("inspect --json", ["inspect", t, "--json"], json_stdout=True),
            Step("inspect --keys", ["inspect", t, "--keys"]),
            Step("inspect base", ["inspect", base, "--json"], json_stdout=True),
            Step("inspect broadcast", ["inspect", bc, "--json"], json_stdout=True),
            Step("inspect checkpoints dir", ["inspect", root / "outputs" / "checkpoints"]),
            Step("extract-adapter --dry-run --json", ["extract-adapter", t, f"{o}/adapter-dry", "--dry-run", "--json"],
                 json_stdout=True),
            Step("extract-adapter", ["extract-adapter", t, f"{o}/adapter"], out=f"{o}/adapter"),
            Step("extract-adapter bf16 --json", ["extract-adapter", t, f"{o}/adapter-bf16", "--dtype", "bf16",
                                                 "--json"], out=f"{o}/adapter-bf16", json_stdout=True),
            Step("inspect adapter", ["inspect", f"{o}/adapter"]),
            Step("fix-adapter", ["fix-adapter", bc, f"{o}/adapter-fixed"], out=f"{o}/adapter-fixed"),
            Step("fix-adapter --json --dry-run", ["fix-adapter", bc, f"{o}/adapter-fixed2", "--json", "--dry-run"],
                 json_stdout=True),
            Step("adapter-to-dcp --dry-run --json",
                 ["adapter-to-dcp", f"{o}/adapter", f"{o}/resume-dry", "--base", base, "--lr", "5e-3", "--step", n,
                  "--dry-run", "--json"], json_stdout=True),
            Step("adapter-to-dcp", ["adapter-to-dcp", f"{o}/adapter", f"{o}/resume/outputs/checkpoints/step_{n}/trainer",
                                    "--base", base, "--lr", "5e-3", "--step", n, "--scheduler", "linear",
                                    "--warmup-steps", "2", "--scheduler-step", "0"], out=f"{o}/resume"),
            Step("adapter-to-dcp --optimizer-from --json",
                 ["adapter-to-dcp", f"{o}/adapter", f"{o}/resume2", "--base", base, "--optimizer-from", t,
                  "--world-size", "2", "--json"], out=f"{o}/resume2", json_stdout=True),
            Step("inspect resumed", ["inspect", f"{o}/resume/outputs/checkpoints/step_{n}/trainer", "--alpha", "16"]),
            Step("merge --dry-run", ["merge", base, t, f"{o}/merged", "--dry-run"]),
            Step("merge --dry-run --json", ["merge", base, t, f"{o}/merged", "--dry-run", "--json"], json_stdout=True),
            Step("merge", ["merge", base, t, f"{o}/merged"], out=f"{o}/merged"),
            Step("merge sharded --json", ["merge", base, t, f"{o}/merged-sharded", "--max-shard-size", "150KB",
                                          "--json", "--threads", "2"], out=f"{o}/merged-sharded", json_stdout=True),
            Step("merge fp32", ["merge", base, t, f"{o}/merged-fp32", "--dtype", "fp32"], out=f"{o}/merged-fp32"),
            Step("merge PEFT adapter", ["merge", base, f"{o}/adapter", f"{o}/merged-peft"], out=f"{o}/merged-peft"),
            Step("merge --base-from-checkpoint", ["merge", "--base-from-checkpoint", t, f"{o}/merged-from-ckpt",
                                                  "--config-from", base], out=f"{o}/merged-from-ckpt"),
            Step("diff-vs-base identical", ["diff-vs-base", base, base]),
            Step("diff-vs-base dcp", ["diff-vs-base", t, base, "--json"], json_stdout=True),
            Step("diff-vs-base --adapter", ["diff-vs-base", f"{o}/merged", base, "--adapter", t, "--top", "3"]),
            Step("diff-vs-base --adapter --json", ["diff-vs-base", f"{o}/merged", base, "--adapter", f"{o}/adapter",
                                                   "--json"], json_stdout=True),
            Step("diff-vs-base --targeted-only", ["diff-vs-base", f"{o}/merged", base, "--adapter", t,
                                                  "--targeted-only"]),
            Step("verify --deep", ["verify", t, "--deep"]),
            Step("verify --json", ["verify", t, "--json"], json_stdout=True),
            Step("verify merged --deep", ["verify", f"{o}/merged-sharded", "--deep"]),
            Step("verify adapter --base", ["verify", f"{o}/adapter", "--base", base, "--deep", "--json"],
                 json_stdout=True),
            Step("slim --dry-run --json", ["slim", t, f"{o}/slim", "--dry-run", "--json"], json_stdout=True),
            Step("slim", ["slim", t, f"{o}/slim", "--base", base], out=f"{o}/slim"),
            Step("slim no base --json", ["slim", t, f"{o}/slim-nobase", "--json"], out=f"{o}/slim-nobase",
                 json_stdout=True),
            Step("inspect slim", ["inspect", f"{o}/slim"]),
            Step("rehydrate", ["rehydrate", f"{o}/slim", f"{o}/rehydrated", "--base", base], out=f"{o}/rehydrated"),
            Step("rehydrate --world-size 2 --json", ["rehydrate", f"{o}/slim", f"{o}/rehydrated-w2", "--base", base,
                                                     "--world-size", "2", "--json"], out=f"{o}/rehydrated-w2",
                 json_stdout=True),
            Step("verify rehydrated", ["verify", f"{o}/rehydrated"]),
            Step("set-lr --dry-run", ["set-lr", t, f"{o}/lr-half", "--scale", "0.5", "--dry-run"]),
            Step("set-lr", ["set-lr", t, f"{o}/lr-half", "--scale", "0.5"], out=f"{o}/lr-half"),
            Step("set-lr --lr --json", ["set-lr", t, f"{o}/lr-new", "--lr", "1e-4", "--json"], out=f"{o}/lr-new",
                 json_stdout=True),
            Step("set-lr --in-place", ["set-lr", f"{o}/inplace", "--scale", "2", "--in-place"], out=f"{o}/inplace",
                 copy=((str(t), f"{o}/inplace"),)),
            Step("set", ["set", t, f"{o}/set", "progress.step=7"], out=f"{o}/set"),
            Step("set --json --dry-run", ["set", t, f"{o}/set2", "progress.step=9", "--json", "--dry-run"],
                 json_stdout=True),
            Step("restart-prep merge", ["restart-prep", t, f"{o}/restart-merged", "--base", base, "--lr", "5e-3"],
                 out=f"{o}/restart-merged"),
            Step("restart-prep adapter --json", ["restart-prep", t, f"{o}/restart-adapter", "--base", base, "--lr",
                                                 "5e-3", "--mode", "adapter", "--json"], out=f"{o}/restart-adapter",
                 json_stdout=True),
            Step("restart-prep merge --config --json",
                 ["restart-prep", t, f"{o}/rp-cfg/merged", "--base", base, "--lr", "5e-3", "--config",
                  f"{o}/rp-cfg/rl.toml", "--json"], out=f"{o}/rp-cfg",
                 copy=((str(i / "configs" / "good.toml"), f"{o}/rp-cfg/rl.toml"),), json_stdout=True),
            Step("restart-prep adapter --config",
                 ["restart-prep", t, f"{o}/rp-cfg2/ckpt", "--base", base, "--lr", "5e-3", "--mode", "adapter",
                  "--config", f"{o}/rp-cfg2/rl.toml"], out=f"{o}/rp-cfg2",
                 copy=((str(i / "configs" / "good.toml"), f"{o}/rp-cfg2/rl.toml"),)),
            Step("restart-prep adapter --dry-run", ["restart-prep", t, f"{o}/restart-adapter2", "--base", base,
                                                    "--lr", "5e-3", "--mode", "adapter", "--dry-run"]),
            Step("gc --dry-run", ["gc", f"{o}/gc/checkpoints", "--keep-full", "1", "--base", base, "--min-age", "0",
                                  "--dry-run"], copy=((str(root / "outputs" / "checkpoints"), f"{o}/gc/checkpoints"),)),
            Step("doctor", ["doctor", root]),
            Step("doctor --json", ["doctor", root, "--json", "--no-weights-check"], json_stdout=True),
        ]
        out += [Step(f"{label}: {x.name}", x.args, x.out, x.copy, x.json_stdout) for x in s]
    # gc needs two steps: the factory run's checkpoint twice (step_1 slimmed, step_2 kept)
    ft = next(iter(sorted((fac / "outputs" / "checkpoints").glob("step_*"))))
    out.append(Step("factory: gc", ["gc", "out/gc2/checkpoints", "--keep-full", "1", "--base", fac / "base_model",
                                    "--min-age", "0", "--json"], out="out/gc2",
                    copy=((str(ft), "out/gc2/checkpoints/step_1"), (str(ft), "out/gc2/checkpoints/step_2")),
                    json_stdout=True))
    for v in ("E_head_dense", "F_head_moe", "G_head_fullft"):
        root = head / v
        for t in sorted((root / "outputs" / "checkpoints").glob("step_*/trainer")):
            s = t.parent.name
            out += [Step(f"{v} {s}: inspect --json", ["inspect", t, "--json"], json_stdout=True),
                    Step(f"{v} {s}: inspect --keys", ["inspect", t, "--keys", "--json"], json_stdout=True),
                    Step(f"{v} {s}: verify --deep", ["verify", t, "--deep", "--json"], json_stdout=True),
                    Step(f"{v} {s}: slim", ["slim", t, f"out/{v}-{s}-slim", "--json"], out=f"out/{v}-{s}-slim",
                         json_stdout=True),
                    Step(f"{v} {s}: set-lr", ["set-lr", t, f"out/{v}-{s}-lr", "--scale", "0.5", "--json"],
                         out=f"out/{v}-{s}-lr", json_stdout=True)]
        out += [Step(f"{v}: doctor", ["doctor", root, "--no-weights-check"]),
                Step(f"{v}: inspect base", ["inspect", root / "base_model"])]
        for b in sorted((root / "outputs" / "broadcasts").glob("step_*")):
            out.append(Step(f"{v} {b.name}: inspect broadcast", ["inspect", b, "--json"], json_stdout=True))
            out.append(Step(f"{v} {b.name}: verify broadcast", ["verify", b, "--json"], json_stdout=True))
    dense = head / "E_head_dense"
    dt = dense / "outputs" / "checkpoints" / "step_3" / "trainer"
    out += [
        Step("E_head_dense: extract-adapter", ["extract-adapter", dt, "out/E-adapter", "--alpha", "16", "--base",
                                               dense / "base_model"], out="out/E-adapter"),
        Step("E_head_dense: merge", ["merge", dense / "base_model", dt, "out/E-merged", "--alpha", "16"],
             out="out/E-merged"),
        Step("E_head_dense: diff-vs-base --adapter", ["diff-vs-base", "out/E-merged", dense / "base_model", "--adapter",
                                                      dt, "--alpha", "16", "--json"], json_stdout=True),
        Step("E_head_dense: fix-adapter", ["fix-adapter", dense / "outputs" / "broadcasts" / "step_3", "out/E-fixed",
                                           "--alpha", "16", "--base", dense / "base_model"], out="out/E-fixed"),
        Step("E_head_dense: average", ["average", dense / "outputs" / "checkpoints" / "step_2" / "trainer", dt,
                                        "out/E-avg", "--alpha", "16", "--json"], out="out/E-avg", json_stdout=True),
        Step("E_head_dense: average --rank --weights", ["average", dense / "outputs" / "checkpoints" / "step_2" /
                                                        "trainer", dt, "out/E-avg2", "--alpha", "16", "--rank", "2",
                                                        "--weights", "1,3"], out="out/E-avg2"),
        Step("E_head_dense: average --merge", ["average", dense / "outputs" / "checkpoints" / "step_2" / "trainer", dt,
                                               "out/E-avg-merged", "--alpha", "16", "--merge", dense / "base_model"],
             out="out/E-avg-merged"),
        Step("E_head_dense: resize-adapter --json", ["resize-adapter", "out/E-adapter", "out/E-resized", "--rank", "2",
                                                     "--json"], out="out/E-resized", json_stdout=True),
        Step("E_head_dense: resize-adapter --energy", ["resize-adapter", dt, "out/E-resized2", "--alpha", "16",
                                                       "--energy", "0.9"], out="out/E-resized2"),
        Step("E_head_dense: export (LoRA)", ["export", dt, "out/E-export", "--alpha", "16", "--config-from",
                                             dense / "base_model"], out="out/E-export"),
        Step("G_head_fullft: export --json", ["export", head / "G_head_fullft" / "outputs" / "checkpoints" / "step_3" /
                                              "trainer", "out/G-export", "--config-from",
                                              head / "G_head_fullft" / "base_model", "--json"], out="out/G-export",
             json_stdout=True),
        Step("E_head_dense: report --json", ["report", dense / "outputs" / "checkpoints", "--alpha", "16", "--json"],
             json_stdout=True),
        Step("E_head_dense: report", ["report", dt, "--alpha", "16", "--out", "out/E-report.html"],
             out="out/E-report.html"),
        Step("G_head_fullft: diff-vs-base", ["diff-vs-base", head / "G_head_fullft" / "outputs" / "broadcasts" /
                                             "step_3", head / "G_head_fullft" / "base_model", "--json"],
             json_stdout=True),
        Step("doctor good.toml", ["doctor", i / "configs" / "good.toml", "--json"], json_stdout=True),
        Step("doctor bad.toml", ["doctor", i / "configs" / "bad.toml"]),
        Step("--version", ["--version"]),
        Step("--help", ["--help"]),
    ]
    return out


# ------------------------------------------------------------------------------------------ inputs
def build_inputs(old: Path, new: Path, inputs: Path, python: str) -> None:
    if (inputs / ".complete").exists():
        return
    if inputs.exists():
        shutil.rmtree(inputs)
    inputs.mkdir(parents=True)
    for name in ("primerl-tiny", "primerl-head", "configs"):
        shutil.copytree(new / "tests" / "fixtures" / name, inputs / name, symlinks=True)
    factory = "ckpt_tools.fixtures.factory" if (old / "ckpt_tools" / "fixtures" / "factory.py").exists() \
        else "tests.factory"
    env = dict(os.environ, PYTHONPATH=str(old))
    subprocess.run([python, "-m", factory, str(inputs / "run")], check=True, env=env, cwd=old,
                   stdout=subprocess.DEVNULL)
    for p in inputs.rglob("*"):          # read-only inputs: a command that writes into one fails loudly
        if p.is_file() and not p.is_symlink():
            os.chmod(p, 0o444)
    (inputs / ".complete").write_text("ok\n")


# ------------------------------------------------------------------------------------------ comparing
def _drop_timings(x):
    if isinstance(x, dict):
        return {k: _drop_timings(v) for k, v in x.items() if k not in TIMING_KEYS}
    if isinstance(x, list):
        return [_drop_timings(v) for v in x]
    return x


def normalize_text(text: str, json_stdout: bool) -> str:
    if json_stdout and text.strip():
        try:
            return _BAK.sub(".bak-<time>", json.dumps(_drop_timings(json.loads(text)), indent=1, sort_keys=False))
        except ValueError:
            pass
    text = _BAK.sub(".bak-<time>", text)
    return _FREE_TEXT.sub("<n> free", _TIME_TEXT.sub("<t>s", text))


def metadata_digest(path: Path) -> str:
    """The decoded content of a DCP `.metadata`, without its random save id (our own outputs: trusted)."""
    md = pickle.loads(path.read_bytes())

    def plain(x):
        if hasattr(x, "__dict__") and not isinstance(x, type):
            return {type(x).__name__: {k: plain(v) for k, v in sorted(vars(x).items()) if k != "save_id"}}
        if isinstance(x, dict):
            return sorted((repr(plain(k)), plain(v)) for k, v in x.items())
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return repr(x)

    return hashlib.sha256(json.dumps(plain(md)).encode()).hexdigest()


def tree_files(root: Path) -> dict[str, str]:
    out = {}
    paths = [root] if root.is_file() else sorted(root.rglob("*"))
    for p in paths:
        if p.is_symlink() or not p.is_file():
            continue
        rel = _BAK.sub(".bak-<time>", str(p.relative_to(root.parent)))
        if p.name == ".metadata" or p.name.startswith(".metadata.bak-"):
            out[rel] = "metadata:" + metadata_digest(p)
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def run_tree(tree: Path, work: Path, inputs: Path, python: str, plan: list[Step]) -> dict[str, Outcome]:
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1", COLUMNS="120")
    env.pop("CKPT_TOOLS_TEST_SLOW_WRITE", None)
    results = {}
    for s in plan:
        for src, rel in s.copy:
            dst = work / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            (shutil.copytree if Path(src).is_dir() else shutil.copyfile)(src, dst)
            for p in [dst, *dst.rglob("*")]:
                os.chmod(p, 0o755 if p.is_dir() else 0o644)
        if s.out is not None:
            (work / s.out).parent.mkdir(parents=True, exist_ok=True)
        p = subprocess.run([python, "-m", "ckpt_tools", *map(str, s.args)], cwd=work, env=env, capture_output=True,
                           text=True)
        o = Outcome(p.returncode, normalize_text(p.stdout, s.json_stdout), normalize_text(p.stderr, False))
        if s.out is not None and (work / s.out).exists():
            o.files = tree_files(work / s.out)
        results[s.name] = o
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", type=Path, required=True)
    ap.add_argument("--new", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--inputs", type=Path, help="default: WORK/inputs (built once, reused)")
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--only", help="run only the steps whose name contains this text")
    a = ap.parse_args(argv)
    work = a.work.resolve()
    inputs = (a.inputs or work / "inputs").resolve()
    t0 = time.monotonic()
    build_inputs(a.old.resolve(), a.new.resolve(), inputs, a.python)
    os.chdir(work)   # every command runs here: relative input and output paths print the same for both trees
    plan = [s for s in steps(Path(os.path.relpath(inputs, work))) if not a.only or a.only in s.name]
    outcomes = {}
    for label, tree in (("old", a.old.resolve()), ("new", a.new.resolve())):
        if (work / "out").exists():
            shutil.rmtree(work / "out")
        t1 = time.monotonic()
        outcomes[label] = run_tree(tree, work, inputs, a.python, plan)
        print(f"{label} tree {tree}: {len(plan)} commands in {time.monotonic() - t1:.0f} s", flush=True)
        if (work / f"out.{label}").exists():
            shutil.rmtree(work / f"out.{label}")
        if (work / "out").exists():
            os.rename(work / "out", work / f"out.{label}")
    bad = 0
    files = 0
    for s in plan:
        o, n = outcomes["old"][s.name], outcomes["new"][s.name]
        files += len(o.files)
        diffs = [what for what, x, y in (("exit code", o.rc, n.rc), ("stdout", o.stdout, n.stdout),
                                         ("stderr", o.stderr, n.stderr), ("files", o.files, n.files)) if x != y]
        if diffs:
            bad += 1
            print(f"DIFFERS  {s.name}: {', '.join(diffs)}")
            if "exit code" in diffs:
                print(f"    exit {o.rc} -> {n.rc}")
            for what, x, y in (("stdout", o.stdout, n.stdout), ("stderr", o.stderr, n.stderr)):
                if what in diffs:
                    import difflib
                    d = list(difflib.unified_diff(x.splitlines(), y.splitlines(), "old", "new", lineterm="", n=1))
                    print("    " + "\n    ".join(d[:40]))
            if "files" in diffs:
                for k in sorted(set(o.files) | set(n.files)):
                    if o.files.get(k) != n.files.get(k):
                        print(f"    {k}: {o.files.get(k, 'absent')[:20]} -> {n.files.get(k, 'absent')[:20]}")
    print(f"{len(plan) - bad} of {len(plan)} commands identical (exit code, stdout, stderr, {files} output files); "
          f"{bad} differ; {time.monotonic() - t0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
