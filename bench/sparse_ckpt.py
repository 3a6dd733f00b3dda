#!/usr/bin/env python3
"""A prime-rl LoRA checkpoint of a big model's true size on a small disk (issue 21's at-size bench): every
frozen fp32 master is zero and stored as holes, so a Qwen3-32B-shaped checkpoint of 126 GB takes ~3.3 GB.

    MALLOC_MMAP_THRESHOLD_=65536 torchrun --nproc-per-node 4 bench/sparse_ckpt.py --size 32b --root /tmp/x/run

It is written by torch DCP itself, from the factory's FSDP2 model, the way the factory and prime-rl write one:
- the model is the factory's: Qwen3ForCausalLM from the size's config (tests/factory `qwen3_config`) built on
  the meta device, each targeted projection wrapped in prime-rl's LoRA module (`PrimeLoRALinear`), sharded
  with `fully_shard` per decoder layer and the root (bf16 params, fp32 reduce), materialized on CPU by
  `to_empty`. The frozen masters are left as the untouched zero pages the allocator hands out (the mmap
  threshold makes every allocation above 64 KiB a fresh mapping; each is checked to be zero), the norms 1.0;
  LoRA A ~ N(0, 1/in), B ~ N(0, 0.005^2).
- one AdamW step (prime-rl's defaults, grad clip 1.0) and the warmup scheduler step, from a random gradient
  on the LoRA params (a 32B forward does not fit this machine; the optimizer state is AdamW's own);
- `dcp.save({"app": AppState(model, [optimizer], scheduler, progress)})` (the factory's AppState, prime-rl's
  CheckpointManager call) through torch's `FileSystemWriter`, whose file streams are the one change: a
  `write` of a buffer that is all zero bytes (>= 4 KiB) seeks over it instead, leaving a hole. Every byte
  torch writes is therefore in the file (a hole reads as zeros), every zip record's header and CRC-32 is the
  one torch computed, and `.metadata` is torch's.
- rank 0 writes the bf16 base as an HF dir the same way (safetensors headers real, zero weights as holes,
  norms 1.0), so the masters are the base's exact upcast as in a real run, the run's orch.toml (alpha), and
  `sparse_ckpt.json`: sizes, allocated bytes, the LoRA item bytes, timings.

Local `ckpt` commands need `ckpt --allow-sparse` on these files (their sparse-file guard is right to refuse
them otherwise); served over HTTP they are ordinary bytes.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import struct
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
sys.path[:0] = [str(BENCH), str(REPO)]

from sizes import LORA_ALPHA, SIZES, factory_spec_kwargs  # noqa: E402

SCHEMA = "ckpt-sparse-ckpt/1"
HOLE_MIN = 4096
SHARD_BYTES = 5 * 10**9


class SparseStream:
    """A binary file stream whose writes of all-zero buffers become holes (a seek); the file's length is
    set at close, so a trailing hole is kept. Only `write`, `tell`, `seek`, `flush`, `fileno`, `close`."""

    def __init__(self, path, mode="wb"):
        self.f = open(path, mode)
        self.pos = 0
        self.end = 0
        self.hole_bytes = 0

    def write(self, b) -> int:
        import numpy as np

        mv = memoryview(b).cast("B")
        n = len(mv)
        if n >= HOLE_MIN and not np.frombuffer(mv, dtype=np.uint8).any():
            self.pos += n
            self.f.seek(self.pos)
            self.hole_bytes += n
        else:
            self.f.write(mv)
            self.pos += n
        self.end = max(self.end, self.pos)
        return n

    def tell(self) -> int:
        return self.pos

    def seek(self, off, whence=0):
        self.pos = self.f.seek(off, whence)
        return self.pos

    def flush(self):
        self.f.flush()

    def fileno(self):
        return self.f.fileno()

    def writable(self):
        return True

    def close(self):
        if not self.f.closed:
            self.f.flush()
            self.f.truncate(self.end)
            self.f.close()

    @property
    def closed(self):
        return self.f.closed

    def __enter__(self):
        return self

    def __exit__(self, *a):
        self.close()


def sparse_writer(path):
    """torch's FileSystemWriter for `path`, its streams SparseStreams (everything else torch's own)."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import FileSystem

    class SparseFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, p, mode):
            if "w" not in mode:
                with super().create_stream(p, mode) as s:
                    yield s
                return
            with SparseStream(p, mode) as s:
                yield s

    w = FileSystemWriter(path)
    w.fs = SparseFileSystem()
    return w


def allocated_bytes(root: Path) -> tuple[int, int]:
    """(apparent size, allocated bytes) of every file under root (`ls -l` and `du` totals)."""
    size = alloc = 0
    for p in root.rglob("*"):
        if p.is_file():
            st = p.stat()
            size += st.st_size
            alloc += st.st_blocks * 512
    return size, alloc


def write_sparse_base(path: Path, config, named_shapes, norm_value=1.0) -> dict:
    """The bf16 base as an HF dir: safetensors headers and the norms written, every other weight a hole
    (zeros). Shards of <= 5 GB, an index when there are several; the config and generation config."""
    import torch
    from transformers import GenerationConfig

    shards, current, size = [], [], 0
    for name, shape in named_shapes:
        nbytes = 2 * int(torch.Size(shape).numel())
        if current and size + nbytes > SHARD_BYTES:
            shards.append(current)
            current, size = [], 0
        current.append((name, shape, nbytes))
        size += nbytes
    shards.append(current)
    path.mkdir(parents=True, exist_ok=True)
    index, total = {}, 0
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
        header, off = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, nbytes in shard:
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + nbytes]}
            off += nbytes
            index[name] = fname
        hb = json.dumps(header, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)
        start = 8 + len(hb)
        with SparseStream(path / fname) as s:
            s.write(struct.pack("<Q", len(hb)) + hb)
            for name, shape, nbytes in shard:
                begin = start + header[name]["data_offsets"][0]
                if name.endswith("norm.weight"):
                    s.seek(begin)
                    s.write(torch.full(tuple(shape), norm_value, dtype=torch.bfloat16).view(torch.uint8).numpy())
                s.end = max(s.end, begin + nbytes)
        total += off
    if len(shards) > 1:
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=2))
    config.dtype = torch.bfloat16
    config.use_cache = True
    config.save_pretrained(str(path))
    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id).save_pretrained(str(path))
    return {"files": len(shards), "bytes": total}


