#!/usr/bin/env python3
"""Benchmark `ckpt merge` side by side with a floor and with peers, in one run (not in CI).

    python bench/merge.py [--workdir /tmp/ckpt-bench-merge] [--preset qwen3-1.7b|small]
                          [--only floor,ckpt,peft,mergekit] [--record docs/benchmarks.md]

Inputs (built once, cached in --workdir): a Qwen3-1.7B-shaped random bf16 model written by
transformers' save_pretrained (sharded at 2GB), and a PEFT adapter r=32 on all 7 projections
(random A and B, PEFT's default fp32 adapter weights).

Contenders, each in a fresh process, the base read from a warm page cache:
  floor         safetensors `load_file` + `save_file` of every base shard (the same bytes), then fsync
                (ckpt merge fsyncs its output too); "floor-nosync" skips the fsync
  ckpt          `python -m ckpt_tools merge BASE ADAPTER OUT --max-shard-size 2GB` (default threads)
  peft          transformers `from_pretrained(bf16)` + `PeftModel.from_pretrained` + `merge_and_unload`
                + `save_pretrained`
  mergekit      `mergekit-yaml` passthrough of `BASE+ADAPTER` from the venv in $MERGEKIT_VENV
                (default /tmp/mk-venv), when it is installed there

Measured per contender: wall time of the process (imports included) and of the work alone,
peak RSS (wait4's ru_maxrss), bytes through read()/write() syscalls (/proc/self/io rchar/wchar;
mmap reads are not counted there) and the output size. Results go to --workdir/results.json and,
with --record, between the merge markers of docs/benchmarks.md.
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
BEGIN, END = "<!-- merge:begin -->", "<!-- merge:end -->"
PROJ = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PRESETS = {
    # Qwen/Qwen3-1.7B's config.json shapes (tied embeddings)
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    # for trying the bench itself quickly
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=64, vocab_size=32000, tie_word_embeddings=True),
}


# ------------------------------------------------------------------------------------- inputs


def build_inputs(work: Path, preset: str, rank: int) -> tuple[Path, Path]:
    base, adapter = work / "base", work / "adapter"
    stamp = work / "inputs.json"
    want = {"preset": preset, "rank": rank}
    if stamp.exists() and json.loads(stamp.read_text()) == want and base.is_dir() and adapter.is_dir():
        return base, adapter
    shutil.rmtree(base, ignore_errors=True)
    shutil.rmtree(adapter, ignore_errors=True)
    code = f"""
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM
from peft import LoraConfig, get_peft_model
torch.manual_seed(0)
cfg = Qwen3Config(**{PRESETS[preset]!r}, max_position_embeddings=40960, rope_parameters={{"rope_type": "default", "rope_theta": 1e6}})
model = Qwen3ForCausalLM._from_config(cfg, dtype=torch.bfloat16)
model.save_pretrained({str(base)!r}, max_shard_size="2GB")
pm = get_peft_model(model, LoraConfig(r={rank}, lora_alpha={2 * rank}, target_modules={PROJ!r}, init_lora_weights=False))
with torch.no_grad():
    for n, p in pm.named_parameters():
        if "lora_B" in n:
            p.mul_(0.01)
