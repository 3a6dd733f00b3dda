"""The plain facts `ckpt doctor`'s trap checks read, and what they report.

`RunFacts` is gathered by `ckpt_tools.ops.doctor` (the config view, checkpoint sizes and lrs, free
disk, diff-vs-base of `outputs/weights`); a `Finding` is one trap found: the key as the user writes
it in TOML, its value and default, why it bites (one line, with the prime-rl source behind it) and
the exact fix (a TOML snippet or a ckpt command). No I/O here.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field
from typing import Any

from ...formats.primerl.attempt_facts import AttemptFacts
from ...formats.primerl.config import RunConfig, toml_key

__all__ = [
    "DEFAULT_DECODE_RATE",
    "PROBLEM_SEVERITIES",
    "AdapterConfig",
    "Finding",
    "RunFacts",
    "StepFacts",
    "WeightsExport",
    "ckpt_command",
    "finding",
    "section_config",
    "toml_fix",
    "toml_value",
]

ERROR, WARNING, INFO = "error", "warning", "info"
PROBLEM_SEVERITIES = (ERROR, WARNING)  # what makes `ckpt doctor` exit 3

# A loaded vLLM server's decode rate per sequence we assume when judging a client timeout (tokens/s).
# Deliberately low: at full batch a 32B model decodes each sequence at tens of tokens/s; a timeout
# that needs more than this per sequence is one a busy server misses. `--decode-rate` overrides it.
DEFAULT_DECODE_RATE = 5.0


@dataclass(frozen=True)
class Finding:
    trap: str
    severity: str
    key: str  # dotted path: trainer.optim.lr
    toml: str  # as the user writes it: [trainer.optim] lr
    value: Any
    default: Any
    why: str
    fix: str  # a TOML snippet ("[table]\nkey = value") or a ckpt command
    source: str = ""  # prime-rl file:line behind the why
    file: str | None = None  # config file the value comes from, when it was written

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class StepFacts:
    step: int
    path: str  # the step's trainer dir
    complete: bool  # has .metadata
    slim: bool
    bytes: int
    unique_bytes: int | None = None
    lr: float | None = None
    initial_lr: float | None = None


@dataclass(frozen=True)
class WeightsExport:
    step: int
    path: str
    identical_to_base: bool | None  # diff-vs-base verdict; None: not compared
    base: str | None = None


@dataclass(frozen=True)
class AdapterConfig:
    path: str
    r: int
    lora_alpha: float
    absent_full: tuple[str, ...] = ()  # modules_to_save it lists but holds no tensor of


@dataclass(frozen=True)
class RunFacts:
    config: RunConfig | None
    steps: tuple[StepFacts, ...] = ()
    checkpoints_dir: str | None = None
    free_bytes: int | None = None
    weights: tuple[WeightsExport, ...] = ()
    weights_bytes: int = 0  # size of the newest outputs/weights/step_N
    adapter_configs: tuple[AdapterConfig, ...] = ()
    model_available: bool | None = None  # the model is a local dir or in the local HF cache
    base: str | None = None  # base model for fixes (--base, or the config's model name)
    fresh_lr: float | None = None  # lr a freshly built scheduler sets (HEAD offloaded resume)
    decode_rate: float = DEFAULT_DECODE_RATE
    attempts: tuple[AttemptFacts, ...] = ()  # the run's launch attempts (after Aug 2026), when several
    written_by: dict[int, str] = field(default_factory=dict)  # checkpoint step -> the attempt that wrote it

    def full_steps(self) -> list[StepFacts]:
        return [s for s in self.steps if s.complete and not s.slim]


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):  # a TOML basic string: JSON's escapes, newlines and controls included
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if v is None:
        return '"None"'
    return str(v)


def toml_fix(path: str, value) -> str:
    """The TOML that sets `path` to `value`: `[table]\\nkey = value` (or `key = value` at the top)."""
    table, _, leaf = path.rpartition(".")
    line = f"{leaf} = {toml_value(value)}"
    return f"[{table}]\n{line}" if table else line


def ckpt_command(*args) -> str:
    """A `ckpt` command line to paste into a shell: every argument `shlex.quote`d, since paths and
    names come from the run's own files (a downloaded run whose model.name is
    `base_model;touch${IFS}PWNED;` must not become a command)."""
    return " ".join(["ckpt", *(shlex.quote(str(a)) for a in args)])


def finding(
    cfg: RunConfig | None,
    trap,
    severity,
    path,
    why,
    fix,
    source,
    *,
    value=None,
    default=None,
    use_config=True,
) -> Finding:
    if cfg is not None and use_config:
        value, default = cfg.value(path), cfg.default(path)
    f = cfg.where(path) if cfg is not None else None
    return Finding(
        trap,
        severity,
        path,
        toml_key(path),
        value,
        default,
        why,
        fix,
        source,
        str(f) if f is not None else None,
    )


def section_config(facts: RunFacts, section: str, generation: str | None = None) -> RunConfig | None:
    cfg = facts.config
    if cfg is None or section not in cfg.sections or (generation and cfg.generation != generation):
        return None
    return cfg
