"""A prime-rl run launched more than once (after August 2026): one config dir per launch attempt.

``make_head_attempts(out_dir, [spec_1, spec_2, ...], resume_steps=[k_2, ...])`` trains ``spec_1`` from
scratch (``make_head_run``), then each later attempt resumes from ``checkpoints/step_<k>`` with its own spec
(another alpha, lr, optimizer ... as a user relaunching with ``--resume.step k`` and an edited config would),
for real on gloo ranks (``head_train.train_child(resume_step=k)``: model and optimizer state loaded, the
param groups not: prime-rl's default CPU-offloaded optimizer). The configs are laid out as prime-rl's
launcher writes them (``utils/pathing.py``: ``create_attempt_dirs``, ``write_launch_artifacts``), in the
trainer's ``output_dir`` (the run dir, ``outputs``)::

    outputs/configs/attempt_<n>/resolved/trainer.json   the attempt's resolved TrainerConfig (resume.step)
    outputs/configs/attempt_<n>/resolved/rl.json        the rl root: run name, resume, the shared model
    outputs/configs/attempt_<n>/rl.toml                 the launch TOML (the attempt's alpha and lr)
    outputs/configs/attempt_<n>/command.txt             the command, shell-quoted
    outputs/configs/latest -> attempt_<last>            relative symlink (``latest="link"``), or a plain copy
                                                        of the last attempt (``"copy"``: an object store), a
                                                        link to nothing (``"dangling"``), or absent (``None``)

``run_info.json`` gains ``attempts``: for each, its number, spec, resume step and the checkpoint steps it
wrote. The checkpoint of a step an attempt wrote was trained (up to it) with that attempt's alpha.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path

from tests.factory.factory import FactoryError, run_distributed
from tests.factory.head_factory import make_head_run
from tests.factory.head_files import trainer_config, write_json
from tests.factory.head_spec import HeadRunPaths, HeadSpec, head_paths
from tests.factory.head_train import RAW_FACTS, RAW_TRUTH
from tests.factory.head_truth import write_truth

__all__ = ["AttemptRun", "make_head_attempts", "RUN_NAME"]

RUN_NAME = "reverse-text--base-model--h36"


@dataclass(frozen=True)
class AttemptRun:
    paths: HeadRunPaths  # the last attempt's view (its reference / expected dir), every checkpoint
    run_dir: Path  # outputs: the trainer's output_dir, which holds configs/ and checkpoints/
    specs: tuple[HeadSpec, ...]
    resume_steps: tuple[int | None, ...]  # per attempt: None (fresh) or the step it resumed from
    wrote: tuple[tuple[int, ...], ...]  # per attempt: the checkpoint steps it wrote

    def attempt_of(self, step: int) -> int:
        """The attempt number (1-based) whose save is the checkpoint of ``step`` now on disk."""
        return max(i + 1 for i, steps in enumerate(self.wrote) if step in steps)

    def config_dir(self, n: int) -> Path:
        return self.run_dir / "configs" / f"attempt_{n}"


def _rl_toml(spec: HeadSpec) -> str:
    lines = ["[model]", 'name = "base_model"', "", "[trainer.optim]", f"lr = {spec.lr!r}"]
    if spec.optimizer != "adamw":
        lines.append(f'type = "{spec.optimizer}"')
    if spec.lora:
        lines += [
            "",
            "[trainer.model.lora]",
            f"rank = {spec.lora_rank}",
            f"alpha = {float(spec.lora_alpha)!r}",
        ]
    return "\n".join(lines) + "\n"


def _write_attempt(run_dir: Path, n: int, spec: HeadSpec, resume_step: int | None) -> None:
    d = run_dir / "configs" / f"attempt_{n}"
    trainer = trainer_config(spec, resume_step)
    trainer["output_dir"] = "outputs"
    resume = None if resume_step is None else {"step": resume_step, "dir": None}
    write_json(d / "resolved" / "trainer.json", trainer)
    write_json(
        d / "resolved" / "rl.json",
        {
            "run": {"name": RUN_NAME, "dir": None},
            "output_dir": ".",
            "resume": resume,
            "model": {"name": "base_model"},
        },
    )
    (d / "rl.toml").write_text(_rl_toml(spec))
    argv = ["uv", "run", "rl", "@", "rl.toml", "--run.name", RUN_NAME]
    if resume_step is not None:
        argv += ["--resume.step", str(resume_step)]
    (d / "command.txt").write_text(shlex.join(argv) + "\n")


def _point_latest(configs: Path, n: int, how: str | None) -> None:
    latest = configs / "latest"
    if how == "link":
        os.symlink(f"attempt_{n}", latest)
    elif how == "copy":
        shutil.copytree(configs / f"attempt_{n}", latest)
    elif how == "dangling":
        os.symlink(f"attempt_{n + 7}", latest)
    elif how is not None:
        raise ValueError(f"latest={how!r}: one of 'link', 'copy', 'dangling', None")


def make_head_attempts(out_dir: str | os.PathLike, specs: list[HeadSpec], resume_steps: list[int],
                       *, latest: str | None = "link") -> AttemptRun:
    """Train ``specs[0]`` fresh, then ``specs[i]`` resuming from ``resume_steps[i - 1]`` (see the module doc).
    Each attempt's configs are written at its launch, before its checkpoints (their times say so)."""
    if len(resume_steps) != len(specs) - 1:
        raise ValueError("one resume step per attempt after the first")
    launched = time.time()
    first = make_head_run(out_dir, specs[0])
    root = first.root
    run_dir = root / "outputs"
    first.trainer_config.unlink()  # this layout keeps its configs in the run dir, per attempt
    first.trainer_config.parent.rmdir()
    _write_attempt(run_dir, 1, specs[0], None)
    for f in (run_dir / "configs" / "attempt_1").rglob("*"):
        os.utime(f, (launched, launched))
    wrote = [tuple(specs[0].checkpoint_steps())]
    checkpoints = dict(first.checkpoints)
    for n, (spec, k) in enumerate(zip(specs[1:], resume_steps), start=2):
        if k not in checkpoints:
            raise ValueError(f"attempt {n} resumes from step {k}, which has no checkpoint ({sorted(checkpoints)})")
        if spec.world_size != specs[0].world_size or spec.arch != specs[0].arch or spec.lora != specs[0].lora:
            raise ValueError("every attempt trains the same model on the same world size")
        _write_attempt(run_dir, n, spec, k)
        run_distributed("tests.factory.head_train:train_child", spec.world_size, (spec.to_dict(), str(root), k))
        steps = tuple(s for s in spec.checkpoint_steps() if s > k)
        paths = head_paths(root, spec)
        checkpoints.update({s: paths.checkpoints[s] for s in steps})
        missing = [str(checkpoints[s]) for s in steps if not checkpoints[s].is_dir()]
        if missing:
            raise FactoryError(f"attempt {n} did not write {missing}")
        write_truth(replace(paths, checkpoints=dict(sorted(checkpoints.items()))), spec, root / RAW_TRUTH,
                    root / RAW_FACTS, {})
        wrote.append(steps)
    _point_latest(run_dir / "configs", len(specs), latest)
    last = replace(head_paths(root, specs[-1]), checkpoints=dict(sorted(checkpoints.items())))
    info = json.loads(last.run_info.read_text())
    info["attempts"] = [{"attempt": i + 1, "spec": s.to_dict(), "resume_step": ([None] + list(resume_steps))[i],
                         "wrote": list(w)} for i, (s, w) in enumerate(zip(specs, wrote))]
    last.run_info.write_text(json.dumps(info, indent=2) + "\n")
    return AttemptRun(last, run_dir, tuple(specs), (None, *resume_steps), tuple(wrote))
