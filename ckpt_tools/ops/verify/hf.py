"""`ckpt verify` of an HF model dir: config.json, the index and every shard header checked against each
other (every disagreement listed: `formats.hf_dir.checks`, the rules HFModelDir.open refuses), shapes
against what the config implies, and with `--deep` every float read and checked for inf/nan, and every
file with a digest (SHA256SUMS, a Hub blob name) read against it (`digests`)."""

from __future__ import annotations

import threading
from pathlib import Path

from ...core.dtypes import EXPONENT_MASKS, is_floating, itemsize, torch_dtype
from ...core.errors import CkptError
from ...core.problems import PROBLEM, VerifyReport
from ...core.progress import Progress
from ...core.progress import report as report_progress
from ...dist import Group, map_units
from ...formats.hf_dir.checks import check_index, header_finding
from ...formats.hf_dir.config import dtype_disagreement, shape_problems
from ...formats.hf_dir.fp8 import unsupported_quantization
from ...formats.safetensors.header import read_header
from ...io.inputs import MAX_CONFIG_VALUES, OpenFiles, read_json
from .digests import prove

__all__ = ["FINITE_BLOCK_BYTES", "PIECE_BYTES", "verify_hf"]


def _load_json(path: Path, report: VerifyReport):
    try:
        return read_json(path, root=path.parent, what=path.name, max_values=MAX_CONFIG_VALUES)
    except CkptError as exc:
        report.problem(path, None, exc.message)
    return None


def verify_hf(
    path: Path,
    report: VerifyReport,
    *,
    deep: bool,
    progress: Progress | None = None,
    group: Group | None = None,
) -> None:
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
        report.problem(
            path,
            None,
            "has both model.safetensors and model.safetensors.index.json; loaders "
            "disagree on which wins (delete the stale one)",
        )
    if index_path.is_file() and not single.is_file():
        # the index and every shard header against each other: the rules HFModelDir.open refuses, all listed
        check = check_index(path, index_path)
        for f in check.findings:
            (report.problem if f.severity == PROBLEM else report.warn)(f.file, f.key, f.message)
        files, tensors = len(check.headers) + len(check.unreadable), check.tensors
    else:
        header = _header(single, report, read_header) if single.is_file() else None
        files, tensors = int(single.is_file()), dict(header.tensors) if header is not None else {}
    if config is not None:
        for name, message in shape_problems(config, {n: t.shape for n, t in tensors.items()}):
            report.problem(tensors[name].path, name, message)
        warning = dtype_disagreement(config, {t.dtype for t in tensors.values()})
        if warning:
            report.warn(path / "config.json", None, warning)
    if config is not None:
        _check_fp8(path, config, tensors, report, deep)
    _integrity(path, tensors, report, deep, progress, group)
    report.checked.update(
        {"files": files, "tensors": len(tensors), "tensor_bytes": sum(t.nbytes for t in tensors.values())}
    )


def _check_fp8(path: Path, config: dict, tensors: dict, report: VerifyReport, deep: bool) -> None:
    """A block-FP8 dir's rules (`formats.hf_dir.fp8.fp8_problems`: each fp8 weight with its float32 scale on
    the right grid, none in modules_to_not_convert); with --deep every scale read: finite and positive. A
    quantization this package does not read is said, not checked."""
    from ...formats.hf_dir.fp8 import fp8_problems, fp8_scheme, quantized_pairs, scale_value_problems

    scheme = fp8_scheme(config)
    why = unsupported_quantization(config)
    if why is not None:
        report.warn(path / "config.json", None, f"quantized ({why}): its quantized tensors are not checked")
        return
    if scheme is None:
        return
    for name, message in fp8_problems(
        scheme, {n: (t.dtype_name, tuple(t.shape)) for n, t in tensors.items()}
    ):
        report.problem(tensors[name].path, name, message)
    if not deep:
        return
    files = OpenFiles(path, what="safetensors shard")
    try:
        for w, s in sorted(quantized_pairs({n: t.dtype_name for n, t in tensors.items()}).items()):
            t = tensors[s]
            if t.dtype_name != "float32":
                continue
            buf = bytearray(t.nbytes)
            files.read_into(t.path.name, t.begin, memoryview(buf), s)
            bad = scale_value_problems(memoryview(buf).cast("f").tolist())
            if bad:
                report.problem(t.path, s, f"{bad}: the blocks of {w} dequantize wrongly")
    finally:
        files.close()


def _integrity(path: Path, tensors: dict, report: VerifyReport, deep: bool, progress, group) -> None:
    """With --deep: every digested file read once against its digests (its floats counted on the way),
    the other tensors read for inf/nan only; `report.integrity` says what that proves."""
    by_file: dict[str, list] = {}
    for t in tensors.values():
        by_file.setdefault(t.path.name, []).append(t)
    digested = prove(
        path,
        report,
        deep=deep,
        weight_files=set(by_file),
        tensors_by_file=by_file,
        counter_for=_nonfinite_counter,
        progress=progress,
        group=group,
    )
    if deep:
        _deep_finite(
            path, {n: t for n, t in tensors.items() if t.path.name not in digested}, report, progress, group
        )


