"""prime-rl run configs of both generations, read into one view.

Where the files are (`locate_run_configs`, `config_files`, implemented in `files.py`):

- 16e747c (Jan 2026): the user's TOML, `uv run rl @ rl.toml [@ more.toml] [--trainer @ t.toml]`;
  files named by a file's top-level `toml_files = [...]` load right after it (paths relative to it)
  and override it (utils/pydantic_config.py:100-177). A run dir holds only the orchestrator's resolved
  copy, `outputs/run_*/configs/orch.toml` (orchestrator.py:79-83); the trainer's is not on disk there.
- HEAD (Aug 2026): the rl entrypoint writes the resolved `<run_dir>/configs/{rl,trainer,orchestrator,
  inference}.json` (entrypoints/rl.py:70-85).

How values are resolved (`load_run_config` -> `RunConfig.value(path)`), for a 16e747c rl config:

1. files merge in load order, later files win, **per top-level table** (pydantic-settings 2.10.1
   `_read_files`: `vars.update(...)`, sources/base.py:194-204): a later file's `[trainer]` replaces an
   earlier file's whole `[trainer]` table (verified with 16e747c's RLConfig). What that drops is
   recorded in `RunConfig.shadowed`;
2. shared top-level keys are copied down by RLConfig's validators and win over the section's own
   value (`SHARED_COPIES`, rl.py:241-385);
3. derived values: the trainer tokenizer defaults to the trainer's *own* model name while `[trainer]`
   is parsed, before the shared `[model] name` is copied down (trainer/rl/config.py:259-264); the
   orchestrator LoRA is created with the name `r{rank}-a{alpha}` and alpha **16.0** (rl.py:417-430);
4. else the schema's default (variant-aware).

HEAD files are already resolved: every value is in them. Keys a schema does not know are listed in
`RunConfig.unknown`, never guessed at. `lora_settings()` gives the LoRA rank/alpha the run trains and
serves with, by its generation's rule. No torch, no tensors.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...core.errors import FormatError
from .files import (
    GEN_16E747C,
    GEN_HEAD,
    HEAD_JSON,
    SECTIONS,
    ConfigFile,
    RunFiles,
    config_files,
    locate_run_configs,
    read_json,
    read_toml,
)
from .schema import OPTIONAL, SUB, TABLE_LIST, Schema
from .schema_16e747c import SCHEMA as SCHEMA_16E747C
from .schema_head import TRAINER_SCHEMA as SCHEMA_HEAD_TRAINER

__all__ = [
    "GEN_16E747C",
    "GEN_HEAD",
    "HEAD_JSON",
    "SECTIONS",
    "SHARED_COPIES",
    "ConfigFile",
    "LoraSettings",
    "RunConfig",
    "RunFiles",
    "Setting",
    "Shadowed",
    "UnknownKey",
    "config_files",
    "load_run_config",
    "locate_run_configs",
    "lora_settings",
    "toml_key",
]


# ------------------------------------------------------------------------------------------ view
@dataclass(frozen=True)
class Setting:
    path: str
    value: Any
    file: Path


@dataclass(frozen=True)
class UnknownKey:
    path: str  # "trainer.optim.learning_rate"
    value: Any
    file: Path
    table: str  # "trainer.optim"
    policy: str  # FORBID | DROP; None: no schema for this section (HEAD orchestrator ...)
    known: tuple[str, ...]  # the keys that table does have (for the variant in force)
    variant: str | None = None


@dataclass(frozen=True)
class Shadowed:
    path: str  # a leaf an earlier file set that a later file's table dropped
    value: Any
    file: Path
    by_file: Path
    table: str  # the top-level table the later file replaced


# (shared key, target, transform, rl.py line): RLConfig's validators copy these down, over the
# section's own value, when the shared value is not None (and, for [ckpt]/[model]/[wandb], the table
# is present). "run_default" appends the orchestrator's run dir; "-trainer" etc. suffix W&B names.
SHARED_COPIES = (
    ("log.level", "trainer.log.level", None, 245),
    ("log.level", "orchestrator.log.level", None, 246),
    ("log.file", "trainer.log.file", None, 248),
    ("log.file", "orchestrator.log.file", None, 249),
    ("ckpt.interval", "trainer.ckpt.interval", None, 267),
    ("ckpt.interval", "orchestrator.ckpt.interval", None, 268),
    ("ckpt.resume_step", "trainer.ckpt.resume_step", None, 272),
    ("ckpt.resume_step", "orchestrator.ckpt.resume_step", None, 273),
    ("ckpt.keep_last", "trainer.ckpt.keep_last", None, 277),
    ("ckpt.keep_last", "orchestrator.ckpt.keep_last", None, 278),
    ("ckpt.keep_interval", "trainer.ckpt.keep_interval", None, 281),
    ("ckpt.keep_interval", "orchestrator.ckpt.keep_interval", None, 282),
    ("wandb.project", "trainer.wandb.project", None, 298),
    ("wandb.project", "orchestrator.wandb.project", None, 299),
    ("wandb.name", "trainer.wandb.name", "-trainer", 303),
    ("wandb.name", "orchestrator.wandb.name", "-orchestrator", 304),
    ("wandb.offline", "trainer.wandb.offline", None, 308),
    ("wandb.offline", "orchestrator.wandb.offline", None, 309),
    ("model.name", "trainer.model.name", None, 338),
    ("model.name", "orchestrator.model.name", None, 339),
    ("model.name", "inference.model.name", None, 341),
    ("max_steps", "trainer.max_steps", None, 351),
    ("max_steps", "orchestrator.max_steps", None, 352),
    ("max_async_level", "trainer.max_async_level", None, 362),
    ("max_async_level", "orchestrator.max_async_level", None, 363),
    ("output_dir", "trainer.output_dir", None, 373),
    ("output_dir", "orchestrator.output_dir", "/run_default", 374),
    ("seq_len", "trainer.model.seq_len", None, 384),
    ("seq_len", "orchestrator.seq_len", None, 385),
)
# Tables RLConfig creates when a shared table is present (rl.py:259-263, 292-295).
_CREATED_BY = {
    "trainer.ckpt": "ckpt",
    "orchestrator.ckpt": "ckpt",
    "trainer.wandb": "wandb",
    "orchestrator.wandb": "wandb",
}
_OPTIONAL_SHARED = {"ckpt", "wandb", "model"}  # None unless written; [log] is always there (rl.py:241-249)
_FALSY_COPIES = {"wandb.project", "wandb.name", "wandb.offline"}  # copied only when truthy (rl.py:297-307)


@dataclass
class RunConfig:
    """One run's configuration. `value(path)` is what prime-rl would use, `origin(path)` says why."""

    generation: str
    files: RunFiles
    data: dict  # merged tree (rl root), as written
    written: dict[str, Setting] = field(default_factory=dict)
    tables: dict[str, Path] = field(default_factory=dict)  # table paths written, -> file
    unknown: list[UnknownKey] = field(default_factory=list)
    shadowed: list[Shadowed] = field(default_factory=list)

    @property
    def sections(self) -> set[str]:
        """Which of trainer / orchestrator / inference the files describe. An rl config always has a
        trainer and an orchestrator (required fields, rl.py:114-115; absent tables take defaults)."""
        out = {c.section for c in self.files.files if c.section}
        if self.is_rl:
            out |= {"trainer", "orchestrator"} | ({"inference"} if "inference" in self.data else set())
        return out

    @property
    def is_rl(self) -> bool:
        return any(c.section == "" for c in self.files.files)

    def schema_for(self, path: str) -> Schema | None:
        if self.generation == GEN_16E747C:
            return SCHEMA_16E747C
        return SCHEMA_HEAD_TRAINER if path == "trainer" or path.startswith("trainer.") else None

    def is_set(self, path: str) -> bool:
        return path in self.written

    def where(self, path: str) -> Path | None:
        s = self.written.get(path)
        return s.file if s else self.tables.get(path)

    def variant(self, table: str) -> str | None:
        schema = self.schema_for(table)
        t = schema.table(table) if schema else None
        if t is None or t.variants is None:
            return None
        v = self.written.get(f"{table}.type")
        return v.value if v is not None and isinstance(v.value, str) else t.default_variant

    def enabled(self, table: str) -> bool:
        """Is this (sub-)table on? Written, created by a shared table, or a default-on sub-table of an
        enabled parent. The root and the sections count as on when the files describe them."""
        if table in ("",) or table in SECTIONS:
            return table in self.sections or table == ""
        if table in self.tables:
            return True
        if table in self.written and self.written[table].value is None:
            return False  # `weights = "None"` turns a default-on sub-table off
        if self.generation == GEN_16E747C and self.is_rl:
            src = _CREATED_BY.get(table)
            if src and src in self.tables:
                return True
            if table == "orchestrator.model.lora" and self.enabled("trainer.model.lora"):
                return True  # rl.py:422-426
        parent, _, leaf = table.rpartition(".")
        schema = self.schema_for(table)
        t = schema.table(parent) if schema else None
        if t is None:
            return False
        marker = t.fields_for(self.variant(parent)).get(leaf)
        return marker is SUB and self.enabled(parent)

    def _copy_for(self, path: str):
        if not (self.generation == GEN_16E747C and self.is_rl):
            return None
        for src, dst, transform, line in SHARED_COPIES:
            if dst != path:
                continue
            table = src.split(".")[0] if "." in src else ""
            if table in _OPTIONAL_SHARED and table not in self.tables:
                continue
            v, _ = self._resolve(src, copies=False)
            if v is None or (src in _FALSY_COPIES and not v):
                continue
            if transform == "/run_default":
                v = f"{str(v).rstrip('/')}/run_default"
            elif transform:
                v = f"{v}{transform}"
            return v, f"copied from {_toml_key(src)} (rl.py:{line})"
        return None

    def _lora_override(self, path: str):
        """rl.py:432-434: with a trainer LoRA and an [inference] table, vLLM gets LoRA on and the
        trainer's rank, whatever [inference] says."""
        if (
            path in ("inference.enable_lora", "inference.max_lora_rank")
            and self.generation == GEN_16E747C
            and self.is_rl
            and "inference" in self.sections
            and self.enabled("trainer.model.lora")
        ):
            v = True if path.endswith("enable_lora") else self.value("trainer.model.lora.rank")
            return v, "set from the trainer's LoRA (rl.py:432-434)"
        return None

    def _resolve(self, path: str, *, copies: bool = True) -> tuple[Any, str]:
        if copies:
            c = self._copy_for(path) or self._lora_override(path)
            if c is not None:
                return c
        if path in self.written:
            return self.written[path].value, str(self.written[path].file)
        section = path.split(".")[0]
        if section in SECTIONS and section not in self.sections:
            return None, f"the {section} config is not in these files"
        parent = path.rpartition(".")[0]
        if not self.enabled(parent):
            return None, f"[{parent}] is not set (off)"
        if self.generation == GEN_16E747C:
            derived = self._derived(path)
            if derived is not None:
                return derived
        schema = self.schema_for(path)
        if schema is None:
            return None, "unknown (no schema for this section)"
        known, default = schema.field_default(path, self.variant)
        if not known:
            return None, "not a key of this prime-rl version"
        return default, "default"

    def _derived(self, path: str):
        if path in ("trainer.tokenizer.name", "trainer.tokenizer.trust_remote_code"):
            src = "trainer.model." + ("name" if path.endswith("name") else "trust_remote_code")
            v, _ = self._resolve(src, copies=False)  # before [model] is copied down (see module doc)
            return v, f"{_toml_key(src)} as written under [trainer] (trainer/rl/config.py:259-264)"
        if path == "orchestrator.model.lora.name" and self.enabled("trainer.model.lora"):
            r, a = self.value("trainer.model.lora.rank"), self.value("trainer.model.lora.alpha")
            return f"r{r}-a{float(a)}", "generated from the trainer's LoRA (rl.py:428-430)"
        return None

    def value(self, path: str):
        return self._resolve(path)[0]

    def origin(self, path: str) -> str:
        return self._resolve(path)[1]

    def default(self, path: str):
        schema = self.schema_for(path)
        return schema.field_default(path, self.variant)[1] if schema else None


