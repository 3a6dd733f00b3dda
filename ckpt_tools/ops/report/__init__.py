"""`ckpt report`: what a run changed, and its learning rate, as a picture (docs/report.md).

One contract: `plan_report(path, options) -> ReportPlan` (metadata only: what PATH is, its steps, the
base, the run's config), `run_report(plan, progress) -> ReportReport` (the numbers, `run.compute_report`;
then the page and PNGs, `page`, written atomically; nothing is written for --json alone).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...core.progress import Progress
from ...io.files import atomic_write_bytes, write_new_file
from ...io.remote_display import display
from ...io.remote_url import redact
from ...io.staging import AtomicOutputDir, check_against_inputs, check_output_file
from .plan import CHECKPOINT, MERGED, RUN, ReportOptions, ReportPlan, StepInput, plan_report
from .run import ReportResult, StepNumbers, compute_report

__all__ = [
    "CHECKPOINT",
    "MERGED",
    "RUN",
    "ReportOptions",
    "ReportPlan",
    "ReportReport",
    "ReportResult",
    "StepInput",
    "StepNumbers",
    "plan_report",
    "run_report",
    "write_diff_page",
    "write_page",
]


@dataclass(frozen=True)
class ReportReport:
    plan: ReportPlan
    result: ReportResult | None = None  # None: a dry run
    page: str | None = None  # the HTML file written
    pngs: tuple[str, ...] = ()  # the PNG files written

    def to_json(self) -> dict:
        if self.result is None:
            return {"plan": self.plan.to_json(), "result": None}
        out = self.result.to_json()
        out["page"], out["pngs"] = self.page, list(self.pngs)
        return {"plan": self.plan.to_json(), "result": out}


def write_page(
    html_text: str,
    figures: list,
    out: str | Path | None,
    png_dir: str | Path | None,
    *,
    inputs: list,
    overwrite: bool,
) -> tuple[str | None, tuple[str, ...]]:
    """The page at `out` (a new file, or replaced under `overwrite`) and one PNG per figure in the new
    directory `png_dir` (atomic: it appears whole)."""
    from .page import figure_png

    page = None if out is None else _write_html(html_text, out, inputs=inputs, overwrite=overwrite)
    pngs: list[str] = []
    if png_dir is not None:
        with AtomicOutputDir(png_dir, inputs=inputs, overwrite=overwrite) as tmp:
            for stem, _caption, fig in figures:
                write_new_file(Path(tmp) / f"{stem}.png", figure_png(fig))
                pngs.append(str(Path(png_dir).expanduser().resolve() / f"{stem}.png"))
    return page, tuple(pngs)


def _write_html(html_text: str, out: str | Path, *, inputs: list, overwrite: bool) -> str:
    """The page at `out`: a new file, or replaced under `overwrite` (never an input)."""
    p = check_against_inputs(out, inputs) if overwrite else check_output_file(out, inputs, what="report page")
    atomic_write_bytes(p, html_text.encode("utf-8"))
    return str(p)


def write_diff_page(diff_json: dict, out: str | Path, *, inputs: list, overwrite: bool = False) -> str:
    """`diff-vs-base --report FILE`: the report page of a comparison (changed fraction, max |Δ| a tensor)."""
    from .page import diff_page

    text, _figs = diff_page(diff_json)
    return _write_html(text, out, inputs=inputs, overwrite=overwrite)


def run_report(plan: ReportPlan, progress: Progress | None = None) -> ReportReport:
    o = plan.options
    result = compute_report(plan, progress)
    page: str | None = None
    pngs: tuple[str, ...] = ()
    if o.out is not None or o.png_dir is not None:
        from .page import report_page  # matplotlib: only when a picture is asked for

        text, figs = report_page(
            redact(display(result.to_json()))
        )  # a URL input named as its URL on the page
        inputs = [plan.path, *(s.path for s in plan.steps), *([plan.base] if plan.base else [])]
        page, pngs = write_page(text, figs, o.out, o.png_dir, inputs=inputs, overwrite=o.overwrite)
    return ReportReport(plan, result, page, pngs)
