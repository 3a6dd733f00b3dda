"""What a checkpoint's step dir holds beside its DCP `trainer/` (prime-rl after August 2026; docs/reference/
primerl-head-format.md, "since August 2026"):

- `weights/`: bf16 HF safetensors written from the step's checkpoint by prime-rl's converter
  (`tools/converters/dcp_to_bf16.py`, PR #3348; full fine-tunes only) or by `ckpt export`: `model.safetensors`
  or shards with `model.safetensors.index.json` (the converter writes it last), `config.json`, tokenizer;
- `weights-FP8/`: the same as block FP8 (`dcp_to_fp8.py` / `bf16_to_fp8.py`): `float8_e4m3fn` weights with
  `<name>_scale_inv` per 128x128 block and `quantization_config` in `config.json`;
- `orchestrator/`: the orchestrator's checkpoint (`progress.pt`, written last).

`step_extras(step_dir)` lists them (names, sizes, whether a weights dir is complete: every shard its index
names present and no `tmp-rank*` file of a converter still writing), from listings and `config.json`
alone. They are never part of the DCP checkpoint: commands that rewrite `trainer/` leave them as they are.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...core.errors import CkptError
from ...io.inputs import as_input, read_json
from .run_dir import dir_bytes

__all__ = ["BF16", "FP8", "ORCHESTRATOR", "WEIGHTS_DIRS", "StepExtra", "step_extras"]

WEIGHTS_DIRS = ("weights", "weights-FP8")
BF16, FP8, ORCHESTRATOR, OTHER = "bf16 HF weights", "block-FP8 HF weights", "orchestrator checkpoint", "other"
_INDEX = "model.safetensors.index.json"
_WRITERS = {
    BF16: "prime-rl's tools/converters/dcp_to_bf16.py (PR #3348) or `ckpt export`",
    FP8: "prime-rl's tools/converters/dcp_to_fp8.py (PR #3348) or `ckpt export --dtype fp8`",
    ORCHESTRATOR: "prime-rl's orchestrator (progress.pt)",
}


@dataclass(frozen=True)
class StepExtra:
    name: str
    path: Path
    kind: str  # BF16 | FP8 | ORCHESTRATOR | OTHER
    bytes: int
    complete: bool
    problem: str | None = None

    @property
    def is_weights(self) -> bool:
        return self.kind in (BF16, FP8)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "path": str(self.path),
            "kind": self.kind,
            "written_by": _WRITERS.get(self.kind),
            "bytes": self.bytes,
            "complete": self.complete,
            "problem": self.problem,
        }


def _quantized(d: Path) -> bool:
    try:
        cfg = read_json(d / "config.json", root=d, what="config.json")
    except CkptError:
        return False
    q = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    return isinstance(q, dict) and q.get("quant_method") == "fp8"


def _completeness(d: Path) -> tuple[bool, str | None]:
    """Complete: its index names only shards that are there (or it is one model.safetensors), and no
    converter's `tmp-rank*.safetensors` is left."""
    pending = sorted(p.name for p in d.glob("tmp-rank*.safetensors"))
    if pending:
        return (
            False,
            f"a converter's temporary shards are still there ({pending[0]}): written or killed mid-way",
        )
    if (d / _INDEX).is_file():
        try:
            index = read_json(d / _INDEX, root=d, what="safetensors index")
            shards = set((index.get("weight_map") or {}).values())
        except (CkptError, AttributeError):
            return False, f"{_INDEX} is not a readable index"
        missing = sorted(s for s in shards if not isinstance(s, str) or not (d / s).is_file())
        return (not missing), (f"shards named by {_INDEX} are missing: {missing[:3]}" if missing else None)
    if (d / "model.safetensors").is_file():
        return True, None
    return False, "no model.safetensors and no index: no weights"


def _extra(p: Path) -> StepExtra:
    if p.name == "orchestrator":
        return StepExtra(p.name, p, ORCHESTRATOR, dir_bytes(p), (p / "progress.pt").is_file())
    if p.name in WEIGHTS_DIRS or (p / "config.json").is_file():
        complete, problem = _completeness(p)
        kind = FP8 if p.name == "weights-FP8" or _quantized(p) else BF16
        return StepExtra(p.name, p, kind, dir_bytes(p), complete, problem)
    return StepExtra(p.name, p, OTHER, dir_bytes(p), True)


def step_extras(step_dir: str | Path) -> list[StepExtra]:
    """The dirs of `step_dir` other than `trainer/` (and gc's own `.trainer.*` leftovers), by name."""
    d = as_input(step_dir)
    try:
        entries = sorted(d.iterdir())
    except OSError:
        return []
    return [
        _extra(p)
        for p in entries
        if p.is_dir() and not p.is_symlink() and p.name != "trainer" and not p.name.startswith(".")
    ]
