"""The arithmetic of the report (pure: results records in, numbers out).

- `aggregate` groups the runs of one (size, case, contender, ranks) and takes medians and ranges;
- `ratio` is the one definition of "x times": a contender's median wall over another's;
- `projection` scales a measured time to another model size by bytes moved: the fixed cost (the
  interpreter and imports, measured separately) stays, the rest grows with the bytes.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from sizes import SIZES, ModelSize

METRICS = ("wall_s", "cpu_s", "work_s", "peak_rss_bytes", "peak_tree_rss_bytes", "out_bytes")
IO_METRICS = ("rchar", "wchar", "read_bytes", "write_bytes")
# Measured beside the commands, as the fixed cost of each kind of process.
STARTUP_PROXY = {"ckpt": "ckpt --version", "python": "python -c 'import torch'", "shell": None}
PROJECTED_FROM_TINY_UP = 100_000_000  # sizes whose base is smaller than this are all fixed cost


@dataclass(frozen=True)
class Summary:
    median: float
    low: float
    high: float
    n: int


def summarize(values) -> Summary | None:
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None
    return Summary(statistics.median(vals), min(vals), max(vals), len(vals))


@dataclass
class Agg:
    size: str
    case: str
    contender: str
    role: str
    ranks: int
    status: str  # "ok" when at least one run succeeded, else the first run's status
    reason: str | None = None
    reads: tuple[str, ...] = ()
    writes: str | None = None
    argv0: str | None = None
    m: dict[str, Summary] = field(default_factory=dict)
    failures: int = 0
    shared_from: str | None = None  # measured once, for this other command of the same run

    def median(self, metric: str) -> float | None:
        s = self.m.get(metric)
        return s.median if s else None


def aggregate(runs: list[dict]) -> dict[tuple[str, str, str, int], Agg]:
    groups: dict[tuple[str, str, str, int], list[dict]] = {}
    for r in runs:
        groups.setdefault((r["size"], r["case"], r["contender"], r["ranks"]), []).append(r)
    out = {}
    for key, rs in groups.items():
        ok = [r for r in rs if r["status"] == "ok"]
        first = (ok or rs)[0]
        agg = Agg(size=key[0], case=key[1], contender=key[2], role=first["role"], ranks=key[3],
                  status="ok" if ok else first["status"], reason=None if ok else first.get("reason"),
                  reads=tuple(first.get("reads") or ()), writes=first.get("writes"),
                  argv0=_kind_of_process(first.get("argv")), failures=len(rs) - len(ok),
                  shared_from=first.get("shared_from"))
        for metric in METRICS:
            s = summarize(r.get(metric) for r in ok)
            if s:
                agg.m[metric] = s
        for metric in IO_METRICS:
            s = summarize((r.get("io") or {}).get(metric) for r in ok)
            if s:
                agg.m[metric] = s
        out[key] = agg
    return out


def _kind_of_process(argv: list[str] | None) -> str | None:
    """What starts the process, for its fixed cost: ckpt, another Python program, or a shell tool."""
    if not argv:
        return None
    if "ckpt_tools" in argv[:8]:
        return "ckpt"
    if argv[0] == "sh" and any("mergekit" in a for a in argv):
        return "python"
    if argv[0] == "sh" or argv[0].endswith(("/cat", "/cp")):
        return "shell"
    return "python" if "python" in argv[0].rsplit("/", 1)[-1] else "shell"


def ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den <= 0:
        return None
    return num / den


def volume_bytes(size: ModelSize, kinds: tuple[str, ...]) -> int:
    """Bytes a contender moves at a size, by the formulas of sizes.py (reads, then the write)."""
    return sum(size.bytes_of(k) for k in kinds)


@dataclass(frozen=True)
class Projection:
    contender: str
    fixed_s: float
    per_gb_s: dict[str, float]  # size -> seconds per GB moved, beyond the fixed cost
    from_size: str
    to_size: str
    volume_from: int
    volume_to: int
    seconds: float
    rss_bytes: float | None  # linear in bytes from the two largest sizes; None with one size
    rss_from: float | None


def projection(aggs: list[Agg], volume: tuple[str, ...], fixed_s: dict[str, float], to: str = "32b"
               ) -> Projection | None:
    """Project one contender's measured wall time to `to`, from the largest size it ran at.

    aggs: the contender's aggregates at each size (ranks 1); fixed_s: its fixed cost at each size,
    measured in the same run. Sizes whose base is under 100 MB are skipped (all fixed cost). Returns
    None when nothing bigger was measured or no bytes move."""
    pts = sorted(((SIZES[a.size], a) for a in aggs if a.status == "ok" and a.median("wall_s") is not None
                  and SIZES[a.size].base_bytes >= PROJECTED_FROM_TINY_UP), key=lambda p: p[0].params)
    if not pts or not volume:
        return None
    target = SIZES[to]
    per_gb = {}
    for size, a in pts:
        per_gb[size.name] = max(0.0, a.median("wall_s") - fixed_s.get(size.name, 0.0)) / (volume_bytes(size, volume) / 1e9)
    big_size, big = pts[-1]
    v_from, v_to = volume_bytes(big_size, volume), volume_bytes(target, volume)
    fixed = fixed_s.get(big_size.name, 0.0)
    seconds = fixed + per_gb[big_size.name] * v_to / 1e9
    rss_from = big.median("peak_rss_bytes")  # ranks 1: the kernel's exact peak of the process
    rss = None
    if len(pts) >= 2:
        small_size, small = pts[-2]
        r_small = small.median("peak_rss_bytes")
        v_small = volume_bytes(small_size, volume)
        if rss_from is not None and r_small is not None and v_from > v_small:
            rss = rss_from + (rss_from - r_small) / (v_from - v_small) * (v_to - v_from)
    return Projection(big.contender, fixed, per_gb, big_size.name, to, v_from, v_to, seconds, rss, rss_from)


MIN_RUNS_FOR_VERDICT = 5   # fewer runs than this give figures, never a verdict


def spread_ratio(num: Summary | None, den: Summary | None) -> tuple[float, float, float] | None:
    """(best, median, worst) of num/den over the measured spreads: the worst pairs ckpt's slowest run
    with the floor's fastest."""
    if num is None or den is None or den.low <= 0 or den.high <= 0:
        return None
    return num.low / den.high, num.median / den.median, num.high / den.low


def target_met(value: float | None, limit: float, *, worst: float | None = None, runs: int | None = None) -> str:
    """The verdict of a `<= limit` target: "met" only when it holds across the measured spread (`worst`,
    the least favourable pairing of runs) and at least MIN_RUNS_FOR_VERDICT runs were made."""
    if value is None:
        return "not measured"
    if value > limit:
        return "**not met**"
    if runs is not None and runs < MIN_RUNS_FOR_VERDICT:
        return f"no verdict ({runs} runs; {MIN_RUNS_FOR_VERDICT} needed)"
    if worst is not None and worst > limit:
        return f"**not met** across the spread (worst {worst:.2f}x)"
    return "met"
