"""`ckpt verify` of an HF model dir: config.json, the index and every shard header checked against each
other (every disagreement listed), shapes against what the config implies, and with `--deep` every
float read and checked for inf/nan."""
from __future__ import annotations

import threading
from pathlib import Path

from typing import TYPE_CHECKING

from ...core.dtypes import torch_dtype
from ...core.errors import CkptError
from ...core.progress import Progress
from ...core.progress import report as report_progress
from ...formats.hf_dir.config import dtype_disagreement, shape_problems
from ...formats.safetensors.header import read_header
from ...io.inputs import OpenFiles, is_plain_file_name, read_json
from ...core.problems import VerifyReport
from ...dist import Group, map_units

if TYPE_CHECKING:   # annotations only: torch is imported where tensors are built
    import torch

__all__ = ["FINITE_BLOCK_BYTES", "verify_hf"]

FINITE_BLOCK_BYTES = 16 * 2**20


def _load_json(path: Path, report: VerifyReport):
    try:
        return read_json(path, root=path.parent, what=path.name)
    except CkptError as exc:
        report.problem(path, None, exc.message)
    return None


def verify_hf(path: Path, report: VerifyReport, *, deep: bool, progress: Progress | None = None,
              group: Group | None = None) -> None:
    single, index_path = path / "model.safetensors", path / "model.safetensors.index.json"
    config = None
    if (path / "config.json").is_file():
        config = _load_json(path / "config.json", report)
        if config is not None and not isinstance(config, dict):
            report.problem(path / "config.json", None, "is not a JSON object")
            config = None
    else:
        report.warn(path / "config.json", None, "no config.json: transformers cannot load this directory")
    if single.is_file() and index_path.is_file():
        report.problem(path, None, "has both model.safetensors and model.safetensors.index.json; loaders "
                                   "disagree on which wins (delete the stale one)")
    headers = {}
    weight_map = None
    if index_path.is_file() and not single.is_file():
        index = _load_json(index_path, report)
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if index is not None and (not isinstance(weight_map, dict) or not weight_map):
            report.problem(index_path, None, "has no non-empty 'weight_map' object")
            weight_map = None
        files: dict[str, list[str]] = {}
        for k, f in (weight_map or {}).items():
            if not is_plain_file_name(f):
                report.problem(index_path, k, f"weight_map points at {f!r}, not a file inside the model dir")
                continue
            files.setdefault(f, []).append(k)
        for f in sorted(files):
            if not (path / f).is_file():
                keys = sorted(files[f])
                report.problem(path / f, keys[0], f"shard listed in {index_path.name} is missing "
                                                  f"({len(keys)} tensor(s) map to it; this is the first)")
                continue
            headers[f] = _header(path / f, report, read_header)
        listed = set(files)
        for extra in sorted(n.name for n in path.glob("*.safetensors")):
            if extra not in listed:
                report.warn(path / extra, None, f"not referenced by {index_path.name}; loaders ignore it")
        meta = index.get("metadata") if isinstance(index, dict) else None
        total = meta.get("total_size") if isinstance(meta, dict) else None
        if isinstance(total, int) and all(h is not None for h in headers.values()) and len(headers) == len(files):
            have = sum(t.nbytes for h in headers.values() for t in h.tensors.values())
            if have != total:
                report.warn(index_path, None, f"metadata.total_size is {total} but the shards hold {have} "
                                              "bytes of tensor data")
    elif single.is_file():
        headers[single.name] = _header(single, report, read_header)
    # index <-> headers, duplicates
    owner: dict[str, str] = {}
    for f, h in sorted(headers.items()):
        if h is None:
            continue
        for k in h.tensors:
            if k in owner:
                report.problem(path / f, k, f"tensor also stored in {owner[k]}")
            owner.setdefault(k, f)
            if weight_map is not None:
                mapped = weight_map.get(k)
                if mapped is None:
                    report.problem(path / f, k, f"tensor is not listed in {index_path.name}: loaders will not find it")
                elif mapped != f:
                    report.problem(path / f, k, f"tensor is in {f} but {index_path.name} maps it to {mapped}")
    if weight_map is not None:
        for k, f in sorted(weight_map.items()):
            h = headers.get(f)
            if h is not None and k not in h.tensors and k not in owner:
                report.problem(path / f, k, f"{index_path.name} maps the tensor to {f}, which does not hold it")
    tensors = {k: headers[f].tensors[k] for k, f in owner.items()}
    if config is not None:
        for name, message in shape_problems(config, {n: t.shape for n, t in tensors.items()}):
            report.problem(tensors[name].path, name, message)
        warning = dtype_disagreement(config, {t.dtype for t in tensors.values()})
        if warning:
            report.warn(path / "config.json", None, warning)
    if deep:
        _deep_finite(path, tensors, report, progress, group)
    report.checked.update({"files": len(headers), "tensors": len(tensors),
                           "tensor_bytes": sum(t.nbytes for t in tensors.values())})


