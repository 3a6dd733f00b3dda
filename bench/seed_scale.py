#!/usr/bin/env python3
"""The seed's run at its true size (issue 23): a Qwen3-32B LoRA checkpoint written by FSDP2 over N GPUs
with NCCL, the way prime-rl's trainer writes it, then every command timed beside its floor and checked
against the truth the generator recorded.

    torchrun --nproc-per-node 4 bench/seed_scale.py generate --size 32b --root /data/seed
    python bench/seed_scale.py measure --root /data/seed --ranks 1,4 --results seed-32b.json
    python bench/seed_scale.py report seed-32b.json          # the docs/benchmarks.md table

`bench/seed_scale.sh` runs both on the device host. Sizes are bench/sizes.py's (tiny, 8b, 14b, 32b); the
test suite runs the whole script at `tiny` on 2 gloo CPU ranks (tests/test_seed_scale.py), so it is known
to work before the 4-GPU host is lent.

generate (under torchrun; NCCL on CUDA where there is a GPU, else gloo on CPU):
- the model is built on the meta device from the size's Qwen3 config (tests/factory's `qwen3_config`),
  every targeted projection wrapped in prime-rl's LoRA module (`base_layer` + `lora_A/lora_B` parameter
  lists: the factory's `PrimeLoRALinear`), sharded with `fully_shard` per decoder layer then the root
  (bf16 params, fp32 reduce: prime-rl's MixedPrecisionPolicy), materialized on the GPUs and given random
  values: base weights bf16-representable (their fp32 masters are exact upcasts, as in a real run whose
  masters were loaded from a bf16 base), LoRA A ~ N(0, 1/in), B ~ N(0, 0.005^2);
- `--steps` AdamW steps (prime-rl's defaults, grad clip 1.0) on random tokens, the linear warmup
  scheduler, so the LoRA and the Adam moments are real;
- `dcp.save({"app": AppState(model, [optimizer], scheduler, progress)})` into
  outputs/checkpoints/step_<steps>/trainer, prime-rl's CheckpointManager call (AppState: the factory's
  mirror of prime-rl's trainer/ckpt.py);
- rank 0 writes the bf16 base as an HF dir (each tensor gathered once, shards of <= 5 GB), the run's
  orch.toml (alpha), and the truth: every LoRA tensor in fp32, the lr, step and scheduler state.

measure: each command in its own process through bench/launch.py (wall, peak RSS), in the order below,
beside `cat` / `cp -r && sync` of what it reads or writes, and its output checked:
inspect (step and lr equal the truth), extract-adapter (every tensor equal to the truth), slim ->
rehydrate (every item of the rebuilt checkpoint bit-equal to the original's, in its chunk layout), set-lr (the new lr), merge BASE CKPT (diff-vs-base --adapter proves it), merge
--base-from-checkpoint and export (byte-identical to merge BASE CKPT: the masters are the base's upcast),
verify --deep. Commands that split their work run with each of --ranks under torchrun. Outputs are
deleted as soon as they are checked: at 32B the checkpoint (126 GB) and the base (65 GB) leave room for
one more output on the host's 235 GB.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
sys.path[:0] = [str(BENCH), str(REPO)]

from runner import run_measured, tree_bytes, tree_digests  # noqa: E402
from sizes import LORA_ALPHA, LORA_RANK, SIZES, factory_spec_kwargs  # noqa: E402

SCHEMA = "ckpt-seed-scale/1"
SHARD_BYTES = 5 * 10**9
MULTI_RANK = {"rehydrate", "merge", "merge --base-from-checkpoint", "export", "diff-vs-base --adapter",
              "verify --deep", "slim"}


# ------------------------------------------------------------------------------------------- generate


def _spec(size: str, steps: int, world: int):
    from tests.factory.factory import FactorySpec

    kw = factory_spec_kwargs(SIZES[size])
    return FactorySpec(**kw, steps=steps, world_size=world, lr=1e-4, scheduler="linear", warmup_steps=steps,
                       max_steps=max(10, steps + 1), seq_len=16 if size == "tiny" else 64)


def generate(a) -> int:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from tests.factory import factory as F

    cuda = torch.cuda.is_available() and a.device != "cpu"
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    t0 = time.perf_counter()
    spec = _spec(a.size, a.steps, world)
    root = Path(a.root).resolve()
    paths = F.run_paths(root, spec)

    model, config = F.sharded_lora_skeleton(spec, world, device.type)

    named = list(model.named_parameters())
    with torch.no_grad():
        for i, (name, p) in enumerate(named):
            local = p.to_local() if hasattr(p, "to_local") else p
            g = torch.Generator(device=device).manual_seed(a.seed * 1_000_003 + i * 1009 + rank)
            if ".lora_A." in name:
                local.normal_(0.0, 1.0 / p.shape[1] ** 0.5, generator=g)
            elif ".lora_B." in name:
                local.normal_(0.0, 0.005, generator=g)
            elif name.endswith("norm.weight"):
                local.fill_(1.0)
            else:   # bf16-representable: the fp32 master is the exact upcast of the base's bf16 value
                local.normal_(0.0, config.initializer_range, generator=g)
                local.copy_(local.to(torch.bfloat16).to(torch.float32))
    for name, p in named:
        p.requires_grad_(".lora_A." in name or ".lora_B." in name)
    optimizer = F.build_optimizer(model, spec)
    scheduler = F.build_scheduler(optimizer, spec)
    progress = F.Progress()
    lora = F.lora_named_parameters(model)
    t_build = time.perf_counter()

    for step in range(spec.steps):
        g = torch.Generator(device=device).manual_seed(a.seed * 7919 + step * 104729 + rank)
        ids = torch.randint(0, spec.vocab_size, (spec.batch_size, spec.seq_len), generator=g, device=device)
        F.train_step(model, optimizer, scheduler, progress, [p for _, p in lora], ids, spec, world)
    t_train = time.perf_counter()

    paths.checkpoint.mkdir(parents=True, exist_ok=True)
    dcp.save({"app": F.app_state_class()(model, [optimizer], scheduler, progress)}, checkpoint_id=paths.checkpoint)
    t_save = time.perf_counter()

    # the truth and the bf16 base, each tensor gathered once (a collective: every rank takes part)
    truth = {}
    for name, p in lora:
        full = p.full_tensor().detach().to("cpu", torch.float32) if hasattr(p, "full_tensor") else p.detach().cpu()
        if rank == 0:
            module, kind, slot = name.rsplit(".", 2)
            truth[f"lora.{module}.slot{slot}.{kind[-1]}"] = full.contiguous()
    base = [(n.replace(".base_layer.", "."), p) for n, p in named if ".lora_" not in n]
    if spec.tie_word_embeddings:
        base = [(n, p) for n, p in base if n != "lm_head.weight"]
    shards, current, size = [], [], 0
    for n, p in base:
        nbytes = p.numel() * 2
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append((n, p))
        size += nbytes
    shards.append(current)
    index = {}
    if rank == 0:
        paths.base_model.mkdir(parents=True, exist_ok=True)
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
        tensors = {}
        for n, p in shard:
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            if rank == 0:
                tensors[n] = full.detach().to(torch.bfloat16).cpu().contiguous()
                index[n] = fname
            del full
        if rank == 0:
            save_file(tensors, str(paths.base_model / fname), metadata={"format": "pt"})
        del tensors
    if rank == 0:
        if len(shards) > 1:
            total = sum(p.numel() * 2 for _, p in base)
            (paths.base_model / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=2))
        config.dtype = torch.bfloat16
        config.use_cache = True
        config.save_pretrained(str(paths.base_model))
        GenerationConfig(bos_token_id=spec.bos_token_id, eos_token_id=spec.eos_token_id).save_pretrained(
            str(paths.base_model))
        paths.orch_toml.parent.mkdir(parents=True, exist_ok=True)
        paths.orch_toml.write_text(F.orch_toml_text(spec, "base_model"))
        paths.truth.parent.mkdir(parents=True, exist_ok=True)
        save_file(truth, str(paths.truth), metadata={"format": "pt"})
        info = {"schema": SCHEMA, "size": a.size, "world_size": world, "backend": dist.get_backend(),
                "device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
                "lr": float(optimizer.param_groups[0]["lr"]), "step": progress.step,
                "scheduler": F.jsonable(scheduler.state_dict()), "lora_rank": LORA_RANK, "lora_alpha": LORA_ALPHA,
                "checkpoint": str(paths.checkpoint.relative_to(root)), "base": str(paths.base_model.relative_to(root)),
                "truth": str(paths.truth.relative_to(root)),
                "checkpoint_bytes": tree_bytes(paths.checkpoint), "base_bytes": tree_bytes(paths.base_model),
                "seconds": {"build": round(t_build - t0, 1), "train": round(t_train - t_build, 1),
                            "dcp_save": round(t_save - t_train, 1),
                            "base_and_truth": round(time.perf_counter() - t_save, 1)}}
        (root / "seed_scale.json").write_text(json.dumps(info, indent=2))
        print(json.dumps(info), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


# -------------------------------------------------------------------------------------------- measure


def _same_checkpoint(a_dir: Path, b_dir: Path) -> bool:
    """Every item of two DCP checkpoints equal: tensors bit for bit (one at a time) in the same chunk
    layout, byte items byte for byte. (The files themselves differ: each zip record is written anew.)"""
    import torch

    from ckpt_tools.formats.dcp.model import TensorEntry
    from ckpt_tools.formats.dcp.reader import DcpCheckpoint

    def bits(t):
        return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])

    with DcpCheckpoint.open(a_dir) as a, DcpCheckpoint.open(b_dir) as b:
        if sorted(a.entries) != sorted(b.entries):
            return False
        for key, ea in a.entries.items():
            eb = b.entries[key]
            if type(ea) is not type(eb):
                return False
            if isinstance(ea, TensorEntry):
                if [(c.offsets, c.sizes) for c in ea.chunks] != [(c.offsets, c.sizes) for c in eb.chunks]:
                    return False
                x, y = a.read_tensor(key), b.read_tensor(key)
                if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(bits(x), bits(y)):
                    return False
            elif a.read_item_bytes(ea.file, ea.offset, ea.length, key) != \
                    b.read_item_bytes(eb.file, eb.offset, eb.length, key):
                return False
    return True


def _same_tensors(a_dir: Path, b_dir: Path) -> bool:
    """Two HF dirs hold the same tensors bit for bit (one tensor at a time; their shard layouts may differ)."""
    import torch
    from safetensors import safe_open

    def index(d: Path) -> dict[str, Path]:
        return {k: f for f in sorted(d.glob("*.safetensors")) for k in safe_open(str(f), "pt").keys()}

    ia, ib = index(a_dir), index(b_dir)
    if sorted(ia) != sorted(ib):
        return False
    for k in ia:
        with safe_open(str(ia[k]), "pt") as fa, safe_open(str(ib[k]), "pt") as fb:
            x, y = fa.get_tensor(k), fb.get_tensor(k)
        if x.dtype != y.dtype or x.shape != y.shape or \
                not torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)):
            return False
    return True


def _ckpt_json(args: list[str]) -> dict:
    r = subprocess.run([sys.executable, "-m", "ckpt_tools", *args, "--json"], capture_output=True, text=True,
                       cwd=REPO)
    return json.loads(r.stdout) if r.stdout.strip() else {"ok": False, "error": r.stderr[-2000:]}


class Measure:
    def __init__(self, a):
        self.a = a
        self.root = Path(a.root).resolve()
        self.info = json.loads((self.root / "seed_scale.json").read_text())
        self.ckpt = self.root / self.info["checkpoint"]
        self.base = self.root / self.info["base"]
        self.work = Path(a.workdir or self.root / "work").resolve()
        self.logs = self.work / "logs"
        self.ranks = [int(n) for n in a.ranks.split(",")]
        self.rows: list[dict] = []
        self.results = {"schema": SCHEMA, "generator": self.info, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                        "ranks": self.ranks, "rows": self.rows,
                        "python": sys.version.split()[0], "host_cores": os.cpu_count()}

    def out(self, name: str) -> Path:
        p = self.work / name
        shutil.rmtree(p, ignore_errors=True)
        return p

    def timed(self, label: str, argv: list[str], ranks: int = 1, **extra) -> dict:
        if ranks > 1:
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
                    "-m", "ckpt_tools", *argv]
        elif argv[0] not in ("cat", "sh"):
            argv = [sys.executable, "-m", "ckpt_tools", *argv]
        env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        rec = run_measured(argv, self.logs, f"{label.replace(' ', '_').replace('/', '_')}-{ranks}",
                           self.a.timeout_s, env=env, cwd=REPO)
        row = {"command": label, "ranks": ranks, "wall_s": rec.get("wall_s"), "peak_rss_bytes": rec.get("peak_rss_bytes"),
               "peak_tree_rss_bytes": rec.get("peak_tree_rss_bytes"), "status": rec.get("status"),
               "reason": rec.get("reason"), **extra}
        if rec.get("status") != "ok":
            row["stderr_tail"] = rec.get("stderr_tail", "")[-1500:]
        self.rows.append(row)
        self.save()
        print(f"{label} (N={ranks}): {row['status']} {row['wall_s']:.2f} s, "
              f"{(row['peak_rss_bytes'] or 0) / 2**20:.0f} MiB", flush=True)
        return row

    def floor(self, label: str, paths: list[Path]) -> dict:
        files = [str(p) for d in paths for p in sorted(d.rglob("*")) if p.is_file()]
        return self.timed(label, ["sh", "-c", 'cat "$@" > /dev/null', "cat", *files])

    def copy_floor(self, label: str, src: Path) -> dict:
        dst = self.out("floor-copy")
        row = self.timed(label, ["sh", "-c", f'cp -r "{src}" "{dst}" && sync'])
        shutil.rmtree(dst, ignore_errors=True)
        return row

    def check(self, row: dict, ok: bool, what: str) -> None:
        row["matched_truth"] = bool(ok) and row["status"] == "ok"
        row["check"] = what
        self.save()

    def save(self) -> None:
        if self.a.results:
            Path(self.a.results).write_text(json.dumps(self.results, indent=2))

    def run(self) -> int:
        import torch
        from safetensors.torch import load_file

        self.work.mkdir(parents=True, exist_ok=True)
        ck, base = str(self.ckpt), str(self.base)
        truth = load_file(str(self.root / self.info["truth"]))
        self.floor("cat checkpoint", [self.ckpt])
        self.floor("cat base", [self.base])
        self.copy_floor("cp -r checkpoint && sync", self.ckpt)
        self.copy_floor("cp -r base && sync", self.base)

        row = self.timed("inspect", ["inspect", ck])
        info = _ckpt_json(["inspect", ck]).get("result") or {}
        self.check(row, info.get("step") == self.info["step"] and info.get("lr") == self.info["lr"],
                   "step and lr equal the generator's")

        out = self.out("adapter")
        row = self.timed("extract-adapter", ["extract-adapter", ck, str(out)])
        got = load_file(str(out / "adapter_model.safetensors")) if (out / "adapter_model.safetensors").exists() else {}
        want = {k: v for k, v in truth.items() if k.startswith("lora.")}
        same = len(got) == len(want) and all(
            torch.equal(got[f"base_model.model.{k[5:].rsplit('.slot', 1)[0]}.lora_{k[-1]}.weight"], v)
            for k, v in want.items())
        self.check(row, same, f"{len(want)} LoRA tensors equal the truth")
        shutil.rmtree(out, ignore_errors=True)

        slim = self.out("slim")
        for n in self.ranks:
            shutil.rmtree(slim, ignore_errors=True)
            row = self.timed("slim", ["slim", ck, str(slim), "--base", base], ranks=n)
            self.check(row, (slim / ".metadata").exists(), "written")
        for n in self.ranks:
            full = self.out("rehydrated")
            row = self.timed("rehydrate", ["rehydrate", str(slim), str(full), "--base", base], ranks=n)
            self.check(row, full.exists() and _same_checkpoint(self.ckpt, full),
                       "every item bit-equal to the original's, same layout")
            shutil.rmtree(full, ignore_errors=True)
        shutil.rmtree(slim, ignore_errors=True)

        out = self.out("lr")
        row = self.timed("set-lr", ["set-lr", ck, str(out), "--lr", "5e-6"])
        got = (_ckpt_json(["inspect", str(out)]).get("result") or {}).get("lr")
        self.check(row, got == 5e-6, "inspect reads the new lr")
        shutil.rmtree(out, ignore_errors=True)

        merged = self.out("merged")
        reference = None
        for n in self.ranks:
            shutil.rmtree(merged, ignore_errors=True)
            row = self.timed("merge", ["merge", base, ck, str(merged)], ranks=n)
            digest = tree_digests(merged) if merged.exists() else None
            reference = reference or digest
            self.check(row, digest is not None and digest == reference, "the same bytes at every N")
        for n in self.ranks:
            row = self.timed("diff-vs-base --adapter", ["diff-vs-base", str(merged), base, "--adapter", ck], ranks=n)
            self.check(row, row["status"] == "ok", "exit 0: exactly base + the LoRA")
        for label, argv in (("merge --base-from-checkpoint", ["merge", "--base-from-checkpoint", ck]),
                            ("export", ["export", ck])):
            for n in self.ranks:
                out = self.out("from-masters")
                row = self.timed(label, [*argv, str(out), "--config-from", base], ranks=n)
                self.check(row, out.exists() and _same_tensors(out, merged),
                           "every tensor bit-equal to merge BASE CKPT's (the masters are the base's upcast)")
                shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(merged, ignore_errors=True)
        for n in self.ranks:
            row = self.timed("verify --deep", ["verify", ck, "--deep"], ranks=n)
            self.check(row, row["status"] == "ok", "every payload checked")
        self.results["ended"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        self.save()
        failed = [r for r in self.rows if "matched_truth" in r and not r["matched_truth"]]
        for r in failed:
            print(f"MISMATCH: {r['command']} (N={r['ranks']}): {r.get('check')} {r.get('reason') or ''}", flush=True)
        return 1 if failed else 0


FLOORS = {"inspect": None, "extract-adapter": "cat checkpoint", "slim": "cat checkpoint",
          "rehydrate": "cp -r checkpoint && sync", "set-lr": None, "merge": "cp -r base && sync",
          "merge --base-from-checkpoint": "cp -r base && sync", "export": "cp -r base && sync",
          "diff-vs-base --adapter": "cat base", "verify --deep": "cat checkpoint"}


def report(path: str) -> str:
    """The markdown table of a results file: each command's time, its floor, the ratio, peak RSS, truth."""
    res = json.loads(Path(path).read_text())
    g = res["generator"]
    floors = {r["command"]: r for r in res["rows"] if r["command"] in set(FLOORS.values())}
    lines = [f"Generated by `bench/seed_scale.py generate --size {g['size']}` on {g['world_size']} {g['backend']} "
             f"rank(s) ({g['device']}, torch {g['torch']}): a {g['checkpoint_bytes'] / 1e9:.1f} GB checkpoint, "
             f"{g['base_bytes'] / 1e9:.1f} GB bf16 base; measured {res['started']}.", "",
             "| command | N | time | floor | ratio | peak RSS | output |", "|---|---:|---:|---|---:|---:|---|"]
    for r in res["rows"]:
        if r["command"] in floors:
            continue
        fl = floors.get(FLOORS.get(r["command"]) or "")
        ratio = f"{r['wall_s'] / fl['wall_s']:.2f}x" if fl and r.get("wall_s") and fl.get("wall_s") else "-"
        floor = f"`{fl['command']}` {fl['wall_s']:.1f} s" if fl else "-"
        rss = max(r.get("peak_rss_bytes") or 0, r.get("peak_tree_rss_bytes") or 0) / 2**30
        verdict = ("matched: " if r.get("matched_truth") else "**MISMATCH**: ") + r.get("check", "")
        lines.append(f"| `{r['command']}` | {r['ranks']} | {r['wall_s']:.2f} s | {floor} | {ratio} | {rss:.2f} GiB | "
                     f"{verdict} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    g = sub.add_parser("generate", help="(under torchrun) write the checkpoint, the bf16 base and the truth")
    g.add_argument("--size", choices=sorted(SIZES), default="32b")
    g.add_argument("--root", required=True)
    g.add_argument("--steps", type=int, default=2)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", choices=["auto", "cpu"], default="auto")
    m = sub.add_parser("measure", help="time every command beside its floor and check its output")
    m.add_argument("--root", required=True)
    m.add_argument("--ranks", default="1,4")
    m.add_argument("--workdir", default=None, help="where outputs go (default ROOT/work)")
    m.add_argument("--results", default=None)
    m.add_argument("--timeout-s", type=float, default=1800.0)
    r = sub.add_parser("report", help="the markdown table of a results file")
    r.add_argument("results")
    a = ap.parse_args(argv)
    if a.what == "generate":
        return generate(a)
    if a.what == "measure":
        return Measure(a).run()
    print(report(a.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