def _header(p: Path, report: VerifyReport, read_header=read_header):
    try:
        return read_header(p)
    except (CkptError, OSError) as exc:
        f = header_finding(p, exc)
        report.problem(f.file, f.key, f.message)
    return None


# Bytes of one read: small enough that the pread's copy is still in the CPU's cache when it is
# checked (16 MB blocks went out to memory and back: profiled 1.9 ms/MB against 0.07 in cache).
FINITE_BLOCK_BYTES = 1 * 2**20
# The unit of work: a tensor, or a piece of a big one (an 8B model's embedding is 1.2 GB, a quarter
# of a rank's share on 4 workers), so the workers finish together.
PIECE_BYTES = 64 * 2**20


def _pieces(order: list[str], tensors: dict) -> list[tuple[int, int, int]]:
    """(tensor index, byte offset, bytes) of every unit, in file order; an empty tensor is one piece."""
    out: list[tuple[int, int, int]] = []
    for i, name in enumerate(order):
        n = tensors[name].nbytes
        out.extend((i, pos, min(PIECE_BYTES, n - pos)) for pos in range(0, n, PIECE_BYTES))
        if not n:
            out.append((i, 0, 0))
    return out


def _nonfinite_counter(dtype_name: str):
    """A function counting inf/nan in a writable byte view of `dtype_name` values (it may overwrite
    them), or None for a dtype without such values. numpy for the IEEE kinds: the exponent mask in
    place, then one max, so a clean block costs two passes in cache and `verify --deep` needs no torch
    (its import was 2-3 s of a run); torch for the fp8 kinds."""
    if not is_floating(dtype_name):
        return None
    mask = EXPONENT_MASKS.get(dtype_name)
    if mask is None:
        import torch

        from ...core.tensor_math import count_nonfinite

        dt = torch_dtype(dtype_name)
        return lambda view: count_nonfinite(torch.frombuffer(view, dtype=dt))
    import numpy as np

    uints: dict[int, type[np.unsignedinteger]] = {2: np.uint16, 4: np.uint32, 8: np.uint64}
    uint = uints[itemsize(dtype_name)]

    def count(view) -> int:
        v = np.frombuffer(view, dtype=uint)
        np.bitwise_and(v, uint(mask), out=v)  # all exponent bits set <=> == mask; else < mask
        return int(np.count_nonzero(v == mask)) if v.size and int(v.max()) == mask else 0

    return count


def _deep_finite(
    dir_: Path, tensors: dict, report: VerifyReport, progress: Progress | None, group: Group | None = None
) -> None:
    """Every float of every tensor read (in FINITE_BLOCK_BYTES blocks into a per-thread buffer) and
    counted if inf/nan. The units are tensors and pieces of big ones (`PIECE_BYTES`): split over
    torchrun's ranks (`group`) and this rank's threads (`dist.local_workers`: preadv and numpy release
    the GIL); the problems are reported in file order, as one thread would. Memory: one block per
    thread."""
    total = sum(t.nbytes for t in tensors.values())
    order = sorted(tensors, key=lambda n: (str(tensors[n].path), tensors[n].begin))
    pieces = _pieces(order, tensors)
    files = OpenFiles(dir_, what="safetensors shard")
    local = threading.local()
    state = {"done": 0}

    def check(k: int) -> list | None:
        i, start, nbytes = pieces[k]
        name = order[i]
        t = tensors[name]
        try:
            counter = _nonfinite_counter(t.dtype_name)
            item = itemsize(t.dtype_name)
            block = max(item, FINITE_BLOCK_BYTES // item * item)
            buf = getattr(local, "buf", None)
            if buf is None or len(buf) < min(block, nbytes):  # grown to the largest block seen, then reused
                buf = local.buf = bytearray(min(block, nbytes))
            bad = 0
            for pos in range(start, start + nbytes, block):
                n = min(block, start + nbytes - pos)
                view = memoryview(buf)[:n]
                files.read_into(t.path.name, t.begin + pos, view, name)
                if counter is not None:
                    bad += counter(view)
            return ["bad", bad] if bad else None
        except Exception as exc:
            return ["error", f"cannot read tensor bytes: {type(exc).__name__}: {exc}"]

    def done(k: int, _result) -> None:
        state["done"] += pieces[k][2]
        report_progress(progress, "read", state["done"], total)

    try:
        results = map_units(check, [p[2] for p in pieces], group, done=done)
    finally:
        files.close()
    if results is None:
        return  # not the leader: rank 0 reports
    bad = [0] * len(order)
    error: list[str | None] = [None] * len(order)
    for (i, _start, _n), r in zip(pieces, results):
        if r is None or error[i] is not None:
            continue
        if r[0] == "error":
            error[i] = r[1]  # the first failing piece's read, as one thread would have stopped there
        else:
            bad[i] += r[1]
    for i, name in enumerate(order):
        t = tensors[name]
        err = error[i]
        if err is not None:
            report.problem(t.path, name, err)
        elif bad[i]:
            report.problem(t.path, name, f"{bad[i]} non-finite value(s) (inf/nan)")
