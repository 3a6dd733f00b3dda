"""The traps of a run launched more than once (prime-rl after August 2026: one config dir per launch
attempt, `formats.primerl.attempts`): launches that trained with different LoRA alphas or lrs. Each
checkpoint's scale is the alpha of the launch that wrote it; `ckpt inspect` names that launch."""

from __future__ import annotations

from .facts import INFO, WARNING, Finding, RunFacts, ckpt_command, finding

__all__ = ["attempts_differ"]

_SOURCE = "utils/pathing.py create_attempt_dirs (after 559b447); trainer lora.py:35-45"


def _listed(facts: RunFacts, what: str) -> str:
    parts = []
    for a in facts.attempts:
        steps = sorted(s for s, label in facts.written_by.items() if label == a.label)
        wrote = f", wrote step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))}" if steps else ""
        parts.append(f"{a.label}: {what} {getattr(a, what)!r}{wrote}")
    return "; ".join(parts)


def attempts_differ(facts: RunFacts) -> list[Finding]:
    if len(facts.attempts) < 2:
        return []
    out = []
    ck = facts.checkpoints_dir or "outputs/checkpoints"
    if len({a.alpha for a in facts.attempts if a.alpha is not None}) > 1:
        out.append(
            finding(
                facts.config,
                "attempts-alpha",
                WARNING,
                "trainer.model.lora.alpha",
                f"the run's launches trained with different LoRA alphas ({_listed(facts, 'alpha')}): each "
                "checkpoint's scale is the alpha of the launch that wrote it, and each broadcast's "
                "adapter_config.json says its own launch's",
                f"{ckpt_command('inspect', f'{ck}/step_N/trainer')}  (names the launch that wrote a "
                "checkpoint); --run-config configs/attempt_<n>/resolved/trainer.json pins one",
                _SOURCE,
            )
        )
    if len({a.lr for a in facts.attempts if a.lr is not None}) > 1:
        out.append(
            finding(
                facts.config,
                "attempts-lr",
                INFO,
                "trainer.optim.lr",
                f"the run's launches set different lrs ({_listed(facts, 'lr')}); with the optimizer "
                "CPU-offloaded "
                "(the default) a resumed launch runs at its own lr, without it at the checkpoint's",
                ckpt_command("report", ck),
                "trainer/ckpt.py:104-124 (559b447)",
            )
        )
    return out
