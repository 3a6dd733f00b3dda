"""`ckpt doctor`: a prime-rl run's config and disk traps, found before they cost hours.

Gathers the facts the trap checks need (`ckpt_tools.primerl.traps`), then runs them all:

- the run's configs, either located from a run/outputs/checkpoint dir (16e747c `run_*/configs/orch.toml`,
  HEAD `configs/*.json`) or given as files (`rl.toml` with its `toml_files`, `--trainer FILE` ...),
  read by `ckpt_tools.primerl.config` with prime-rl's precedence rules;
- its checkpoints, through `formats.dcp.summary` (metadata and a few byte items: step, lr, unique bytes);
- free disk where the checkpoints are;
- whether `outputs/weights/step_N` is the base model, through `sources.compare.identical` (the newest
  export only: it reads both models once, stopping at the first tensor that differs);
- for a HEAD resume with the optimizer offloaded, the lr a freshly built scheduler sets
  (`primerl_state.build_optim_state`, torch's own scheduler classes).

Returns a report whose `exit_code` is 3 when any error or warning was found, else 0.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path

from ...core.errors import CkptError, MissingPathError, UsageError
from ...core.primerl_state import SchedulerSpec, build_optim_state
from ...formats.dcp.reader import DcpCheckpoint
from ...formats.dcp.summary import summarize
from ...formats.primerl.attempt_facts import attempt_facts
from ...formats.primerl.attempts import checkpoint_step, writer_of
from ...formats.primerl.config import GEN_HEAD, RunConfig, config_files, load_run_config, locate_run_configs
from ...formats.primerl.resume import checkpoint_generation, resume_instruction, run_name_of
from ...formats.primerl.run_dir import (
    absent_modules_to_save,
    adapter_config_files,
    dir_bytes,
    model_name,
    outputs_dir,
    read_adapter_config,
    resolve_base,
    step_dirs,
    weights_exports,
)
from ...formats.slim.manifest import SLIM_MANIFEST
from ...io.inputs import as_input, free_bytes
from ...sources.compare import identical
from ...sources.open import open_weights
from .traps import DEFAULT_DECODE_RATE, AdapterConfig, Finding, RunFacts, StepFacts, WeightsExport, diagnose

__all__ = [
    "EXIT_CLEAN",
    "EXIT_PROBLEMS",
    "DoctorOptions",
    "DoctorPlan",
    "DoctorReport",
    "doctor",
    "plan_doctor",
    "run_doctor",
]

log = logging.getLogger(__name__)

EXIT_CLEAN = 0
EXIT_PROBLEMS = 3


@dataclass
class DoctorReport:
    target: str | None
    generation: str | None
    config_files: list[dict]
    outputs: str | None
    checkpoints: list[dict]
    findings: list[Finding]
    notes: list[str] = field(default_factory=list)
    attempts: list[dict] = field(default_factory=list)  # a run launched more than once: each launch's

    @property
    def problems(self) -> list[Finding]:
        return [f for f in self.findings if f.severity in ("error", "warning")]

    @property
    def exit_code(self) -> int:
        return EXIT_PROBLEMS if self.problems else EXIT_CLEAN

    def to_json(self) -> dict:
        return {
            "target": self.target,
            "generation": self.generation,
            "config_files": self.config_files,
            "outputs": self.outputs,
            "checkpoints": self.checkpoints,
            "findings": [f.to_json() for f in self.findings],
            "counts": {
                s: sum(1 for f in self.findings if f.severity == s) for s in ("error", "warning", "info")
            },
            "exit_code": self.exit_code,
            "notes": self.notes,
            "attempts": self.attempts,
        }


def _load_config(target: Path | None, files, sections) -> RunConfig | None:
    if files or sections:
        return load_run_config(
            config_files([as_input(f) for f in files], {k: as_input(v) for k, v in (sections or {}).items()})
        )
    if target is None:
        raise UsageError("nothing to check", hint="pass a run dir, an outputs dir or config files")
    found = locate_run_configs(target)
    return load_run_config(found) if found is not None else None


def _step_facts(checkpoints: Path, notes: list[str], trust_pickle: bool) -> list[StepFacts]:
    out = []
    for n, d in step_dirs(checkpoints):
        trainer = d / "trainer"
        if not trainer.is_dir():
            continue
        complete = (trainer / ".metadata").is_file()
        slim = (trainer / SLIM_MANIFEST).is_file()
        size = dir_bytes(trainer)
        lr = initial = unique = None
        if complete:
            try:
                with DcpCheckpoint.open(trainer, trust_pickle=trust_pickle) as ckpt:
                    s = summarize(ckpt)
                lr, initial, unique = s.lr, s.initial_lr, s.unique_bytes
            except CkptError as exc:
                notes.append(f"step_{n}: not read ({exc.message})")
        out.append(
            StepFacts(
                n,
                str(trainer),
                complete,
                slim,
                size,
                unique,
                float(lr) if isinstance(lr, (int, float)) else None,
                float(initial) if isinstance(initial, (int, float)) else None,
            )
        )
    return out


def _weights_facts(outputs: Path, base_dir: Path | None, notes: list[str]) -> tuple[list[WeightsExport], int]:
    exports = weights_exports(outputs)
    if not exports:
        return [], 0
    step, newest = exports[-1]
    size = dir_bytes(newest)
    if base_dir is None:
        notes.append(f"{newest}: not compared with the base (no base model found; pass --base)")
        return [WeightsExport(step, str(newest), None)], size
    try:
        with open_weights(newest) as w, open_weights(base_dir) as b:
            same = identical(w, b)
    except CkptError as exc:
        notes.append(f"{newest}: could not compare with the base ({exc.message})")
        return [WeightsExport(step, str(newest), None)], size
    return [WeightsExport(step, str(newest), same, str(base_dir))], size


def _fresh_lr(cfg: RunConfig, notes: list[str]) -> float | None:
    """HEAD: the lr the param groups hold right after prime-rl builds its scheduler from the config."""
    kind = cfg.value("trainer.scheduler.type")
    try:
        spec = SchedulerSpec(
            kind=kind,
            warmup_steps=cfg.value("trainer.scheduler.warmup_steps") or 0,
            decay_steps=(cfg.value("trainer.scheduler.decay_steps") or 0) if kind == "linear" else 0,
            max_steps=cfg.value("trainer.max_steps"),
            min_lr=cfg.value("trainer.scheduler.min_lr") or 0.0,
        )
        return build_optim_state(float(cfg.value("trainer.optim.lr")), spec, 0, preview_steps=0).lr_now
    except (ValueError, TypeError, ZeroDivisionError) as exc:
        notes.append(f"the fresh scheduler's lr was not computed ({exc})")
        return None


def _with_attempts(facts: RunFacts, cfg: RunConfig | None) -> RunFacts:
    """The run's launch attempts (its configs came from `configs/attempt_<n>/`) and which wrote each step."""
    run = cfg.files.attempts if cfg is not None else None
    if run is None or len(run.attempts) < 2:
        return facts
    wrote = {}
    for s in facts.steps:
        step, when = checkpoint_step(as_input(s.path))
        w = writer_of(run, step, when).attempt if step is not None else None
        if step is not None and w is not None:
            wrote[step] = w.label
    return replace(facts, attempts=tuple(attempt_facts(run)), written_by=wrote)


