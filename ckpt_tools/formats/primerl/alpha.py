"""LoRA alpha provenance, for both prime-rl generations.

A DCP checkpoint stores A and B but not alpha, rank or scale. The scale training used:

- 16e747c (Jan 2026): orchestrator `[model.lora] alpha` / rank, read from
  `outputs/<run>/configs/orch.toml`; the orchestrator's alpha defaults to 16.0 whatever the trainer's
  alpha is, while every adapter_config.json prime-rl writes carries the trainer's alpha.
- HEAD (Aug 2026): the **trainer's** `model.lora.alpha / rank`, held as a bf16 tensor in `LoRAState`
  (so training applied bf16(alpha/rank)); the rl entrypoint writes the resolved configs as JSON,
  `<run_dir>/configs/{rl,trainer}.json`. Read through `formats.primerl.config` (the same reader
  `ckpt doctor` uses: one truth for both generations' files and rules).

One order, the same for every command: --alpha; --run-config FILE (orch.toml, trainer.json or
rl.json); the run's configs, found only where prime-rl writes them for the artifact
(`run_outputs_dir`: `<outputs>/run_*/configs/orch.toml` beside `<outputs>/checkpoints/step_N/trainer`,
or `configs/{trainer,rl}.json` in `<outputs>` or the run dir above it, or under `configs/resolved/` or
`configs/latest/resolved/` there (`files.CONFIG_DIRS`); exactly one run); otherwise an
error that says how to pass it. Never a guess; the file and the rule that gave the scale are always
reported. Every alpha is validated: finite, in (0, MAX_ALPHA].
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from ...core.errors import AlphaError, CkptError, FormatError, UsageError
from ...core.lora_math import check_alpha, lora_scale
from ...io.inputs import read_json, read_toml
from .config import HEAD_JSON, config_files, load_run_config, lora_settings
from .run_dir import find_run_configs, orch_model_name, run_outputs_dir

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

# prime-rl's orchestrator LoRAConfig.alpha default (see docs/format.md, "alpha provenance").
ORCH_DEFAULT_ALPHA = 16.0


@dataclass(frozen=True)
class AlphaResolution:
    alpha: float
    source: str  # human description of where it came from
    config_path: Path | None = None
    warnings: tuple[str, ...] = ()
    rule: str | None = None  # the generation's scale rule that applied (None for --alpha)

    def scale(self, rank: int, rslora: bool = False) -> float:
        return lora_scale(self.alpha, rank, rslora)


RULE_16E747C = (
    "16e747c: scale = orchestrator [model.lora] alpha / rank (default alpha 16.0, not the trainer's; "
    "rl/train.py:101-116)"
)
RULE_HEAD = (
    "HEAD: scale = trainer model.lora.alpha / rank, held as a bf16 tensor in training "
    "(trainer lora.py:35-45; the orchestrator inherits it, configs/rl.py:538-573)"
)


def read_head_lora(path: Path) -> tuple[float, int, str]:
    """(alpha, rank, rule) of the trainer's LoRA from a HEAD JSON config (trainer.json or rl.json), read
    by the run-config reader of both generations (`formats.primerl.config`)."""
    path = Path(path)
    if not os.path.lexists(path):
        raise AlphaError("run config not found", path=path)
    files = [path]
    sibling = path.parent / ("rl.json" if path.name == "trainer.json" else "trainer.json")
    if path.name in HEAD_JSON and sibling.is_file():
        files.append(sibling)  # rl.json's shared values complete trainer.json's
    cfg = load_run_config(config_files(files))
    lora = lora_settings(cfg)
    if lora is None:
        raise AlphaError(
            "no trainer model.lora in this run config: the run is not a LoRA run",
            path=path,
            hint="pass --alpha explicitly if you know what training used",
        )
    alpha = check_alpha(lora.training_alpha, "trainer model.lora.alpha", path=path)
    return alpha, lora.training_rank, lora.rule


def read_orch_lora(path: Path, *, root: Path | None = None) -> dict:
    """The `[model.lora]` table of an orchestrator config (alpha defaulted as prime-rl does, and
    validated: a finite alpha in (0, MAX_ALPHA], a positive integer rank). `root`: the outputs
    tree a discovered config belongs to (None for one the user named)."""
    path = Path(path)
    if not os.path.lexists(path):
        raise AlphaError("run config not found", path=path)
    data, _text = read_toml(path, root=root, what="orchestrator config")
    model = data.get("model")
    if model is not None and not isinstance(model, dict):
        raise FormatError(
            f"'model' is {model!r} ({type(model).__name__}), not a [model] table",
            path=path,
            hint="pass the orchestrator config of the run (outputs/run_*/configs/orch.toml)",
        )
    lora = (model or {}).get("lora")
    if lora is None:
        raise AlphaError(
            "no [model.lora] table: this orchestrator config is not from a LoRA run",
            path=path,
            hint="pass --alpha explicitly",
        )
    if not isinstance(lora, dict):
        raise FormatError(f"'model.lora' is {lora!r} ({type(lora).__name__}), not a table", path=path)
    out = dict(lora)
    if "alpha" not in out:
        out["alpha"] = ORCH_DEFAULT_ALPHA
        out["_alpha_defaulted"] = True
    out["alpha"] = check_alpha(out["alpha"], "[model.lora] alpha", path=path)
    rank = out.get("rank")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank <= 0):
        raise FormatError(f"[model.lora] rank is {rank!r}, not a positive integer", path=path)
    return out


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


def resolve_alpha(
    *,
    alpha: float | None = None,
    run_config: str | Path | None = None,
    ckpt_dir: str | Path | None = None,
    rank: int | None = None,
) -> AlphaResolution:
    """Resolve the training alpha for a DCP checkpoint (see module docstring for the order)."""
    warnings: list[str] = []
    root = None
    if alpha is not None:
        res = AlphaResolution(check_alpha(alpha, "--alpha", error=UsageError), "--alpha")
        warnings += _alpha_contradiction(res.alpha, run_config, ckpt_dir)
    else:
        if run_config is not None:
            path, how = Path(run_config), "--run-config"
        else:
            found = find_run_configs(Path(ckpt_dir)) if ckpt_dir is not None else []
            if len(found) > 1:
                raise AlphaError(
                    "LoRA alpha is not stored in the checkpoint, and several runs' orchestrator configs "
                    f"are in its outputs dir: {', '.join(map(str, found))}",
                    path=ckpt_dir,
                    hint="pick one with --run-config ORCH_TOML, or pass --alpha",
                )
            if not found:
                outputs = run_outputs_dir(ckpt_dir) if ckpt_dir is not None else None
                where = (
                    f"no run config exists ({outputs}/run_*/configs/orch.toml, or configs/trainer.json in "
                    f"{outputs} or {outputs.parent})"
                    if outputs is not None
                    else "the checkpoint is not in prime-rl's layout (<outputs>/checkpoints/step_N/trainer), "
                    "so "
                    "no run config was looked for"
                )
                raise AlphaError(
                    f"LoRA alpha is not stored in a DCP checkpoint, and {where}. prime-rl trains with "
                    "scale = orchestrator [model.lora] alpha / rank at 16e747c (default alpha 16.0, NOT the "
                    "trainer's alpha), and trainer model.lora.alpha / rank at HEAD",
                    path=ckpt_dir,
                    hint="pass --run-config path/to/orch.toml or configs/trainer.json, or --alpha A if you "
                    "know "
                    "what training used",
                )
            path, how = found[0], "run config"
            root = run_outputs_dir(ckpt_dir)
        if Path(path).suffix == ".json":
            h_alpha, h_rank, _ = read_head_lora(path)
            if rank is not None and h_rank != rank:
                warnings.append(
                    f"{path} says rank {h_rank} but the checkpoint's LoRA rank is {rank}; "
                    "the scale uses the trainer's alpha / the checkpoint's rank"
                )
            res = AlphaResolution(
                h_alpha, f"{how} {path} (trainer model.lora.alpha)", Path(path), rule=RULE_HEAD
            )
        else:
            lora = read_orch_lora(path, root=root)
            if lora.get("_alpha_defaulted"):
                warnings.append(
                    f"{path} has no [model.lora] alpha; prime-rl's orchestrator default "
                    f"{ORCH_DEFAULT_ALPHA:g} applies"
                )
            orch_rank = lora.get("rank")
            if orch_rank is not None and rank is not None and int(orch_rank) != rank:
                warnings.append(
                    f"{path} says rank {orch_rank} but the checkpoint's LoRA rank is {rank}; "
                    f"the scale uses the orchestrator's alpha / its rank"
                )
            res = AlphaResolution(lora["alpha"], f"{how} {path}", Path(path), rule=RULE_16E747C)
    if rank is not None and ckpt_dir is not None:
        warnings += adapter_config_disagreements(
            run_adapter_configs(Path(ckpt_dir)), res.alpha / rank, rank, root=run_outputs_dir(ckpt_dir)
        )
    return AlphaResolution(res.alpha, res.source, res.config_path, tuple(warnings), res.rule)


def _alpha_contradiction(alpha: float, run_config, ckpt_dir) -> list[str]:
    """--alpha wins, but when the run's own config (--run-config, or the one beside the checkpoint)
    says another alpha, say so: both values and the file."""
    try:
        if run_config is not None:
            path, root = Path(run_config), None
        else:
            found = find_run_configs(Path(ckpt_dir)) if ckpt_dir is not None else []
            if len(found) != 1:
                return []
            path, root = found[0], run_outputs_dir(ckpt_dir)
        lora = read_orch_lora(path, root=root)
    except CkptError:  # an unreadable config is not --alpha's business: --alpha was given to avoid it
        return []
    if math.isclose(lora["alpha"], alpha, rel_tol=1e-9):
        return []
    how = "" if not lora.get("_alpha_defaulted") else " (prime-rl's default: the file sets none)"
    return [
        f"--alpha {alpha:g} contradicts the run's config {path}: [model.lora] alpha = "
        f"{lora['alpha']:g}{how}; "
        f"using --alpha {alpha:g} (scale alpha / rank), drop --alpha to use the run's"
    ]
