"""What a prime-rl TOML config is: the `rl` entrypoint's combined config, a trainer's or an orchestrator's,
and (where the file says) which prime-rl generation wrote it. No torch, no tensors.

- combined (`uv run rl @ rl.toml`): a top-level `[trainer]`, `[orchestrator]` or `[inference]` table;
- orchestrator / trainer: told apart by the top-level keys only one of the two configs has (16e747c's
  schemas, and HEAD's trainer schema), then by `[model.lora]` keys only one has (`name`: the
  orchestrator's; `dropout`, `target_modules`, `modules_to_save`: the trainer's); a file with neither
  (`[model.lora] alpha` alone) is read as an orchestrator config, as every command did before;
- generation: HEAD (Aug 2026 on) when the file sits in a launch attempt's config dir
  (`configs/attempt_<n>/`, `configs/latest/`: only that prime-rl writes them), or holds top-level keys
  only HEAD has (`run`, `resume` in an rl config; HEAD trainer keys 16e747c's trainer lacks); 16e747c when it
  holds trainer keys only 16e747c has; otherwise None (it cannot be told: both read the same keys).

`formats.primerl.alpha` reads the LoRA alpha training applied from each kind by its generation's rule.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ...io.inputs import as_input
from .attempts import attempt_number
from .files import GEN_16E747C, GEN_HEAD, SECTIONS
from .schema_16e747c import SCHEMA as SCHEMA_16E747C
from .schema_head import TRAINER_SCHEMA

__all__ = ["ORCHESTRATOR", "RL", "TRAINER", "TomlKind", "in_attempt_dir", "toml_kind"]

RL, ORCHESTRATOR, TRAINER = "rl", "orchestrator", "trainer"
# Top-level keys of HEAD's rl config that 16e747c's has not (#3268's [run] and [resume] blocks).
_HEAD_RL_KEYS = {"run", "resume"}
_ORCH_LORA_ONLY = {"name"}
_TRAINER_LORA_ONLY = {"dropout", "target_modules", "modules_to_save"}


@dataclass(frozen=True)
class TomlKind:
    kind: str  # RL | TRAINER | ORCHESTRATOR
    generation: str | None  # GEN_16E747C | GEN_HEAD | None: the file does not say
    why: str


def _keys(table: str, schema=SCHEMA_16E747C) -> set[str]:
    t = schema.table(table)
    return t.all_keys() if t is not None else set()


def in_attempt_dir(path: Path) -> bool:
    """`<run>/configs/attempt_<n>/...` or `<run>/configs/latest/...`: a launch attempt's dir (HEAD only)."""
    parts = as_input(path).parts
    return any(
        p == "configs" and (attempt_number(q) is not None or q == "latest")
        for p, q in itertools.pairwise(parts)
    )


def _side(data: Mapping) -> tuple[str, str]:
    """orchestrator or trainer, and why."""
    keys = set(data)
    orch, trainer = _keys("orchestrator"), _keys("trainer") | _keys("trainer", TRAINER_SCHEMA)
    only_orch, only_trainer = sorted(keys & (orch - trainer)), sorted(keys & (trainer - orch))
    if only_orch and not only_trainer:
        return ORCHESTRATOR, f"orchestrator keys ({', '.join(only_orch[:3])})"
    if only_trainer and not only_orch:
        return TRAINER, f"trainer keys ({', '.join(only_trainer[:3])})"
    model = data.get("model")
    lora = model.get("lora") if isinstance(model, Mapping) else None
    lk = set(lora) if isinstance(lora, Mapping) else set()
    if lk & _TRAINER_LORA_ONLY and not lk & _ORCH_LORA_ONLY:
        return TRAINER, f"trainer [model.lora] keys ({', '.join(sorted(lk & _TRAINER_LORA_ONLY))})"
    return ORCHESTRATOR, "an orchestrator config (no key says otherwise)"


def _trainer_generation(data: Mapping) -> str | None:
    keys = set(data)
    head, old = _keys("trainer", TRAINER_SCHEMA), _keys("trainer")
    if keys <= head and keys - old:
        return GEN_HEAD
    if keys <= old and keys - head:
        return GEN_16E747C
    return None


def toml_kind(data: Mapping, path: Path) -> TomlKind:
    """The kind and generation of the TOML `data` read from `path` (see the module doc)."""
    attempt = in_attempt_dir(path)
    where = " (a launch attempt's config dir)" if attempt else ""
    if any(isinstance(data.get(s), Mapping) for s in SECTIONS):
        head = attempt or bool(set(data) & _HEAD_RL_KEYS)
        return TomlKind(
            RL,
            GEN_HEAD if head else GEN_16E747C,
            f"the rl entrypoint's combined config ([trainer]/[orchestrator] tables){where}",
        )
    side, why = _side(data)
    if side == ORCHESTRATOR:
        return TomlKind(ORCHESTRATOR, GEN_HEAD if attempt else GEN_16E747C, why + where)
    return TomlKind(TRAINER, GEN_HEAD if attempt else _trainer_generation(data), why + where)
