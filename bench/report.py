#!/usr/bin/env python3
"""Render a results file of bench/harness.py as markdown (and PNG plots) for docs/benchmarks.md.

    python bench/report.py RESULTS.json --label 2-core [--plots docs/bench] [--record docs/benchmarks.md]

The section has: the run (machine, cache, command line), the inputs (measured bytes beside the formula
used for the projection), a summary per size (each ckpt command against its floors and peers, as
ratios), the issue-14 targets at the largest size, the rank sweep, the Qwen3-32B projection, and the
detail of every contender at the largest size. With --record, it replaces the text between
`<!-- bench:LABEL:begin -->` and `<!-- bench:LABEL:end -->` (appending a section when absent).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from _doc import record_section
from cases import CASES, is_torchrun_label
from sizes import SIZES
from stats import STARTUP_PROXY, Agg, Summary, aggregate, projection, ratio, spread_ratio, target_met, volume_bytes

GIB, MIB = 2**30, 2**20
# issue 14's targets: (case, floor label, limit of ckpt wall / floor wall)
TARGETS = (("merge", "cp -r base && sync", 1.1), ("diff-vs-base", "cat merged base", 1.5),
           ("diff-vs-base --adapter", "cat merged base adapter", 2.0))
# issue 22's: the checkpoint side and the check, each beside its floor plus one torch import (the issue's
# own measure: every command pays one), in the same run
TORCH_IMPORT = "python -c 'import torch'"
TARGETS_22 = (("slim", "cat dcp", 1.3), ("rehydrate", "cp -r dcp && sync", 1.2),
              ("merge --base-from-checkpoint", "cat dcp + cp -r base && sync", 1.2),
              ("export", "cat dcp + cp -r base && sync", 1.2), ("extract-adapter", "cat LoRA items", 1.2),
              ("diff-vs-base", "cat merged base", 1.5), ("diff-vs-base --adapter", "cat merged base adapter", 2.0))
RSS_TARGET_BYTES = GIB


# ------------------------------------------------------------------------------------- formatting


def fmt_s(s: Summary | None) -> str:
    if s is None:
        return "-"
    if s.n == 1 or s.low == s.high:
        return _sec(s.median)
    return f"{_sec(s.median)} ({_sec(s.low)}-{_sec(s.high)})"


def _sec(x: float) -> str:
    return f"{x:.2f}" if x < 10 else f"{x:.1f}"


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_rss(n: float | None) -> str:
    if n is None:
        return "-"
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.0f} MiB"


def fmt_x(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def rss_of(a: Agg) -> float | None:
    """Peak RSS of the tree: the sampled sum when several processes ran (torchrun), else the exact max."""
    exact, tree = a.median("peak_rss_bytes"), a.median("peak_tree_rss_bytes")
    if a.ranks > 1 and tree:
        return max(tree, exact or 0)
    return exact


def not_ok(a: Agg) -> str:
    return f"{a.status}: {a.reason or ''}".strip()


# ------------------------------------------------------------------------------------- model


class Results:
    def __init__(self, res: dict):
        self.res = res
        self.aggs = aggregate(res["runs"])
        self.sizes = [s for s in res["options"]["sizes"] if s in res["sizes"]]
        self.cases = [c for c in CASES if any(k[1] == c.name for k in self.aggs)]
        self.volumes = {}  # (case, contender) -> kinds, from the records (older ones: from cases.py)
        for r in res["runs"]:
            if "volume" in r:
                self.volumes[(r["case"], r["contender"])] = tuple(r["volume"])

    def get(self, size: str, case: str, contender: str, ranks: int = 1) -> Agg | None:
        return self.aggs.get((size, case, contender, ranks))

    def contenders(self, size: str, case: str, ranks: int = 1) -> list[Agg]:
        return [a for k, a in self.aggs.items() if k[0] == size and k[1] == case and k[3] == ranks]

    def ckpt(self, size: str, case: str, ranks: int = 1) -> Agg | None:
        """ckpt's aggregate at N ranks: the plain process for N = 1, torchrun for N > 1."""
        return next((a for a in self.contenders(size, case, ranks)
                     if a.role == "ckpt" and (ranks > 1 or not is_torchrun_label(a.contender))), None)

    def ckpt_torchrun1(self, size: str, case: str) -> Agg | None:
        """ckpt under torchrun with one rank (the rank sweep's baseline), if it ran."""
        return next((a for a in self.contenders(size, case, 1) if a.role == "ckpt" and is_torchrun_label(a.contender)),
                    None)

    def largest(self) -> str | None:
        return max(self.sizes, key=lambda s: SIZES[s].params) if self.sizes else None

    def volume(self, case: str, contender: str) -> tuple[str, ...]:
        if (case, contender) in self.volumes:
            return self.volumes[(case, contender)]
        from cases import case_by_name, ckpt_contender  # older results files carry no volume

        c = case_by_name(case)
        for cand in (ckpt_contender(c, 1), *c.floors, *c.peers):
            if cand.label == contender:
                return cand.volume_kinds
        return ()

    def fixed_s(self, size: str, a: Agg) -> float:
        """The contender's fixed cost: its kind of process's start-up, measured in the same run."""
        proxy = STARTUP_PROXY.get(a.argv0 or "shell")
        if proxy is None:
            return 0.0
        for k, agg in self.aggs.items():
            if k[0] == size and k[2] == proxy and k[3] == 1 and agg.status == "ok":
                return agg.median("wall_s") or 0.0
        return 0.0


