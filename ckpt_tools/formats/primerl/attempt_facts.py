"""What each launch attempt of a run trained with (`attempts`): its LoRA alpha and rank, lr and optimizer,
read from its resolved configs by `config` (the reader `ckpt doctor` uses), for `inspect` and `doctor` to
report side by side. A config that cannot be read is reported as such, never guessed."""

from __future__ import annotations

from dataclasses import dataclass

from ...core.errors import CkptError
from .attempts import Attempt, RunAttempts
from .config import config_files, load_run_config, lora_settings

__all__ = ["AttemptFacts", "attempt_facts"]


@dataclass(frozen=True)
class AttemptFacts:
    label: str
    resumed: bool
    resume_step: int | None
    max_steps: int | None
    alpha: float | None  # the trainer's LoRA alpha (None: not a LoRA run, or unread)
    rank: int | None
    lr: float | None
    optimizer: str | None
    config: str  # the dir of its resolved configs
    problem: str | None = None  # why its configs were not read

    def to_json(self) -> dict:
        return {
            "attempt": self.label,
            "resumed": self.resumed,
            "resume_step": self.resume_step,
            "max_steps": self.max_steps,
            "alpha": self.alpha,
            "rank": self.rank,
            "lr": self.lr,
            "optimizer": self.optimizer,
            "config": self.config,
            "problem": self.problem,
        }


def _number(v: object) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _facts(a: Attempt) -> AttemptFacts:
    try:
        cfg = load_run_config(config_files(list(a.files)))
        lora = lora_settings(cfg)
        lr, kind = (
            (cfg.value("trainer.optim.lr"), cfg.value("trainer.optim.type"))
            if "trainer" in cfg.sections
            else (None, None)
        )
    except CkptError as exc:
        return AttemptFacts(
            a.label,
            a.resumed,
            a.resume_step,
            a.max_steps,
            None,
            None,
            None,
            None,
            str(a.resolved),
            exc.message,
        )
    return AttemptFacts(
        a.label,
        a.resumed,
        a.resume_step,
        a.max_steps,
        lora.training_alpha if lora is not None else None,
        lora.training_rank if lora is not None else None,
        _number(lr),
        kind if isinstance(kind, str) else None,
        str(a.resolved),
    )


def attempt_facts(run: RunAttempts) -> list[AttemptFacts]:
    """One `AttemptFacts` per attempt of `run`, in launch order."""
    return [_facts(a) for a in run.attempts]
