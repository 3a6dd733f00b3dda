"""A prime-rl TOML, edited the way a user would (restart-prep): tomlkit keeps comments, order and
formatting; only the keys of these tables change, and a config where no model name or no lr key is
found is refused, naming the keys looked for."""

from __future__ import annotations

import difflib
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

import tomlkit
from tomlkit.exceptions import TOMLKitError

from ...core.errors import FormatError
from ...core.primerl_state import SchedulerSpec

__all__ = [
    "LR_KEYS",
    "MAX_STEPS_KEYS",
    "MODEL_NAME_KEYS",
    "RESUME_KEYS",
    "SCHEDULER_TABLES",
    "TomlChange",
    "config_kind",
    "patch_config_text",
    "scheduler_from_config",
    "unified_diff",
]

# Dotted key paths in prime-rl configs: `rl` (shared [model], [trainer.*], [orchestrator.*],
# [inference.*]) and the standalone trainer (`[model]`, `[optim]`, `[ckpt]`).
MODEL_NAME_KEYS = ("model.name", "trainer.model.name", "orchestrator.model.name", "inference.model.name")
LR_KEYS = ("optim.lr", "trainer.optim.lr")
RESUME_KEYS = (
    "ckpt.resume_step",
    "ckpt.resume_dir",
    "trainer.ckpt.resume_step",
    "trainer.ckpt.resume_dir",
    "orchestrator.ckpt.resume_step",
    "orchestrator.ckpt.resume_dir",
)
SCHEDULER_TABLES = ("scheduler", "trainer.scheduler")
MAX_STEPS_KEYS = ("max_steps", "trainer.max_steps")


# ============================================================================ TOML (pure)
@dataclass(frozen=True)
class TomlChange:
    key: str
    before: object
    after: object  # None: removed

    def to_json(self) -> dict:
        return {"key": self.key, "before": self.before, "after": self.after}


def _get_parent(doc, dotted: str):
    """(table, last key) of a dotted path when every table on the way exists, else (None, None)."""
    *parents, last = dotted.split(".")
    cur = doc
    for p in parents:
        if not hasattr(cur, "get") or p not in cur:
            return None, None
        cur = cur[p]
    if not hasattr(cur, "get") or last not in cur:
        return None, None
    return cur, last


def _plain(v):
    return v.unwrap() if hasattr(v, "unwrap") else v


def patch_config_text(
    text: str,
    *,
    model_name: str | None,
    lr: float | None,
    resume_step: int | None = None,
    remove_resume: bool = False,
    rebase_from: Path | None = None,
    where: str | Path = "config",
) -> tuple[str, list[TomlChange]]:
    """Return the edited TOML text and the list of changes. `model_name` / `lr` set every key of
    `MODEL_NAME_KEYS` / `LR_KEYS` present (at least one must be); `remove_resume` deletes every
    `RESUME_KEYS` present; `resume_step` sets `ckpt.resume_step` (in every ckpt table present, or a
    new top-level `[ckpt]`); `rebase_from` (the source config's directory, when the copy is written
    elsewhere) makes relative `toml_files` entries absolute, since prime-rl resolves them relative
    to the file that names them. Nothing else changes: tomlkit keeps comments, order, formatting."""
    try:
        doc = tomlkit.parse(text)
    except TOMLKitError as exc:
        raise FormatError(f"not valid TOML: {exc}", path=where) from None
    except RecursionError:
        raise FormatError("not valid TOML: nested too deeply", path=where) from None
    changes: list[TomlChange] = []

    def set_all(keys, value, what):
        found = 0
        for dotted in keys:
            table, last = _get_parent(doc, dotted)
            if table is None:
                continue
            found += 1
            before = _plain(table[last])
            if before != value:
                table[last] = value
                changes.append(TomlChange(dotted, before, value))
        if not found:
            raise FormatError(
                f"no {what} key found: looked for {', '.join(keys)}",
                path=where,
                hint=f"add it to the config (e.g. [{keys[0].rsplit('.', 1)[0]}] "
                f"{keys[0].rsplit('.', 1)[1]} = ...) and rerun",
            )

    inherits = doc.get("toml_files")
    if rebase_from is not None and isinstance(_plain(inherits), list):
        old = [str(x) for x in _plain(inherits)]
        new = [x if os.path.isabs(x) else str((Path(rebase_from) / x).resolve()) for x in old]
        if new != old:
            doc["toml_files"] = new
            changes.append(TomlChange("toml_files", old, new))
    if model_name is not None:
        set_all(MODEL_NAME_KEYS, model_name, "model name")
    if lr is not None:
        set_all(LR_KEYS, float(lr), "learning rate")
    if remove_resume:
        for dotted in RESUME_KEYS:
            table, last = _get_parent(doc, dotted)
            if table is not None:
                changes.append(TomlChange(dotted, _plain(table[last]), None))
                del table[last]
    if resume_step is not None:
        tables = [t for t in ("ckpt", "trainer.ckpt") if _get_parent(doc, t)[0] is not None]
        if not tables:
            doc.add("ckpt", tomlkit.table())
            tables = ["ckpt"]
        for t in tables:
            table, last = _get_parent(doc, t)
            tab = table[last]
            before = _plain(tab.get("resume_step"))
            if before != resume_step:
                tab["resume_step"] = resume_step
                changes.append(TomlChange(f"{t}.resume_step", before, resume_step))
    return tomlkit.dumps(doc), changes


def config_kind(text: str) -> str:
    """`rl` for a combined prime-rl config (trainer/orchestrator/inference tables), else `trainer`."""
    doc = tomllib.loads(text)
    return "rl" if any(k in doc for k in ("trainer", "orchestrator", "inference")) else "trainer"


def scheduler_from_config(text: str, where: str | Path = "config"):
    """prime-rl's `[scheduler]` (or `[trainer.scheduler]`) of a config as a SchedulerSpec
    (constant when the config has none, as prime-rl defaults)."""
    doc = tomllib.loads(text)

    def dig(dotted):
        cur = doc
        for p in dotted.split("."):
            if not isinstance(cur, dict) or p not in cur:
                return None
            cur = cur[p]
        return cur

    sched = next((dig(t) for t in SCHEDULER_TABLES if isinstance(dig(t), dict)), None) or {}
    max_steps = next((dig(k) for k in MAX_STEPS_KEYS if isinstance(dig(k), int)), None)
    try:
        return SchedulerSpec(
            sched.get("type", "constant"),
            warmup_steps=int(sched.get("warmup_steps", 0)),
            decay_steps=int(sched.get("decay_steps", 0)),
            max_steps=max_steps,
            min_lr=float(sched.get("min_lr", 0.0)),
        )
    except (ValueError, TypeError) as exc:
        raise FormatError(f"cannot use its [scheduler] table: {exc}", path=where) from None


def unified_diff(old: str, new: str, name: str) -> str:
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{name}", f"b/{name}"))