def _header(p: Path, report: VerifyReport, read_header=read_header):
    try:
        return read_header(p)
    except CkptError as exc:
        report.problem(exc.path or p, exc.key, exc.message)
    except OSError as exc:
        report.problem(p, None, f"cannot read: {exc.strerror}")
    return None


def _deep_finite(dir_: Path, tensors: dict, report: VerifyReport, progress: Progress | None,
                 group: Group | None = None) -> None:
    """Every float of every tensor read (in FINITE_BLOCK_BYTES blocks into a per-thread buffer) and
    counted if inf/nan. Tensors are independent units: split over torchrun's ranks (`group`) and this
    rank's threads (`dist.local_workers`: preadv and torch release the GIL); the problems are reported
    in file order, as one thread would. Memory: one block per thread."""
    # lazy: only --deep reads values; verify without it needs no torch (2-3 s of start-up)
    import torch

    from ...core.tensor_math import count_nonfinite
    total = sum(t.nbytes for t in tensors.values())
    order = sorted(tensors, key=lambda n: (str(tensors[n].path), tensors[n].begin))
    files = OpenFiles(dir_, what="safetensors shard")
    local = threading.local()
    state = {"done": 0}

    def check(i: int) -> list | None:
        name = order[i]
        t = tensors[name]
        try:
            dt = torch_dtype(t.dtype_name)
            item = dt.itemsize
            block = max(item, FINITE_BLOCK_BYTES // item * item)
            buf = getattr(local, "buf", None)
            if buf is None or len(buf) < min(block, t.nbytes):   # grown to the largest block seen, then reused
                buf = local.buf = bytearray(min(block, t.nbytes))
            bad = 0
            for pos in range(0, t.nbytes, block):
                n = min(block, t.nbytes - pos)
                view = memoryview(buf)[:n]
                files.read_into(t.path.name, t.begin + pos, view, name)
                if dt.is_floating_point and n:
                    bad += count_nonfinite(torch.frombuffer(view, dtype=dt))
            if bad:
                return [str(t.path), name, f"{bad} non-finite value(s) (inf/nan)"]
        except Exception as exc:
            return [str(t.path), name, f"cannot read tensor bytes: {type(exc).__name__}: {exc}"]
        return None

    def done(i: int, _result) -> None:
        state["done"] += tensors[order[i]].nbytes
        report_progress(progress, "read", state["done"], total)

    intra_op = torch.get_num_threads()
    torch.set_num_threads(1)   # the threads are the parallelism (OpenMP on top oversubscribes: ops.merge.pipeline)
    try:
        results = map_units(check, [tensors[n].nbytes for n in order], group, done=done)
    finally:
        torch.set_num_threads(intra_op)
        files.close()
    for problem in results or ():
        if problem is not None:
            report.problem(Path(problem[0]), problem[1], problem[2])
