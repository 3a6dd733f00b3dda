"""A run's config dirs, one per launch attempt (prime-rl after August 2026), and which one wrote a checkpoint.

prime-rl's launcher gives every launch (fresh or resumed) its own config dir (`utils/pathing.py`:
`create_attempt_dirs`, `get_config_dir`; docs/reference/primerl-head-format.md, "since August 2026"):

    <run>/configs/attempt_<n>/resolved/{rl,trainer,orchestrator,inference}.json   the resolved configs
    <run>/configs/attempt_<n>/rl.toml, command.txt                                 launch TOML, command
    <run>/configs/latest -> attempt_<n>                                            a relative symlink

and reads its configs from `$PRL_ATTEMPT_CONFIG_DIR`, else `configs/latest/resolved`, else the legacy
`configs/resolved` (before attempts); 559b447 wrote `<run>/configs/*.json`. A resume is a new attempt,
perhaps with another alpha or lr. A downloaded run may hold several; `latest` may dangle after a copy, or
be a plain dir (an object store has no symlinks), or be gone.

`run_attempts(run_dir)` lists them in launch order (`Attempt`: its resolved dir, the step it resumed from,
its max_steps, when it was written); `writer_of(attempts, step)` picks the attempt that wrote a step's
checkpoint: by the step range each attempt ran (from its resume step, as the configs say), then, for what
that leaves open (a bare `--resume` names no step), by modification time when the times are usable (never
over a URL, whose shadow files have no times); otherwise it answers with the candidates and the caller
decides (they may agree on what it needs). Never blindly `latest`.

Reads directory listings and small JSON files only (through `io.inputs`).
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ...core.errors import CkptError
from ...core.keys import step_of
from ...io import inputs
from ...io.inputs import as_input, mtime_of, real_name, search_top

__all__ = [
    "ATTEMPT_ENV",
    "HEAD_JSON_NAMES",
    "Attempt",
    "RunAttempts",
    "WriterChoice",
    "attempt_number",
    "checkpoint_step",
    "run_attempts",
    "writer_of",
]

ATTEMPT_ENV = "PRL_ATTEMPT_CONFIG_DIR"
# The resolved configs of one launch, in prime-rl's load order (rl.json holds the root).
HEAD_JSON_NAMES = ("rl.json", "trainer.json", "orchestrator.json", "inference.json")
_ATTEMPT = re.compile(r"^attempt_(\d+)$")


def attempt_number(name: str) -> int | None:
    m = _ATTEMPT.match(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class Attempt:
    """One launch's resolved configs."""

    label: str  # "attempt_2", "configs/latest (a copy of ...)", "configs/resolved", "configs", "$PRL_..."
    number: int | None  # n of attempt_<n>; None for the legacy dirs and an unmatched copy
    resolved: Path  # the dir holding its resolved JSON
    files: tuple[Path, ...]  # its JSON configs, in HEAD_JSON_NAMES order
    resumed: bool  # a `resume` block: it resumed (from resume_step, or the latest checkpoint if None)
    resume_step: int | None  # the step it resumed from (resume.step, or resume.dir's step_N)
    max_steps: int | None
    written_at: float | None  # when its configs were written (None over a URL: no times there)

    @property
    def start(self) -> int | None:
        """The last step before its first trained one: 0 for a fresh launch, the resume step, or None
        (a bare `--resume`: the newest checkpoint when it was launched)."""
        if not self.resumed:
            return 0
        return self.resume_step

    @property
    def trainer_first(self) -> tuple[Path, ...]:
        """trainer.json then rl.json (the files that hold the trainer's LoRA), those present."""
        names = ("trainer.json", "rl.json")
        return tuple(sorted((f for f in self.files if f.name in names), key=lambda f: names.index(f.name)))

    def describe(self) -> str:
        how = (
            "fresh"
            if not self.resumed
            else (
                f"resumed from step {self.resume_step}"
                if self.resume_step is not None
                else "resumed from the latest step"
            )
        )
        return f"{self.label} ({how}{'' if self.max_steps is None else f', max_steps {self.max_steps}'})"


@dataclass(frozen=True)
class RunAttempts:
    run_dir: Path
    attempts: tuple[Attempt, ...]  # in launch order (the legacy dirs first)
    latest: str  # what configs/latest is: "-> attempt_2", "a dangling link", "a plain dir", "absent"
    notes: tuple[str, ...] = ()

    @property
    def newest(self) -> Attempt | None:
        return self.attempts[-1] if self.attempts else None


@dataclass(frozen=True)
class WriterChoice:
    """The attempt that wrote a checkpoint, or (attempt None) the ones it may be, and how that was decided."""

    attempt: Attempt | None
    how: str
    candidates: tuple[Attempt, ...]


