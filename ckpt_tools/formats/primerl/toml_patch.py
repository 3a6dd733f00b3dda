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
from .files import GEN_16E747C, GEN_HEAD

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
    # HEAD (#3268): the top-level [resume] block (a trainer config's own [resume]); `resume = true` is a
    # bare --resume
    "resume.step",
    "resume.dir",
    "trainer.resume.step",
    "trainer.resume.dir",
    "resume",
    "trainer.resume",
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


def _parse(text: str, where: str | Path):
    try:
        return tomlkit.parse(text)
    except TOMLKitError as exc:
        raise FormatError(f"not valid TOML: {exc}", path=where) from None
    except RecursionError:
        raise FormatError("not valid TOML: nested too deeply", path=where) from None


def _set_all(doc, keys, value, what: str, changes: list[TomlChange], where) -> None:
    """Set every dotted key of `keys` present in `doc` to `value`; at least one must be."""
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


def _rebase_includes(doc, rebase_from: Path | None, changes: list[TomlChange]) -> None:
    inherits = doc.get("toml_files")
    if rebase_from is None or not isinstance(_plain(inherits), list):
        return
    old = [str(x) for x in _plain(inherits)]
    new = [x if os.path.isabs(x) else str((Path(rebase_from) / x).resolve()) for x in old]
    if new != old:
        doc["toml_files"] = new
        changes.append(TomlChange("toml_files", old, new))


def _remove(doc, dotted_keys, changes: list[TomlChange]) -> None:
    for dotted in dotted_keys:
        table, last = _get_parent(doc, dotted)
        if table is not None:
            changes.append(TomlChange(dotted, _plain(table[last]), None))
            del table[last]


def _set_in(doc, table_path: str, key: str, value, changes: list[TomlChange]) -> None:
    """`[table_path] key = value`, the table created at the top when absent."""
    table, last = _get_parent(doc, table_path)
    if table is None:
        doc.add(table_path, tomlkit.table())
        table, last = _get_parent(doc, table_path)
    tab = table[last]
    before = _plain(tab.get(key))
    if before != value:
        tab[key] = value
        changes.append(TomlChange(f"{table_path}.{key}", before, value))


def _set_resume(doc, step: int, form: str, run_name: str | None, changes: list[TomlChange]) -> None:
    """16e747c: `ckpt.resume_step` in every ckpt table present (or a new `[ckpt]`); HEAD: `[resume] step`
    (the old keys and `resume.dir` removed: step and dir are exclusive) and, for an rl config, the run's
    `[run] name` (a relaunch without it makes a new run dir)."""
    if form == GEN_HEAD:
        stale = [k for k in RESUME_KEYS if "ckpt." in k or k.endswith("resume.dir")]
        stale += [k for k in ("resume", "trainer.resume") if not isinstance(_plain(doc.get(k)), dict)]
        _remove(doc, stale, changes)
        where = "trainer.resume" if _get_parent(doc, "trainer.resume")[0] is not None else "resume"
        _set_in(doc, where, "step", step, changes)
        if run_name is not None and any(k in doc for k in ("trainer", "orchestrator", "inference", "run")):
            _set_in(doc, "run", "name", run_name, changes)
        return
    tables = [t for t in ("ckpt", "trainer.ckpt") if _get_parent(doc, t)[0] is not None] or ["ckpt"]
    for t in tables:
        _set_in(doc, t, "resume_step", step, changes)


def patch_config_text(
    text: str,
    *,
    model_name: str | None,
    lr: float | None,
    resume_step: int | None = None,
    remove_resume: bool = False,
    rebase_from: Path | None = None,
    where: str | Path = "config",
    resume_form: str = GEN_16E747C,
    run_name: str | None = None,
) -> tuple[str, list[TomlChange]]:
    """Return the edited TOML text and the list of changes. `model_name` / `lr` set every key of
    `MODEL_NAME_KEYS` / `LR_KEYS` present (at least one must be); `remove_resume` deletes every
    `RESUME_KEYS` present; `resume_step` makes the config resume at that step in the `resume_form` of its
    prime-rl generation (`_set_resume`: 16e747c's `ckpt.resume_step`, HEAD's `[resume] step` and
    `[run] name = run_name`); `rebase_from` (the source config's directory, when the copy is written
    elsewhere) makes relative `toml_files` entries absolute, since prime-rl resolves them relative
    to the file that names them. Nothing else changes: tomlkit keeps comments, order, formatting."""
    doc = _parse(text, where)
    changes: list[TomlChange] = []
    _rebase_includes(doc, rebase_from, changes)
    if model_name is not None:
        _set_all(doc, MODEL_NAME_KEYS, model_name, "model name", changes, where)
    if lr is not None:
        _set_all(doc, LR_KEYS, float(lr), "learning rate", changes, where)
    if remove_resume:
        _remove(doc, RESUME_KEYS, changes)
    if resume_step is not None:
        _set_resume(doc, resume_step, resume_form, run_name, changes)
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