def _resume_note(facts: RunFacts, notes: list[str]) -> None:
    """How to resume at the newest full checkpoint, in the form of the run's prime-rl generation."""
    full = facts.full_steps()
    if not full:
        return
    newest = full[-1]
    gen, _why = checkpoint_generation(newest.path, ())
    name = run_name_of(newest.path) if gen == GEN_HEAD else None
    notes.append(f"to resume at step {newest.step}: {resume_instruction(gen, newest.step, run_name=name)}")


@dataclass(frozen=True)
class DoctorOptions:
    files: tuple = ()  # config files, in the order `rl @ A @ B` takes them
    sections: dict | None = None  # {"trainer": FILE, ...}: `--trainer @ FILE`
    outputs: str | None = None
    base: str | None = None
    decode_rate: float = DEFAULT_DECODE_RATE
    compare_weights: bool = True
    trust_pickle: bool = False


@dataclass(frozen=True)
class DoctorPlan:
    """What doctor reads: the run's config (located or given), its outputs dir, its base model."""

    target: Path | None
    config: RunConfig | None
    outputs: Path | None
    base_dir: Path | None
    notes: tuple[str, ...]
    options: DoctorOptions


def _outputs(outputs: str | None, cfg: RunConfig | None, tgt: Path | None) -> Path | None:
    """--outputs (a dir), else the run's outputs dir found from its config or the target."""
    if outputs is not None:
        if not as_input(outputs).is_dir():
            raise UsageError("--outputs is not a directory", path=outputs)
        return as_input(outputs)
    return outputs_dir(cfg, tgt if tgt is not None and tgt.is_dir() else None)


