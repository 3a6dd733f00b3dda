"""`ckpt report`, planned from metadata alone: what PATH is (one checkpoint, a run's checkpoints dir, or a
merged / HF model dir against --base), its steps (full or slim), where the weights' norms and the trained
weights' base come from (the fp32 masters in a full checkpoint, else the bf16 base), the run's config
(max_steps for the planned lr curve) and what is written (-o page, --png dir)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...core.errors import CkptError, UsageError
from ...formats.dcp.layout import METADATA_NAME
from ...formats.primerl.config import RunConfig, load_run_config
from ...formats.primerl.files import locate_run_configs
from ...formats.primerl.run_dir import checkpoints_dir_of, find_run_configs, resolve_base, step_dirs
from ...formats.slim.manifest import is_slim
from ...formats.sniff import CHECKPOINTS, DCP, HF, sniff
from ...io.inputs import as_input

__all__ = ["CHECKPOINT", "MERGED", "RUN", "ReportOptions", "ReportPlan", "StepInput", "plan_report"]

CHECKPOINT, RUN, MERGED = "checkpoint", "checkpoints", "merged"


@dataclass(frozen=True)
class ReportOptions:
    base: str | None = None  # bf16 HF base (dir or hub id): W0 of trained weights, ||W|| for slim steps
    out: str | None = None  # the HTML page (None: none written)
    png_dir: str | None = None  # one PNG per plot
    set_lr: float | None = None  # overlay the lr curve `ckpt set-lr --lr X` would give
    scale: float | None = None  # ... or `--scale F`
    alpha: float | None = None
    run_config: str | None = None
    overwrite: bool = False
    trust_pickle: bool = False


@dataclass(frozen=True)
class StepInput:
    step: int | None  # None: a single checkpoint's step is read from its progress
    path: str
    slim: bool


@dataclass(frozen=True)
class ReportPlan:
    path: str
    kind: str  # checkpoint | checkpoints | merged
    steps: tuple[StepInput, ...]
    base: str | None  # resolved base dir, or None
    base_how: str | None
    base_problem: str | None
    run_config: tuple[str, ...]
    max_steps: int | None
    max_steps_from: str
    options: ReportOptions

    def to_json(self) -> dict:
        o = self.options
        return {
            "path": self.path,
            "kind": self.kind,
            "base": self.base,
            "base_from": self.base_how,
            "steps": [{"step": s.step, "path": s.path, "slim": s.slim} for s in self.steps],
            "run_config": list(self.run_config),
            "max_steps": self.max_steps,
            "max_steps_from": self.max_steps_from,
            "out": o.out,
            "png_dir": o.png_dir,
            "set_lr": o.set_lr,
            "scale": o.scale,
        }


def _trainer(step_dir: Path) -> Path:
    return step_dir / "trainer" if (step_dir / "trainer" / METADATA_NAME).is_file() else step_dir


def _max_steps(cfg, configs: tuple[str, ...]) -> tuple[int | None, str]:
    """The run's max_steps (what the planned lr curve runs to) and where it comes from, said so that a
    reader of the page understands it: a run config's key, or where the scheduler's last phase ends and why
    (no run config found, one found that sets none, one that could not be read)."""
    if cfg is not None:
        for key in ("trainer.max_steps", "orchestrator.max_steps", "max_steps"):
            section = key.split(".")[0]
            if section in cfg.sections or "." not in key:
                try:
                    v = cfg.value(key)
                except (CkptError, KeyError):
                    continue
                if isinstance(v, int) and not isinstance(v, bool):
                    return v, f"{key} in the run config"
    names = ", ".join(as_input(c).name for c in configs)
    why = (
        "no run config found"
        if not configs
        else f"the run config {names} sets no max_steps"
        if cfg is not None
        else f"the run config {names} could not be read"
    )
    return None, f"where the scheduler's last phase ends ({why})"


def plan_report(path: str | Path, options: ReportOptions) -> ReportPlan:
    p = as_input(path)
    kind = sniff(p) if p.exists() else None
    if options.set_lr is not None and options.scale is not None:
        raise UsageError("give one of --set-lr or --scale, not both")
    report_kind, steps = _steps(p, kind, options)
    if (options.set_lr is not None or options.scale is not None) and report_kind == MERGED:
        raise UsageError("--set-lr / --scale draw a checkpoint's lr schedule; a model dir has none")
    cfg: RunConfig | None = None
    configs: tuple[str, ...] = ()
    if report_kind != MERGED:
        cfg, configs = _run_config(steps, options)
    max_steps, max_from = _max_steps(cfg, configs)
    base_dir, base_how, base_problem = None, None, None
    needs_base = (
        report_kind == MERGED or options.base is not None or any(s.slim for s in steps) or cfg is not None
    )
    if needs_base:
        try:
            b = resolve_base(options.base, cfg)
        except CkptError as exc:
            if options.base is not None:
                raise
            b, base_problem = None, exc.message
        if b is not None:
            base_dir, base_how, base_problem = (
                (str(b.dir) if b.dir else None),
                b.how,
                b.problem or base_problem,
            )
    return ReportPlan(
        str(p), report_kind, steps, base_dir, base_how, base_problem, configs, max_steps, max_from, options
    )


def _steps(p: Path, kind: str | None, options: ReportOptions) -> tuple[str, tuple[StepInput, ...]]:
    """What PATH is (one checkpoint, a run's checkpoints, a merged dir) and the steps it reports."""
    if kind == DCP:
        ck = p / "trainer" if (p / "trainer" / METADATA_NAME).is_file() else p
        return CHECKPOINT, (StepInput(None, str(ck), is_slim(ck)),)
    if kind == CHECKPOINTS or (p.is_dir() and kind is None and (p / "checkpoints").is_dir()):
        root = checkpoints_dir_of(p)
        steps = tuple(
            StepInput(n, str(_trainer(d)), is_slim(_trainer(d)))
            for n, d in step_dirs(root)
            if (_trainer(d) / METADATA_NAME).is_file()
        )
        if not steps:
            raise UsageError(
                "holds no complete step_N checkpoint (step_N/trainer/.metadata)",
                path=root,
                hint="pass a run's outputs/checkpoints directory, or one step's trainer dir",
            )
        return RUN, steps
    if kind == HF:
        if options.base is None:
            raise UsageError(
                "a model dir is reported against its base: give --base",
                path=p,
                hint="e.g. ckpt report merged/ --base Qwen/Qwen3-8B",
            )
        return MERGED, (StepInput(None, str(p), False),)
    if not p.exists():
        raise UsageError("no such checkpoint, checkpoints dir or model dir", path=p)
    raise UsageError(
        "not a DCP checkpoint, a run's checkpoints dir or an HF model dir",
        path=p,
        hint="ckpt report takes step_N/trainer, outputs/checkpoints, or a merged dir with --base",
    )


def _run_config(
    steps: tuple[StepInput, ...], options: ReportOptions
) -> tuple[RunConfig | None, tuple[str, ...]]:
    """The run's config (--run-config, else the one beside the last step's checkpoint or above its URL) and
    its files; (None, ()) where there is none or it does not read."""
    cfg: RunConfig | None = None
    configs: tuple[str, ...] = ()
    try:
        files = locate_run_configs(options.run_config or steps[-1].path)
        if files is None and options.run_config is None:  # a URL's run configs lie above it
            above = find_run_configs(as_input(steps[-1].path))
            files = locate_run_configs(above[0]) if len(above) == 1 else None
        if files is not None:
            configs = tuple(str(c.path) for c in files.files)
            cfg = load_run_config(files)
    except CkptError:
        cfg = None
    return cfg, configs
