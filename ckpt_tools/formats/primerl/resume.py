"""How a prime-rl run resumes, in the form its generation takes (docs/reference/primerl-head-format.md,
"since August 2026"), decided from the run's files.

- 16e747c: `ckpt.resume_step = N` in the config (`--ckpt.resume-step N`); the run writes into the same
  `output_dir`.
- HEAD (#3268, in 559b447 and after): a top-level `[resume]` block (`--resume.step N`; a bare `--resume` takes
  the newest checkpoint), and the run dir is `output_dir / run.dir` (default `run.name`, auto-generated per
  launch), so the relaunch names the same run (`--run.name NAME`); `ckpt.resume_step` is gone.

`checkpoint_generation(ckpt_dir, ...)`: the generation of the run that wrote a checkpoint: from its run config
(HEAD's resolved JSON or 16e747c's orch.toml, where prime-rl writes them), else from the checkpoint's own
marks (prime-format grouped experts, `fused` in the AdamW param group: HEAD writes False or True (#3305),
16e747c None; SignSGD exists only at HEAD). `run_name_of(ckpt_dir)`: the `run.name` of the launch attempt that
wrote it (its `rl.json`), or None. `resume_instruction(...)`: the sentence to tell the user.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

from ...core.errors import CkptError
from ...core.keys import KeyInfo, classify
from ...io.inputs import read_json
from .files import GEN_16E747C, GEN_HEAD
from .optimizers import optimizer_facts
from .run_dir import run_config_choice

__all__ = ["checkpoint_generation", "generation_of", "param_group_fused", "resume_instruction", "run_name_of"]


class _Checkpoint(Protocol):
    dir: Path
    entries: Any

    def read_object(self, key: str) -> Any: ...


def param_group_fused(ckpt: _Checkpoint, infos: Iterable[KeyInfo]) -> object:
    """Param group 0's `fused` (None when it has none: 16e747c's AdamW, SignSGD)."""
    key = next(
        (i.key for i in infos if i.group == "param_groups" and i.field == "fused" and i.group_index == 0),
        None,
    )
    return ckpt.read_object(key) if key is not None else None


def generation_of(ckpt: _Checkpoint) -> tuple[str, str]:
    """`checkpoint_generation` of an open checkpoint (its keys, its `fused`, its grouped experts)."""
    infos = [classify(k, e.path) for k, e in ckpt.entries.items()]
    experts = any(i.group == "base" and i.stacked for i in infos)
    return checkpoint_generation(ckpt.dir, infos, fused=param_group_fused(ckpt, infos), experts=experts)


def checkpoint_generation(
    ckpt_dir: str | Path, infos: Iterable[KeyInfo], *, fused: object = None, experts: bool = False
) -> tuple[str, str]:
    """(generation, what said so) of the run that wrote the checkpoint (see the module doc)."""
    configs = run_config_choice(ckpt_dir).configs
    if configs:
        return (GEN_HEAD if configs[0].suffix == ".json" else GEN_16E747C), f"run config {configs[0].name}"
    if experts:
        return GEN_HEAD, "prime-format grouped experts"
    if fused is not None:  # HEAD's AdamW: False in its default CPUOffloadOptimizer, True without (#3305)
        return GEN_HEAD, f"param_groups fused={fused}"
    if optimizer_facts(infos).name == "SignSGD":  # 16e747c had no SignSGD (#3303)
        return GEN_HEAD, "SignSGD param groups"
    return GEN_16E747C, "param_groups"  # 16e747c's plain AdamW writes fused None


def run_name_of(ckpt_dir: str | Path) -> str | None:
    """The `run.name` the launch that wrote `ckpt_dir` ran under (its attempt's resolved rl.json), or None."""
    choice = run_config_choice(ckpt_dir)
    writer = choice.writer.attempt if choice.writer is not None else None
    attempt = writer or (choice.attempts.newest if choice.attempts is not None else None)
    rl = next((f for f in (attempt.files if attempt is not None else ()) if f.name == "rl.json"), None)
    if rl is None:
        return None
    try:
        run = read_json(rl, what="prime-rl config").get("run")
    except (CkptError, AttributeError):
        return None
    name = run.get("name") if isinstance(run, dict) else None
    return name if isinstance(name, str) and name else None


def resume_instruction(
    generation: str, step: int, *, run_name: str | None = None, lr: float | None = None
) -> str:
    """What to relaunch with to resume at `step` (and `lr` in the config), in the generation's form."""
    with_lr = f" and lr {lr!r} in the config" if lr is not None else ""
    if generation == GEN_HEAD:
        name = (
            f"--run.name {run_name}"
            if run_name
            else "--run.name <the run's name: its run dir under output_dir>"
        )
        return (
            f"relaunch with --resume.step {step} {name}{with_lr} (prime-rl's [resume] block, #3268; "
            "--resume alone takes the newest checkpoint)"
        )
    return f"resume with ckpt.resume_step = {step}{with_lr} (--ckpt.resume-step {step})"