pm.save_pretrained({str(adapter)!r})
"""
    print(f"building {preset} base + r={rank} adapter in {work} ...", flush=True)
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    print(f"  built in {time.perf_counter() - t:.0f}s", flush=True)
    stamp.write_text(json.dumps(want))
    return base, adapter


# ------------------------------------------------------------------------------------- children


def _io() -> dict:
    out = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k.strip()] = int(v)
    return out


def _report(work_s: float) -> None:
    print("BENCH-RESULT " + json.dumps({"work_s": work_s, "io": _io()}), flush=True)


def child_floor(base: str, out: str, fsync: str) -> None:
    from safetensors.torch import load_file, save_file

    t = time.perf_counter()
    os.makedirs(out)
    for name in sorted(os.listdir(base)):
        src = os.path.join(base, name)
        dst = os.path.join(out, name)
        if name.endswith(".safetensors"):
            save_file(load_file(src), dst, metadata={"format": "pt"})
        else:
            shutil.copyfile(src, dst)
        if fsync == "1":
            fd = os.open(dst, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    _report(time.perf_counter() - t)


def child_ckpt(base: str, adapter: str, out: str, threads: str) -> None:
    from ckpt_tools.ops.merge import execute_merge, prepare_merge

    t = time.perf_counter()
    plan = prepare_merge(base, adapter, max_shard_size="2GB", threads=int(threads) if threads != "-" else None)
    execute_merge(plan, out)
    _report(time.perf_counter() - t)


def child_peft(base: str, adapter: str, out: str) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.save_pretrained(out, max_shard_size="2GB")
    _report(time.perf_counter() - t)


# ------------------------------------------------------------------------------------- driver


def measure(label: str, argv: list[str], out: Path, env: dict | None = None) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    t = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, **(env or {})))
    stdout, stderr = proc.communicate()   # communicate() reaps, so take the rusage from wait4 first
    wall = time.perf_counter() - t
    rec = {"label": label, "wall_s": round(wall, 2), "rc": proc.returncode}
    if proc.returncode != 0:
        rec["error"] = (stderr or stdout)[-2000:]
        print(f"  {label}: FAILED rc={proc.returncode}\n{rec['error']}", flush=True)
        return rec
    for line in stdout.splitlines():
        if line.startswith("BENCH-RESULT "):
            r = json.loads(line[len("BENCH-RESULT "):])
            rec["work_s"] = round(r["work_s"], 2)
            rec["rchar"], rec["wchar"] = r["io"]["rchar"], r["io"]["wchar"]
    rec["out_bytes"] = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    rec["peak_rss"], rec["cpu_s"] = _peak_rss.get(proc.pid, (None, None))
    print(f"  {label}: wall {rec['wall_s']}s work {rec.get('work_s')}s CPU {rec['cpu_s']}s peak RSS "
          f"{(rec['peak_rss'] or 0) / 2**30:.2f} GiB", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    return rec


_peak_rss: dict[int, tuple[int, float]] = {}   # pid -> (peak RSS bytes, CPU seconds)


def _install_rusage_hook() -> None:
    """Popen reaps its child with waitpid; route that through wait4 to keep the child's rusage."""
    real = os.waitpid

    def waitpid(pid, options):
        if pid > 0:
            p, status, ru = os.wait4(pid, options)
            if p:
                _peak_rss[p] = (ru.ru_maxrss * 1024, round(ru.ru_utime + ru.ru_stime, 2))   # Linux: KiB
            return p, status
        return real(pid, options)

    os.waitpid = waitpid


def warm(paths: list[Path]) -> None:
    for d in paths:
        for p in d.rglob("*"):
            if p.is_file():
                with open(p, "rb") as f:
                    while f.read(1 << 24):
                        pass


def machine() -> dict:
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    mem = next((int(l.split()[1]) * 1024 for l in open("/proc/meminfo") if l.startswith("MemTotal")), 0)
    import torch

    return {"cpu": cpu, "cores": os.cpu_count(), "mem_bytes": mem, "python": platform.python_version(),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "loadavg_start": os.getloadavg()}