# ------------------------------------------------------------------------------------- sections


def render(res: dict, label: str, plots: dict[str, str] | None = None) -> str:
    R = Results(res)
    out = [render_run(R, label), "", render_inputs(R)]
    for size in sorted(R.sizes, key=lambda s: -SIZES[s].params):
        out += ["", f"#### Summary at {size} ({label})", "", render_summary(R, size)]
    big = R.largest()
    if big:
        out += ["", f"#### Targets of issue 14 at {big} ({label})", "", render_targets(R, big)]
        if any(R.ckpt(big, case) for case, _, _ in TARGETS_22[:5]):
            out += ["", f"#### Targets of issue 22 at {big} ({label})", "", render_targets(R, big, TARGETS_22, plus_torch=True)]
        out += ["", f"#### Ranks ({label})", "", render_ranks(R)]
        out += ["", f"#### Projection to Qwen3-32B ({label})", "", render_projection(R)]
        out += ["", f"#### Every contender at {big} ({label})", "", render_detail(R, big)]
    if plots:
        out += ["", f"#### Plots ({label})", ""]
        out += [f"![{title}]({path})" for title, path in plots.items()]
    return "\n".join(out)


def render_run(R: Results, label: str) -> str:
    res, m = R.res, R.res["machine"]
    o = res["options"]
    when = "before each command" if o.get("warm", "case") == "case" else "once, before the first run that reads it"
    cache = (f"warm: each input was read {when}, so contenders read it from the page cache (the disk read "
             "column shows any miss)" if o["cache"] == "warm" else
             "cold: `echo 3 > /proc/sys/vm/drop_caches` before every run")
    runs = [res] + res.get("more_invocations", [])
    by = "; then ".join(f"`python bench/harness.py {' '.join(r['argv'][1:])}` ({r['started']}, commit "
                        f"{r['machine'].get('commit') or '?'}{', with local changes' if r['machine'].get('dirty') else ''})"
                        for r in runs)
    return "\n".join([
        f"Measured by {by}; the last run ended {res.get('finished', '(stopped early)')}.",
        "",
        f"- Machine ({label}): {m['cpu']}, {m['cores']} cores, {m['mem_bytes'] / GIB:.0f} GiB RAM, kernel "
        f"{m['kernel']}; Python {m.get('python')}, torch {m.get('torch')}, transformers {m.get('transformers')}, "
        f"peft {m.get('peft')}, safetensors {m.get('safetensors')}; OMP_NUM_THREADS "
        f"{m.get('omp_num_threads') or 'unset'}; no GPU used. Load average {m['loadavg_start'][0]:.1f} at the "
        f"start, {m.get('loadavg_end', [float('nan')])[0]:.1f} at the end.",
        f"- Inputs and outputs on {m['workdir_fs']} (DCP inputs on {m['dcp_dir_fs']}); page cache {cache}. "
        "Every writing contender ends with its output on disk (fsync or `sync`).",
        f"- Each contender ran {o['repeat']} time(s), interleaved with the others of its command"
        + (f" in a new shuffled order each repetition (seed {o['order_seed']})" if "order_seed" in o else "")
        + "; figures are medians, with (min-max) where they differ. A target is met only when it holds for "
        "the least favourable pairing of runs (ckpt's slowest against the floor's fastest), with at least "
        "5 runs. Wall time is the whole process, interpreter start included.",
        f"- The measured tree: commit {m.get('commit')}{' with uncommitted changes' if m.get('dirty') else ''}"
        + (f", files sha256 {m['tree_sha256'][:16]}" if m.get("tree_sha256") else "") + ".",
        f"- Peak RSS is the kernel's peak for the process tree (largest process; with N ranks, the sum of "
        f"the ranks sampled every 0.1 s). The launcher floor is {fmt_rss(res.get('launcher_floor_rss_bytes'))}: "
        "a process smaller than that reads as that.",
        "- read()/write() are /proc/<pid>/io rchar/wchar of the tree (syscall bytes: page-cache hits "
        "count, mmap reads do not); disk are read_bytes/write_bytes (what reached the block layer).",
        f"- mergekit: {'`' + res['mergekit'] + '`' if res.get('mergekit') else 'not installed'}; "
        f"ckpt commands present: {', '.join(res.get('ckpt_commands') or [])}.",
    ])