def _toml_key(path: str) -> str:
    """A dotted path as the user writes it in TOML: `[trainer.optim] lr`, or `max_steps` at the top."""
    table, _, leaf = path.rpartition(".")
    return f"[{table}] {leaf}" if table else leaf


toml_key = _toml_key


def _none_string(v):
    return (
        None if v == "None" else v
    )  # prime-rl's BaseConfig turns "None" into None (pydantic_config.py:21-29)


def _walk(cfg: RunConfig, node: dict, path: str, file_of, schema_path_of) -> None:
    """Record the leaves of a merged tree with their files; list keys the schema does not know."""
    schema = cfg.schema_for(path)
    table = schema.table(schema_path_of(path)) if schema else None
    variant = table.variant_of(node) if table is not None else None
    fields = table.fields_for(variant) if table is not None else None
    for k, v in node.items():
        p = f"{path}.{k}" if path else k
        f = file_of(p)
        marker = fields.get(k) if fields is not None else None
        if fields is not None and k not in fields:
            assert table is not None  # fields come from a table
            cfg.unknown.append(UnknownKey(p, v, f, path, table.policy, tuple(fields), variant))
            continue
        if isinstance(v, dict) and (
            marker is SUB or marker is OPTIONAL or (fields is None and schema is None)
        ):
            cfg.tables[p] = f
            _walk(cfg, v, p, file_of, schema_path_of)
        elif marker is TABLE_LIST and isinstance(v, list):
            for i, item in enumerate(v):
                if isinstance(item, dict):
                    _walk(cfg, item, f"{p}[{i}]", file_of, schema_path_of)
            cfg.written[p] = Setting(p, v, f)
        else:
            if table is not None and table.policy == "forbid":
                v = _none_string(v)
            cfg.written[p] = Setting(p, v, f)


