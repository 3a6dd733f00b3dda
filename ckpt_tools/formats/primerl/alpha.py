"""LoRA alpha provenance, for both prime-rl generations.

A DCP checkpoint stores A and B but not alpha, rank or scale. The scale training used:

- 16e747c (Jan 2026): orchestrator `[model.lora] alpha` / rank, read from
  `outputs/<run>/configs/orch.toml` (or the rl entrypoint's combined config, `[orchestrator.model.lora]`);
  the orchestrator's alpha defaults to 16.0 whatever the trainer's alpha is, while every
  adapter_config.json prime-rl writes carries the trainer's alpha.
- HEAD (Aug 2026 on): the **trainer's** `model.lora.alpha / rank`, held as a bf16 tensor in `LoRAState`
  (so training applied bf16(alpha/rank)); the rl entrypoint writes the resolved configs as JSON,
  `<run_dir>/configs/{rl,trainer}.json` (559b447), `configs/resolved/`, then one
  `configs/attempt_<n>/resolved/` per launch (`attempts`: a resume may change the alpha). Read through
  `formats.primerl.config` (the same reader `ckpt doctor` uses: one truth for both generations' files).

One order, the same for every command: --alpha; --run-config FILE (orch.toml, the combined rl TOML, a
trainer config, trainer.json or rl.json: `alpha_files.config_alpha`); the run's configs, found only where
prime-rl writes them for the artifact (`run_dir.run_config_choice`: `<outputs>/run_*/configs/orch.toml`
beside `<outputs>/checkpoints/step_N/trainer`, or the resolved JSON in `<outputs>` or the run dir above it,
of the launch attempt that wrote the checkpoint (by the step range each ran, or by time), never blindly
`latest`; exactly one run); otherwise an error that says how to pass it. Never a guess: attempts that
may have written it and disagree on alpha are an error naming each; the file, the attempt and the rule
that gave the scale are always reported. Every alpha is validated: finite, in (0, MAX_ALPHA].
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from ...core.errors import AlphaError, CkptError, UsageError
from ...core.lora_math import check_alpha, lora_scale
from ...io.inputs import as_input, read_json
from .alpha_files import (
    ORCH_DEFAULT_ALPHA,
    RULE_16E747C,
    RULE_HEAD,
    FileAlpha,
    config_alpha,
    read_head_lora,
    read_orch_lora,
)
from .run_dir import ConfigChoice, find_run_configs, orch_model_name, run_config_choice, run_outputs_dir

__all__ = [
    "ORCH_DEFAULT_ALPHA",
    "RULE_16E747C",
    "RULE_HEAD",
    "AlphaResolution",
    "adapter_config_disagreements",
    "find_run_configs",
    "orch_model_name",
    "read_head_lora",
    "read_orch_lora",
    "resolve_alpha",
    "run_adapter_configs",
    "run_outputs_dir",
]


@dataclass(frozen=True)
class AlphaResolution:
    alpha: float
    source: str  # human description of where it came from
    config_path: Path | None = None
    warnings: tuple[str, ...] = ()
    rule: str | None = None  # the generation's scale rule that applied (None for --alpha)

    def scale(self, rank: int, rslora: bool = False) -> float:
        return lora_scale(self.alpha, rank, rslora)


def run_adapter_configs(ckpt_dir: Path) -> list[Path]:
    """adapter_config.json files prime-rl wrote for the same run (broadcasts and weight exports),
    in the `<outputs>` of `run_outputs_dir` only."""
    outputs = run_outputs_dir(ckpt_dir)
    if outputs is None:
        return []
    return (
        sorted(outputs.glob("run_*/broadcasts/step_*/adapter_config.json"))
        + sorted(outputs.glob("broadcasts/step_*/adapter_config.json"))
        + sorted(outputs.glob("weights/step_*/lora_adapters/adapter_config.json"))
    )  # 16e747c, HEAD, 16e747c


def adapter_config_disagreements(
    configs: list[Path], training_scale: float, rank: int | None, root: Path | None = None
) -> list[str]:
    out = []
    for c in configs:
        try:
            cfg = read_json(c, root=root, what="adapter_config.json")
            a, r = float(cfg["lora_alpha"]), int(cfg["r"])
        except CkptError as exc:  # only a cross-check: a config we cannot read costs a warning
            out.append(f"not read: {exc}")
            continue
        except (ValueError, KeyError, TypeError, OverflowError):
            continue
        if not (math.isfinite(a) and r > 0):
            continue
        s = lora_scale(a, r, bool(cfg.get("use_rslora")))
        if not math.isclose(s, training_scale, rel_tol=1e-6):
            out.append(
                f"{c} says lora_alpha={a:g}, r={r} (scale {s:g}) but training used scale "
                f"{training_scale:g}: PEFT/vLLM loading that file would apply the wrong scale"
            )
    return out


def _rank_warning(path: Path, fa: FileAlpha, rank: int | None) -> list[str]:
    if fa.rank is None or rank is None or fa.rank == rank:
        return []
    whose = (
        "the trainer's alpha / the checkpoint's rank"
        if fa.rule == RULE_HEAD
        else "the orchestrator's alpha / its rank"
    )
    return [f"{path} says rank {fa.rank} but the checkpoint's LoRA rank is {rank}; the scale uses {whose}"]


def _from_file(
    path: Path, how: str, rank: int | None, *, root: Path | None = None, note: str = ""
) -> AlphaResolution:
    """The alpha of one config file (`config_alpha`), described as every command reports it."""
    fa = config_alpha(path, root=root)
    what = "" if (fa.key, fa.rule) == ("[model.lora] alpha", RULE_16E747C) else f" ({fa.key})"  # as before
    warnings = [*fa.warnings, *_rank_warning(path, fa, rank)]
    return AlphaResolution(fa.alpha, f"{how} {path}{what}{note}", path, tuple(warnings), fa.rule)


def _no_config(ckpt_dir: str | Path | None) -> AlphaError:
    outputs = run_outputs_dir(ckpt_dir) if ckpt_dir is not None else None
    where = (
        f"no run config exists ({outputs}/run_*/configs/orch.toml, or configs/trainer.json or "
        f"configs/attempt_<n>/resolved/trainer.json in {outputs} or {outputs.parent})"
        if outputs is not None
        else "the checkpoint is not in prime-rl's layout (<outputs>/checkpoints/step_N/trainer), so no run "
        "config "
        "was looked for"
    )
    return AlphaError(
        f"LoRA alpha is not stored in a DCP checkpoint, and {where}. prime-rl trains with scale = "
        "orchestrator "
        "[model.lora] alpha / rank at 16e747c (default alpha 16.0, NOT the trainer's alpha), and trainer "
        "model.lora.alpha / rank at HEAD",
        path=ckpt_dir,
        hint="pass --run-config path/to/orch.toml, rl.toml or configs/trainer.json, or --alpha A if you know "
        "what training used",
    )


def _undecided(
    choice: ConfigChoice, ckpt_dir: str | Path, rank: int | None, root: Path | None
) -> AlphaResolution:
    """Several launch attempts may have written the checkpoint: one alpha if they agree, else an error."""
    seen = []
    for a in choice.undecided:
        f = a.trainer_first[0] if a.trainer_first else None
        seen.append((a, _from_file(f, "run config", rank, root=root) if f is not None else None))
    alphas = {r.alpha for _, r in seen if r is not None}
    if len(alphas) == 1 and all(r is not None for _, r in seen):
        a, res = seen[-1]
        assert res is not None
        note = f"; {', '.join(x.label for x, _ in seen)} may have written it and all say alpha {res.alpha:g}"
        return replace(res, source=res.source + note)
    listed = "; ".join(f"{a.describe()}: alpha {'?' if r is None else f'{r.alpha:g}'}" for a, r in seen)
    assert choice.writer is not None
    raise AlphaError(
        f"LoRA alpha is not stored in the checkpoint, and the launches of its run that may have written it "
        f"disagree: {listed} ({choice.writer.how})",
        path=ckpt_dir,
        hint="pass the attempt's config with --run-config (configs/attempt_<n>/resolved/trainer.json), or "
        "--alpha",
    )


def _from_run(ckpt_dir: str | Path | None, rank: int | None) -> AlphaResolution:
    """The alpha of the run config prime-rl wrote for `ckpt_dir` (see the module doc)."""
    choice = run_config_choice(as_input(ckpt_dir)) if ckpt_dir is not None else ConfigChoice(())
    if len(choice.configs) > 1:
        raise AlphaError(
            "LoRA alpha is not stored in the checkpoint, and several runs' orchestrator configs are in its "
            f"outputs dir: {', '.join(map(str, choice.configs))}",
            path=ckpt_dir,
            hint="pick one with --run-config ORCH_TOML, or pass --alpha",
        )
    if not choice.configs:
        raise _no_config(ckpt_dir)
    root = run_outputs_dir(ckpt_dir) if ckpt_dir is not None else None
    if choice.undecided:
        return _undecided(choice, as_input(ckpt_dir), rank, root)
    writer = choice.writer
    note = (
        ""
        if writer is None or len(choice.attempts.attempts if choice.attempts else ()) < 2
        else f"; launch {writer.attempt.label if writer.attempt else '?'}, {writer.how}"
    )
    return _from_file(choice.configs[0], "run config", rank, root=root, note=note)


def resolve_alpha(
    *,
    alpha: float | None = None,
    run_config: str | Path | None = None,
    ckpt_dir: str | Path | None = None,
    rank: int | None = None,
) -> AlphaResolution:
    """Resolve the training alpha for a DCP checkpoint (see module docstring for the order)."""
    if alpha is not None:
        res = AlphaResolution(check_alpha(alpha, "--alpha", error=UsageError), "--alpha")
        res = replace(res, warnings=tuple(_alpha_contradiction(res.alpha, run_config, ckpt_dir)))
    elif run_config is not None:
        res = _from_file(as_input(run_config), "--run-config", rank)
    else:
        res = _from_run(ckpt_dir, rank)
    if rank is not None and ckpt_dir is not None:
        cross = adapter_config_disagreements(
            run_adapter_configs(as_input(ckpt_dir)), res.alpha / rank, rank, root=run_outputs_dir(ckpt_dir)
        )
        res = replace(res, warnings=res.warnings + tuple(cross))
    return res


def _alpha_contradiction(alpha: float, run_config, ckpt_dir) -> list[str]:
    """--alpha wins, but when the run's own config (--run-config, or the one beside the checkpoint)
    says another alpha, say so: both values and the file."""
    try:
        if run_config is not None:
            path, root = as_input(run_config), None
        else:
            found = find_run_configs(as_input(ckpt_dir)) if ckpt_dir is not None else []
            if len(found) != 1:
                return []
            path, root = found[0], run_outputs_dir(ckpt_dir)
        fa = config_alpha(path, root=root)
    except CkptError:  # an unreadable config is not --alpha's business: --alpha was given to avoid it
        return []
    if math.isclose(fa.alpha, alpha, rel_tol=1e-9):
        return []
    how = "" if not any("default" in w for w in fa.warnings) else " (prime-rl's default: the file sets none)"
    return [
        f"--alpha {alpha:g} contradicts the run's config {path}: {fa.key} = {fa.alpha:g}{how}; "
        f"using --alpha {alpha:g} (scale alpha / rank), drop --alpha to use the run's"
    ]
