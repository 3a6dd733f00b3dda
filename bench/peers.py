"""The Python floors and peers the harness measures beside ckpt's commands, one per process.

    python bench/peers.py st-rewrite BASE OUT           # floor: safetensors load_file + save_file per shard
    python bench/peers.py peft-merge BASE ADAPTER OUT SHARD_BYTES
    python bench/peers.py dcp-to-torch-save DCP OUT     # torch's own DCP -> one torch.save file
    python bench/peers.py dcp-load-lora DCP OUT         # torch's _load_state_dict_from_keys, LoRA keys only
    python bench/peers.py lora-ranges DCP OUT.json      # (untimed) the model LoRA items' byte ranges
    python bench/peers.py cat-ranges RANGES.json        # floor: exactly those byte ranges read, no torch

Each is what a user would write with the library in question; each fsyncs what it writes, as ckpt's
commands do, so the comparison is between durable outputs.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def st_rewrite(base: str, out: str) -> None:
    """The safetensors rewrite floor: every shard loaded and saved again, the same bytes."""
    from safetensors.torch import load_file, save_file

    src, dst = Path(base), Path(out)
    dst.mkdir()
    for p in sorted(src.iterdir()):
        if p.suffix == ".safetensors":
            save_file(load_file(p), dst / p.name, metadata={"format": "pt"})
        elif p.is_file():
            shutil.copyfile(p, dst / p.name)
    _fsync_tree(dst)


def peft_merge(base: str, adapter: str, out: str, shard_bytes: str) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.save_pretrained(out, max_shard_size=int(shard_bytes))
    _fsync_tree(Path(out))


def dcp_to_torch_save(dcp: str, out: str) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save as convert

    Path(out).mkdir()
    convert(dcp, Path(out) / "checkpoint.pt")
    _fsync_tree(Path(out))


def dcp_load_lora(dcp: str, out: str) -> None:
    """The LoRA tensors of a DCP checkpoint through torch's key-selective loader, saved as safetensors."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    # the model's LoRA factors only (`app.model.<...>.lora_A/B`): the optimizer's moments of them
    # (`app.optimizers.state.<...>.lora_A.exp_avg`) also contain ".lora_" and are twice their bytes
    keys = {k for k in FileSystemReader(dcp).read_metadata().state_dict_metadata
            if k.startswith("app.model.") and ".lora_" in k}
    if not keys:
        raise SystemExit(f"{dcp}: no LoRA keys in .metadata")
    state = _load_state_dict_from_keys(keys=keys, checkpoint_id=dcp)
    flat = {}

    def walk(prefix: str, node) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            flat[prefix] = node.contiguous()

    walk("", state)
    Path(out).mkdir()
    save_file(flat, Path(out) / "adapter_model.safetensors")
    _fsync_tree(Path(out))


def lora_ranges(dcp: str, out: str) -> None:
    """The model LoRA items' byte ranges as torch's own `.metadata` places them, as JSON (untimed: the
    harness makes it before the floor `cat-ranges` runs, so the floor pays no torch import)."""
    import json

    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(dcp).read_metadata()
    ranges = sorted((info.relative_path, info.offset, info.length) for idx, info in meta.storage_data.items()
                    if idx.fqn.startswith("app.model.") and ".lora_" in idx.fqn)
    if not ranges:
        raise SystemExit(f"{dcp}: no LoRA items in .metadata")
    Path(out).write_text(json.dumps({"dcp": dcp, "ranges": ranges}))


def cat_ranges(ranges_json: str) -> None:
    """The floor of extract-adapter (issue 22): the byte ranges of `lora-ranges` read once into a reused
    buffer, what `cat` of exactly those items costs."""
    import json

    spec = json.loads(Path(ranges_json).read_text())
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    fds: dict[str, int] = {}
    try:
        for rel, off, length in spec["ranges"]:
            fd = fds.get(rel)
            if fd is None:
                fd = fds[rel] = os.open(Path(spec["dcp"]) / rel, os.O_RDONLY)
            end = off + length
            while off < end:
                n = os.preadv(fd, [view[:min(len(buf), end - off)]], off)
                if n <= 0:
                    raise SystemExit(f"{rel}: short read at {off}")
                off += n
    finally:
        for fd in fds.values():
            os.close(fd)


PEERS = {"st-rewrite": st_rewrite, "peft-merge": peft_merge, "dcp-to-torch-save": dcp_to_torch_save,
         "dcp-load-lora": dcp_load_lora,
         "lora-ranges": lora_ranges, "cat-ranges": cat_ranges}


if __name__ == "__main__":
    if len(sys.argv) < 2 or sys.argv[1] not in PEERS:
        raise SystemExit(__doc__)
    PEERS[sys.argv[1]](*sys.argv[2:])