def _leaves(d: dict, prefix: str = ""):
    for k, v in d.items():
        p = f"{prefix}.{k}" if prefix else k
        if isinstance(v, dict) and v:
            yield from _leaves(v, p)
        else:
            yield p, v


def load_run_config(files: RunFiles) -> RunConfig:
    """Read the files and merge them as prime-rl does (see the module docstring)."""
    merged: dict = {}
    owner: dict[str, Path] = {}  # top-level key -> the file whose value is in force
    shadowed: list[Shadowed] = []
    for c in files.files:
        data = read_json(c.path) if c.format == "json" else read_toml(c.path)
        data = {k: v for k, v in data.items() if k != "toml_files"}
        if c.section:
            data = {c.section: data}
        for k, v in data.items():
            if k in merged and c.format == "toml" and isinstance(merged[k], dict):
                new = dict(_leaves(v)) if isinstance(v, dict) else {}
                shadowed += [
                    Shadowed(f"{k}.{p}", val, owner[k], c.path, k)
                    for p, val in _leaves(merged[k])
                    if p not in new
                ]
            merged[k] = v
            owner[k] = c.path
    cfg = RunConfig(files.generation, files, merged, shadowed=shadowed)

    def file_of(p: str) -> Path:
        return owner[p.split(".")[0].split("[")[0]]

    def schema_path_of(p: str) -> str:
        return re.sub(r"\[\d+\]", "", p)

    for k, v in merged.items():
        f = owner[k]
        schema = cfg.schema_for(k)
        root = schema.table("") if schema is not None else None
        if cfg.generation == GEN_HEAD and k != "trainer":
            if isinstance(v, dict):
                cfg.tables[k] = f
                _walk(cfg, v, k, file_of, schema_path_of)
            else:
                cfg.written[k] = Setting(k, v, f)
            continue
        if root is not None and k not in root.fields:
            cfg.unknown.append(UnknownKey(k, v, f, "", root.policy, tuple(root.fields)))
        elif isinstance(v, dict):
            cfg.tables[k] = f
            _walk(cfg, v, k, file_of, schema_path_of)
        else:
            cfg.written[k] = Setting(k, _none_string(v), f)
    return cfg


