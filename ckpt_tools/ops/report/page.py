"""The report as pictures: matplotlib figures (imported here only: `ckpt report` and `diff-vs-base --report`
are the only commands that need it) drawn from a report's JSON, and one self-contained HTML page with
each plot inline as SVG (text as paths: no fonts, scripts or URLs are fetched; readable offline).

Pure rendering: the numbers come in as the `--json` result (so a page shows exactly what --json says),
and the bytes go out as strings; `io` writes them."""

from __future__ import annotations

import functools
import html
import io
import math
import re
from typing import TYPE_CHECKING, Any

from ...core.keys import layer_of
from ...core.units import human_bytes
from .numbers import module_group

if TYPE_CHECKING:
    from matplotlib.typing import RcKeyType

__all__ = [
    "PROJ_COLUMNS",
    "diff_figures",
    "diff_page",
    "figure_png",
    "figure_svg",
    "page_html",
    "report_figures",
    "report_page",
]

PROJ_COLUMNS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
_RC: dict[RcKeyType, Any] = {
    "svg.fonttype": "path",
    "svg.hashsalt": "ckpt-report",
    "font.size": 9,
    "axes.titlesize": 10,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "figure.dpi": 100,
    "text.parse_math": False,  # a name from a file is text: `$\\nosuchcmd$` is not mathtext
}
_CSS = (
    "\n"
    "body{font-family:system-ui,-apple-system,'Segoe UI',Roboto,Helvetica,Arial,sans-serif;margin:0;"
    "color:#1d2330;background:#f5f6f8}\n"
    "header{background:#1d2330;color:#fff;padding:18px 32px}header h1{margin:0 0 4px;font-size:20px;"
    "font-weight:600}\n"
    "header .sub{color:#b8c0d0;font-size:13px;word-break:break-all}\n"
    "main{max-width:1180px;margin:0 auto;padding:18px 24px 40px}\n"
    ".facts{display:flex;flex-wrap:wrap;gap:10px;margin:0 0 16px}\n"
    ".fact{background:#fff;border-radius:8px;padding:10px 14px;box-shadow:0 1px 2px rgba(0,0,0,.08);"
    "min-width:120px}\n"
    ".fact b{display:block;font-size:17px}.fact span{color:#5b6475;font-size:12px}\n"
    "section{background:#fff;border-radius:10px;box-shadow:0 1px 3px rgba(0,0,0,.08);"
    "margin:0 0 18px;padding:14px 18px}\n"
    "section h2{font-size:15px;margin:0 0 2px}section p.note{color:#5b6475;font-size:12px;"
    "margin:0 0 8px}\n"
    "section svg{max-width:100%;height:auto;display:block}\n"
    "table{border-collapse:collapse;font-size:12px;width:100%}th,td{padding:4px 8px;"
    "text-align:right;border-bottom:1px solid #eceef2}\n"
    "th:first-child,td:first-child{text-align:left;"
    "font-family:ui-monospace,Menlo,Consolas,monospace}\n"
    ".warn{background:#fff7e6;border-left:4px solid #f0a020;padding:8px 12px;margin:0 0 8px;"
    "font-size:12px;border-radius:4px}\n"
)


def _figure(w: float, h: float):
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    return Figure(figsize=(w, h), layout="constrained")


def figure_svg(fig) -> str:
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context(_RC):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    text = text[text.index("<svg") :]  # drop the XML prolog and DOCTYPE: inline in HTML
    return re.sub(r"<metadata>.*?</metadata>\s*", "", text, count=1, flags=re.S)  # (RDF: Dublin Core URIs)


def figure_png(fig, dpi: int = 130) -> bytes:
    import matplotlib

    buf = io.BytesIO()
    with matplotlib.rc_context(_RC):
        fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    return buf.getvalue()


def _fmt(x) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    if not isinstance(x, (int, float)):
        return str(x)
    return f"{x:.3g}"


# ------------------------------------------------------------------------------------------ figures
def _layers(modules: dict) -> list[int]:
    """The layers of these modules (each has one), in order."""
    return sorted({k for n in modules if (k := layer_of(n)) is not None})


def _grid(modules: dict, columns: list[str], rows: list[int], key) -> list[list[float | None]]:
    cells = {(layer_of(n), key(n)): m["rel_delta"] for n, m in modules.items()}
    return [[cells.get((r, c)) for c in columns] for r in rows]


