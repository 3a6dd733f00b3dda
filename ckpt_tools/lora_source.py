"""One view of "a LoRA" for every command: from a PEFT adapter dir or straight from a prime-rl
DCP checkpoint (which stores A/B but not alpha: resolved by ckpt_tools.alpha, never guessed).

`LoraSource.modules` maps HF module FQNs (`model.layers.0.self_attn.q_proj`) to rank and scale;
`read(module)` returns fp32 (A, B) for one module at a time.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .alpha import AlphaResolution, check_alpha, resolve_alpha
from .dcp.reader import METADATA_NAME, DcpCheckpoint
from .errors import FormatError, UsageError
from .keys import classify, lora_key
from .lora_math import lora_scale


@dataclass(frozen=True)
class LoraModuleSpec:
    module: str
    rank: int
    scale: float
    fan_in_fan_out: bool = False
    a_dtype: torch.dtype = torch.float32

    @property
    def weight_name(self) -> str:
        return f"{self.module}.weight"


class LoraSource:
    kind: str
    path: Path
    modules: dict[str, LoraModuleSpec]
    full_tensors: dict[str, str]       # modules_to_save replacements: HF name -> source key
    alpha_source: str
    alpha: float | None
    use_rslora: bool = False
    warnings: tuple[str, ...] = ()

    def read(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def read_full(self, name: str) -> torch.Tensor:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def describe(self) -> dict:
        ranks = sorted({m.rank for m in self.modules.values()})
        scales = sorted({m.scale for m in self.modules.values()})
        return {"kind": self.kind, "path": str(self.path), "modules": len(self.modules),
                "rank": ranks[0] if len(ranks) == 1 else ranks, "alpha": self.alpha,
                "scale": scales[0] if len(scales) == 1 else scales, "alpha_source": self.alpha_source,
                "modules_to_save": sorted(self.full_tensors)}


class PeftLoraSource(LoraSource):
    kind = "peft"

    def __init__(self, path: Path):
        from .peft_adapter import open_peft_adapter

        self.adapter = open_peft_adapter(path, strict=True)
        cfg = self.adapter.config
        self.path = Path(path)
        self.alpha = cfg.lora_alpha
        self.use_rslora = cfg.use_rslora
        self.alpha_source = f"adapter_config.json (lora_alpha {cfg.lora_alpha:g}" + \
            (", rsLoRA" if cfg.use_rslora else "") + (", alpha/rank patterns" if cfg.alpha_pattern or cfg.rank_pattern else "") + ")"
        self.modules = {m.module: LoraModuleSpec(m.module, m.rank, m.scale, cfg.fan_in_fan_out,
                                                 self.adapter._dtypes[m.a_key])
                        for m in self.adapter.modules.values()}
        self.full_tensors = dict(self.adapter.full_tensors)

    def read(self, module: str):
        a, b = self.adapter.read_pair(module)
        return a.to(torch.float32), b.to(torch.float32)

    def read_full(self, name: str) -> torch.Tensor:
        return self.adapter.read(self.full_tensors[name])


class DcpLoraSource(LoraSource):
    kind = "dcp"

    def __init__(self, path: Path, *, alpha: float | None, run_config: Path | None, slot: int = 0,
                 trust_pickle: bool = False, ckpt: DcpCheckpoint | None = None):
        self.ckpt = ckpt or DcpCheckpoint.open(path, trust_pickle=trust_pickle)
        self.path = self.ckpt.dir
        self.slot = slot
        infos = [classify(k, e.path) for k, e in self.ckpt.entries.items()]
        lora = [i for i in infos if i.group == "lora"]
        slots = sorted({i.slot for i in lora})
        if not lora:
            raise FormatError("the checkpoint holds no LoRA parameters (no app.model.*.lora_A.<i> keys)",
                              path=self.path / METADATA_NAME,
                              hint="this is not a LoRA run; there is nothing to extract or merge")
        if slot not in slots:
            raise UsageError(f"adapter slot {slot} is not in the checkpoint (slots present: {slots})",
                             path=self.path, hint=f"pass --slot {slots[0]}")
        mods = sorted({i.module for i in lora if i.slot == slot})
        ranks = {}
        for m in mods:
            ka, kb = lora_key(m, "A", slot), lora_key(m, "B", slot)
            if ka not in self.ckpt.entries or kb not in self.ckpt.entries:
                raise FormatError(f"module {m} lacks lora_A.{slot} or lora_B.{slot}", path=self.path / METADATA_NAME)
            ea, eb = self.ckpt.entries[ka], self.ckpt.entries[kb]
            if len(ea.shape) != 2 or len(eb.shape) != 2 or ea.shape[0] != eb.shape[1]:
                raise FormatError(f"A {list(ea.shape)} and B {list(eb.shape)} do not share a rank",
                                  path=self.path / METADATA_NAME, key=ka)
            ranks[m] = ea.shape[0]
        uniq = sorted(set(ranks.values()))
        res: AlphaResolution = resolve_alpha(alpha=alpha, run_config=run_config, ckpt_dir=self.path,
                                             rank=uniq[0] if len(uniq) == 1 else None)
        self.alpha = res.alpha
        self.alpha_source = res.source
        self.resolution = res
        self.warnings = res.warnings
        self.modules = {m: LoraModuleSpec(m, r, lora_scale(res.alpha, r)) for m, r in ranks.items()}
        self.full_tensors = {}

    def read(self, module: str):
        a = self.ckpt.read_tensor(lora_key(module, "A", self.slot))
        b = self.ckpt.read_tensor(lora_key(module, "B", self.slot))
        return a.to(torch.float32), b.to(torch.float32)

    def lora_keys(self) -> list[str]:
        return [lora_key(m, ab, self.slot) for m in self.modules for ab in "AB"]

    def close(self) -> None:
        self.ckpt.close()


def is_dcp(path: Path) -> bool:
    p = Path(path)
    # lexists: a `.metadata` that is a FIFO or bad link marks a checkpoint the reader then refuses by name
    return os.path.lexists(p / METADATA_NAME) or os.path.lexists(p / "trainer" / METADATA_NAME)


def open_lora_source(path: str | Path, *, alpha: float | None = None, run_config: str | Path | None = None,
                     slot: int = 0, trust_pickle: bool = False) -> LoraSource:
    """A PEFT adapter dir or a prime-rl DCP checkpoint. For PEFT, alpha comes from its config
    (an explicit --alpha overrides it, with the adapter's own rank)."""
    p = Path(path)
    if is_dcp(p):
        return DcpLoraSource(p, alpha=alpha, run_config=Path(run_config) if run_config else None, slot=slot,
                             trust_pickle=trust_pickle)
    if (p / "adapter_config.json").is_file():
        src = PeftLoraSource(p)
        if alpha is not None:
            src.alpha = check_alpha(alpha, "--alpha", error=UsageError)
            src.alpha_source = "--alpha (overrides adapter_config.json)"
            src.modules = {m: LoraModuleSpec(s.module, s.rank, lora_scale(alpha, s.rank, src.use_rslora),
                                             s.fan_in_fan_out, s.a_dtype) for m, s in src.modules.items()}
        return src
    raise UsageError("not a LoRA source: expected a PEFT adapter dir (adapter_config.json) or a prime-rl "
                     "DCP checkpoint (.metadata)", path=p)