def render_inputs(R: Results) -> str:
    lines = ["| size | params | input | files | bytes | formula | made by | in |", "|---|---:|---|---:|---:|---:|---|---:|"]
    for size in R.sizes:
        rec = R.res["sizes"][size]
        for kind, info in (rec.get("inputs") or {}).items():
            err = info["bytes"] / info["predicted_bytes"] - 1 if info.get("predicted_bytes") else None
            built = f"{info['build_s']:.0f} s" if isinstance(info.get("build_s"), (int, float)) else "-"
            lines.append(f"| {size} | {rec['params'] / 1e9:.2f}B | {kind} | {info['files']} | {fmt_bytes(info['bytes'])} "
                         f"| {fmt_bytes(info['predicted_bytes'])}{f' ({err:+.1%})' if err is not None else ''} | "
                         f"{info['how']} | {built} |")
    return "\n".join(lines)


def _vs(R: Results, size: str, case: str, ck: Agg, role: str) -> str:
    parts = []
    for a in R.contenders(size, case):
        if a.role != role:
            continue
        if a.status != "ok":
            parts.append(f"{a.contender}: {a.status}")
            continue
        r = ratio(ck.median("wall_s"), a.median("wall_s"))
        parts.append(f"{fmt_x(r)} {a.contender} ({_sec(a.median('wall_s'))} s, {fmt_rss(rss_of(a))})")
    return "; ".join(parts) or "-"