# ------------------------------------------------------------------------------------------ reading
def _json_files(d: Path) -> tuple[Path, ...]:
    try:
        return tuple(d / n for n in HEAD_JSON_NAMES if (d / n).is_file())
    except OSError:
        return ()


def _resume_facts(files: tuple[Path, ...], root: Path | None) -> tuple[bool, int | None, int | None]:
    """(resumed, resume step, max_steps) from the attempt's trainer.json (or rl.json's root)."""
    resumed, step, max_steps = False, None, None
    for f in sorted(files, key=lambda f: f.name != "trainer.json"):
        if f.name not in ("trainer.json", "rl.json"):
            continue
        try:
            data = inputs.read_json(f, root=root, what="prime-rl config")
        except CkptError:
            continue
        if not isinstance(data, dict):
            continue
        block = data.get("resume")
        if isinstance(block, dict):
            resumed = True
            step = _step_of(block)
        ms = data.get("max_steps")
        max_steps = ms if isinstance(ms, int) and not isinstance(ms, bool) else max_steps
        if "resume" in data:
            break
    return resumed, step, max_steps


def _step_of(block: Mapping) -> int | None:
    s = block.get("step")
    if isinstance(s, int) and not isinstance(s, bool) and s >= 0:
        return s
    d = block.get("dir")
    return step_of(Path(d).name) if isinstance(d, str) else None


def _written_at(files: tuple[Path, ...]) -> float | None:
    """When the files were written (the earliest); None over a URL (no file time is asked of a store)."""
    times = [mtime_of(f) for f in files]
    return min(t for t in times if t is not None) if times and None not in times else None


def _attempt(label: str, number: int | None, resolved: Path, root: Path | None) -> Attempt | None:
    files = _json_files(resolved)
    if not files:
        return None
    resumed, step, max_steps = _resume_facts(files, root)
    return Attempt(label, number, resolved, files, resumed, step, max_steps, _written_at(files))


def _same_bytes(a: Attempt, b: Attempt, root: Path | None) -> bool:
    names = {f.name for f in a.files}
    if names != {f.name for f in b.files}:
        return False
    try:
        return all(
            inputs.read_input(
                a.resolved / n, root=root, what="prime-rl config", max_bytes=inputs.MAX_JSON_BYTES
            )
            == inputs.read_input(
                b.resolved / n, root=root, what="prime-rl config", max_bytes=inputs.MAX_JSON_BYTES
            )
            for n in sorted(names)
        )
    except CkptError:
        return False


def _numbered(configs: Path, root: Path | None) -> list[Attempt]:
    try:
        entries = sorted(configs.iterdir())
    except OSError:
        return []
    found = []
    for e in entries:
        n = attempt_number(e.name)
        if n is not None and not e.is_symlink():
            a = _attempt(e.name, n, e / "resolved", root)
            if a is not None:
                found.append(a)
    return sorted(found, key=lambda a: a.number or 0)


def _latest(configs: Path, numbered: list[Attempt], root: Path | None) -> tuple[str, Attempt | None]:
    """What configs/latest is, and the attempt it adds: a plain dir (a copy: an object store has no
    links) that holds none of the numbered attempts' bytes. A link is only named, never read through."""
    latest = configs / "latest"
    if latest.is_symlink():
        target = os.readlink(latest)
        n = attempt_number(target.strip("/")) if "/" not in target.strip("/") else None
        if not (latest / "resolved").is_dir():
            return f"a dangling link (-> {target})", None
        if n is not None:
            return f"-> {target}", None
        return f"a link to {target}, not one of the run's attempt dirs: not read", None
    if not latest.is_dir():
        return "absent", None
    copy = _attempt("configs/latest", None, latest / "resolved", root)
    if copy is None:
        return "a plain dir without resolved configs", None
    same = next((a for a in numbered if _same_bytes(a, copy, root)), None)
    if same is not None:
        return f"a plain dir, a copy of {same.label}", None
    return "a plain dir, none of the numbered attempts", Attempt(
        "configs/latest (a plain dir)",
        None,
        copy.resolved,
        copy.files,
        copy.resumed,
        copy.resume_step,
        copy.max_steps,
        copy.written_at,
    )


