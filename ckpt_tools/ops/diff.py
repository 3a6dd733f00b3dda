"""`ckpt diff-vs-base`: does WEIGHTS differ from BASE, tensor by tensor, and (with an adapter) is it
exactly BASE + the LoRA?

Plan, then execute. `plan_diff` pairs tensors by name from headers alone (and, with an adapter,
marks each pair targeted / replaced / untargeted and refuses an adapter that does not fit BASE)
before any tensor byte is read. `run_diff` then streams one tensor pair at a time:

- same dtype and shape: raw byte comparison in blocks (memcmp, no decoding). Identical tensors cost
  one read of each side. A tensor that differs is read again, decoded block by block, for its
  statistics (fp64 accumulation);
- different dtypes, same shape: both sides are upcast exactly to a common dtype (bf16/fp16/fp32 ->
  fp32, anything with fp64 -> fp64) block by block and compared bitwise there. A prime-rl DCP's fp32
  base weights therefore come out "identical after upcast" to the bf16 hub model;
- different shapes: reported, not compared.

With an adapter, each targeted tensor is read whole on both sides and compared with
`lora_math.merge_weight(W0, A, B, s, out_dtype=WEIGHTS dtype)` = round(W0_32 + s*B32@A32), the
one rounding every ckpt-tools merge does; the distance is reported in ulps. Untargeted tensors must
be unchanged.

Verdict (and the CLI's exit code): IDENTICAL (3) when every compared tensor is bitwise identical
(after exact upcast), else ADAPTER_MISMATCH (4) when an adapter check failed, else DIFFERS (0).
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import FormatError, UsageError
from ..lora_math import merge_weight, ulps_apart
from ..weights_source import WeightInfo, WeightsSource, dtype_name, open_weights

log = logging.getLogger(__name__)

# Bytes per side per block: memory is a few blocks, whatever the tensor size. The identity scan
# reuses small buffers (they stay in cache: several GB/s from the page cache); decoded statistics
# use larger blocks to amortize per-op overhead.
RAW_BLOCK_BYTES = 1 * 2**20
BLOCK_BYTES = 4 * 2**20

EXIT_DIFFERS = 0
EXIT_IDENTICAL = 3
EXIT_ADAPTER_MISMATCH = 4

# per-tensor status
IDENTICAL = "identical"                  # same dtype and shape, same bytes
IDENTICAL_UPCAST = "identical_upcast"    # dtypes differ; bitwise equal after exact upcast
DIFFERS = "differs"
SHAPE_CHANGED = "shape_changed"
SKIPPED = "skipped"                      # --targeted-only: not read
SAME = (IDENTICAL, IDENTICAL_UPCAST)

# role of a pair when an adapter is given
TARGETED = "targeted"        # W = W0 + s*B@A expected
REPLACED = "replaced"        # modules_to_save: W = the adapter's full tensor expected
UNTARGETED = "untargeted"    # W = W0 expected


def common_dtype(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    """The dtype both sides upcast to exactly (every fp8/fp16/bf16 value is an fp32 value)."""
    if a == b:
        return a
    if a.is_floating_point and b.is_floating_point:
        return torch.float64 if torch.float64 in (a, b) else torch.float32
    return torch.float64


def _bits(t: torch.Tensor) -> torch.Tensor:
    """An integer view of the same bytes (bitwise comparison: -0.0 != 0.0, NaN payloads count)."""
    size = t.element_size()
    if t.dtype in (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64):
        return t
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[size])


@dataclass
class DeltaStats:
    """Streaming statistics of W - W0 (fp64 accumulation)."""
    numel: int = 0
    changed: int = 0            # elements whose bits differ (in the common dtype)
    max_abs: float = 0.0
    sum_sq_delta: float = 0.0
    sum_sq_base: float = 0.0
    nonfinite: int = 0          # elements where W or W0 is inf/nan

    def add(self, w: torch.Tensor, w0: torch.Tensor) -> None:
        """Fold in one block pair (same dtype, 1-D). Few passes: this runs over every element."""
        self.numel += w.numel()
        n_changed = int(torch.count_nonzero(_bits(w) != _bits(w0)))
        b64 = w0.to(torch.float64)
        base_sq = float(torch.dot(b64, b64)) if b64.numel() else 0.0
        if not n_changed:
            self.sum_sq_base += base_sq
            return
        self.changed += n_changed
        d = w.to(torch.float64).sub_(b64)
        del b64
        delta_sq = float(torch.dot(d, d))
        if not (math.isfinite(delta_sq) and math.isfinite(base_sq)):
            # rare: inf/nan somewhere; count them and keep the statistics over the finite part
            finite = torch.isfinite(d)
            self.nonfinite += int(d.numel() - torch.count_nonzero(finite))
            d = torch.where(finite, d, torch.zeros((), dtype=torch.float64))
            delta_sq = float(torch.dot(d, d))
            b64 = w0.to(torch.float64)
            b64 = torch.where(torch.isfinite(b64), b64, torch.zeros((), dtype=torch.float64))
            base_sq = float(torch.dot(b64, b64))
        lo, hi = torch.aminmax(d)
        self.max_abs = max(self.max_abs, abs(float(lo)), abs(float(hi)))
        self.sum_sq_base += base_sq
        self.sum_sq_delta += delta_sq

    @property
    def rel_fro(self) -> float:
        """||W - W0||_F / ||W0||_F (inf when W0 is all zero and W is not)."""
        if self.sum_sq_delta == 0.0:
            return 0.0
        if self.sum_sq_base == 0.0:
            return math.inf
        return math.sqrt(self.sum_sq_delta) / math.sqrt(self.sum_sq_base)


@dataclass(frozen=True)
class PairPlan:
    name: str
    weights: WeightInfo
    base: WeightInfo
    role: str | None             # TARGETED / REPLACED / UNTARGETED, None without an adapter
    module: str | None           # the LoRA module for TARGETED
    read: bool                   # False: skipped by --targeted-only

    @property
    def mode(self) -> str:
        if self.weights.shape != self.base.shape:
            return "shape"
        return "raw" if self.weights.dtype == self.base.dtype else "upcast"


@dataclass(frozen=True)
class DiffPlan:
    weights: dict
    base: dict
    adapter: dict | None
    pairs: tuple[PairPlan, ...]
    only_in_weights: tuple[str, ...]
    only_in_base: tuple[str, ...]
    targets_missing_in_weights: tuple[str, ...]   # tensors the adapter changes that WEIGHTS lacks
    targeted_only: bool

    @property
    def bytes_to_read(self) -> int:
        return sum(p.weights.nbytes + p.base.nbytes for p in self.pairs if p.read)


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

    def to_json(self) -> dict:
        p = self.plan
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[t.status] = counts.get(t.status, 0) + 1
        return _jsonable({
            "weights": p.weights, "base": p.base, "adapter": p.adapter,
            "verdict": self.verdict, "exit_code": self.exit_code, "summary": self.summary,
            "counts": counts, "shared": len(p.pairs),
            "only_in_weights": list(p.only_in_weights), "only_in_base": list(p.only_in_base),
            "targeted_only": p.targeted_only,
            "adapter_check": self.adapter_summary,
            "tensors": [t.__dict__ for t in self.tensors],
            "bytes_read": self.bytes_read, "seconds": round(self.seconds, 3),
            "warnings": self.warnings,
        })


def _jsonable(x):
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


# ------------------------------------------------------------------------------------------ plan
def plan_diff(weights: WeightsSource, base: WeightsSource, lora=None, *, targeted_only: bool = False) -> DiffPlan:
    """Pair tensors by name (metadata only). With a LoRA source, mark roles and refuse an adapter
    that does not fit BASE (all problems in one error)."""
    if targeted_only and lora is None:
        raise UsageError("--targeted-only needs --adapter (it reads only the tensors the adapter targets)")
    wk, bk = set(weights.keys()), set(base.keys())
    shared = sorted(wk & bk)
    if not shared:
        raise FormatError(f"WEIGHTS ({len(wk)} tensors) and BASE ({len(bk)} tensors) share no tensor name",
                          path=weights.path, hint=f"is {base.path} the base model of this checkpoint? "
                          f"e.g. WEIGHTS has {sorted(wk)[:2]}, BASE has {sorted(bk)[:2]}")
    roles: dict[str, tuple[str, str | None]] = {}
    missing_in_weights: list[str] = []
    if lora is not None:
        problems = []
        for module, spec in sorted(lora.modules.items()):
            name = spec.weight_name
            if name not in bk:
                problems.append(f"targets {name}, which BASE does not have")
                continue
            roles[name] = (TARGETED, module)
        for name in sorted(lora.full_tensors):
            if name not in bk:
                problems.append(f"replaces {name} (modules_to_save), which BASE does not have")
                continue
            roles[name] = (REPLACED, None)
        if problems:
            shown = "; ".join(problems[:10]) + (f"; and {len(problems) - 10} more" if len(problems) > 10 else "")
            raise FormatError(f"the adapter does not fit BASE: {shown}", path=lora.path,
                              hint="the adapter was trained on a different base model, or BASE is not the base")
        if not roles:
            raise FormatError("the adapter targets no tensor", path=lora.path,
                              hint="an adapter that matches nothing would merge to the base unchanged")
        missing_in_weights = sorted(n for n in roles if n not in wk)
    pairs = []
    for name in shared:
        role, module = roles.get(name, (UNTARGETED if lora is not None else None, None))
        read = not targeted_only or role in (TARGETED, REPLACED)
        pairs.append(PairPlan(name, weights.info(name), base.info(name), role, module, read))
    return DiffPlan(weights=weights.describe(), base=base.describe(),
                    adapter=lora.describe() if lora is not None else None, pairs=tuple(pairs),
                    only_in_weights=tuple(sorted(wk - bk)), only_in_base=tuple(sorted(bk - wk)),
                    targets_missing_in_weights=tuple(missing_in_weights), targeted_only=targeted_only)


# ------------------------------------------------------------------------------------------ execute
def _pairs(weights: WeightsSource, base: WeightsSource, ranges: list[tuple[int, int]], read) -> Iterator[tuple]:
    """Yield read(src, start, n) for both sides over `ranges`, the next pair read ahead by two
    threads while the caller works on the current one (preadv releases the GIL). Memory: 2 pairs."""
    if len(ranges) <= 1:
        for s, n in ranges:
            yield read(weights, s, n), read(base, s, n)
        return
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ckpt-diff-read")
    try:
        def submit(r):
            return pool.submit(read, weights, *r), pool.submit(read, base, *r)

        pending = submit(ranges[0])
        for i in range(len(ranges)):
            cur = pending
            if i + 1 < len(ranges):
                pending = submit(ranges[i + 1])
            yield cur[0].result(), cur[1].result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _ranges(total: int, block: int) -> list[tuple[int, int]]:
    return [(s, min(block, total - s)) for s in range(0, total, block)]


def _raw_identical(weights: WeightsSource, base: WeightsSource, name: str, nbytes: int, block_bytes: int) -> bool:
    block = min(block_bytes, RAW_BLOCK_BYTES)
    ranges = _ranges(nbytes, block)
    # two buffer sets, alternating: pair i+1 is read ahead while pair i is compared
    bufs = {id(weights): [bytearray(block), bytearray(block)], id(base): [bytearray(block), bytearray(block)]}

    def read(src, s, n):
        buf = bufs[id(src)][s // block % 2]
        src.read_into(name, s, memoryview(buf)[:n])
        return buf if n == block else buf[:n]   # (memoryview == is item by item: 60x slower)

    for x, y in _pairs(weights, base, ranges, read):
        if x != y:   # memcmp of two bytearrays
            return False
    return True


def _stream_stats(weights: WeightsSource, base: WeightsSource, p: PairPlan, block_bytes: int) -> DeltaStats:
    ct = common_dtype(p.weights.dtype, p.base.dtype)
    block = max(1, block_bytes // max(p.weights.dtype.itemsize, p.base.dtype.itemsize))

    def read(src, s, n):
        return src.read_elems(p.name, s, n).to(ct)

    st = DeltaStats()
    for w, w0 in _pairs(weights, base, _ranges(p.weights.numel, block), read):
        st.add(w, w0)
    return st


def _whole_stats(w: torch.Tensor, w0: torch.Tensor, block_elems: int) -> DeltaStats:
    ct = common_dtype(w.dtype, w0.dtype)
    fw, fb = w.reshape(-1), w0.reshape(-1)
    st = DeltaStats()
    for start in range(0, fw.numel(), block_elems):
        st.add(fw[start:start + block_elems].to(ct), fb[start:start + block_elems].to(ct))
    return st


def _result(p: PairPlan, status: str, st: DeltaStats | None) -> TensorDiff:
    td = TensorDiff(p.name, status, dtype_name(p.weights.dtype), dtype_name(p.base.dtype),
                    list(p.weights.shape), list(p.base.shape), p.weights.numel, role=p.role)
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


def _compare_streaming(weights, base, p: PairPlan, block_bytes: int) -> TensorDiff:
    if p.mode == "shape":
        return _result(p, SHAPE_CHANGED, None)
    if p.mode == "raw" and _raw_identical(weights, base, p.name, p.weights.nbytes, block_bytes):
        st = DeltaStats(numel=p.weights.numel)
        return _result(p, IDENTICAL, st)
    st = _stream_stats(weights, base, p, block_bytes)
    return _result(p, _status(p, st), st)


def _ulps_check(w: torch.Tensor, expected: torch.Tensor, block_elems: int) -> dict:
    """Bitwise equality first (one cheap pass); the ulps distance only where they differ, in blocks."""
    fw, fe = w.reshape(-1), expected.reshape(-1)
    off = int(torch.count_nonzero(_bits(fw) != _bits(fe)))
    if not off:
        return {"ok": True, "max_ulps": 0, "elements_off": 0}
    if not w.dtype.is_floating_point:
        return {"ok": False, "max_ulps": None, "elements_off": off}
    max_ulps = 0
    for s in range(0, fw.numel(), block_elems):
        max_ulps = max(max_ulps, int(ulps_apart(fw[s:s + block_elems], fe[s:s + block_elems]).max()))
    return {"ok": False, "max_ulps": max_ulps, "elements_off": off}


def _compare_with_adapter(weights, base, lora, p: PairPlan, block_bytes: int) -> TensorDiff:
    """Targeted / replaced tensors: both read whole (the merge's matmul needs them whole)."""
    if p.mode == "shape":
        td = _result(p, SHAPE_CHANGED, None)
        td.adapter_check = {"ok": False, "expected": "same shape as BASE",
                            "problem": f"shape {list(p.weights.shape)} != BASE {list(p.base.shape)}"}
        return td
    w = weights.read_tensor(p.name)
    w0 = base.read_tensor(p.name)
    st = _whole_stats(w, w0, max(1, block_bytes // 8))
    td = _result(p, _status(p, st), st)
    if p.role == TARGETED:
        spec = lora.modules[p.module]
        a, b = lora.read(p.module)
        expected = merge_weight(w0, a, b, spec.scale, out_dtype=w.dtype, fan_in_fan_out=spec.fan_in_fan_out,
                                name=p.name)
        check = {"expected": f"round_{dtype_name(w.dtype)}(W0 + {spec.scale:g} * B @ A)", "module": p.module,
                 "rank": spec.rank, "scale": spec.scale}
        del a, b
    else:
        expected = lora.read_full(p.name).to(w.dtype)
        check = {"expected": f"the adapter's {p.name} (modules_to_save) as {dtype_name(w.dtype)}"}
        if tuple(expected.shape) != tuple(w.shape):
            check.update(ok=False, problem=f"adapter tensor shape {list(expected.shape)} != {list(w.shape)}")
            td.adapter_check = check
            return td
    del w0
    check.update(_ulps_check(w, expected, max(1, block_bytes // 8)))
    td.adapter_check = check
    return td


def _one_sided(plan: DiffPlan) -> str:
    parts = []
    if plan.only_in_weights:
        parts.append(f"{len(plan.only_in_weights)} tensors only in WEIGHTS")
    if plan.only_in_base:
        parts.append(f"{len(plan.only_in_base)} only in BASE")
    return ("; " + ", ".join(parts)) if parts else ""


def _verdict(plan: DiffPlan, tensors: list[TensorDiff], lora) -> tuple[str, int, str, dict | None]:
    compared = [t for t in tensors if t.status != SKIPPED]
    changed = [t for t in compared if not t.same]
    upcast = [t for t in compared if t.status == IDENTICAL_UPCAST]
    skipped = len(tensors) - len(compared)
    scope = f"{len(compared)} compared tensors" if skipped else f"{len(compared)} shared tensors"
    adapter_summary = None
    if lora is not None:
        targeted = [t for t in compared if t.role in (TARGETED, REPLACED)]
        exact = [t for t in targeted if t.adapter_check and t.adapter_check.get("ok")]
        bad = [t for t in targeted if not (t.adapter_check and t.adapter_check.get("ok"))]
        untargeted_changed = [t for t in compared if t.role == UNTARGETED and not t.same]
        max_ulps = max((t.adapter_check.get("max_ulps") or 0 for t in targeted if t.adapter_check), default=0)
        passed = not bad and not untargeted_changed and not plan.targets_missing_in_weights
        adapter_summary = {
            "passed": passed, "targeted": len(targeted), "exact": len(exact), "max_ulps": max_ulps,
            "off": [{"name": t.name, "max_ulps": (t.adapter_check or {}).get("max_ulps"),
                     "elements_off": (t.adapter_check or {}).get("elements_off"),
                     "problem": (t.adapter_check or {}).get("problem")} for t in bad],
            "untargeted_changed": [t.name for t in untargeted_changed],
            "untargeted_checked": len([t for t in compared if t.role == UNTARGETED]),
            "missing_in_weights": list(plan.targets_missing_in_weights),
            "alpha": lora.alpha, "alpha_source": lora.alpha_source,
        }
    if not changed:
        how = " (after exact upcast of the narrower dtype)" if upcast else ""
        if plan.weights["kind"] == "dcp":
            why = "as expected for a LoRA checkpoint's frozen base weights (the LoRA lives in lora_A/lora_B)"
        else:
            why = "the LoRA was not merged (or had no effect)"
        text = f"identical to base: all {scope} are bitwise identical{how}; {why}"
        if adapter_summary is not None and not adapter_summary["passed"]:
            text += f"; the adapter check FAILED ({len(adapter_summary['off'])} targeted tensors are not W0 + s*B@A)"
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
        text += (f"; adapter check passed: {adapter_summary['exact']}/{adapter_summary['targeted']} targeted "
                 f"tensors equal round(W0 + s*B@A) exactly ({adapter_summary['max_ulps']} ulps off)")
        if not plan.targeted_only:
            text += f", {adapter_summary['untargeted_checked']} untargeted unchanged"
    return "differs", EXIT_DIFFERS, text, adapter_summary


def run_diff(plan: DiffPlan, weights: WeightsSource, base: WeightsSource, lora=None, *,
             block_bytes: int = BLOCK_BYTES,
             on_tensor: Callable[[int, int, TensorDiff], None] | None = None) -> DiffReport:
    import time

    t0 = time.perf_counter()
    tensors: list[TensorDiff] = []
    total = len(plan.pairs)
    for i, p in enumerate(plan.pairs):
        if not p.read:
            td = _result(p, SKIPPED, None)
        elif p.role in (TARGETED, REPLACED):
            td = _compare_with_adapter(weights, base, lora, p, block_bytes)
        else:
            td = _compare_streaming(weights, base, p, block_bytes)
        weights.release()
        base.release()
        tensors.append(td)
        if on_tensor is not None:
            on_tensor(i + 1, total, td)
    verdict, code, summary, adapter_summary = _verdict(plan, tensors, lora)
    warnings = list(getattr(lora, "warnings", ()) or ()) if lora is not None else []
    return DiffReport(plan, tensors, verdict, code, summary, adapter_summary, warnings,
                      bytes_read=weights.bytes_read + base.bytes_read, seconds=time.perf_counter() - t0)


def diff_vs_base(weights: str | Path, base: str | Path, *, adapter: str | Path | None = None,
                 alpha: float | None = None, run_config: str | Path | None = None, targeted_only: bool = False,
                 trust_pickle: bool = False, block_bytes: int = BLOCK_BYTES,
                 on_tensor: Callable[[int, int, TensorDiff], None] | None = None) -> DiffReport:
    """Open both sides (and the adapter), plan from metadata, then compare one pair at a time."""
    if adapter is None and (alpha is not None or run_config is not None):
        raise UsageError("--alpha/--run-config only apply with --adapter")
    w = open_weights(weights, trust_pickle=trust_pickle)
    try:
        b = open_weights(base, trust_pickle=trust_pickle)
        try:
            lora = None
            if adapter is not None:
                from ..lora_source import open_lora_source

                lora = open_lora_source(adapter, alpha=alpha, run_config=run_config, trust_pickle=trust_pickle)
            try:
                plan = plan_diff(w, b, lora, targeted_only=targeted_only)
                return run_diff(plan, w, b, lora, block_bytes=block_bytes, on_tensor=on_tensor)
            finally:
                if lora is not None:
                    lora.close()
        finally:
            b.close()
    finally:
        w.close()