def render_summary(R: Results, size: str) -> str:
    lines = ["| command | ckpt wall s | peak RSS | read() / write() | GB/s moved | ckpt vs floors | ckpt vs peers |",
             "|---|---:|---:|---:|---:|---|---|"]
    for case in R.cases:
        ck = R.ckpt(size, case.name)
        if ck is None:
            continue
        if ck.status != "ok":
            lines.append(f"| {case.name} | {not_ok(ck)} | | | | | |")
            continue
        vol = volume_bytes(SIZES[size], R.volume(case.name, ck.contender))
        fixed = R.fixed_s(size, ck)
        work = (ck.median("wall_s") or 0) - fixed
        rate = f"{vol / 1e9 / work:.2f}" if vol and work > 0 else "-"
        lines.append(f"| {case.name} | {fmt_s(ck.m.get('wall_s'))} | {fmt_rss(rss_of(ck))} | "
                     f"{fmt_bytes(ck.median('rchar'))} / {fmt_bytes(ck.median('wchar'))} | {rate} | "
                     f"{_vs(R, size, case.name, ck, 'floor')} | {_vs(R, size, case.name, ck, 'peer')} |")
    lines += ["", "Ratios are ckpt's median wall time over the other's (below 1x: ckpt is faster). GB/s "
              "moved: bytes the command reads and writes (by the input formulas) over its wall time less "
              "`ckpt --version`'s."]
    return "\n".join(lines)


def _plus_torch_import(R: Results, size: str, fl: Agg | None) -> Agg | None:
    """`fl` with the size's `python -c 'import torch'` added to its wall times (lows to lows, highs to highs)."""
    imp = next((a for k, a in R.aggs.items() if k[0] == size and k[2] == TORCH_IMPORT and k[3] == 1
                and a.status == "ok"), None)
    if fl is None or imp is None or fl.status != "ok":
        return None
    w, t = fl.m["wall_s"], imp.m["wall_s"]
    return dataclasses.replace(fl, m=dict(fl.m, wall_s=Summary(w.median + t.median, w.low + t.low, w.high + t.high,
                                                              min(w.n, t.n))))


def render_targets(R: Results, size: str, targets=TARGETS, plus_torch: bool = False) -> str:
    lines = ["| target | measured | verdict |", "|---|---|---|"]
    for case, floor, limit in targets:
        ck, fl = R.ckpt(size, case), R.get(size, case, floor)
        if plus_torch:
            fl, floor = _plus_torch_import(R, size, fl), f"{floor}` + `import torch"
        ok = ck and fl and ck.status == fl.status == "ok"
        spread = spread_ratio(ck.m.get("wall_s"), fl.m.get("wall_s")) if ok else None
        r = spread[1] if spread else None
        shown = (f"{fmt_x(r)} ({fmt_x(spread[0])}-{fmt_x(spread[2])}; {_sec(ck.median('wall_s'))} s vs "
                 f"{_sec(fl.median('wall_s'))} s)") if r else "-"
        runs = min(ck.m["wall_s"].n, fl.m["wall_s"].n) if r else None
        lines.append(f"| `{case}` within {limit}x of `{floor}` | {shown} | "
                     f"{target_met(r, limit, worst=spread[2] if spread else None, runs=runs)} |")
    worst = [(rss_of(a), a.case, (a.m.get("peak_rss_bytes") or Summary(0, 0, 0, 0)).high)
             for a in (R.ckpt(size, c.name) for c in R.cases) if a and a.status == "ok"]
    if worst:
        rss, case, high = max(worst, key=lambda t: t[0] or 0)
        top = max(w[2] for w in worst)
        lines.append(f"| default peak RSS under 1 GiB for every command | largest: {fmt_rss(rss)} ({case}) | "
                     f"{target_met(rss / GIB if rss else None, 1.0, worst=max(top, rss or 0) / GIB)} |")
    v, c = R.ckpt(size, "verify --deep HF dir"), R.get(size, "verify --deep HF dir", "cat base")
    if v and c and v.status == c.status == "ok":
        vol = SIZES[size].base_bytes
        lines.append(f"| `verify --deep` at memory bandwidth | {fmt_x(ratio(v.median('wall_s'), c.median('wall_s')))} "
                     f"of `cat`; {vol / 1e9 / max(1e-9, v.median('wall_s') - R.fixed_s(size, v)):.2f} GB/s | "
                     "see the ratio |")
    lines.append(f"\nMeasured at {size}; the issue states the merge target at 8B (on the 16-core host).")
    return "\n".join(lines)