def run_attempts(run_dir: str | os.PathLike, *, env: Mapping[str, str] | None = None) -> RunAttempts | None:
    """The config dirs of the run in `run_dir`, oldest first (see the module doc); None when it has none
    (and `$PRL_ATTEMPT_CONFIG_DIR` names none)."""
    run = as_input(run_dir)
    configs = run / "configs"
    root = search_top(run) or run  # a config is read only inside the run's tree (a URL's: inside it)
    attempts: list[Attempt] = []
    for label, d in (("configs", configs), ("configs/resolved", configs / "resolved")):
        a = _attempt(label, None, d, root)
        if a is not None:
            attempts.append(a)
    numbered = _numbered(configs, root)
    latest, extra = _latest(configs, numbered, root) if configs.is_dir() else ("absent", None)
    attempts += numbered + ([extra] if extra is not None else [])
    notes: list[str] = []
    pinned = (os.environ if env is None else env).get(ATTEMPT_ENV)
    if pinned:
        attempts, notes = _with_pinned(attempts, Path(pinned), notes)
    if not attempts:
        return None
    return RunAttempts(run, tuple(attempts), latest, tuple(notes))


def _with_pinned(attempts: list[Attempt], pinned: Path, notes: list[str]) -> tuple[list[Attempt], list[str]]:
    """`$PRL_ATTEMPT_CONFIG_DIR` (prime-rl's `get_config_dir` reads it first): the run's config dir when
    the run has none of its own; one of them, or ignored (said so), when it has."""
    own = next((a for a in attempts if real_name(a.resolved) == real_name(pinned)), None)
    if own is not None:
        return attempts, [*notes, f"${ATTEMPT_ENV} names {own.label}"]
    if attempts:
        return attempts, [*notes, f"${ATTEMPT_ENV}={pinned} is not one of this run's config dirs: ignored"]
    a = _attempt(f"${ATTEMPT_ENV}", None, pinned, None)
    if a is None:
        return attempts, [*notes, f"${ATTEMPT_ENV}={pinned} holds no resolved prime-rl config"]
    return [a], notes


# ------------------------------------------------------------------------------------------ the writer
def checkpoint_step(path: Path, *, timed: bool = True) -> tuple[int | None, float | None]:
    """(N, when its `.metadata` was written) for `.../step_N` or `.../step_N/trainer` (or a file in
    it); (None, None) for anything else. The time is None over a URL (a shadow file has none), and
    without `timed` (a path that only names a URL's layout)."""
    p = as_input(path)
    for d in (p, p.parent, p.parent.parent):
        n = step_of(d.name)
        if n is not None:
            return n, mtime_of(d / "trainer" / ".metadata") if timed else None
    return None, None


def _by_range(attempts: tuple[Attempt, ...], step: int) -> tuple[Attempt | None, list[Attempt]]:
    """The last attempt that started before `step` (and ran that far), and the later ones whose start is
    unknown (a bare --resume): they may have rewritten it."""
    unknown: list[Attempt] = []
    for a in reversed(attempts):
        if a.start is None:
            unknown.append(a)
            continue
        if a.start < step and (a.max_steps is None or step <= a.max_steps):
            return a, unknown
    return None, unknown


def _by_time(candidates: list[Attempt], step_time: float | None) -> Attempt | None:
    """The last candidate written before the checkpoint, when every candidate has a time and the times
    follow the launch order (a copy that reset them makes them say nothing)."""
    times = [a.written_at for a in candidates if a.written_at is not None]
    if step_time is None or len(times) != len(candidates):
        return None
    if any(b <= a for a, b in itertools.pairwise(times)):
        return None
    before = [a for a in candidates if a.written_at is not None and a.written_at <= step_time]
    return before[-1] if before else None


def writer_of(run: RunAttempts, step: int | None, step_time: float | None = None) -> WriterChoice:
    """The attempt whose launch wrote the checkpoint of `step` (`step_time`: its `.metadata`'s mtime)."""
    attempts = run.attempts
    if len(attempts) == 1:
        return WriterChoice(attempts[0], f"the run's only config dir ({attempts[0].label})", attempts)
    if step is None:
        return WriterChoice(None, "not a checkpoint of a step: any attempt", attempts)
    found, unknown = _by_range(attempts, step)
    if found is not None and not unknown:
        return WriterChoice(
            found, f"by step range: {found.describe()} is the last launch that ran step {step}", (found,)
        )
    ordered = [a for a in attempts if a is found or a in unknown]
    if len(ordered) == 1:
        only = ordered[0]
        return WriterChoice(
            only,
            f"by step range: {only.describe()} is the only launch that can have run step {step}",
            (only,),
        )
    timed = _by_time(ordered, step_time)
    if timed is not None:
        return WriterChoice(
            timed,
            f"by time: {timed.label} was launched before step {step}'s checkpoint was "
            "written, the next launch after it",
            (timed,),
        )
    if not ordered:
        return WriterChoice(None, f"no launch of the run ran step {step}, by its configs", attempts)
    return WriterChoice(
        None,
        f"step {step} may have been written by {', '.join(a.label for a in ordered)} "
        "(a resume without a step; no usable file times)",
        tuple(ordered),
    )