def _spec(size: str, world: int, lora_rank: int | None):
    from tests.factory.factory import FactorySpec

    kw = factory_spec_kwargs(SIZES[size])
    if lora_rank:
        kw["lora_rank"] = lora_rank
    return FactorySpec(**kw, steps=1, world_size=world, lr=1e-4, scheduler="linear", warmup_steps=1, max_steps=10)


def generate(a) -> int:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.tensor import DTensor

    from tests.factory import factory as F

    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.perf_counter()
    spec = _spec(a.size, world, a.lora_rank)
    root = Path(a.root).resolve()
    paths = F.run_paths(root, spec)

    model, config = F.sharded_lora_skeleton(spec, world, "cpu")

    named = list(model.named_parameters())
    zeroed = 0   # frozen bytes that were not fresh zero pages and had to be written (small allocations)
    with torch.no_grad():
        for i, (name, p) in enumerate(named):
            local = p.to_local() if hasattr(p, "to_local") else p
            g = torch.Generator().manual_seed(a.seed * 1_000_003 + i * 1009 + rank)
            if ".lora_A." in name:
                local.normal_(0.0, 1.0 / p.shape[1] ** 0.5, generator=g)
            elif ".lora_B." in name:
                local.normal_(0.0, 0.005, generator=g)
            elif name.endswith("norm.weight"):
                local.fill_(1.0)
            elif local.numel() and bool(local.any()):   # reading a fresh page maps the zero page: no memory
                local.zero_()
                zeroed += local.numel() * 4
    for name, p in named:
        p.requires_grad_(".lora_A." in name or ".lora_B." in name)
    optimizer = F.build_optimizer(model, spec)
    scheduler = F.build_scheduler(optimizer, spec)
    progress = F.Progress()
    lora = F.lora_named_parameters(model)
    t_build = time.perf_counter()

    # one optimizer step, as factory.train_step after its backward: a random gradient, the clip, AdamW
    for i, (name, p) in enumerate(lora):
        g = torch.Generator().manual_seed(a.seed * 7919 + i * 104729 + rank)
        local = torch.empty(p.to_local().shape).normal_(0.0, 1e-3, generator=g)
        p.grad = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride(),
                                    run_check=False)
    torch.nn.utils.clip_grad_norm_([p for _, p in lora], max_norm=spec.max_norm)
    F.apply_step(optimizer, scheduler, progress, spec, world)
    t_train = time.perf_counter()

    paths.checkpoint.mkdir(parents=True, exist_ok=True)
    dcp.save({"app": F.app_state_class()(model, [optimizer], scheduler, progress)},
             storage_writer=sparse_writer(paths.checkpoint))
    t_save = time.perf_counter()
    zeroed_all = [None] * world
    dist.all_gather_object(zeroed_all, zeroed)

    if rank == 0:
        base = [(n.replace(".base_layer.", "."), tuple(p.shape)) for n, p in named if ".lora_" not in n]
        if spec.tie_word_embeddings:
            base = [(n, s) for n, s in base if n != "lm_head.weight"]
        base_info = write_sparse_base(paths.base_model, F.qwen3_config(spec), base)
        paths.orch_toml.parent.mkdir(parents=True, exist_ok=True)
        paths.orch_toml.write_text(F.orch_toml_text(spec, "base_model"))
        ck_size, ck_alloc = allocated_bytes(paths.checkpoint)
        b_size, b_alloc = allocated_bytes(paths.base_model)
        lora_bytes = sum(p.numel() * 4 for _, p in lora)
        info = {"schema": SCHEMA, "size": a.size, "world_size": world, "torch": torch.__version__,
                "lora_rank": spec.lora_rank, "lora_alpha": LORA_ALPHA, "targets": list(spec.targets),
                "layers": spec.num_layers, "hidden": spec.hidden_size, "step": progress.step,
                "lr": float(optimizer.param_groups[0]["lr"]),
                "checkpoint": str(paths.checkpoint.relative_to(root)), "base": str(paths.base_model.relative_to(root)),
                "checkpoint_bytes": ck_size, "checkpoint_allocated_bytes": ck_alloc,
                "base_bytes": b_size, "base_allocated_bytes": b_alloc, "base_tensor_bytes": base_info["bytes"],
                "lora_param_bytes": lora_bytes, "adam_state_bytes": 2 * lora_bytes,
                "frozen_bytes_zeroed_by_hand": sum(zeroed_all),
                "seconds": {"build": round(t_build - t0, 1), "step": round(t_train - t_build, 1),
                            "dcp_save": round(t_save - t_train, 1),
                            "base": round(time.perf_counter() - t_save, 1)}}
        (root / "sparse_ckpt.json").write_text(json.dumps(info, indent=2))
        print(json.dumps(info), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="tiny", choices=sorted(SIZES))
    ap.add_argument("--root", required=True)
    ap.add_argument("--lora-rank", type=int, default=None, help="default: the size's (bench/sizes.py, 32)")
    ap.add_argument("--seed", type=int, default=0)
    return generate(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