def render_ranks(R: Results) -> str:
    ranks = sorted({k[3] for k in R.aggs})
    if ranks == [1]:
        return "Only N = 1 ran (`--ranks 1`)."
    multi = [n for n in ranks if n > 1]
    lines = ["| size | command | N=1 (plain) | N=1 (torchrun) | " + " | ".join(f"N={n}" for n in multi)
             + " | no N slower than N = 1 |", "|---|---|---:|---:|" + "---:|" * len(multi) + "---|"]
    for size in R.sizes:
        for case in R.cases:
            if not case.multi_rank:
                continue
            plain, base = R.ckpt(size, case.name, 1), R.ckpt_torchrun1(size, case.name)
            cells = [_rank_cell(plain, None), _rank_cell(base, None)]
            slower = []
            for n in multi:
                a = R.ckpt(size, case.name, n)
                cells.append(_rank_cell(a, base))
                if a is not None and a.status == "ok" and base is not None and base.status == "ok" \
                        and a.median("wall_s") > base.m["wall_s"].high:
                    slower.append(n)
            if all(c == "-" for c in cells[1:]):
                continue
            verdict = ("n/a: no torchrun N = 1" if base is None or base.status != "ok"
                       else f"**not met**: N = {', '.join(map(str, slower))} slower" if slower else "met")
            lines.append(f"| {size} | {case.name} | " + " | ".join(cells) + f" | {verdict} |")
    reasons = sorted({(k[1], a.reason) for k, a in R.aggs.items() if k[3] > 1 and a.status == "n/a"})
    if reasons:
        lines += ["", "n/a: " + "; ".join(f"{case}: {why}" for case, why in reasons[:3])
                  + (f"; and {len(reasons) - 3} more alike" if len(reasons) > 3 else "")]
    lines += ["", "Medians (min-max) and peak RSS (the ranks' sum). N = 1 (plain) is `python -m ckpt_tools ...`; "
              "N = 1 (torchrun) and N > 1 are `torchrun --standalone --nproc-per-node N -m ckpt_tools ...`, run once "
              "a probe on tiny inputs gives one --json report from 2 ranks, every N in a new shuffled order each "
              "repetition. The launcher's own start-up (torchrun imports torch before it starts a rank) is the "
              "difference between the two N = 1 columns; the ranks are judged against torchrun's N = 1: an N is "
              "slower when its median is above the slowest N = 1 run. The speed-up in brackets is over torchrun's "
              "N = 1."]
    return "\n".join(lines)


def _rank_cell(a: Agg | None, base: Agg | None) -> str:
    if a is None:
        return "-"
    if a.status != "ok":
        return a.status
    w = a.m["wall_s"]
    rng = f" ({_sec(w.low)}-{_sec(w.high)})" if w.n > 1 and w.low != w.high else ""
    sp = ratio(base.median("wall_s"), a.median("wall_s")) if base is not None and base.status == "ok" else None
    return f"{_sec(a.median('wall_s'))} s{rng}, {fmt_rss(rss_of(a))}" + (f" ({sp:.2f}x)" if sp else "")


