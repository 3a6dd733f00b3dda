"""`ckpt slim`: keep only a checkpoint's unique state; record what was dropped so it can be rebuilt.

A prime-rl LoRA checkpoint is ~97% frozen base weights: fp32 masters that are exact upcasts of the
public bf16 base model (docs/primerl-format.md §0). `slim` copies every other storage item (LoRA,
AdamW state, param_groups, scheduler, progress, anything unrecognised) VERBATIM by byte range into
a new checkpoint, and writes `ckpt-slim-manifest.json` beside its `.metadata`: for every dropped
tensor its key, planner path, shape, dtype, original chunk layout and the sha256 of its bytes in
row-major order, plus the identity of the base model it came from. `ckpt rehydrate` rebuilds the
dropped tensors from the base and proves each one against that hash.

A slim checkpoint is NOT loadable by prime-rl's strict DCP loader on its own (`Missing key in
checkpoint state_dict`): the manifest says so, `ckpt inspect` says so, rehydrate first.

The module also owns the manifest format and the hashing both sides use (`tensor_sha256`,
`base_tensor_name`, `base_identity`), so slim and rehydrate cannot drift apart.
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import logging
import os
import struct
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..atomic import copy_input_tree, write_new_file
from ..dcp.reader import METADATA_NAME, DcpCheckpoint, TensorEntry
from ..dcp.zipitem import decode_tensor_pickle, parse_item
from ..errors import CkptError, FormatError, UnsafePickleError, UsageError
from ..inputs import MAX_JSON_BYTES, open_input, read_input, read_json, read_toml, scan_tree
from ..keys import FROZEN_GROUPS, classify, world_size_from_chunks
from .inspect import SLIM_MANIFEST

log = logging.getLogger(__name__)

MANIFEST_FORMAT = "ckpt-tools/slim-manifest"
MANIFEST_VERSION = 1
NOT_LOADABLE = ("SLIM checkpoint: the frozen base weights were removed. It is NOT loadable by prime-rl's "
                "strict loader on its own; run `ckpt rehydrate SLIM OUT --base BASE` to rebuild the full "
                "checkpoint, then resume from OUT.")
HASH_INPUT = "the tensor's bytes in its stored dtype, row-major (C order), little-endian"

Progress = Callable[[str, int, int], None]   # (phase, done_bytes, total_bytes)


# ------------------------------------------------------------------------------------------ plan
@dataclass(frozen=True)
class ChunkLayout:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str


@dataclass(frozen=True)
class DroppedTensor:
    key: str
    path: tuple
    hf_name: str
    shape: tuple[int, ...]
    dtype: str                      # "float32" (torch dtype name without "torch.")
    chunks: tuple[ChunkLayout, ...]
    nbytes: int


@dataclass(frozen=True)
class KeptItem:
    key: str
    path: tuple
    kind: str                       # "tensor" | "bytes"
    file: str
    offset: int
    length: int
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    chunk_offsets: tuple[int, ...] | None = None
    chunk_sizes: tuple[int, ...] | None = None


@dataclass(frozen=True)
class SlimPlan:
    source: str
    out: str
    world_size: int | None
    data_files: tuple[str, ...]          # the source's data files (output file i <- source file i)
    kept: tuple[KeptItem, ...]           # in source (file, offset) order: sequential reads
    dropped: tuple[DroppedTensor, ...]   # sorted by key
    extra_files: tuple[str, ...]         # other entries of the checkpoint dir, copied (dataloader/)
    kept_bytes: int                      # stored bytes of the kept items (what is written)
    dropped_bytes: int                   # stored bytes of the dropped items
    dropped_tensor_bytes: int            # payload bytes hashed
    source_bytes: int
    base: dict | None                    # base identity (from --base) or the run config's model name
    verify_base: bool

    def to_json(self) -> dict:
        return {
            "source": self.source, "out": self.out, "world_size": self.world_size,
            "kept_items": len(self.kept), "kept_keys": len({k.key for k in self.kept}),
            "dropped_keys": len(self.dropped), "kept_bytes": self.kept_bytes,
            "dropped_bytes": self.dropped_bytes, "source_bytes": self.source_bytes,
            "size_ratio": self.source_bytes / max(1, self.kept_bytes),
            "extra_files": list(self.extra_files), "base": self.base, "verify_base": self.verify_base,
            "dropped": [d.key for d in self.dropped],
        }


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def torch_dtype_of(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise FormatError(f"unknown dtype {name!r} in the slim manifest")
    return dt


def _extra_entries(ckpt_dir: Path, data_files: set[str]) -> list[str]:
    """Entries of a checkpoint dir that are neither its metadata nor its referenced data files:
    prime-rl's sft `dataloader/` folder and anything else a user put there travel along. Backups
    and temp files of our own surgery, and unreferenced .distcp files, do not. Each is checked as
    an input now (`inputs.scan_tree`: no FIFO, device, socket or symlink out of the checkpoint)."""
    out = []
    for name in sorted(os.listdir(ckpt_dir)):
        if name == METADATA_NAME or name in data_files or name == SLIM_MANIFEST:
            continue
        if name.startswith(".") or name.endswith(".distcp"):   # .metadata.bak-*, temp files
            continue
        scan_tree(ckpt_dir / name, root=ckpt_dir, what="checkpoint entry")
        out.append(name)
    return out


def extra_bytes(ckpt_dir: Path, names) -> int:
    """Bytes a copy of the extra entries `names` writes."""
    return sum(size for n in names for _p, size in scan_tree(ckpt_dir / n, root=ckpt_dir, what="checkpoint entry"))


def trainable_params(ckpt: DcpCheckpoint) -> set[str]:
    """Param FQNs that have optimizer state: never frozen, never recoverable from the base."""
    return {i.param for i in (classify(k, e.path) for k, e in ckpt.entries.items())
            if i.group == "optimizer_state"}


def plan_slim(ckpt: DcpCheckpoint, out: Path, *, base: dict | None = None, verify_base: bool = False) -> SlimPlan:
    """What slim will keep and drop, from metadata alone. Dropped = the `base` group (frozen fp32
    masters, HF names) minus any param that has optimizer state."""
    if (ckpt.dir / SLIM_MANIFEST).exists():
        raise UsageError("is already a slim checkpoint", path=ckpt.dir / SLIM_MANIFEST,
                         hint="nothing left to drop; `ckpt rehydrate` it to get the full checkpoint back")
    trainable = trainable_params(ckpt)
    kept: list[KeptItem] = []
    dropped: list[DroppedTensor] = []
    for key, e in ckpt.entries.items():
        info = classify(key, e.path)
        frozen = (info.group in FROZEN_GROUPS and isinstance(e, TensorEntry) and info.hf_name not in trainable)
        if frozen:
            dropped.append(DroppedTensor(
                key=key, path=tuple(e.path), hf_name=info.hf_name, shape=tuple(e.shape), dtype=dtype_name(e.dtype),
                chunks=tuple(ChunkLayout(c.offsets, c.sizes, c.file) for c in e.chunks), nbytes=e.nbytes))
        elif isinstance(e, TensorEntry):
            for c in e.chunks:
                kept.append(KeptItem(key, tuple(e.path), "tensor", c.file, c.offset, c.length, dtype_name(e.dtype),
                                     tuple(e.shape), c.offsets, c.sizes))
        else:
            kept.append(KeptItem(key, tuple(e.path), "bytes", e.file, e.offset, e.length))
    if not dropped:
        raise UsageError("has no frozen base weights to drop (no app.model.* tensor without optimizer state)",
                         path=ckpt.dir, hint="is this already a slim or adapter-only checkpoint? "
                                             "`ckpt inspect` shows its groups")
    kept.sort(key=lambda k: (k.file, k.offset))
    dropped.sort(key=lambda d: d.key)
    files = ckpt.data_files()
    sharded = [len(e.chunks) for e in ckpt.tensor_entries() if e.shape and e.shape[0] > 1]
    source_bytes = sum(ckpt.file_size(f) for f in files) + (ckpt.dir / METADATA_NAME).stat().st_size
    return SlimPlan(
        source=str(ckpt.dir), out=str(out), world_size=world_size_from_chunks(sharded), data_files=tuple(files),
        kept=tuple(kept), dropped=tuple(dropped), extra_files=tuple(_extra_entries(ckpt.dir, set(files))),
        kept_bytes=sum(k.length for k in kept),
        dropped_bytes=sum(ckpt.entries[d.key].stored_bytes for d in dropped),
        dropped_tensor_bytes=sum(d.nbytes for d in dropped), source_bytes=source_bytes, base=base,
        verify_base=verify_base)


# ------------------------------------------------------------------------------------------ hashing
def sha256_of_tensor(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes in row-major order (the manifest's content hash)."""
    h = hashlib.sha256()
    update_hash(h, t.detach().cpu())
    return h.hexdigest()


