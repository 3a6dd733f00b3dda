"""The LoRA view of a PEFT adapter (`PeftAdapter.lora()`): its modules as `LoraModule`s, alpha from
adapter_config.json (an explicit --alpha overrides it: `LoraSource.with_alpha`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...io.inputs import as_input
from ..handle import LoraModule, LoraSource, TensorFacts

if TYPE_CHECKING:  # annotations only: torch is imported where tensors are built; the handle makes this view
    import torch

    from .adapter import PeftAdapter

__all__ = ["PeftLoraSource"]


class PeftLoraSource(LoraSource):
    kind = "peft"
    adapter: PeftAdapter  # (always: the handle it is the LoRA view of)

    def __init__(self, adapter: PeftAdapter):
        self.adapter = ad = adapter
        cfg = ad.config
        self.path = as_input(ad.dir)
        self.alpha = cfg.lora_alpha
        self.use_rslora = cfg.use_rslora
        self.alpha_source = (
            f"adapter_config.json (lora_alpha {cfg.lora_alpha:g}"
            + (", rsLoRA" if cfg.use_rslora else "")
            + (", alpha/rank patterns" if cfg.alpha_pattern or cfg.rank_pattern else "")
            + ")"
        )
        self.modules = {
            m.module: LoraModule(
                m.module,
                m.rank,
                m.scale,
                m.a_key,
                m.b_key,
                ad.factor_shape(m.module, "A"),
                ad.factor_shape(m.module, "B"),
                cfg.fan_in_fan_out,
                ad.dtypes[m.a_key],
                m.view.expert if m.view else None,
                m.view.fused.projs[m.view.part] if m.view else None,
            )
            for m in ad.modules.values()
        }
        self.full_tensors = dict(ad.full_tensors)
        self.resident_bytes = ad.nbytes if ad.weights_path.suffix == ".bin" else 0
        self.config_path, self.weights_path = cfg.path, ad.weights_path

    def read_key(self, key: str) -> torch.Tensor:
        return self.adapter.read(key)

    def read_factor(self, module: str, ab: str) -> torch.Tensor:
        return self.adapter.read_factor(module, ab)  # a fused expert LoRA's projection: its own slice

    @property
    def layout(self) -> str:
        return self.adapter.layout

    def key_facts(self, key: str) -> TensorFacts:
        return TensorFacts(key, self.adapter.dtypes[key], tuple(self.adapter.shapes[key]))