def render(res: dict) -> str:
    rows = {r["label"]: r for r in res["runs"]}
    floor = rows.get("floor")
    ours = rows.get("ckpt")
    peft = rows.get("peft")
    gib = 2**30
    lines = [
        f"Measured {res['date']} with `python bench/merge.py --preset {res['preset']}`: base {res['base_bytes'] / 1e9:.2f} GB "
        f"bf16 ({res['base_tensors']} tensors, {res['base_shards']} shards), adapter r={res['rank']} on all 7 "
        f"projections ({res['adapter_bytes'] / 1e6:.0f} MB fp32). Machine: {res['machine']['cpu']}, "
        f"{res['machine']['cores']} cores, {res['machine']['mem_bytes'] / gib:.0f} GiB RAM, torch "
        f"{res['machine']['torch']}; load average {res['machine']['loadavg_start'][0]:.1f} at the start and "
        f"{res['loadavg_end'][0]:.1f} at the end (the machine is shared: other engineers' tests were running). "
        "Inputs were in the page cache; every contender writes a new directory on the same disk.",
        "",
        "| contender | wall s | work s | CPU s | peak RSS | read() bytes | write() bytes | output | "
        "wall vs floor | CPU vs floor | RSS vs PEFT |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in res["runs"]:
        if r.get("rc"):
            lines.append(f"| {r['label']} | failed (rc {r['rc']}) | | | | | | | | | |")
            continue
        vs_floor = f"{r['wall_s'] / floor['wall_s']:.2f}x" if floor and floor.get("wall_s") else ""
        cpu_floor = f"{r['cpu_s'] / floor['cpu_s']:.2f}x" if floor and floor.get("cpu_s") else ""
        vs_peft = f"{r['peak_rss'] / peft['peak_rss']:.0%}" if peft and peft.get("peak_rss") and r.get("peak_rss") else ""
        def gb(k):  # external tools (mergekit) do not report their own io / work time
            return f"{r[k] / 1e9:.2f} GB" if k in r else "n/a"

        work = f"{r['work_s']:.1f}" if "work_s" in r else "n/a"
        lines.append(f"| {r['label']} | {r['wall_s']:.1f} | {work} | {r.get('cpu_s') or 0:.1f} | "
                     f"{(r.get('peak_rss') or 0) / gib:.2f} GiB | {gb('rchar')} | {gb('wchar')} | "
                     f"{r.get('out_bytes', 0) / 1e9:.2f} GB | {vs_floor} | {cpu_floor} | {vs_peft} |")
    if ours and peft and not ours.get("rc") and not peft.get("rc"):
        lines += ["", f"ckpt merge vs PEFT: {peft['wall_s'] / ours['wall_s']:.2f}x faster (wall), "
                      f"{peft.get('work_s', 0) / max(ours.get('work_s', 1e-9), 1e-9):.2f}x (work); peak RSS "
                      f"{ours['peak_rss'] / peft['peak_rss']:.0%} of PEFT's."]
    if floor and ours and not ours.get("rc"):
        lines += [f"ckpt merge vs the floor: {ours['wall_s'] / floor['wall_s']:.2f}x (wall), "
                  f"{ours.get('work_s', 0) / max(floor.get('work_s', 1e-9), 1e-9):.2f}x (work), "
                  f"{(ours.get('cpu_s') or 0) / max(floor.get('cpu_s') or 1e-9, 1e-9):.2f}x (CPU)."]
    for r in res["runs"]:
        if r.get("note"):
            lines += ["", f"{r['label']}: {r['note']}"]
    return "\n".join(lines)


def record(doc: Path, body: str) -> None:
    record_section(doc, body, BEGIN, END, "ckpt merge")


def mergekit_cmd(venv: Path, base: Path, adapter: Path, out: Path, work: Path) -> list[str] | None:
    exe = venv / "bin" / "mergekit-yaml"
    if not exe.exists():
        return None
    cfg = work / "mergekit.yml"
    cfg.write_text(f"merge_method: passthrough\nmodels:\n  - model: {base}+{adapter}\ndtype: bfloat16\n")
    return [str(exe), str(cfg), str(out), "--lora-merge-cache", str(work / "mk-cache"),
            "--out-shard-size", "1B"]


def main(argv=None) -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "_child":
        {"floor": child_floor, "ckpt": child_ckpt, "peft": child_peft}[sys.argv[2]](*sys.argv[3:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/ckpt-bench-merge"))
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen3-1.7b")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--only", default="floor-nosync,floor,ckpt,ckpt-1thread,peft,mergekit")
    ap.add_argument("--record", type=Path, help="write the table between the merge markers of this file")
    ap.add_argument("--from-results", action="store_true",
                    help="render (and --record) --workdir/results.json of an earlier run; run nothing")
    args = ap.parse_args(argv)
    if args.from_results:
        body = render(json.loads((args.workdir / "results.json").read_text()))
        print(body)
        if args.record:
            record(args.record, body)
        return 0
    _install_rusage_hook()
    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    base, adapter = build_inputs(work, args.preset, args.rank)
    warm([base, adapter])
    me = [sys.executable, str(Path(__file__).resolve()), "_child"]
    env = {"PYTHONPATH": str(REPO)}
    out = work / "out"
    runs = []
    mk_venv = Path(os.environ.get("MERGEKIT_VENV", "/tmp/mk-venv"))
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "preset": args.preset, "rank": args.rank,
           "machine": machine(), "runs": runs}
    from safetensors import safe_open

    shards = sorted(base.glob("*.safetensors"))
    res["base_shards"] = len(shards)
    res["base_bytes"] = sum(p.stat().st_size for p in shards)
    res["base_tensors"] = sum(len(safe_open(p, "pt").keys()) for p in shards)
    res["adapter_bytes"] = (adapter / "adapter_model.safetensors").stat().st_size
    for label in args.only.split(","):
        print(f"running {label} ...", flush=True)
        if label in ("floor", "floor-nosync"):
            runs.append(measure(label, me + ["floor", str(base), str(out), "1" if label == "floor" else "0"], out))
        elif label == "ckpt":
            runs.append(measure(label, me + ["ckpt", str(base), str(adapter), str(out), "-"], out, env))
        elif label.startswith("ckpt-") and label.endswith("thread"):
            n = label[len("ckpt-"):-len("thread")]
            runs.append(measure(label, me + ["ckpt", str(base), str(adapter), str(out), n], out, env))
        elif label == "peft":
            runs.append(measure(label, me + ["peft", str(base), str(adapter), str(out)], out))
        elif label == "mergekit":
            cmd = mergekit_cmd(mk_venv, base, adapter, out, work)
            if cmd is None:
                runs.append({"label": "mergekit", "rc": -1, "note": f"not installed in {mk_venv}"})
                continue
            shutil.rmtree(work / "mk-cache", ignore_errors=True)
            rec = measure(label, cmd, out)
            rec["note"] = ("mergekit-yaml passthrough of BASE+ADAPTER; mergekit merges a `model+lora` reference by "
                           "loading the whole model with PEFT (merge_and_unload into its lora-merge cache) before "
                           "its streaming writer runs")
            runs.append(rec)
        else:
            raise SystemExit(f"unknown contender {label!r}")
    res["loadavg_end"] = os.getloadavg()
    (work / "results.json").write_text(json.dumps(res, indent=2))
    body = render(res)
    print("\n" + body)
    if args.record:
        record(args.record, body)
        print(f"\nrecorded in {args.record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