def render_projection(R: Results) -> str:
    lines = ["| command | contender | fixed s | s/GB moved, by size | bytes at 32B | projected wall at 32B | "
             "peak RSS at 32B |", "|---|---|---:|---|---:|---:|---:|"]
    for case in R.cases:
        labels = sorted({k[2] for k in R.aggs if k[1] == case.name and k[3] == 1},
                        key=lambda lbl: (not lbl.startswith("ckpt"), lbl))
        for label in labels:
            aggs = [a for k, a in R.aggs.items() if k[1] == case.name and k[2] == label and k[3] == 1]
            vol = R.volume(case.name, label)
            if not vol:
                continue
            p = projection(aggs, vol, {a.size: R.fixed_s(a.size, a) for a in aggs if a.status == "ok"})
            if p is None:
                continue
            per = ", ".join(f"{s}: {v:.2f}" for s, v in p.per_gb_s.items())
            rss = fmt_rss(p.rss_bytes) if p.rss_bytes is not None else f"{fmt_rss(p.rss_from)} at {p.from_size} " \
                                                                       "(one size: no trend)"
            lines.append(f"| {case.name} | {label} | {p.fixed_s:.1f} | {per} | {fmt_bytes(p.volume_to)} | "
                         f"**{_sec(p.seconds)} s** | {rss} |")
    lines += ["", "A projection, not a measurement: wall = fixed + (s/GB at the largest size measured) x GB "
              "moved at Qwen3-32B (64 layers, hidden 5120, untied; r=32 on 7 projections), with the "
              "bytes from the input formulas (checked against the measured inputs above). Fixed is the "
              "start-up of that kind of process measured in the same run (`ckpt --version`, "
              "`python -c 'import torch'`, 0 for shell tools). It assumes the 32B inputs are read as fast "
              "as here (page cache, same disk), which needs ~2x their size in RAM; peak RSS is extrapolated "
              "linearly in bytes from the two largest sizes."]
    return "\n".join(lines)