def _row_block_payloads(ckpt: DcpCheckpoint, e: TensorEntry):
    """Yield each non-empty chunk's payload (a memoryview) in row-major order when the chunks are
    dim-0 row blocks tiling the tensor (FSDP2's Shard(0)), else return None. Each chunk's zip
    CRC-32 is checked on the way: we never record a hash of corrupt bytes as the truth."""
    import zlib

    chunks = sorted((c for c in e.chunks if c.numel), key=lambda c: c.offsets[0] if c.offsets else 0)
    expect_row = 0
    for c in chunks:
        if c.sizes and (any(o != 0 for o in c.offsets[1:]) or c.sizes[1:] != e.shape[1:] or c.offsets[0] != expect_row):
            return None
        expect_row += c.sizes[0] if c.sizes else 1
    if e.shape and expect_row != e.shape[0]:
        return None

    def gen():
        for c in chunks:
            raw = ckpt.read_item_bytes(c.file, c.offset, c.length, e.key)
            try:
                layout = parse_item(io.BytesIO(raw))
                rec = decode_tensor_pickle(raw[layout.pkl_offset:layout.pkl_offset + layout.pkl_size])
            except UnsafePickleError as exc:
                raise UnsafePickleError(exc.message, path=ckpt.dir / c.file, key=e.key,
                                        hint="this tensor item's pickle is not a plain tensor; the checkpoint "
                                             "is damaged or crafted") from None
            except (ValueError, KeyError, EOFError, IndexError, TypeError, struct.error) as exc:
                raise FormatError(f"chunk at {list(c.offsets)} is not a readable tensor item: {exc}",
                                  path=ckpt.dir / c.file, key=e.key, hint="run `ckpt verify`") from None
            if not (rec.dtype == e.dtype and rec.size == c.sizes and rec.is_contiguous_whole
                    and layout.data_size == c.numel * e.dtype.itemsize):
                yield None
                return
            payload = memoryview(raw)[layout.data_offset:layout.data_offset + layout.data_size]
            if zlib.crc32(payload) != layout.data_crc:
                raise FormatError(f"chunk at {list(c.offsets)} fails its CRC-32 check (stored "
                                  f"{layout.data_crc:#010x})", path=ckpt.dir / c.file, key=e.key,
                                  hint="the checkpoint is corrupt; slim an intact copy")
            yield payload
            del raw, payload   # before the next chunk is read: one chunk in memory, not two
    return gen()