# ------------------------------------------------------------------------------------------ LoRA
@dataclass(frozen=True)
class LoraSettings:
    """The LoRA a run trains and serves with, by its generation's rule."""

    generation: str
    trainer_rank: int
    trainer_alpha: float
    orchestrator_rank: int | None
    orchestrator_alpha: float | None
    training_alpha: float  # the alpha of the scale the trainer's forward applies
    training_rank: int
    served_alpha: float  # what adapter_config.json claims (vLLM scales by it)
    served_rank: int
    rule: str  # the rule, with its source

    @property
    def training_scale(self) -> float:
        return self.training_alpha / self.training_rank

    @property
    def served_scale(self) -> float:
        return self.served_alpha / self.served_rank

    @property
    def consistent(self) -> bool:
        return math.isclose(self.training_scale, self.served_scale, rel_tol=1e-9)


def _number(cfg: RunConfig, path: str, kind):
    """The value at `path` as `kind` (float for an alpha, int for a rank), as pydantic's lax mode
    takes it (a number, or a string of one); anything else (a TOML datetime, an array, a table, a
    bool) is a FormatError naming the key and its file, not a TypeError."""
    v = cfg.value(path)
    if v is None:
        return None
    try:
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            raise TypeError
        out = kind(v)
        if kind is float and not math.isfinite(out):
            raise ValueError
        return out
    except (TypeError, ValueError, OverflowError):
        where = cfg.where(path)
        raise FormatError(
            f"{toml_key(path)} = {str(v)[:80]!r} ({type(v).__name__}) is not "
            f"{'a finite number' if kind is float else 'an integer'}",
            path=where,
            key=path,
            hint="prime-rl's config validation refuses it too; fix the value",
        ) from None


