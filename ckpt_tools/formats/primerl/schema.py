"""Which keys prime-rl's config classes have, with their defaults, per generation.

A schema is a set of tables keyed by dotted path ("trainer.optim"). Each table says what prime-rl does
with a key it does not know:

- FORBID: the table is a prime-rl `BaseConfig` (`extra="forbid"`, utils/pydantic_config.py:18-19 at
  16e747c): an unknown key stops the launch with `Extra inputs are not permitted`;
- DROP: the table is a plain pydantic `BaseModel` (16e747c's optimizer, scheduler, weight-broadcast
  and rollout-transport configs): an unknown key vanishes silently and its default applies.

A field's default is a plain value, or one of the markers below for what is not a plain value: a
sub-table that is always there (SUB), one that is off (None) unless written (OPTIONAL), an array of
tables (TABLE_LIST), a required field (REQUIRED), a free-form value whose inner keys are the user's
(FREE, e.g. HTTP headers). A table with a discriminator (`type`) has one field set per variant; a
table written without `type` takes the default's variant (pydantic-settings'
`nested_model_default_partial_update`, verified: `[trainer.optim] lr = 1e-5` stays AdamW).

The data lives in `schema_16e747c` and `schema_head`; this module is the machinery only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "DISCRIMINATOR",
    "DROP",
    "FORBID",
    "FREE",
    "OPTIONAL",
    "REQUIRED",
    "SUB",
    "TABLE_LIST",
    "Schema",
    "T",
    "Table",
    "V",
    "plain_default",
]

FORBID = "forbid"
DROP = "drop"
DISCRIMINATOR = "type"


class _Marker:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


SUB = _Marker("SUB")  # a sub-table present by default (defaults from its own table)
OPTIONAL = _Marker("OPTIONAL")  # a sub-table that is None (feature off) unless written
TABLE_LIST = _Marker("TABLE_LIST")  # an array of tables ([[orchestrator.env]])
REQUIRED = _Marker("REQUIRED")  # no default: prime-rl refuses a config without it


@dataclass(frozen=True)
class FREE:
    """A free-form value (a dict of the user's own keys, or a str/dict union): not descended into."""

    default: Any = None


def plain_default(v):
    """The default as a value: None for markers of off/required things, {} for FREE dicts."""
    if isinstance(v, FREE):
        return v.default
    if v is SUB:
        return {}
    if isinstance(v, _Marker):
        return None
    return v


@dataclass(frozen=True)
class Table:
    path: str  # "" is the root
    policy: str  # FORBID | DROP
    fields: Mapping[str, Any] = field(default_factory=dict)
    variants: Mapping[str, Mapping[str, Any]] | None = None
    default_variant: str | None = None

    def variant_of(self, written: Mapping | None) -> str | None:
        """The variant a written table selects (its `type`, else the default's)."""
        if self.variants is None:
            return None
        t = (written or {}).get(DISCRIMINATOR)
        return t if isinstance(t, str) else self.default_variant

    def fields_for(self, variant: str | None = None) -> Mapping[str, Any]:
        if self.variants is None:
            return self.fields
        return self.variants.get(variant or self.default_variant or "", {})

    def known_keys(self, variant: str | None = None) -> list[str]:
        return list(self.fields_for(variant))

    def all_keys(self) -> set[str]:
        if self.variants is None:
            return set(self.fields)
        return {k for f in self.variants.values() for k in f}


def T(path: str, policy: str, fields: Mapping[str, Any]) -> Table:
    return Table(path, policy, dict(fields))


def V(path: str, policy: str, *, default: str | None, variants: Mapping[str, Mapping[str, Any]]) -> Table:
    return Table(path, policy, {}, {k: dict(v) for k, v in variants.items()}, default)


@dataclass(frozen=True)
class Schema:
    """The key tables of one prime-rl generation. `prefix` maps a file's root into the rl tree
    (HEAD's trainer.json is the trainer table: prefix "trainer")."""

    generation: str
    commit: str
    source: str  # where the facts come from (files, for humans)
    tables: Mapping[str, Table]

    @classmethod
    def of(cls, generation: str, commit: str, source: str, tables, prefix: str = "") -> Schema:
        out = {}
        for t in tables:
            path = ".".join(p for p in (prefix, t.path) if p)
            out[path] = Table(path, t.policy, t.fields, t.variants, t.default_variant)
        return cls(generation, commit, source, out)

    def table(self, path: str) -> Table | None:
        return self.tables.get(path)

    def field_default(self, path: str, variant_of=None):
        """(known, default) of a leaf key. `variant_of(table_path)` returns the variant in force
        for variant tables (default: the table's default variant)."""
        parent, _, leaf = path.rpartition(".")
        t = self.tables.get(parent)
        if t is None:
            return False, None
        variant = variant_of(parent) if (variant_of is not None and t.variants is not None) else None
        fields = t.fields_for(variant)
        if leaf not in fields:
            return False, None
        return True, plain_default(fields[leaf])
