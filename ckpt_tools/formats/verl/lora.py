"""The LoRA of a verl checkpoint (`VerlCheckpoint.lora(...)`): PEFT's factors in the model file, alpha from
the
run's own `lora_train_meta.json` (verl 0.9.1 writes `r` and `lora_alpha`, `FSDPCheckpointManager.
_save_lora_train_meta`), else `--alpha`; never guessed (older verl stored no alpha at all: verl #1821).

verl builds the adapter with `LoraConfig(r, lora_alpha, target_modules, ...)` and nothing else
(`FSDPEngine._build_lora_module`): PEFT's default scale `lora_alpha / r`, no rsLoRA, one adapter ("default").
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ...core.errors import AlphaError, FormatError, UsageError
from ...core.lora_math import check_alpha, lora_scale
from ..handle import LoraModule, LoraSource, RawTensor, TensorFacts
from .layout import LORA_META
from .views import VerlKeySource

if TYPE_CHECKING:
    import torch

    from .reader import VerlCheckpoint  # the handle imports this view lazily: no import cycle

__all__ = ["VerlAlpha", "VerlLoraSource", "resolve_verl_alpha"]


@dataclass(frozen=True)
class VerlAlpha:
    alpha: float
    source: str
    config_path: Path | None = None  # what extract-adapter's base lookup may read (none for verl)
    warnings: tuple[str, ...] = ()


def resolve_verl_alpha(ckpt: VerlCheckpoint, alpha: float | None, rank: int | None) -> VerlAlpha:
    """--alpha, else lora_train_meta.json's lora_alpha (its r checked against the factors' rank)."""
    meta = ckpt.lora_meta()
    meta_path = ckpt.dir / LORA_META
    warnings: list[str] = []
    if meta is not None and rank is not None and meta.get("r") not in (None, rank):
        warnings.append(f"{LORA_META} says r {meta.get('r')!r}, the factors have rank {rank}")
    if alpha is not None:
        if meta is not None and meta.get("lora_alpha") not in (None, alpha):
            warnings.append(
                f"--alpha {alpha:g} overrides {LORA_META}'s lora_alpha {meta.get('lora_alpha')!r}"
            )
        return VerlAlpha(check_alpha(alpha, "--alpha", error=UsageError), "--alpha", None, tuple(warnings))
    if meta is None:
        raise AlphaError(
            f"the checkpoint stores the LoRA factors but not alpha (no {LORA_META}: verl before 0.8 wrote "
            "none)",
            path=ckpt.dir,
            hint="pass --alpha: the actor_rollout_ref.model.lora_alpha the run trained with",
        )
    value = meta.get("lora_alpha")
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise FormatError(f"lora_alpha is {value!r}, not a number", path=meta_path, hint="pass --alpha")
    return VerlAlpha(
        check_alpha(float(value), "lora_alpha", error=FormatError), str(meta_path), None, tuple(warnings)
    )


def _pairs(ckpt: VerlCheckpoint) -> dict[str, tuple[str, str]]:
    """module -> (A key, B key), every factor of PEFT's one adapter."""
    found: dict[str, dict[str, str]] = {}
    adapters = set()
    for key, info in ckpt.infos.items():
        if info.group == "lora" and info.module is not None and info.ab is not None:
            found.setdefault(info.module, {})[info.ab] = key
            adapters.add(info.adapter or "")
    if len(adapters) > 1:
        raise FormatError(
            f"the model file holds {len(adapters)} PEFT adapters ({sorted(adapters)}): verl trains one",
            path=ckpt.dir,
        )
    for m, ab in found.items():
        if set(ab) != {"A", "B"}:
            raise FormatError(
                f"module {m} lacks lora_{'B' if 'A' in ab else 'A'}",
                path=ckpt.dir,
                key=next(iter(ab.values())),
            )
    return {m: (ab["A"], ab["B"]) for m, ab in sorted(found.items())}


class VerlLoraSource(LoraSource):
    kind = "verl"
    ckpt: VerlCheckpoint  # type: ignore[assignment]  # the handle its factors come from, as DCP's LoRA view

    def __init__(self, ckpt: VerlCheckpoint, *, alpha: float | None, slot: int = 0):
        if slot != 0:
            raise UsageError("--slot: a verl checkpoint holds one adapter (slot 0)", path=ckpt.dir)
        self.ckpt = ckpt
        self.path = ckpt.dir
        self.config_path = self.weights_path = ckpt.dir / ckpt.archives[0].file
        self.slot = 0
        pairs = _pairs(ckpt)
        if not pairs:
            raise FormatError(
                "the checkpoint holds no LoRA parameters (no base_model.model.*.lora_A.default.weight keys)",
                path=self.config_path,
                hint="this is a full fine-tune: `ckpt export` writes its weights",
            )
        shapes = {m: (ckpt.entries[a], ckpt.entries[b]) for m, (a, b) in pairs.items()}
        for ea, eb in shapes.values():
            if len(ea.shape) != 2 or len(eb.shape) != 2 or ea.shape[0] != eb.shape[1]:
                raise FormatError(
                    f"A {list(ea.shape)} and B {list(eb.shape)} do not share a rank",
                    path=self.path,
                    key=ea.key,
                )
        ranks = sorted({ea.shape[0] for ea, _ in shapes.values()})
        res = resolve_verl_alpha(ckpt, alpha, ranks[0] if len(ranks) == 1 else None)
        self.alpha, self.alpha_source, self.resolution = res.alpha, res.source, res
        self.warnings = res.warnings
        self.modules = {
            m: LoraModule(
                m,
                ea.shape[0],
                lora_scale(res.alpha, ea.shape[0]),
                ea.key,
                eb.key,
                ea.shape,
                eb.shape,
                False,
                ea.dtype,
            )
            for m, (ea, eb) in shapes.items()
        }
        self.full_tensors = {}  # verl trains the LoRA only (PEFT freezes the rest; no modules_to_save)
        self._keys = VerlKeySource(ckpt)

    def read_key(self, key: str) -> torch.Tensor:
        return self._keys.read_tensor(key)

    def read_raw_key(self, key: str) -> RawTensor:
        f = self._keys.facts(key)
        buf = bytearray(f.nbytes)
        if buf:
            self._keys.read_span(key, 0, buf)
        return RawTensor(f.dtype, tuple(f.shape), buf)

    def read_raw_factor(self, module: str, ab: str) -> RawTensor:
        m = self.modules[module]
        return self.read_raw_key(m.a_key if ab == "A" else m.b_key)

    def key_facts(self, key: str) -> TensorFacts:
        return self._keys.facts(key)

    def lora_keys(self) -> list[str]:
        return sorted({k for m in self.modules.values() for k in (m.a_key, m.b_key)})

    def close(self) -> None:
        self.ckpt.close()