def lora_settings(cfg: RunConfig) -> LoraSettings | None:
    """None when the run has no LoRA (or the files do not say)."""
    if cfg.generation == GEN_HEAD:
        if not cfg.enabled("trainer.model.lora"):
            return None
        r, a = _number(cfg, "trainer.model.lora.rank", int), _number(cfg, "trainer.model.lora.alpha", float)
        return LoraSettings(
            GEN_HEAD,
            r,
            a,
            None,
            None,
            a,
            r,
            a,
            r,
            "HEAD: scale = trainer model.lora.alpha / rank (trainer lora.py:35-45); the "
            "orchestrator inherits both, conflicts raise (configs/rl.py:538-573)",
        )
    have_trainer = "trainer" in cfg.sections
    have_orch = "orchestrator" in cfg.sections
    if have_trainer and not cfg.enabled("trainer.model.lora"):
        return None
    if not have_trainer and not (have_orch and cfg.enabled("orchestrator.model.lora")):
        return None
    o_rank = _number(cfg, "orchestrator.model.lora.rank", int) if have_orch else None
    o_alpha = _number(cfg, "orchestrator.model.lora.alpha", float) if have_orch else None
    if have_trainer:
        t_rank, t_alpha = (
            _number(cfg, "trainer.model.lora.rank", int),
            _number(cfg, "trainer.model.lora.alpha", float),
        )
    else:  # a run dir's orch.toml: the trainer's LoRA is in the generated name r{rank}-a{alpha}
        m = re.fullmatch(r"r(\d+)-a([0-9.eE+-]+)", str(cfg.value("orchestrator.model.lora.name") or ""))
        if not m:
            return None
        t_rank, t_alpha = int(m.group(1)), float(m.group(2))
    if o_alpha is None:
        o_alpha = 16.0  # the orchestrator LoRAConfig default rl.py creates (orchestrator/config.py:35-56)
    train_rank = int(o_rank) if o_rank is not None else t_rank
    return LoraSettings(
        GEN_16E747C,
        t_rank,
        t_alpha,
        int(o_rank) if o_rank is not None else None,
        o_alpha,
        o_alpha,
        train_rank,
        t_alpha,
        t_rank,
        "16e747c: scale = orchestrator [model.lora] alpha / (its rank or the trainer's) "
        "(rl/train.py:101-116, runs.py:212-218); adapter_config.json carries the trainer's "
        "alpha/rank (lora.py:237-279)",
    )