def _heatmap(title: str, grid, rows, columns, xlabel: str, ylabel: str, ax=None, fig=None):
    import numpy as np
    from matplotlib.colors import LogNorm

    vals = np.array([[v if v is not None and v > 0 else np.nan for v in row] for row in grid], dtype=float)
    if ax is None:
        fig = _figure(min(11.5, 3.2 + 0.95 * len(columns)), min(9.0, 1.8 + 0.42 * len(rows)))
        ax = fig.add_subplot()
    ax.set_facecolor("#eceef2")
    finite = vals[np.isfinite(vals)]
    # a log scale where the values span a decade or more (a run's first steps next to its last), else linear
    norm = (
        LogNorm(vmin=float(finite.min()), vmax=float(finite.max()))
        if finite.size and finite.max() >= 10 * finite.min()
        else None
    )
    im = ax.imshow(vals, aspect="auto", cmap="viridis", norm=norm, interpolation="nearest")
    ax.set_xticks(
        range(len(columns)),
        [c.rsplit(".", 1)[-1] if "." in c else c for c in columns],
        rotation=30 if len(columns) > 8 else 0,
        ha="right" if len(columns) > 8 else "center",
    )
    ax.set_yticks(range(len(rows)), [str(r) for r in rows])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    for s in ax.spines.values():
        s.set_visible(False)
    if len(rows) * len(columns) <= 160:
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 0.0)
        mid = math.sqrt(lo * hi) if norm is not None else (lo + hi) / 2
        for i, row in enumerate(grid):
            for j, v in enumerate(row):
                if v is not None:
                    ax.text(
                        j,
                        i,
                        f"{v:.2g}",
                        ha="center",
                        va="center",
                        fontsize=7,
                        color="white" if v < mid else "black",
                    )
    fig.colorbar(im, ax=ax, label="||ΔW||_F / ||W||_F", shrink=0.9)
    return fig


def _heatmaps(step: str, s: dict) -> list[tuple[str, str, object]]:
    mods = {n: m for n, m in s["modules"].items() if layer_of(n) is not None and m["rel_delta"] is not None}
    dense = {n: m for n, m in mods.items() if ".experts." not in n}
    experts = {n: m for n, m in mods.items() if ".experts." in n}
    out = []
    if dense:
        groups = sorted({module_group(n) for n in dense})
        columns = [c for c in PROJ_COLUMNS if c in groups] + [g for g in groups if g not in PROJ_COLUMNS]
        rows = _layers(dense)
        out.append(
            (
                f"heatmap_step_{step}",
                f"Relative change per layer and module, step {step}",
                _heatmap(
                    f"step {step}: relative change ||ΔW|| / ||W||",
                    _grid(dense, columns, rows, module_group),
                    rows,
                    columns,
                    "module",
                    "layer",
                ),
            )
        )
    projs = [p for p in ("gate_proj", "up_proj", "down_proj") if any(n.endswith("." + p) for n in experts)]
    if projs:
        rows = _layers(experts)
        ids = sorted({int(n.split(".experts.", 1)[1].split(".")[0]) for n in experts})
        fig = _figure(11.5, min(9.0, 2.0 + 0.42 * len(rows)))
        for ax, proj in zip(fig.subplots(1, len(projs)), projs):
            these = {n: m for n, m in experts.items() if n.endswith("." + proj)}
            grid = _grid(
                these, [str(e) for e in ids], rows, lambda n: n.split(".experts.", 1)[1].split(".")[0]
            )
            _heatmap(f"experts' {proj}", grid, rows, [str(e) for e in ids], "expert", "layer", ax=ax, fig=fig)
        out.append(
            (f"experts_step_{step}", f"Experts: relative change per layer and expert, step {step}", fig)
        )
    return out


def _steps_figure(steps: dict):
    from matplotlib.ticker import MaxNLocator

    keys = [k for k in steps if k.lstrip("-").isdigit()]
    xs = [int(k) for k in keys]
    groups = sorted({g for k in keys for g in steps[k]["groups"]})
    fig = _figure(11.5, 3.6)
    axes = fig.subplots(1, 3)
    for ax, (field, title) in zip(
        axes,
        (
            ("rel_delta", "change ||ΔW|| / ||W|| by module group"),
            ("exp_avg_fro", "Adam exp_avg ||m||_F"),
            ("exp_avg_sq_fro", "Adam exp_avg_sq ||v||_F"),
        ),
    ):
        for g in groups:
            ys = [steps[k]["groups"].get(g, {}).get(field) for k in keys]
            if any(y for y in ys):
                ax.plot(xs, [y if y else float("nan") for y in ys], marker="o", ms=3, lw=1.4, label=g)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if ax.has_data():
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    handles, labels = (
        axes[0].get_legend_handles_labels() if axes[0].has_data() else axes[1].get_legend_handles_labels()
    )
    if handles:
        fig.legend(handles, labels, loc="outside right center", fontsize=7, frameon=False)
    return fig