def checkpoint_tensor_sha256(ckpt: DcpCheckpoint, e: TensorEntry) -> str:
    """sha256 of a checkpoint tensor's row-major bytes. Row-block chunks are hashed chunk by chunk
    straight from their items (memory: one chunk); any other layout is assembled first."""
    payloads = _row_block_payloads(ckpt, e)
    if payloads is not None:
        h = hashlib.sha256()
        for p in payloads:
            if p is None:
                break
            h.update(p)
            del p
        else:
            return h.hexdigest()
    return sha256_of_tensor(ckpt.read_tensor(e.key))


# ------------------------------------------------------------------------------------------ base model
def base_tensor_name(hf_name: str, base_keys, tie_word_embeddings: bool) -> str | None:
    """The base model tensor a checkpoint's frozen tensor is an upcast of: the same HF name, or
    for `lm_head.weight` of a tied model (whose safetensors omit it) the input embedding."""
    if hf_name in base_keys:
        return hf_name
    if hf_name.endswith("lm_head.weight") and tie_word_embeddings:
        prefix = hf_name[: -len("lm_head.weight")]
        for cand in (prefix + "model.embed_tokens.weight", "model.embed_tokens.weight"):
            if cand in base_keys:
                return cand
    return None


def _is_tied(config: dict | None) -> bool:
    if not config:
        return False
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    text = config.get("text_config")
    if isinstance(text, dict) and "tie_word_embeddings" in text:
        return bool(text["tie_word_embeddings"])
    return True   # transformers' PretrainedConfig default


