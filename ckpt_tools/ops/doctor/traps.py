"""The run-level traps `ckpt doctor` reports: one small function per trap, over plain facts.

Every trap is `check(facts) -> list[Finding]`, registered in `TRAPS` with its id. Facts are plain data
(`RunFacts`: the run's config view, its checkpoints' sizes and lrs, free disk, what diff-vs-base said
of `outputs/weights`), gathered by `ckpt_tools.ops.doctor`; nothing here reads a file. Each finding
carries the key as the user writes it in TOML, its value and default, why it bites (one line, with
the prime-rl source behind it) and the exact fix: a TOML snippet or a ckpt command. The checks live in
`traps_config` (what a config shows by itself) and `traps_run` (what needs the run's disk too); the
facts and the finding type in `facts`. A new trap is one function there plus one line in `TRAPS`.

Only what prime-rl's source supports is reported (shared/docs/primerl-config-traps.md for 16e747c,
primerl-head-format.md for HEAD). Where a trap of 16e747c does not exist at HEAD (the orchestrator's
alpha rule, the client timeout field, `outputs/weights`), its check returns nothing for HEAD runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .facts import (
    DEFAULT_DECODE_RATE,
    ERROR,
    INFO,
    PROBLEM_SEVERITIES,
    WARNING,
    AdapterConfig,
    Finding,
    RunFacts,
    StepFacts,
    WeightsExport,
    toml_fix,
    toml_value,
)
from .traps_attempts import attempts_differ
from .traps_config import (
    linear_decay_crash,
    lora_alpha,
    max_model_len_noop,
    max_tokens_unset,
    output_dir_overridden,
    shadowed_tables,
    tokenizer_default,
    unknown_keys,
    world_size,
)
from .traps_run import (
    broadcast_modules_to_save,
    client_timeout,
    disk_space,
    dist_timeout,
    no_retention,
    resume_lr_offload,
    resume_lr_restored,
    weights_are_base,
)

__all__ = [
    "DEFAULT_DECODE_RATE",
    "ERROR",
    "INFO",
    "PROBLEM_SEVERITIES",
    "TRAPS",
    "WARNING",
    "AdapterConfig",
    "Diagnosis",
    "Finding",
    "RunFacts",
    "StepFacts",
    "WeightsExport",
    "diagnose",
    "toml_fix",
    "toml_value",
]

TRAPS: tuple[tuple[str, Callable[[RunFacts], list[Finding]]], ...] = (
    ("unknown-key", unknown_keys),
    ("shadowed-table", shadowed_tables),
    ("dist-timeout", dist_timeout),
    ("client-timeout", client_timeout),
    ("no-retention", no_retention),
    ("disk", disk_space),
    ("tokenizer-default", tokenizer_default),
    ("resume-lr", resume_lr_restored),
    ("resume-lr-offload", resume_lr_offload),
    ("lora-alpha", lora_alpha),
    ("weights-are-base", weights_are_base),
    ("broadcast-modules-to-save", broadcast_modules_to_save),
    ("linear-decay-crash", linear_decay_crash),
    ("max-model-len-noop", max_model_len_noop),
    ("max-tokens", max_tokens_unset),
    ("world-size", world_size),
    ("output-dir", output_dir_overridden),
    ("attempts", attempts_differ),
)


@dataclass
class Diagnosis:
    findings: list[Finding] = field(default_factory=list)

    @property
    def problems(self) -> list[Finding]:
        return [f for f in self.findings if f.severity in PROBLEM_SEVERITIES]


def diagnose(facts: RunFacts) -> Diagnosis:
    """Run every trap; findings sorted errors first, then by key."""
    out: list[Finding] = []
    for _name, check in TRAPS:
        out += check(facts)
    order = {ERROR: 0, WARNING: 1, INFO: 2}
    out.sort(key=lambda f: (order[f.severity], f.trap, f.key))
    return Diagnosis(out)
