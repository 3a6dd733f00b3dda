"""The LoRA alpha one prime-rl config file says training applied, by its kind and generation's rule.

- HEAD JSON (`trainer.json`, `rl.json` of a run's resolved configs): the trainer's `model.lora.alpha`;
- 16e747c orchestrator TOML (`outputs/run_*/configs/orch.toml`): its `[model.lora] alpha`, default 16.0;
- the `rl` entrypoint's combined TOML (`uv run rl @ rl.toml`, e.g. a downloaded repo's `code/rl_32b.toml`):
  16e747c: `[orchestrator.model.lora] alpha` (default 16.0, whatever `[trainer.model.lora] alpha` says),
  over the orchestrator's rank or the trainer's; HEAD (a launch attempt's `rl.toml`, or `[run]`/`[resume]`
  in it): `[trainer.model.lora] alpha` (default 32.0), which the orchestrator inherits;
- a trainer TOML: HEAD: its `[model.lora] alpha`; 16e747c trained with the orchestrator's alpha, which a
  trainer config does not hold, so it is refused there (and where the file does not say which prime-rl
  wrote it), naming the files that do say.

`config_alpha(path)` -> `FileAlpha` (alpha, rank, the key it came from, the rule, warnings); every alpha is
validated (finite, in (0, MAX_ALPHA]). The kind is `kinds.toml_kind`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ...core.errors import AlphaError, FormatError
from ...core.lora_math import check_alpha
from ...io.inputs import as_input, lexists, read_toml
from .config import HEAD_JSON, config_files, load_run_config, lora_settings
from .files import GEN_HEAD
from .kinds import ORCHESTRATOR, RL, TomlKind, toml_kind

__all__ = [
    "HEAD_DEFAULT_ALPHA",
    "ORCH_DEFAULT_ALPHA",
    "RULE_16E747C",
    "RULE_HEAD",
    "FileAlpha",
    "config_alpha",
    "read_head_lora",
    "read_orch_lora",
]

# prime-rl's orchestrator LoRAConfig.alpha default at 16e747c (see docs/format.md, "alpha provenance").
ORCH_DEFAULT_ALPHA = 16.0
# HEAD's trainer LoRAConfig.alpha default (configs/trainer.py:103-128 at 559b447).
HEAD_DEFAULT_ALPHA = 32.0
_HEAD_DEFAULT_RANK = 16

RULE_16E747C = (
    "16e747c: scale = orchestrator [model.lora] alpha / rank (default alpha 16.0, not the trainer's; "
    "rl/train.py:101-116)"
)
RULE_HEAD = (
    "HEAD: scale = trainer model.lora.alpha / rank, held as a bf16 tensor in training "
    "(trainer lora.py:35-45; the orchestrator inherits it, configs/rl.py:538-573)"
)
_NAMED_HINT = (
    "pass the run's orchestrator config (outputs/run_*/configs/orch.toml), its combined rl config, "
    "HEAD's configs/.../trainer.json, or --alpha A if you know what training used"
)


@dataclass(frozen=True)
class FileAlpha:
    alpha: float
    rank: int | None  # the rank the file's rule divides by (None: the checkpoint's)
    key: str  # where in the file: "trainer model.lora.alpha", "[orchestrator.model.lora] alpha", ...
    rule: str
    warnings: tuple[str, ...] = ()


def _missing(path: Path) -> None:
    if not lexists(path):
        raise AlphaError("run config not found", path=path)


def read_head_lora(path: Path) -> tuple[float, int, str]:
    """(alpha, rank, rule) of the trainer's LoRA from a HEAD JSON config (trainer.json or rl.json), read
    by the run-config reader of both generations (`formats.primerl.config`)."""
    path = as_input(path)
    _missing(path)
    files = [path]
    sibling = path.parent / ("rl.json" if path.name == "trainer.json" else "trainer.json")
    if path.name in HEAD_JSON and sibling.is_file():
        files.append(sibling)  # rl.json's shared values complete trainer.json's
    lora = lora_settings(load_run_config(config_files(files)))
    if lora is None:
        raise AlphaError(
            "no trainer model.lora in this run config: the run is not a LoRA run",
            path=path,
            hint="pass --alpha explicitly if you know what training used",
        )
    alpha = check_alpha(lora.training_alpha, "trainer model.lora.alpha", path=path)
    return alpha, lora.training_rank, lora.rule


def _lora_table(data: Mapping, where: str, path: Path) -> dict | None:
    """The `[<where>.lora]` table of `data` (None when absent), refused when not a table."""
    node: object = data
    walked: list[str] = []
    for part in [*where.split("."), "lora"]:
        if node is None:
            return None
        if not isinstance(node, Mapping):
            # name the key that holds the non-table, not the table we were looking for
            raise FormatError(
                f"'{'.'.join(walked)}' is {node!r} ({type(node).__name__}), not a [{'.'.join(walked)}] table",
                path=path,
                hint="pass a prime-rl config (outputs/run_*/configs/orch.toml, rl.toml)",
            )
        node = node.get(part)
        walked.append(part)
    if node is not None and not isinstance(node, Mapping):
        raise FormatError(f"'{where}.lora' is {node!r} ({type(node).__name__}), not a table", path=path)
    return dict(node) if node is not None else None


def _rank(value: object, key: str, path: Path) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise FormatError(f"{key} is {value!r}, not a positive integer", path=path)
    return value if isinstance(value, int) else None


def read_orch_lora(path: Path, *, root: Path | None = None) -> dict:
    """The `[model.lora]` table of an orchestrator config (alpha defaulted as prime-rl does, and
    validated: a finite alpha in (0, MAX_ALPHA], a positive integer rank). `root`: the outputs
    tree a discovered config belongs to (None for one the user named)."""
    path = as_input(path)
    _missing(path)
    return _orch_lora(read_toml(path, root=root, what="orchestrator config")[0], path)


def _orch_lora(data: Mapping, path: Path) -> dict:
    lora = _lora_table(data, "model", path)
    if lora is None:
        raise AlphaError(
            "no [model.lora] table: this orchestrator config is not from a LoRA run",
            path=path,
            hint="pass --alpha explicitly",
        )
    if "alpha" not in lora:
        lora["alpha"], lora["_alpha_defaulted"] = ORCH_DEFAULT_ALPHA, True
    lora["alpha"] = check_alpha(lora["alpha"], "[model.lora] alpha", path=path)
    _rank(lora.get("rank"), "[model.lora] rank", path)
    return lora


def _orch_alpha(data: Mapping, path: Path) -> FileAlpha:
    lora = _orch_lora(data, path)
    warn = (
        (f"{path} has no [model.lora] alpha; prime-rl's orchestrator default {ORCH_DEFAULT_ALPHA:g} applies",)
        if lora.get("_alpha_defaulted")
        else ()
    )
    return FileAlpha(lora["alpha"], lora.get("rank"), "[model.lora] alpha", RULE_16E747C, warn)


def _rl_16e747c(path: Path) -> FileAlpha:
    """16e747c's combined config: the orchestrator's alpha (rl.py creates it with 16.0), over its rank or
    the trainer's, read with prime-rl's merge rules (`config.load_run_config`)."""
    cfg = load_run_config(config_files([path]))
    lora = lora_settings(cfg)
    if lora is None:
        raise AlphaError(
            "no [trainer.model.lora] table: this rl config is not from a LoRA run",
            path=path,
            hint="pass --alpha explicitly",
        )
    alpha = check_alpha(lora.training_alpha, "[orchestrator.model.lora] alpha", path=path)
    warn: tuple[str, ...] = ()
    if not cfg.is_set("orchestrator.model.lora.alpha"):
        other = (
            f" (not [trainer.model.lora] alpha {lora.trainer_alpha:g})"
            if lora.trainer_alpha != ORCH_DEFAULT_ALPHA
            else ""
        )
        warn = (
            f"{path} has no [orchestrator.model.lora] alpha; prime-rl's orchestrator default "
            f"{ORCH_DEFAULT_ALPHA:g} applies{other}",
        )
    return FileAlpha(alpha, lora.training_rank, "[orchestrator.model.lora] alpha", RULE_16E747C, warn)


def _head_toml(data: Mapping, path: Path, where: str, kind: TomlKind) -> FileAlpha:
    """HEAD's rule from a TOML: the trainer's alpha (default 32.0) over its rank (default 16)."""
    lora = _lora_table(data, where, path)
    if lora is None:
        raise AlphaError(
            f"no [{where}.lora] table: this config is not from a LoRA run",
            path=path,
            hint="pass --alpha explicitly",
        )
    alpha = check_alpha(lora.get("alpha", HEAD_DEFAULT_ALPHA), f"[{where}.lora] alpha", path=path)
    rank = _rank(lora.get("rank", _HEAD_DEFAULT_RANK), f"[{where}.lora] rank", path)
    warn: list[str] = []
    if "alpha" not in lora:
        warn.append(f"{path} has no [{where}.lora] alpha; prime-rl's default {HEAD_DEFAULT_ALPHA:g} applies")
    if kind.kind == RL:
        orch = _lora_table(data, "orchestrator.model", path) or {}
        if "alpha" in orch and orch["alpha"] != alpha:
            warn.append(
                f"{path}: [orchestrator.model.lora] alpha {orch['alpha']!r} differs from the trainer's "
                f"{alpha:g}; prime-rl refuses that config (configs/rl.py:538-573); using the trainer's"
            )
    return FileAlpha(alpha, rank, f"[{where}.lora] alpha", RULE_HEAD, tuple(warn))


def _toml_alpha(path: Path, root: Path | None) -> FileAlpha:
    data, _ = read_toml(path, root=root, what="prime-rl config")
    kind = toml_kind(data, path)
    if kind.kind == ORCHESTRATOR:
        if kind.generation == GEN_HEAD:
            return _head_orch(data, path)
        return _orch_alpha(data, path)
    if kind.kind == RL:
        return (
            _head_toml(data, path, "trainer.model", kind)
            if kind.generation == GEN_HEAD
            else _rl_16e747c(path)
        )
    if kind.generation == GEN_HEAD:
        return _head_toml(data, path, "model", kind)
    said = (lambda lo: f" says alpha {lo.get('alpha', 'unset')}")(_lora_table(data, "model", path) or {})
    gen = (
        "prime-rl 16e747c" if kind.generation else "the file does not say which prime-rl wrote it; at 16e747c"
    )
    raise AlphaError(
        f"a trainer config ({kind.why}){said}: {gen} training applied the orchestrator's [model.lora] alpha "
        f"(default {ORCH_DEFAULT_ALPHA:g}), which a trainer config does not hold (after August 2026 it is "
        "the "
        "trainer's own)",
        path=path,
        hint=_NAMED_HINT,
    )


def _head_orch(data: Mapping, path: Path) -> FileAlpha:
    """HEAD's orchestrator config inherits the trainer's alpha unless it sets one (which must equal it)."""
    lora = _lora_table(data, "model", path) or {}
    if "alpha" not in lora:
        raise AlphaError(
            "a HEAD orchestrator config without [model.lora] alpha: it inherits the trainer's, "
            "which this file does not hold",
            path=path,
            hint=_NAMED_HINT,
        )
    alpha = check_alpha(lora["alpha"], "[model.lora] alpha", path=path)
    return FileAlpha(
        alpha, _rank(lora.get("rank"), "[model.lora] rank", path), "[model.lora] alpha", RULE_HEAD
    )


def config_alpha(path: str | Path, *, root: Path | None = None) -> FileAlpha:
    """The alpha training applied, as the config file at `path` says it (see the module doc). `root`:
    the run tree a found config belongs to (None for one the user named)."""
    path = as_input(path)
    _missing(path)
    if path.suffix == ".json":
        alpha, rank, _rule = read_head_lora(path)
        return FileAlpha(alpha, rank, "trainer model.lora.alpha", RULE_HEAD)
    return _toml_alpha(path, root)