def render_detail(R: Results, size: str) -> str:
    lines = ["| command | contender | role | wall s | CPU s | peak RSS | read() | write() | disk read | disk write "
             "| output | wall vs ckpt |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for case in R.cases:
        ck = R.ckpt(size, case.name)
        for a in sorted(R.contenders(size, case.name), key=lambda a: (a.role != "ckpt", a.role, a.contender)):
            if a.status != "ok":
                lines.append(f"| {case.name} | {a.contender} | {a.role} | {not_ok(a)} | | | | | | | | |")
                continue
            vs = fmt_x(ratio(a.median("wall_s"), ck.median("wall_s"))) if ck and ck.status == "ok" and a is not ck else ""
            who = f"{a.contender} (measured once, with {a.shared_from})" if a.shared_from else a.contender
            lines.append(f"| {case.name} | {who} | {a.role} | {fmt_s(a.m.get('wall_s'))} | "
                         f"{fmt_s(a.m.get('cpu_s'))} | {fmt_rss(rss_of(a))} | {fmt_bytes(a.median('rchar'))} | "
                         f"{fmt_bytes(a.median('wchar'))} | {fmt_bytes(a.median('read_bytes'))} | "
                         f"{fmt_bytes(a.median('write_bytes'))} | {fmt_bytes(a.median('out_bytes'))} | {vs} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- plots


def plot(res: dict, out_dir: Path, label: str) -> dict[str, Path]:
    """PNG plots; matplotlib is imported here only, so rendering markdown (and its test) needs none."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    R = Results(res)
    out_dir.mkdir(parents=True, exist_ok=True)
    made = {}
    for metric, ylabel, fname in (("wall_s", "wall s", "time-vs-size"), ("rss", "peak RSS (GiB)", "rss-vs-size")):
        cases = [c for c in R.cases if any(R.ckpt(s, c.name) and R.ckpt(s, c.name).status == "ok" for s in R.sizes)]
        if not cases or len(R.sizes) < 1:
            continue
        cols = 4
        rows = -(-len(cases) // cols)
        fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.3 * rows), squeeze=False)
        for ax, case in zip(axes.flat, cases):
            labels = sorted({k[2] for k in R.aggs if k[1] == case.name and k[3] == 1},
                            key=lambda lbl: (not lbl.startswith("ckpt"), lbl))
            for lbl in labels:
                pts = sorted(((SIZES[s].params / 1e9, R.get(s, case.name, lbl)) for s in R.sizes
                              if R.get(s, case.name, lbl) and R.get(s, case.name, lbl).status == "ok"),
                             key=lambda t: t[0])
                if not pts:
                    continue
                xs = [x for x, _ in pts]
                if metric == "wall_s":
                    ys = [a.median("wall_s") for _, a in pts]
                    lo = [y - a.m["wall_s"].low for y, (_, a) in zip(ys, pts)]
                    hi = [a.m["wall_s"].high - y for y, (_, a) in zip(ys, pts)]
                    ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", ms=3, capsize=2, label=lbl[:38],
                                lw=2 if lbl.startswith("ckpt") else 1)
                else:
                    ax.plot(xs, [(rss_of(a) or 0) / GIB for _, a in pts], marker="o", ms=3, label=lbl[:38],
                            lw=2 if lbl.startswith("ckpt") else 1)
            ax.set_title(case.name, fontsize=9)
            ax.set_xscale("log")
            if metric == "wall_s":
                ax.set_yscale("log")
            ax.set_xlabel("model params (B)", fontsize=7)
            ax.set_ylabel(ylabel, fontsize=7)
            ax.tick_params(labelsize=7)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=5.5, loc="upper left")
        for ax in list(axes.flat)[len(cases):]:
            ax.axis("off")
        fig.suptitle(f"ckpt-tools benchmarks ({label}): {ylabel} vs model size", fontsize=11)
        fig.tight_layout()
        path = out_dir / f"{_slug(label)}-{fname}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        made[f"{ylabel} vs model size ({label})"] = path
    multi = sorted({(k[0], k[1]) for k, a in R.aggs.items() if k[3] > 1 and a.status == "ok"})
    if multi:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for size, case in multi:
            def at(n):
                return R.ckpt_torchrun1(size, case) if n == 1 else R.ckpt(size, case, n)
            pts = [(n, at(n)) for n in sorted({k[3] for k in R.aggs}) if at(n) is not None and at(n).status == "ok"]
            line, = ax.plot([n for n, _ in pts], [a.median("wall_s") for _, a in pts], marker="o",
                            label=f"{case} ({size})")
            for n, a in pts:   # the spread of each N's runs
                ax.vlines(n, a.m["wall_s"].low, a.m["wall_s"].high, color=line.get_color(), alpha=0.5)
            plain = R.ckpt(size, case, 1)
            if plain is not None and plain.status == "ok":
                ax.axhline(plain.median("wall_s"), color=line.get_color(), linestyle=":", linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("ranks N (torchrun --nproc-per-node; dotted: the plain process)")
        ax.set_ylabel("wall s")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        ax.set_title(f"ckpt-tools ({label}): wall time vs ranks")
        fig.tight_layout()
        path = out_dir / f"{_slug(label)}-time-vs-ranks.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        made[f"wall time vs ranks ({label})"] = path
    return made


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() else "-" for ch in text.lower()).strip("-")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--label", default="this machine", help="names the machine in headings and plot files")
    ap.add_argument("--plots", type=Path, help="write PNG plots into this folder (needs matplotlib)")
    ap.add_argument("--record", type=Path, help="write the section into this markdown file")
    ap.add_argument("--heading", help="heading of a new section (default: Benchmarks on LABEL)")
    a = ap.parse_args(argv)
    res = json.loads(a.results.read_text())
    links = {}
    if a.plots:
        base = a.record.parent if a.record else Path.cwd()
        for title, path in plot(res, a.plots, a.label).items():
            links[title] = _relative(path, base)
    body = render(res, a.label, links)
    if a.record:
        record_section(a.record, body, f"<!-- bench:{a.label}:begin -->", f"<!-- bench:{a.label}:end -->",
                       a.heading or f"Benchmarks on {a.label}")
        print(f"recorded in {a.record}")
    else:
        print(body)
    return 0


def _relative(path: Path, base: Path) -> str:
    try:
        return str(path.resolve().relative_to(base.resolve()))
    except ValueError:
        return str(path.resolve())


if __name__ == "__main__":
    sys.exit(main())