def _lr_figure(lr: dict, saved_steps: list[int]):
    from matplotlib.ticker import MaxNLocator

    fig = _figure(11.5, 3.4)
    ax = fig.add_subplot()
    past = sorted((int(k), v) for k, v in lr["past"].items())
    planned = sorted((int(k), v) for k, v in lr["planned"].items())
    if past:
        ax.plot(
            *zip(*past),
            color="#2b6cb0",
            lw=1.8,
            marker="o" if len(past) < 60 else None,
            ms=3,
            label="past: each step's lr",
        )
    if planned:
        head = [past[-1]] if past else []
        ax.plot(
            *zip(*(head + planned)),
            color="#718096",
            lw=1.5,
            ls="--",
            label=f"planned, to step {lr['max_steps']}",
        )
    if lr.get("set_lr"):
        sl = lr["set_lr"]
        over = sorted((int(k), v) for k, v in sl["planned"].items())
        if over:
            ax.plot(*zip(*over), color="#dd6b20", lw=1.8, label=f"after ckpt set-lr (x{sl['factor']:.3g})")
    ax.axvline(lr["step"], color="#c53030", lw=1, ls=":", label=f"checkpoint: step {lr['step']}")
    saved = [s for s in saved_steps if s != lr["step"] and str(s) in lr["past"]]
    if saved:  # one legend entry for them all
        ax.plot(
            saved,
            [lr["past"][str(s)] for s in saved],
            marker="s",
            color="#c53030",
            ms=4,
            ls="none",
            label="another saved checkpoint (its step's lr)",
        )
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("learning rate")
    ax.set_title(
        f"learning rate ({lr['scheduler']}), planned to step {lr['max_steps']}: {lr['max_steps_from']}"
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, frameon=False, loc="best")
    return fig


def _bytes_figure(b: dict):
    groups = sorted(
        ((g, st) for g, st in b["groups"].items() if st["bytes"] > 0), key=lambda kv: -kv[1]["bytes"]
    )
    fig = _figure(11.5, 0.9 + 0.32 * len(groups))
    ax = fig.add_subplot()
    names = [g for g, _ in groups]
    vals = [st["bytes"] for _, st in groups]
    colors = ["#a0aec0" if g == "base" and b["frozen_bytes"] else "#3182ce" for g in names]
    ax.barh(names, vals, color=colors)
    ax.invert_yaxis()
    for i, v in enumerate(vals):
        ax.text(v, i, " " + human_bytes(v), va="center", fontsize=8)
    total = b["frozen_bytes"] + b["unique_bytes"]
    ax.set_title(
        f"bytes by group: frozen {human_bytes(b['frozen_bytes'])} "
        f"({100 * b['frozen_bytes'] / total if total else 0:.1f}%), unique {human_bytes(b['unique_bytes'])}"
    )
    ax.set_xscale("log")
    ax.set_xlabel("bytes (log)")
    return fig


def _plain_text(build):
    """Build the figures under `_RC`: every label, title and tick is plain text (matplotlib parses `$...$`
    in any text as mathtext; a tensor named `$\\nosuchcmd$` made the page an internal error)."""

    @functools.wraps(build)
    def built(*args, **kwargs):
        import matplotlib

        with matplotlib.rc_context(_RC):
            return build(*args, **kwargs)

    return built


@_plain_text
def report_figures(r: dict) -> list[tuple[str, str, object]]:
    """(file stem, caption, Figure) of every plot of a `ckpt report` result."""
    steps = r["steps"]
    out = []
    if steps:
        last = list(steps)[-1]
        out += _heatmaps(last, steps[last])
    if sum(1 for k in steps if k.isdigit()) > 1:
        out.append(
            ("steps", "Across steps: each module group's change and its Adam moments", _steps_figure(steps))
        )
    if r.get("lr"):
        out.append(
            (
                "lr",
                "Learning rate: each past step's, and the plan for the steps to come",
                _lr_figure(r["lr"], [int(k) for k in steps if k.isdigit()]),
            )
        )
    if steps and steps[list(steps)[-1]].get("bytes"):
        out.append(
            (
                "bytes",
                "What the checkpoint holds (as ckpt inspect counts it)",
                _bytes_figure(steps[list(steps)[-1]]["bytes"]),
            )
        )
    return out


@_plain_text
def diff_figures(d: dict, top: int = 40) -> list[tuple[str, str, object]]:
    """The plots of a `diff-vs-base` result: changed fraction and max |Δ| per changed tensor."""
    changed = [t for t in d["tensors"] if t.get("changed_fraction")]
    changed.sort(key=lambda t: (-(t.get("max_abs_delta") or 0), t["name"]))
    changed = changed[:top]
    if not changed:
        return []
    fig = _figure(11.5, 1.2 + 0.22 * len(changed))
    a1, a2 = fig.subplots(1, 2, sharey=True)
    names = [t["name"] for t in changed]
    a1.barh(names, [100 * t["changed_fraction"] for t in changed], color="#3182ce")
    a1.set_title("changed elements (%)")
    a1.invert_yaxis()
    a1.tick_params(axis="y", labelsize=7)
    a2.barh(names, [t.get("max_abs_delta") or 0 for t in changed], color="#dd6b20")
    a2.set_title("max |ΔW|")
    a2.set_xscale("log")
    return [("diff", f"Changed tensors vs the base (the {len(changed)} with the largest max |Δ|)", fig)]


