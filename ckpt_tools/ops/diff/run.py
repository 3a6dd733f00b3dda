"""`ckpt diff-vs-base`: does WEIGHTS differ from BASE, tensor by tensor, and (with an adapter) is it
exactly BASE + the LoRA?

Plan, then execute. `plan_diff` pairs tensors by name from headers alone (and, with an adapter,
marks each pair targeted / replaced / untargeted and refuses an adapter that does not fit BASE)
before any tensor byte is read. `run_diff` then compares the pairs on this rank's workers, each
pair in blocks (each side read in one piece, folded in `sources.compare.block_chunks`) spread over one
pool of block workers, so a big tensor uses every core; every side is read once:

- same dtype and shape: raw byte comparison per chunk (memcmp, no decoding); the chunks that differ
  give the statistics of W - W0 (fp64 accumulation), the equal ones only ||W0||^2;
- different dtypes, same shape: both sides are upcast exactly to a common dtype (bf16/fp16/fp32 ->
  fp32, anything with fp64 -> fp64) chunk by chunk and compared bitwise there. A prime-rl DCP's fp32
  base weights therefore come out "identical after upcast" to the bf16 hub model;
- different shapes: reported, not compared.

With an adapter, each targeted tensor is checked by value: every element of W must be a correct rounding
(to W's dtype) of W0_32 + s*B@A as any fp32 merge can compute it, whatever its kernel or blocking
(`core.tensor_math.check_merged_values`: the exact value in fp64, a proven bound on fp32's error, and
the elements within that bound of a rounding boundary, "ties", where either neighbour passes). P = B@A
is computed in fp64 by row blocks on every worker, by any kernel: the counts are those of P in one fixed order
(`check_merged_values_bounded`), so they do not depend on the BLAS, and `device="cuda"` (`ops.diff.device`)
gives the same ones from a GPU. Replaced tensors (modules_to_save) must equal the adapter's bit for bit;
untargeted tensors must be unchanged. Memory: one byte budget (`WORKING_BUDGET_BYTES`) that the workers'
buffers are set aside from and each unit acquires its working set from (`core.budget.ByteBudget`).

Verdict (and the CLI's exit code): IDENTICAL (3) when every compared tensor is bitwise identical
(after exact upcast), else ADAPTER_MISMATCH (4) when an adapter check failed, else DIFFERS (0).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...core.budget import ByteBudget
from ...core.dtypes import dtype_name, torch_dtype
from ...core.lora_math import check_shapes
from ...core.pool import one_intra_op_thread
from ...core.progress import Progress, report
from ...core.tensor_math import (
    MergeCheck,
    lora_factors_fp64,
    lora_product_rows_fp64,
    merge_weight_into,
    ulps_apart,
)
from ...dist import Group, SoloGroup, local_workers, map_units, working
from ...sources.compare import (
    BLOCK_BYTES,
    STATS_BLOCK_ELEMS,
    ChunkStats,
    DeltaStats,
    Scratch,
    accelerator,
    bits,
    block_ranges,
    block_stats,
    chunk_map,
    chunk_scratch_bytes,
    common_dtype,
    factor_buffers,
    read_block,
    stream_stats,
    value_check_chunk,
)
from .device import DeviceCheck, resolve_device, units_of
from .fp8 import FP8_CHECK_BYTES, check_quantized, fp8_summary
from .plan import (
    DIFFERS,
    EXIT_ADAPTER_MISMATCH,
    EXIT_DIFFERS,
    EXIT_IDENTICAL,
    IDENTICAL,
    IDENTICAL_UPCAST,
    REPLACED,
    ROUNDED,
    SAME,
    SHAPE_CHANGED,
    SKIPPED,
    TARGETED,
    UNTARGETED,
    DiffOptions,
    DiffPlan,
    DiffSources,
    PairPlan,
    open_diff_sources,
    plan_diff,
)

__all__ = ["DiffReport", "TensorDiff", "diff_vs_base", "run_diff"]


@dataclass
class TensorDiff:
    name: str
    status: str
    weights_dtype: str
    base_dtype: str
    weights_shape: list[int]
    base_shape: list[int]
    numel: int
    changed_elements: int | None = None
    changed_fraction: float | None = None
    max_abs_delta: float | None = None
    rel_fro: float | None = None
    nonfinite: int | None = None
    role: str | None = None
    adapter_check: dict | None = None

    @property
    def same(self) -> bool:
        return self.status in SAME


@dataclass
class DiffReport:
    plan: DiffPlan
    tensors: list[TensorDiff]
    verdict: str
    exit_code: int
    summary: str
    adapter_summary: dict | None = None
    warnings: list[str] = field(default_factory=list)
    bytes_read: int = 0
    seconds: float = 0.0
    page: str | None = None  # the HTML page written (api.diff_vs_base's `page`), not part of the JSON

    def to_json(self) -> dict:
        p = self.plan
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[t.status] = counts.get(t.status, 0) + 1
        return _jsonable(
            {
                "weights": p.weights,
                "base": p.base,
                "adapter": p.adapter,
                "verdict": self.verdict,
                "exit_code": self.exit_code,
                "summary": self.summary,
                "counts": counts,
                "shared": len(p.pairs),
                "only_in_weights": list(p.only_in_weights),
                "only_in_base": list(p.only_in_base),
                "targeted_only": p.targeted_only,
                "adapter_check": self.adapter_summary,
                "tensors": [t.__dict__ for t in self.tensors],
                "bytes_read": self.bytes_read,
                "seconds": round(self.seconds, 3),
                "warnings": self.warnings,
            }
        )


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


def _result(p: PairPlan, status: str, st: DeltaStats | None) -> TensorDiff:
    td = TensorDiff(
        p.name,
        status,
        dtype_name(p.weights.dtype),
        dtype_name(p.base.dtype),
        list(p.weights.shape),
        list(p.base.shape),
        p.weights.numel,
        role=p.role,
    )
    if st is not None:
        td.changed_elements = st.changed
        td.changed_fraction = st.changed / st.numel if st.numel else 0.0
        td.max_abs_delta = st.max_abs
        td.rel_fro = st.rel_fro
        td.nonfinite = st.nonfinite
    return td


def _status(p: PairPlan, st: DeltaStats) -> str:
    if st.changed:
        return DIFFERS
    return IDENTICAL if p.weights.dtype == p.base.dtype else IDENTICAL_UPCAST


def _compare_streaming(weights, base, p: PairPlan, block_bytes: int, pool) -> TensorDiff:
    if p.mode == "shape":
        return _result(p, SHAPE_CHANGED, None)
    st = stream_stats(weights, base, p.name, block_bytes, skip_identical=p.mode == "raw", pool=pool)
    status = _status(p, st)
    if status == DIFFERS and p.mode == "upcast" and _may_be_rounded(p, st):
        status = ROUNDED if _is_rounded(weights, base, p, block_bytes) else DIFFERS
    return _result(p, status, st)


def _may_be_rounded(p: PairPlan, st: DeltaStats) -> bool:
    """Could the narrower side be the wider one rounded? Each rounding moves an element by at most half an
    ulp of the narrower dtype, eps / 2 of it relative, so ||W - W0|| is at most that of
    ||W0||: a cheap bound that spares the second read of weights that truly changed (a fine-tune's delta)."""
    narrow = p.weights if p.weights.itemsize < p.base.itemsize else p.base
    dt = torch_dtype(narrow.dtype)
    if not dt.is_floating_point or st.nonfinite or st.rel_fro is None:
        return False
    return st.rel_fro <= torch.finfo(dt).eps / 2 * 1.01


def _is_rounded(weights, base, p: PairPlan, block_bytes: int) -> bool:
    """Whether the narrower side is, bit for bit, the wider side cast to its dtype (torch's round to nearest
    even, as every exporter casts), block by block."""
    narrow_first = p.weights.itemsize < p.base.itemsize
    (ns, nf), (ws, wf) = (
        ((weights, p.weights), (base, p.base)) if narrow_first else ((base, p.base), (weights, p.weights))
    )
    dt = torch_dtype(nf.dtype)
    for start, n in block_ranges(nf.numel, max(1, block_bytes // max(nf.itemsize, wf.itemsize))):
        narrow = read_block(ns, nf, start, n, "w")[1]
        wide = read_block(ws, wf, start, n, "b")[1]
        if not torch.equal(bits(narrow), bits(wide.to(dt))):
            return False
    return True


_SCRATCH = Scratch()


def _check_targeted_streaming(
    weights, base, lora, p: PairPlan, block_bytes: int, pool, device: DeviceCheck | None = None
) -> TensorDiff:
    """A targeted tensor checked by value, block by block on `pool`'s threads: each block of rows gets its
    P = B@A rows in fp64 (any kernel, any threads: the check does not replay the merge's bits) and a
    proven bound on an fp32 product's error; W and W0 are read once, in the statistics' chunks, each
    chunk's share of the statistics of W - W0 computed and its W checked to be a correct rounding of
    W0 + s*P within that bound (`core.tensor_math.check_merged_values`). Memory: the factors in fp64 and
    one block's P per thread. With `device` (a GPU), the value check runs there (`_device_unit_check`)."""
    spec = lora.modules[p.module]
    check_shapes(
        tuple(p.base.shape),
        tuple(spec.a_shape),
        tuple(spec.b_shape),
        fan_in_fan_out=spec.fan_in_fan_out,
        name=p.name,
    )
    a, b = lora.read_pair(p.module)
    factors = lora_factors_fp64(a, b, fan_in_fan_out=spec.fan_in_fan_out)
    fw, fb = p.weights, p.base
    ct, out_dtype = common_dtype(fw.dtype, fb.dtype), torch_dtype(fw.dtype)
    cols = fw.shape[1] if len(fw.shape) > 1 else 1
    block_elems = max(cols, max(1, block_bytes // 8) // cols * cols)  # whole rows: P is computed by rows

    blocks = block_ranges(fw.numel, block_elems)
    if device is None:
        check = _cpu_unit_check(weights, base, p, factors, spec.scale, cols, ct)
        units = units_of(blocks, max(fw.itemsize, fb.itemsize), block_bytes)
    else:  # the same blocks' statistics; each unit's value check on the GPU
        check = _device_unit_check(weights, base, p, factors, spec.scale, cols, ct, device)
        units = units_of(blocks, max(fw.itemsize, fb.itemsize), device.unit_bytes)
    st, found = DeltaStats(), MergeCheck()
    for parts, mc in chunk_map(pool, check, units):
        for part in parts:
            st.fold(part)
        found.fold(mc)
    if (
        not found.finite
    ):  # the merge would refuse it: the whole-tensor merge raises its error, naming the tensor
        merge_weight_into(
            torch.empty(fw.shape, dtype=out_dtype),
            base.read_tensor(p.name),
            a,
            b,
            spec.scale,
            fan_in_fan_out=spec.fan_in_fan_out,
            name=p.name,
        )
    td = _result(p, _status(p, st), st)
    td.adapter_check = {
        "expected": f"round_{dtype_name(out_dtype)}(W0 + {spec.scale:g} * B @ A)",
        "module": p.module,
        "rank": spec.rank,
        "scale": spec.scale,
    }
    td.adapter_check.update(_ulps_result(found.off, found.max_ulps, out_dtype.is_floating_point))
    td.adapter_check["ties"] = found.ties
    return td


def _cpu_unit_check(weights, base, p: PairPlan, factors, scale: float, cols: int, ct):
    """A unit's check on this thread: its blocks (whole rows) read in one piece a side, then per block its P
    rows
    (fp64, the BLAS on this thread), its statistics chunks and its value check, one C call each (the Python
    around each call holds the GIL: a unit of several blocks keeps it to a few percent at 16 workers)."""
    fw, fb = p.weights, p.base
    iw, ib = fw.itemsize, fb.itemsize
    raw_factors = factor_buffers(factors)

    def check(unit: list[tuple[int, int]]) -> tuple[list[ChunkStats], MergeCheck]:
        start, n = unit[0][0], sum(k for _, k in unit)
        xw, w = read_block(weights, fw, start, n, "w")
        xb, w0 = read_block(base, fb, start, n, "w0")
        parts: list[ChunkStats] = []
        found = MergeCheck()
        for s, k in unit:
            o, r0 = s - start, s // cols
            prod = lora_product_rows_fp64(
                factors, r0, (s + k) // cols, out=_SCRATCH.tensor("prod", k, torch.float64)
            )
            bw, bb, tw, tb = xw[o * iw : (o + k) * iw], xb[o * ib : (o + k) * ib], w[o : o + k], w0[o : o + k]
            parts += block_stats(bw, bb, tw, tb, ct)
            found.fold(
                value_check_chunk(
                    tw, tb, prod, factors, r0, 0, scale, w_raw=bw, w0_raw=bb, factors_raw=raw_factors
                )
            )
        return parts, found

    return check


def _device_unit_check(weights, base, p: PairPlan, factors, scale: float, cols: int, ct, device: DeviceCheck):
    """A unit's check on the GPU: its blocks read into one of the device's pinned slots, their statistics
    chunks
    on this thread (the CPU path's chunks: the same bits), the value check of the whole unit on the device."""
    fw, fb = p.weights, p.base
    iw, ib = fw.itemsize, fb.itemsize
    on_device = device.factors(factors)

    def check(unit: list[tuple[int, int]]) -> tuple[list[ChunkStats], MergeCheck]:
        start, n = unit[0][0], sum(k for _, k in unit)
        with device.slot() as (bw, bb):
            weights.read_span(fw.name, start * iw, bw[: n * iw].numpy())
            base.read_span(fb.name, start * ib, bb[: n * ib].numpy())
            xw, xb = bw.numpy().data, bb.numpy().data
            w, w0 = bw[: n * iw].view(torch_dtype(fw.dtype)), bb[: n * ib].view(torch_dtype(fb.dtype))
            uploaded = device.upload(w, w0)  # (copying while the statistics are computed here)
            parts: list[ChunkStats] = []
            for s, k in unit:
                o = s - start
                parts += block_stats(
                    xw[o * iw : (o + k) * iw], xb[o * ib : (o + k) * ib], w[o : o + k], w0[o : o + k], ct
                )
            return parts, device.check(*uploaded, on_device, start // cols, (start + n) // cols, scale)

    return check


def _ulps_result(off: int, max_ulps: int, floating: bool) -> dict:
    if not off:
        return {"ok": True, "max_ulps": 0, "elements_off": 0}
    return {"ok": False, "max_ulps": max_ulps if floating else None, "elements_off": off}


def _compare_with_adapter(
    weights, base, lora, p: PairPlan, block_bytes: int, pool, device: DeviceCheck | None = None
) -> TensorDiff:
    """Targeted / replaced tensors. A targeted one streams (`_check_targeted_streaming`); a replaced
    one (modules_to_save) streams its statistics, and W is compared bit for bit with the adapter's
    tensor (read whole: `LoraSource.read_full`) block by block (`_replaced_check`)."""
    if p.mode == "shape":
        td = _result(p, SHAPE_CHANGED, None)
        td.adapter_check = {
            "ok": False,
            "expected": "same shape as BASE",
            "problem": f"shape {list(p.weights.shape)} != BASE {list(p.base.shape)}",
        }
        return td
    if p.role == TARGETED:
        return _check_targeted_streaming(weights, base, lora, p, block_bytes, pool, device)
    st = stream_stats(weights, base, p.name, block_bytes, skip_identical=p.mode == "raw", pool=pool)
    td = _result(p, _status(p, st), st)
    fw = p.weights
    expected = lora.read_full(p.name)  # (the adapter's tensor, whole: LoraSource reads it so)
    check: dict[str, object] = {
        "expected": f"the adapter's {p.name} (modules_to_save) as {dtype_name(fw.dtype)}"
    }
    if tuple(expected.shape) != tuple(fw.shape):
        check.update(ok=False, problem=f"adapter tensor shape {list(expected.shape)} != {list(fw.shape)}")
        td.adapter_check = check
        return td
    check.update(_replaced_check(weights, fw, expected.reshape(-1), block_bytes))
    td.adapter_check = check
    return td


def _replaced_check(weights, fw, expected: torch.Tensor, block_bytes: int) -> dict:
    """W against the adapter's tensor cast to W's dtype, block by block (W read by blocks, the cast made
    per block): bitwise equality, and the ulps distance where they differ."""
    dt = torch_dtype(fw.dtype)
    off = max_ulps = 0
    for start, n in block_ranges(fw.numel, max(1, block_bytes // max(fw.itemsize, expected.element_size()))):
        w = read_block(weights, fw, start, n, "w")[1]
        e = expected[start : start + n].to(dt)
        differ = bits(w) != bits(e)
        k = int(torch.count_nonzero(differ))
        if k and dt.is_floating_point:
            max_ulps = max(max_ulps, int(ulps_apart(w[differ], e[differ]).max()))
        off += k
    return _ulps_result(off, max_ulps, dt.is_floating_point)


def _one_sided(plan: DiffPlan) -> str:
    parts = []
    if plan.only_in_weights:
        parts.append(f"{len(plan.only_in_weights)} tensors only in WEIGHTS")
    if plan.only_in_base:
        parts.append(f"{len(plan.only_in_base)} only in BASE")
    return ("; " + ", ".join(parts)) if parts else ""


def _rounded_verdict(plan: DiffPlan, compared: list[TensorDiff], rounded: list[TensorDiff]):
    """Every tensor the same, some only as a rounding of the wider side: the same weights, exported."""
    narrow = {
        t.weights_dtype if _itemsize(t.weights_dtype) < _itemsize(t.base_dtype) else t.base_dtype
        for t in rounded
    }
    text = (
        f"the same weights: {len(rounded)} of {len(compared)} compared tensors are the wider side rounded to "
        f"{'/'.join(sorted(narrow))} (round to nearest even, as an export casts them), the other "
        f"{len(compared) - len(rounded)} bitwise identical{_one_sided(plan)}"
    )
    return "identical_rounded", EXIT_IDENTICAL, text, None


def _itemsize(dtype_text: str) -> int:
    return torch.empty((), dtype=torch_dtype(dtype_text)).element_size()


def _verdict(plan: DiffPlan, tensors: list[TensorDiff], lora) -> tuple[str, int, str, dict | None]:
    compared = [t for t in tensors if t.status != SKIPPED]
    rounded = [t for t in compared if t.status == ROUNDED]
    if rounded and all(t.same or t.status == ROUNDED for t in compared) and lora is None:
        return _rounded_verdict(plan, compared, rounded)
    changed = [t for t in compared if not t.same]
    upcast = [t for t in compared if t.status == IDENTICAL_UPCAST]
    skipped = len(tensors) - len(compared)
    scope = f"{len(compared)} compared tensors" if skipped else f"{len(compared)} shared tensors"
    adapter_summary = None if lora is None else _adapter_summary(plan, compared, lora)
    if not changed:
        how = " (after exact upcast of the narrower dtype)" if upcast else ""
        if plan.weights["kind"] == "dcp":
            why = "as expected for a LoRA checkpoint's frozen base weights (the LoRA lives in lora_A/lora_B)"
        else:
            # two HF dirs alike need not be a failed merge: a full fine-tune's export may be compared too
            why = (
                "if WEIGHTS is meant to hold a merged LoRA, the LoRA was not merged (or had no effect); "
                "if it is a trained model's export, training changed none of these weights"
            )
        text = f"identical to base: all {scope} are bitwise identical{how}; {why}"
        if adapter_summary is not None and not adapter_summary["passed"]:
            text += (
                f"; the adapter check FAILED ({len(adapter_summary['off'])} targeted tensors are not W0 "
                f"+ s*B@A)"
            )
        text += _one_sided(plan)
        return "identical", EXIT_IDENTICAL, text, adapter_summary
    top = max((t.rel_fro for t in changed if t.rel_fro is not None), default=None)
    text = f"differs from base: {len(changed)} of {scope} changed"
    if top is not None:
        text += f" (largest ||W-W0||/||W0|| {top:.3g})"
    text += _one_sided(plan)
    if adapter_summary is not None and not adapter_summary["passed"]:
        return "adapter_mismatch", EXIT_ADAPTER_MISMATCH, text + "; the adapter check FAILED", adapter_summary
    if adapter_summary is not None:
        text += (
            f"; adapter check passed: {adapter_summary['exact']}/{adapter_summary['targeted']} targeted "
            f"tensors are the correctly rounded W0 + s*B@A ({adapter_summary['ties']} elements within the "
            "fp32 error bound of a rounding boundary)"
        )
        if not plan.targeted_only:
            text += f", {adapter_summary['untargeted_checked']} untargeted unchanged"
        if adapter_summary.get("fp8_checked"):
            text += (
                f"; {adapter_summary['fp8_checked']} block-FP8 weights are exactly the quantization of their "
                f"W32 ({adapter_summary['fp8_ties']} codes at a rounding boundary)"
            )
    return "differs", EXIT_DIFFERS, text, adapter_summary


def _adapter_summary(plan: DiffPlan, compared: list[TensorDiff], lora) -> dict:
    """The adapter check over the compared tensors: it passed where every targeted (and replaced) tensor is
    the correctly rounded W0 + s*B@A, no untargeted one changed and no target is missing from W."""
    targeted = [t for t in compared if t.role in (TARGETED, REPLACED)]
    exact = [t for t in targeted if t.adapter_check and t.adapter_check.get("ok")]
    bad = [t for t in targeted if not (t.adapter_check and t.adapter_check.get("ok"))]
    # (an untargeted block-FP8 weight differs from its base by the quantization: checked against the rule)
    untargeted_changed = [
        t for t in compared if t.role == UNTARGETED and not t.same and not (t.adapter_check or {}).get("ok")
    ]
    max_ulps = max((t.adapter_check.get("max_ulps") or 0 for t in targeted if t.adapter_check), default=0)
    passed = not bad and not untargeted_changed and not plan.targets_missing_in_weights
    ties = sum((t.adapter_check or {}).get("ties") or 0 for t in targeted)
    return {
        "passed": passed,
        "targeted": len(targeted),
        "exact": len(exact),
        "max_ulps": max_ulps,
        "ties": ties,
        "off": [
            {
                "name": t.name,
                "max_ulps": (t.adapter_check or {}).get("max_ulps"),
                "elements_off": (t.adapter_check or {}).get("elements_off"),
                "problem": (t.adapter_check or {}).get("problem"),
            }
            for t in bad
        ],
        "untargeted_changed": [t.name for t in untargeted_changed],
        "untargeted_checked": len([t for t in compared if t.role == UNTARGETED]),
        "missing_in_weights": list(plan.targets_missing_in_weights),
        "alpha": lora.alpha,
        "alpha_source": lora.alpha_source,
        **fp8_summary(compared),
    }


# The working set of a rank, whatever the model size and the number of cores (peak RSS under 1 GiB: this,
# torch itself, ~620 MiB with a CUDA build, and the interpreter): first each worker's buffers
# (`_scratch_bytes`: a block of each side, a targeted block's P) and a GPU's pinned slots are set aside, as
# many
# workers as leave UNITS_MIN_BYTES; then each unit acquires what it holds beyond its worker's buffers from the
# rest (`core.budget.ByteBudget`), so the small units run on every worker while a big one waits until its
# bytes
# fit.
WORKING_BUDGET_BYTES = 352 * 2**20
UNITS_MIN_BYTES = 64 * 2**20


# what one worker holds for a targeted tensor's block beyond its reads: the block's P in fp64 (BLOCK_BYTES);
# without the C kernel, the torch check's temporaries over one statistics chunk too (about 100 bytes an
# element, counted as 128: each worker's temporaries come from its own malloc arena, which keeps freed
# pages; at 100 a 16-worker check measured 357 MiB of growth over one worker's, beyond the 352 MiB budget)
_VALUE_CHECK_BYTES = BLOCK_BYTES + (128 * STATS_BLOCK_ELEMS if accelerator is None else 0)


def _scratch_bytes(p: PairPlan) -> int:
    return chunk_scratch_bytes(p.weights.itemsize, p.base.itemsize) + (
        _VALUE_CHECK_BYTES if p.role == TARGETED else 0
    )


def _working_bytes(p: PairPlan, lora) -> int:
    """What unit `p` holds beyond its worker's chunk buffers, honestly counted."""
    if not p.read or p.mode == "shape":
        return 0
    if p.role not in (TARGETED, REPLACED):
        return 0  # streamed: the worker's chunk buffers only
    numel = p.weights.numel
    if p.role == TARGETED:
        spec = lora.modules[p.module]
        return 12 * (math.prod(spec.a_shape) + math.prod(spec.b_shape))  # A, B (<= fp32) and in fp64
    return 4 * numel + 3 * BLOCK_BYTES  # the adapter's tensor (<= fp32); a block of W, its cast and the mask


def run_diff(
    plan: DiffPlan,
    sources: DiffSources,
    progress: Progress | None = None,
    *,
    block_bytes: int = BLOCK_BYTES,
    group: Group | None = None,
    device: str | None = None,
) -> DiffReport:
    """Compare every pair (independent units: on this rank's threads, and under torchrun split over the
    ranks by bytes, every rank getting every result); a `ProgressEvent("compare", i, n, unit="tensors",
    name=...)` after each in order (its `finished` the pair's TensorDiff). `device` "cuda" (or "cuda:N"): the
    adapter check's value check on that GPU (`ops.diff.device`), with the same verdicts and counts."""
    weights, base, lora = sources.weights, sources.base, sources.lora
    on_device = resolve_device(device)
    checker = DeviceCheck(on_device) if on_device is not None and lora is not None else None
    t0 = time.perf_counter()
    group = group or SoloGroup()
    sizes = [p.weights.nbytes + p.base.nbytes if p.read else 0 for p in plan.pairs]
    threads, budget = _workers(plan, sources, group, sizes, checker)
    pool = (
        ThreadPoolExecutor(threads, thread_name_prefix="ckpt-diff-chunks", initializer=one_intra_op_thread)
        if threads > 1
        else None
    )

    def compare(i: int) -> dict:
        p = plan.pairs[i]
        if not p.read:
            td = _result(p, SKIPPED, None)
        elif lora is not None and p.name in weights.quantized and p.mode != "shape":
            with budget.hold(FP8_CHECK_BYTES):  # a block-FP8 weight: the rule's codes and scales (`fp8`)
                td = _compare_streaming(weights, base, p, block_bytes, pool)
                td.adapter_check = check_quantized(weights, base, lora, p)
        elif p.role in (TARGETED, REPLACED):
            with budget.hold(_working_bytes(p, lora)):
                td = _compare_with_adapter(weights, base, lora, p, block_bytes, pool, checker)
        else:
            td = _compare_streaming(weights, base, p, block_bytes, pool)
        if threads == 1:  # (with threads, pages are released when the sources close)
            weights.release()
            base.release()
        return dict(td.__dict__)

    done = _progress_reporter(progress, sizes, t0)
    # The workers are the parallelism: torch's intra-op threads on top of them oversubscribe the cores
    # (OpenMP's spinning on a busy machine: see ops.merge.pipeline).
    intra_op = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = map_units(compare, sizes, group, threads=threads, done=done, everywhere=True)
    finally:
        torch.set_num_threads(intra_op)
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
    tensors = [TensorDiff(**d) for d in results]
    verdict, code, summary, adapter_summary = _verdict(plan, tensors, lora)
    warnings = list(getattr(lora, "warnings", ()) or ()) if lora is not None else []
    (bytes_read,) = group.sum([weights.bytes_read + base.bytes_read], "the bytes read")
    return DiffReport(
        plan,
        tensors,
        verdict,
        code,
        summary,
        adapter_summary,
        warnings,
        bytes_read=bytes_read,
        seconds=time.perf_counter() - t0,
    )


def _workers(
    plan: DiffPlan, sources: DiffSources, group: Group, sizes: list[int], checker: DeviceCheck | None
) -> tuple[int, ByteBudget]:
    """How many units run at once, and the budget their working sets hold from.

    Two levels: `threads` units in flight (map_units), and their chunks on one pool of `threads`
    workers, so a single big tensor uses every core and the units' working sets (the adapter
    check's P) are what the byte budget admits. Only the pool's workers hold chunk buffers.
    Memory by construction: the workers are as many as the working budget affords beside the device's
    buffers and the units' minimum, so the total never grows with the cores (nor with the largest tensor:
    every unit streams in blocks, and holds from the rest of the budget what it holds beyond its worker's)."""
    # under torchrun, only the ranks that get work (`dist.working`: a tiny job runs on rank 0) share the cores
    threads = local_workers(n_working=working(sizes, group))
    if any(
        src.extents(p.name) is None for p in plan.pairs if p.read for src in (sources.weights, sources.base)
    ):
        threads = 1  # a source that assembles whole tensors keeps one in a single slot: one tensor at a time
    scratch = max((_scratch_bytes(p) for p in plan.pairs if p.read), default=0)
    reserved = checker.host_bytes if checker is not None else 0
    threads = max(1, min(threads, (WORKING_BUDGET_BYTES - reserved - UNITS_MIN_BYTES) // max(1, scratch)))
    return threads, ByteBudget(max(UNITS_MIN_BYTES, WORKING_BUDGET_BYTES - reserved - threads * scratch))


def _progress_reporter(progress: Progress | None, sizes: list[int], t0: float) -> Callable[[int, dict], None]:
    """map_units' `done`: a `ProgressEvent("compare", ...)` after each pair, in order (its `finished` the
    pair's TensorDiff; the bytes both sides hold, for the progress line's bytes, rate and ETA: what the
    reads take)."""
    total, bytes_total = len(sizes), sum(sizes)
    done_pairs = done_bytes = 0

    def done(i: int, d: dict) -> None:
        nonlocal done_pairs, done_bytes
        done_pairs += 1
        done_bytes += sizes[i]
        report(
            progress,
            "compare",
            done_pairs,
            total,
            unit="tensors",
            name=d["name"],
            finished=TensorDiff(**d),
            bytes_done=done_bytes,
            bytes_total=bytes_total,
            elapsed_s=time.perf_counter() - t0,
        )

    return done


def diff_vs_base(
    weights: str | Path,
    base: str | Path,
    *,
    adapter: str | Path | None = None,
    alpha: float | None = None,
    run_config: str | Path | None = None,
    targeted_only: bool = False,
    trust_pickle: bool = False,
    block_bytes: int = BLOCK_BYTES,
    device: str | None = None,
    progress: Progress | None = None,
) -> DiffReport:
    """Open both sides (and the adapter), plan from metadata, then compare one pair at a time."""
    options = DiffOptions(
        None if adapter is None else str(adapter),
        alpha,
        None if run_config is None else str(run_config),
        targeted_only,
        trust_pickle,
        device,
    )
    with open_diff_sources(weights, base, options) as sources:
        plan = plan_diff(sources, options)
        return run_diff(plan, sources, progress, block_bytes=block_bytes, device=device)