def plan_doctor(target: str | Path | None, options: DoctorOptions) -> DoctorPlan:
    tgt = as_input(target) if target is not None else None
    if tgt is not None and not tgt.exists():
        raise MissingPathError(tgt)
    notes: list[str] = []
    cfg = _load_config(tgt, options.files, options.sections)
    if cfg is None:
        notes.append(
            "no prime-rl config found here (outputs/run_*/configs/orch.toml or configs/*.json); only the "
            "checkpoints were checked"
        )
    elif cfg.generation == "16e747c" and not cfg.is_rl and "trainer" not in cfg.sections:
        notes.append(
            "a 16e747c run dir holds only the orchestrator's config; trainer settings (timeouts, lr, "
            "tokenizer) were not checked: pass the rl.toml the run was launched with"
        )
    out_dir = _outputs(options.outputs, cfg, tgt)
    b = None
    try:
        b = resolve_base(options.base, cfg)
    except CkptError as exc:
        raise UsageError(f"--base: {exc.message}", path=options.base, hint=exc.hint) from None
    if b is not None and b.problem:
        notes.append(f"base model {b.name!r}: {b.problem}")
    return DoctorPlan(tgt, cfg, out_dir, b.dir if b is not None else None, tuple(notes), options)


def _disk_facts(plan: DoctorPlan, notes: list[str]) -> dict:
    """What the run's outputs dir holds: its checkpoints, the free disk there, the newest weights export
    against the base, the adapter configs prime-rl wrote (RunFacts' fields)."""
    o, out_dir = plan.options, plan.outputs
    got: dict = {
        "steps": (),
        "checkpoints_dir": None,
        "free_bytes": None,
        "weights": (),
        "weights_bytes": 0,
        "adapter_configs": (),
    }
    if out_dir is None:
        return got
    ck = out_dir / "checkpoints"
    if ck.is_dir():
        got["checkpoints_dir"] = str(ck)
        got["steps"] = tuple(_step_facts(ck, notes, o.trust_pickle))
        got["free_bytes"] = free_bytes(ck)
    if o.compare_weights:
        weights, got["weights_bytes"] = _weights_facts(out_dir, plan.base_dir, notes)
        got["weights"] = tuple(weights)
    adapters = []
    for f in adapter_config_files(out_dir):
        ra = read_adapter_config(f)
        if ra is not None:
            adapters.append(AdapterConfig(str(f), ra[0], ra[1], absent_modules_to_save(f)))
    got["adapter_configs"] = tuple(adapters)
    return got


def _facts(plan: DoctorPlan, notes: list[str]) -> RunFacts:
    cfg, base_dir, base = plan.config, plan.base_dir, plan.options.base
    disk = _disk_facts(plan, notes)
    fresh = None
    if (
        cfg is not None
        and cfg.generation == GEN_HEAD
        and disk["steps"]
        and cfg.value("trainer.model.optim_cpu_offload")
    ):
        fresh = _fresh_lr(cfg, notes)
    facts = RunFacts(
        config=cfg,
        **disk,
        model_available=True if base is not None else ((base_dir is not None) if model_name(cfg) else None),
        base=(str(base) if base is not None else (str(base_dir) if base_dir is not None else None)),
        fresh_lr=fresh,
        decode_rate=plan.options.decode_rate,
    )
    return _with_attempts(facts, cfg)


def run_doctor(plan: DoctorPlan, progress=None) -> DoctorReport:
    """Gather the facts (checkpoints, free disk, the newest weights export against the base, adapter
    configs, the run's launch attempts) and run every trap. `progress` is accepted for the one contract;
    nothing reports to it."""
    cfg, tgt, notes = plan.config, plan.target, list(plan.notes)
    facts = _facts(plan, notes)
    diagnosis = diagnose(facts)
    _resume_note(facts, notes)
    files = cfg.files.files if cfg is not None else ()
    return DoctorReport(
        target=str(tgt) if tgt is not None else None,
        generation=cfg.generation if cfg is not None else None,
        config_files=[
            {"path": str(c.path), "section": c.section or "(rl)", "origin": c.origin} for c in files
        ],
        outputs=str(plan.outputs) if plan.outputs is not None else None,
        checkpoints=[
            {
                "step": s.step,
                "path": s.path,
                "complete": s.complete,
                "slim": s.slim,
                "bytes": s.bytes,
                "lr": s.lr,
            }
            for s in facts.steps
        ],
        findings=diagnosis.findings,
        notes=notes,
        attempts=[a.to_json() for a in facts.attempts],
    )


def doctor(
    target: str | Path | None = None,
    *,
    files=(),
    sections=None,
    outputs: str | Path | None = None,
    base: str | Path | None = None,
    decode_rate: float = DEFAULT_DECODE_RATE,
    compare_weights: bool = True,
    trust_pickle: bool = False,
) -> DoctorReport:
    """Check a run (dir or config files) for the traps in `ops.doctor.traps`. Library entry point."""
    options = DoctorOptions(
        tuple(files),
        sections,
        None if outputs is None else str(outputs),
        None if base is None else str(base),
        decode_rate,
        compare_weights,
        trust_pickle,
    )
    return run_doctor(plan_doctor(target, options))
