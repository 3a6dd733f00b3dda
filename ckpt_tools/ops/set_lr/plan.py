"""`ckpt set` planned (every byte item to patch with its old and new value; values keep their type),
and `ckpt set-lr`'s plan, which lives in `sources.lr_plan` (`ckpt report` draws the schedule it
gives) and is re-exported here.
"""

from __future__ import annotations

import difflib
import json
import math
from dataclasses import dataclass
from typing import Any

from ...core.errors import CkptError, UsageError
from ...core.keys import classify
from ...formats.dcp.model import BytesEntry
from ...formats.dcp.reader import DcpCheckpoint
from ...sources.lr_plan import LR_FIELDS, MAX_LR, Change, SetLrPlan, check_lr_value, plan_set_lr

__all__ = [
    "LR_FIELDS",
    "MAX_LR",
    "Change",
    "SetLrPlan",
    "SetValuesPlan",
    "check_lr_value",
    "parse_value",
    "plan_set_lr",
    "plan_set_values",
    "resolve_key",
]

# progress counters (prime-rl's Progress) are counts: never negative
_COUNT_FIELDS = frozenset({"step", "total_tokens", "total_samples"})


def parse_value(text: str, old: Any, key: str) -> Any:
    """`ckpt set` values: the new value must have the old value's type. int stays int (no "3.5"),
    float stays float ("3" gives 3.0), bool is true/false, str is taken as is, a list or tuple is
    a JSON array of the same length with elements of the old elements' types. None is not settable."""

    def fail(why: str) -> CkptError:
        return UsageError(f"cannot set to {text!r}: {why}", key=key)

    if old is None:
        raise fail("the current value is None, so its type is unknown")
    if isinstance(old, bool):
        low = text.strip().lower()
        if low in ("true", "1", "yes"):
            return True
        if low in ("false", "0", "no"):
            return False
        raise fail("expected a bool (true/false)")
    if isinstance(old, int):
        try:
            return int(text.strip(), 10)
        except ValueError:
            raise fail(f"expected an int like the current value {old!r}") from None
    if isinstance(old, float):
        try:
            v = float(text)
        except ValueError:
            raise fail(f"expected a float like the current value {old!r}") from None
        if not math.isfinite(v):
            raise fail("the value is not finite")
        return v
    if isinstance(old, str):
        return text
    if isinstance(old, (list, tuple)):
        try:
            items = json.loads(text)
        except ValueError:
            raise fail(f"expected a JSON array like {json.dumps(list(old))}") from None
        if not isinstance(items, list) or len(items) != len(old):
            raise fail(f"expected a JSON array of {len(old)} element(s) like {json.dumps(list(old))}")
        return type(old)(
            parse_value(json.dumps(x) if not isinstance(x, str) else x, o, key) for x, o in zip(items, old)
        )
    raise fail(f"values of type {type(old).__name__} cannot be set")


def resolve_key(ckpt: DcpCheckpoint, name: str) -> str:
    """A flat key, or one without the leading `app.` (`progress.step`)."""
    for cand in (name, f"app.{name}"):
        if cand in ckpt.entries:
            return cand
    close = difflib.get_close_matches(
        name, [k.removeprefix("app.") for k in ckpt.entries if isinstance(ckpt.entries[k], BytesEntry)], n=3
    )
    raise UsageError(
        "no such byte item in the checkpoint",
        key=name,
        path=ckpt.dir,
        hint=(f"did you mean {', '.join(close)}?" if close else "`ckpt inspect --keys` lists them"),
    )


@dataclass(frozen=True)
class SetValuesPlan:
    source: str
    changes: tuple[Change, ...]
    warnings: tuple[str, ...]

    def to_json(self) -> dict:
        return {
            "source": self.source,
            "warnings": list(self.warnings),
            "changes": [{"key": c.key, "before": c.before, "after": c.after} for c in self.changes],
        }


def plan_set_values(ckpt: DcpCheckpoint, assignments: list[str]) -> SetValuesPlan:
    """Every KEY=VALUE as a change of that byte item, the new value of the old value's type."""
    changes, warnings, seen = [], [], set()
    for a in assignments:
        if "=" not in a:
            raise UsageError(f"{a!r} is not KEY=VALUE", hint="e.g. ckpt set CKPT OUT progress.step=100")
        name, text = a.split("=", 1)
        key = resolve_key(ckpt, name.strip())
        if key in seen:
            raise UsageError("assigned twice", key=key)
        seen.add(key)
        e = ckpt.entries[key]
        if not isinstance(e, BytesEntry):
            raise UsageError("is a tensor; `ckpt set` changes byte items (scalars, lists) only", key=key)
        old = ckpt.read_object(key)
        new = parse_value(text, old, key)
        info = classify(key, e.path)
        if info.group == "progress" and info.field in _COUNT_FIELDS and isinstance(new, int) and new < 0:
            raise UsageError(
                f"cannot set to {new}: {info.field} counts steps/tokens/samples and must be >= 0", key=key
            )
        if (info.group, info.field) in LR_FIELDS:
            check_lr_value(new, key)
        if (info.group, info.field) in LR_FIELDS:
            warnings.append(
                f"{key}: changing one lr field alone desynchronises the schedule; "
                "`ckpt set-lr` patches all of them consistently"
            )
        if info.field == "params":
            warnings.append(f"{key}: param_groups params must name the optimizer's parameters in order")
        changes.append(Change(key, old, new, "set"))
    return SetValuesPlan(str(ckpt.dir), tuple(changes), tuple(warnings))