def base_identity(hf, name: str) -> dict:
    """Who the base model is: the name given, its path, sha256 of config.json and of every weight
    file's raw safetensors header (cheap: headers only, yet it changes with any re-export)."""
    cfg = hf.path / "config.json"
    h = hashlib.sha256()
    for fname, header in sorted(hf.headers.items()):
        fd = open_input(hf.path / fname, root=hf.path, what="safetensors shard")
        try:
            h.update(fname.encode() + b"\0")
            h.update(os.pread(fd, header.header_bytes, 8))   # the raw header read_header validated
        finally:
            os.close(fd)
    cfg_bytes = read_input(cfg, root=hf.path, what="config.json", max_bytes=MAX_JSON_BYTES) \
        if os.path.lexists(cfg) else None
    return {"name": name, "path": str(Path(hf.path).resolve()),
            "config_sha256": hashlib.sha256(cfg_bytes).hexdigest() if cfg_bytes is not None else None,
            "headers_sha256": h.hexdigest(), "tensors": len(hf.keys()),
            "tie_word_embeddings": _is_tied(hf.config)}


def check_base_covers(dropped, hf, where: Path) -> dict[str, str]:
    """Map every dropped key to its base tensor, checking names and shapes. Raises one error
    listing every problem (before a single tensor byte is read)."""
    tied = _is_tied(hf.config)
    keys = set(hf.keys())
    mapping, problems = {}, []
    for d in dropped:
        src = base_tensor_name(d.hf_name, keys, tied)
        if src is None:
            problems.append(f"{d.hf_name}: not in the base model")
            continue
        info = hf.info(src)
        if tuple(info.shape) != tuple(d.shape):
            problems.append(f"{d.hf_name}: base has shape {list(info.shape)}, checkpoint {list(d.shape)}")
            continue
        mapping[d.key] = src
    if problems:
        shown = "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
        raise FormatError(f"the base model does not match the checkpoint's frozen weights "
                          f"({len(problems)} of {len(dropped)} tensors): {shown}", path=where,
                          hint="pass the exact base model the run trained on (same architecture and size)")
    return mapping


def read_base_as(hf, src: str, dtype: torch.dtype) -> torch.Tensor:
    """A base tensor cast to the checkpoint's dtype: the exact fp32 master of a bf16 weight."""
    t = hf.read_tensor(src)
    return t if t.dtype == dtype else t.to(dtype)


# Rows per block when a base tensor is streamed: bounded scratch whatever the tensor's size.
BASE_BLOCK_BYTES = 64 << 20


