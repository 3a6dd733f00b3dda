"""LoRA alpha provenance.

A DCP checkpoint stores A and B but not alpha, rank or scale. prime-rl trains with
scale = orchestrator `[model.lora] alpha` / rank, read from `outputs/<run>/configs/orch.toml`; the
orchestrator's alpha defaults to 16.0 whatever the trainer's alpha is, while every
adapter_config.json prime-rl writes carries the trainer's alpha. So we resolve alpha in one order,
the same for every command: --alpha; --run-config ORCH_TOML; the run's orch.toml found next to the
checkpoint (exactly one run); otherwise an error that says how to pass it. Never a guess.
"""
from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

from .errors import AlphaError, FormatError

# prime-rl's orchestrator LoRAConfig.alpha default (see docs/format.md, "alpha provenance").
ORCH_DEFAULT_ALPHA = 16.0
_SEARCH_LEVELS = 4   # trainer -> step_N -> checkpoints -> outputs


@dataclass(frozen=True)
class AlphaResolution:
    alpha: float
    source: str                 # human description of where it came from
    config_path: Path | None = None
    warnings: tuple[str, ...] = ()

    def scale(self, rank: int, rslora: bool = False) -> float:
        return lora_scale(self.alpha, rank, rslora)


def lora_scale(alpha: float, rank: int, rslora: bool = False) -> float:
    """PEFT's scaling: alpha / r, or alpha / sqrt(r) for rsLoRA."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def _search_up(start: Path, patterns: tuple[str, ...]) -> list[Path]:
    """Matches of `patterns` in the nearest ancestor of `start` (itself included, up to the
    outputs dir) that has any."""
    p = Path(start).resolve()
    for _ in range(_SEARCH_LEVELS + 1):
        found = [f for pat in patterns for f in sorted(p.glob(pat))]
        if found:
            return found
        if p.parent == p:
            break
        p = p.parent
    return []


def find_run_configs(ckpt_dir: Path) -> list[Path]:
    """orch.toml files of the run(s) next to a checkpoint: `<outputs>/run_*/configs/orch.toml`."""
    return _search_up(ckpt_dir, ("run_*/configs/orch.toml",))


def read_orch_lora(path: Path) -> dict:
    """The `[model.lora]` table of an orchestrator config (alpha defaulted as prime-rl does)."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise AlphaError("run config not found", path=path) from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise FormatError(f"not valid TOML: {exc}", path=path) from None
    lora = data.get("model", {}).get("lora")
    if not isinstance(lora, dict):
        raise AlphaError("no [model.lora] table: this orchestrator config is not from a LoRA run",
                         path=path, hint="pass --alpha explicitly")
    out = dict(lora)
    if "alpha" not in out:
        out["alpha"] = ORCH_DEFAULT_ALPHA
        out["_alpha_defaulted"] = True
    try:
        out["alpha"] = float(out["alpha"])
    except (TypeError, ValueError):
        raise FormatError(f"[model.lora] alpha is {out['alpha']!r}, not a number", path=path) from None
    return out


def run_adapter_configs(ckpt_dir: Path) -> list[Path]:
    """adapter_config.json files prime-rl wrote for the same run (broadcasts and weight exports)."""
    return _search_up(ckpt_dir, ("run_*/broadcasts/step_*/adapter_config.json",
                                 "weights/step_*/lora_adapters/adapter_config.json"))


def adapter_config_disagreements(configs: list[Path], training_scale: float, rank: int | None) -> list[str]:
    out = []
    for c in configs:
        try:
            cfg = json.loads(c.read_text())
            a, r = float(cfg["lora_alpha"]), int(cfg["r"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        s = lora_scale(a, r, bool(cfg.get("use_rslora")))
        if not math.isclose(s, training_scale, rel_tol=1e-6):
            out.append(f"{c} says lora_alpha={a:g}, r={r} (scale {s:g}) but training used scale "
                       f"{training_scale:g}: PEFT/vLLM loading that file would apply the wrong scale")
    return out


def resolve_alpha(*, alpha: float | None = None, run_config: str | Path | None = None,
                  ckpt_dir: str | Path | None = None, rank: int | None = None) -> AlphaResolution:
    """Resolve the training alpha for a DCP checkpoint (see module docstring for the order)."""
    warnings: list[str] = []
    if alpha is not None:
        res = AlphaResolution(float(alpha), "--alpha")
    else:
        if run_config is not None:
            path, how = Path(run_config), "--run-config"
        else:
            found = find_run_configs(Path(ckpt_dir)) if ckpt_dir is not None else []
            if len(found) > 1:
                raise AlphaError(
                    "LoRA alpha is not stored in the checkpoint, and several runs' orchestrator configs "
                    f"were found next to it: {', '.join(map(str, found))}",
                    path=ckpt_dir, hint="pick one with --run-config ORCH_TOML, or pass --alpha")
            if not found:
                raise AlphaError(
                    "LoRA alpha is not stored in a DCP checkpoint, and no run config "
                    "(outputs/run_*/configs/orch.toml) was found next to it. prime-rl trains with "
                    "scale = orchestrator [model.lora] alpha / rank (default alpha 16.0, NOT the trainer's "
                    "alpha)", path=ckpt_dir,
                    hint="pass --run-config path/to/orch.toml, or --alpha A if you know what training used")
            path, how = found[0], "run config"
        lora = read_orch_lora(path)
        if lora.get("_alpha_defaulted"):
            warnings.append(f"{path} has no [model.lora] alpha; prime-rl's orchestrator default "
                            f"{ORCH_DEFAULT_ALPHA:g} applies")
        orch_rank = lora.get("rank")
        if orch_rank is not None and rank is not None and int(orch_rank) != rank:
            warnings.append(f"{path} says rank {orch_rank} but the checkpoint's LoRA rank is {rank}; "
                            f"the scale uses the orchestrator's alpha / its rank")
        res = AlphaResolution(lora["alpha"], f"{how} {path}", Path(path))
    if rank is not None and ckpt_dir is not None:
        warnings += adapter_config_disagreements(run_adapter_configs(Path(ckpt_dir)), res.alpha / rank, rank)
    return AlphaResolution(res.alpha, res.source, res.config_path, tuple(warnings))