# ------------------------------------------------------------------------------------------ page
def _table(rows: list[list], head: list[str]) -> str:
    h = "".join(f"<th>{html.escape(x)}</th>" for x in head)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{h}</tr></thead><tbody>{body}</tbody></table>"


def page_html(
    title: str,
    subtitle: str,
    facts: list[tuple[str, str]],
    figures: list[tuple[str, str, object]],
    tables: list[tuple[str, str, list[list], list[str]]],
    warnings: list[str],
) -> str:
    """One HTML document, everything inline, no <script>."""
    parts = [
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f'<meta name="viewport" content="width=device-width, '
        f'initial-scale=1"><style>{_CSS}</style></head><body>',
        f'<header><h1>{html.escape(title)}</h1><div class="sub">{html.escape(subtitle)}</div></header><main>',
    ]
    parts.append(
        '<div class="facts">'
        + "".join(
            f'<div class="fact"><b>{html.escape(v)}</b><span>{html.escape(k)}</span></div>' for k, v in facts
        )
        + "</div>"
    )
    for w in warnings:
        parts.append(f'<div class="warn">{html.escape(w)}</div>')
    for _stem, caption, fig in figures:
        parts.append(f"<section><h2>{html.escape(caption)}</h2>{figure_svg(fig)}</section>")
    for caption, note, rows, head in tables:
        parts.append(
            f'<section><h2>{html.escape(caption)}</h2><p class="note">{html.escape(note)}</p>'
            f"{_table(rows, head)}</section>"
        )
    parts.append("</main></body></html>\n")
    return "".join(parts)


def report_page(r: dict) -> tuple[str, list]:
    """The page of a `ckpt report` result, and its figures (for --png)."""
    steps = r["steps"]
    last = steps[list(steps)[-1]] if steps else None
    facts = [
        ("kind", r["kind"]),
        ("checkpoint at step" if len(steps) == 1 else "checkpoints at steps", ", ".join(steps) or "-"),
    ]
    if last:
        facts.append(("training", last["training"]))
        if last.get("lora_scale") is not None:
            facts.append(("LoRA scale", _fmt(last["lora_scale"])))
        if last.get("lr") is not None:
            facts.append(("lr now", _fmt(last["lr"])))
        if last["largest"]:
            top = last["modules"][last["largest"][0]]
            facts.append(
                ("largest change", f"{last['largest'][0].removeprefix('model.')}  {_fmt(top['rel_delta'])}")
            )
    figs = report_figures(r)
    tables = []
    if last:
        rows = [
            [
                n,
                _fmt(last["modules"][n]["delta_fro"]),
                _fmt(last["modules"][n]["weight_fro"]),
                _fmt(last["modules"][n]["rel_delta"]),
            ]
            for n in last["largest"]
        ]
        tables.append(
            (
                f"Largest relative changes, step {list(steps)[-1]}",
                "||ΔW||_F from the LoRA's Gram matrices "
                "(B@A never formed), or ||W - W0||_F of trained masters against the base",
                rows,
                ["module", "||ΔW||_F", "||W||_F", "relative"],
            )
        )
    return page_html("ckpt report", r["path"], facts, figs, tables, r.get("warnings", [])), figs


def diff_page(d: dict, top: int = 40) -> tuple[str, list]:
    """The page of a `diff-vs-base` result: its verdict, the plots and the changed tensors' table."""
    figs = diff_figures(d, top)
    changed = [t for t in d["tensors"] if t.get("changed_fraction")]
    changed.sort(key=lambda t: (-(t.get("rel_fro") or 0), t["name"]))
    rows = [
        [
            t["name"],
            f"{100 * t['changed_fraction']:.2f}%",
            _fmt(t.get("max_abs_delta")),
            _fmt(t.get("rel_fro")),
        ]
        for t in changed
    ]
    facts = [
        ("verdict", d["verdict"]),
        ("changed tensors", str(len(changed))),
        ("tensors", str(len(d["tensors"]))),
    ]
    sub = (
        f"{d['weights'].get('label', d['weights'].get('path'))} vs "
        f"{d['base'].get('label', d['base'].get('path'))}"
    )
    return page_html(
        "ckpt diff-vs-base",
        sub,
        facts,
        figs,
        [
            (
                "Changed tensors",
                "largest relative change first",
                rows,
                ["tensor", "changed", "max |ΔW|", "||ΔW|| / ||W0||"],
            )
        ],
        [d["summary"]],
    ), figs