def read_base_rows(hf, src: str, dtype: torch.dtype, start: int, rows: int) -> torch.Tensor:
    """Rows [start, start + rows) of a base tensor (one contiguous byte range of the row-major
    safetensors data), cast to `dtype`."""
    from ..formats.safetensors_io import read_tensor

    info = hf.info(src)
    row_bytes = info.nbytes // info.shape[0] if info.shape and info.shape[0] else 0
    part = dataclasses.replace(info, shape=(rows,) + tuple(info.shape[1:]), begin=info.begin + start * row_bytes,
                               nbytes=rows * row_bytes)
    t = read_tensor(part, hf.fd(src))
    return t if t.dtype == dtype else t.to(dtype)


def update_hash(h, t: torch.Tensor) -> None:
    if t.numel():
        h.update(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))


def base_upcast_sha256(hf, src: str, dtype: torch.dtype) -> str:
    """sha256 of a base tensor cast to `dtype`, streamed in row blocks (memory: one block)."""
    info = hf.info(src)
    if not info.shape or info.shape[0] == 0:
        return sha256_of_tensor(read_base_as(hf, src, dtype))
    n = info.shape[0]
    row_out = max(1, (info.numel // n) * dtype.itemsize)
    step = max(1, BASE_BLOCK_BYTES // row_out)
    h = hashlib.sha256()
    for s in range(0, n, step):
        update_hash(h, read_base_rows(hf, src, dtype, s, min(step, n - s)))
    return h.hexdigest()


# ------------------------------------------------------------------------------------------ manifest
def build_manifest(plan: SlimPlan, hashes: dict[str, str], base_verified: bool) -> dict:
    return {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "loadable_by_prime_rl": False,
        "note": NOT_LOADABLE,
        "source": {"path": plan.source, "bytes": plan.source_bytes, "data_files": list(plan.data_files)},
        "base": dict(plan.base or {}, verified=base_verified) if plan.base else None,
        "world_size": plan.world_size,
        "hash": {"algorithm": "sha256", "input": HASH_INPUT},
        "dropped_bytes": plan.dropped_bytes,
        "dropped_tensor_bytes": plan.dropped_tensor_bytes,
        "kept_bytes": plan.kept_bytes,
        "dropped": [
            {"key": d.key, "path": list(d.path), "hf_name": d.hf_name, "shape": list(d.shape), "dtype": d.dtype,
             "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes), "file": c.file} for c in d.chunks],
             "sha256": hashes[d.key]}
            for d in plan.dropped
        ],
    }


@dataclass(frozen=True)
class Manifest:
    path: Path
    raw: dict
    dropped: tuple[DroppedTensor, ...]
    hashes: dict[str, str]
    world_size: int | None
    base: dict | None
    data_files: tuple[str, ...]


def read_manifest(ckpt_dir: Path) -> Manifest:
    """Load and validate `ckpt-slim-manifest.json` completely (every problem is an error that
    names the file and the key)."""
    p = Path(ckpt_dir) / SLIM_MANIFEST
    if not os.path.lexists(p):
        raise UsageError(f"not a slim checkpoint: no {SLIM_MANIFEST}", path=ckpt_dir,
                         hint="rehydrate takes the output of `ckpt slim`")
    m = read_json(p, root=ckpt_dir, what="slim manifest")
    if not isinstance(m, dict) or m.get("format") != MANIFEST_FORMAT:
        raise FormatError(f"not a slim manifest (format is {m.get('format') if isinstance(m, dict) else None!r})",
                          path=p)
    if m.get("version") != MANIFEST_VERSION:
        raise FormatError(f"manifest version {m.get('version')!r}; this ckpt-tools reads version "
                          f"{MANIFEST_VERSION}", path=p, hint="use the ckpt-tools version that wrote it")
    dropped, hashes = [], {}
    for i, d in enumerate(m.get("dropped") or []):
        key = d.get("key") if isinstance(d, dict) else None
        try:
            path = tuple(d["path"])
            if ".".join(map(str, path)) != key:
                raise ValueError(f"path {list(path)} does not flatten to the key")
            shape = tuple(int(s) for s in d["shape"])
            dtype = torch_dtype_of(d["dtype"])
            chunks = tuple(ChunkLayout(tuple(int(o) for o in c["offsets"]), tuple(int(s) for s in c["sizes"]),
                                       str(c.get("file", ""))) for c in d["chunks"])
            for c in chunks:
                if len(c.offsets) != len(shape) or len(c.sizes) != len(shape) or any(
                        o < 0 or s < 0 or o + s > n for o, s, n in zip(c.offsets, c.sizes, shape)):
                    raise ValueError(f"chunk {list(c.offsets)}+{list(c.sizes)} lies outside shape {list(shape)}")
            covered = sum(int(torch.Size(c.sizes).numel()) for c in chunks if all(c.sizes))
            if covered != int(torch.Size(shape).numel()) and shape:
                raise ValueError(f"chunks cover {covered} of {int(torch.Size(shape).numel())} elements")
            digest = str(d["sha256"])
            if len(digest) != 64:
                raise ValueError("sha256 is not 64 hex digits")
            dropped.append(DroppedTensor(key, path, str(d["hf_name"]), shape, dtype_name(dtype), chunks,
                                         int(torch.Size(shape).numel()) * dtype.itemsize))
            hashes[key] = digest
        except CkptError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise FormatError(f"dropped entry #{i} is malformed: {type(exc).__name__}: {exc}", path=p,
                              key=key, hint="the manifest was edited or damaged; slim the original again") from None
    if not dropped:
        raise FormatError("lists no dropped tensors", path=p)
    return Manifest(p, m, tuple(dropped), hashes, m.get("world_size"), m.get("base"),
                    tuple((m.get("source") or {}).get("data_files") or ()))


# ------------------------------------------------------------------------------------------ execute
@dataclass
class SlimResult:
    out: str
    kept_items: int
    dropped_keys: int
    bytes_written: int
    bytes_read: int
    source_bytes: int
    out_bytes: int
    base_verified: bool
    seconds: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        d = asdict(self)
        d["size_ratio"] = self.source_bytes / max(1, self.out_bytes)
        return d


def copy_extra_entries(src_dir: Path, dst_dir: Path, names) -> None:
    """Copy the extra entries by content (files and directories, checked as inputs of `src_dir`)."""
    for name in names:
        copy_input_tree(src_dir / name, dst_dir / name, root=src_dir, what="checkpoint entry")


def output_file_index(data_files) -> dict[str, int]:
    """Output file i (`__i_0.distcp`) receives source file i's items: rank files stay rank files."""
    return {rel: i for i, rel in enumerate(data_files)}


def run_slim(ckpt: DcpCheckpoint, plan: SlimPlan, *, base_dir: Path | None = None, overwrite: bool = False,
             progress: Progress | None = None) -> SlimResult:
    from ..atomic import AtomicOutputDir
    from ..dcp.writer import DcpWriter

    t0 = time.perf_counter()
    hf = None
    mapping: dict[str, str] = {}
    if base_dir is not None:
        from ..formats.hf_dir import HFModelDir
        hf = HFModelDir.open(base_dir)
        mapping = check_base_covers(plan.dropped, hf, Path(base_dir))
    file_index = output_file_index(plan.data_files)
    need = plan.kept_bytes + 64 * 1024 * (1 + len(plan.dropped) // 100) + extra_bytes(ckpt.dir, plan.extra_files)
    seconds = {}
    inputs = [ckpt.dir] + ([base_dir] if base_dir is not None else [])   # --base is an input too
    with AtomicOutputDir(plan.out, inputs=inputs, need_bytes=need, overwrite=overwrite) as tmp:
        writer = DcpWriter(tmp, files=max(1, len(plan.data_files)))
        try:
            done = 0
            for k in plan.kept:   # source order: sequential reads
                raw = ckpt.read_item_bytes(k.file, k.offset, k.length, k.key)
                if k.kind == "bytes":
                    writer.copy_bytes_item(k.key, k.path, raw, file_index=file_index[k.file])
                else:
                    writer.copy_tensor_chunk(k.key, k.path, torch_dtype_of(k.dtype), k.shape, k.chunk_offsets,
                                             k.chunk_sizes, raw, file_index=file_index[k.file])
                done += k.length
                if progress:
                    progress("copy", done, plan.kept_bytes)
            seconds["copy"] = round(time.perf_counter() - t0, 3)
            t1 = time.perf_counter()
            hashes: dict[str, str] = {}
            done = 0
            for d in plan.dropped:
                e = ckpt.entries[d.key]
                hashes[d.key] = checkpoint_tensor_sha256(ckpt, e)
                if hf is not None:
                    got = base_upcast_sha256(hf, mapping[d.key], e.dtype)
                    if got != hashes[d.key]:
                        raise FormatError(
                            f"the base model's {mapping[d.key]} upcast to {d.dtype} differs from the "
                            f"checkpoint's frozen tensor (sha256 {got[:12]}… vs {hashes[d.key][:12]}…)",
                            path=base_dir, key=d.key,
                            hint="this is not the base the run trained on (another revision?), or the "
                                 "tensor was trained; pass the right --base, or slim without --base")
                done += d.nbytes
                if progress:
                    progress("hash", done, plan.dropped_tensor_bytes)
            seconds["hash"] = round(time.perf_counter() - t1, 3)
            writer.finish()
        except BaseException:
            writer.abort()
            raise
        manifest = build_manifest(plan, hashes, base_verified=hf is not None)
        write_new_file(tmp / SLIM_MANIFEST, json.dumps(manifest, indent=1, allow_nan=False) + "\n")
        copy_extra_entries(ckpt.dir, tmp, plan.extra_files)
        out_bytes = sum(f.stat().st_size for f in tmp.iterdir() if f.is_file())
    if hf is not None:
        hf.close()
    seconds["total"] = round(time.perf_counter() - t0, 3)
    return SlimResult(out=plan.out, kept_items=len(plan.kept), dropped_keys=len(plan.dropped),
                      bytes_written=writer.bytes_written, bytes_read=ckpt.stats.bytes_read,
                      source_bytes=plan.source_bytes, out_bytes=out_bytes, base_verified=hf is not None,
                      seconds=seconds)


def slim(ckpt_path: str | Path, out: str | Path, *, base: str | Path | None = None, dry_run: bool = False,
         overwrite: bool = False, trust_pickle: bool = False, progress: Progress | None = None) -> dict:
    """Library entry point: plan (and unless `dry_run`, execute) a slim. Returns a JSON-able report."""
    ckpt = DcpCheckpoint.open(ckpt_path, trust_pickle=trust_pickle)
    try:
        base_dir = None
        base_info = None
        if base is not None:
            from ..formats.hf_dir import HFModelDir, resolve_model_dir
            base_dir = resolve_model_dir(base)
            with HFModelDir.open(base_dir) as hf:
                base_info = base_identity(hf, str(base))
        else:
            base_info = _base_from_run_config(ckpt.dir)
        plan = plan_slim(ckpt, Path(out), base=base_info, verify_base=base_dir is not None)
        report = {"plan": plan.to_json(), "dry_run": dry_run}
        if not dry_run:
            report["result"] = run_slim(ckpt, plan, base_dir=base_dir, overwrite=overwrite,
                                        progress=progress).to_json()
        return report
    finally:
        ckpt.close()


def _base_from_run_config(ckpt_dir: Path) -> dict | None:
    """Without --base, record the model name from the run's orch.toml (unverified) so the user
    knows what to pass to rehydrate."""
    from ..alpha import find_run_configs, run_outputs_dir

    configs = find_run_configs(ckpt_dir)
    if len(configs) != 1:
        return None
    try:
        data, _ = read_toml(configs[0], root=run_outputs_dir(ckpt_dir), what="orchestrator config")
        name = data["model"]["name"]
    except (CkptError, KeyError, TypeError):   # a config we cannot read only costs us a hint
        return None
    if not isinstance(name, str):
        return None
    return {"name": str(name), "source": str(configs[0])}
