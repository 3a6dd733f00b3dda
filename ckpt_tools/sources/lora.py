"""One view of "a LoRA" for every command: from a PEFT adapter dir or straight from a prime-rl DCP
checkpoint (which stores A/B but not alpha: resolved by `formats.primerl.alpha`, never guessed).

`LoraSource.modules` maps HF module FQNs (`model.layers.0.self_attn.q_proj`) to a `LoraModule`
(rank, scale, the keys and shapes of A and B); `read_pair(module)` returns fp32 (A, B) for one module
at a time; `full_tensors` are `modules_to_save` replacements (HF name -> key), read by `read_full`.
A layout is data here (the keys each module's factors live under), so a new layout (MoE experts
stacked [E, r, in]) is a new way to fill `modules`, not a new code path in every command.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..core.errors import FormatError, UsageError
from ..core.keys import classify, expert_hf_name, expert_module, lora_key, require_known, stacked_lora_key, \
    trainable_params
from ..core.lora_math import check_alpha, lora_scale
from ..formats.dcp.layout import METADATA_NAME, is_checkpoint_path
from ..formats.dcp.reader import DcpCheckpoint
from ..formats.peft.adapter import PeftAdapter, open_peft_adapter
from ..formats.peft.config import ADAPTER_CONFIG
from ..formats.primerl.alpha import AlphaResolution, resolve_alpha
from .base import TensorFacts
from .dcp import DcpKeySource

__all__ = ["LoraModule", "LoraSource", "PeftLoraSource", "DcpLoraSource", "NoLoraSource", "open_lora_source",
           "trained_full_tensors"]



@dataclass(frozen=True)
class LoraModule:
    module: str
    rank: int
    scale: float
    a_key: str
    b_key: str
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]
    fan_in_fan_out: bool = False
    a_dtype: str = "float32"
    expert: int | None = None       # grouped-expert LoRA: the keys are stacked [E, r, in] / [E, out, r]; this
    #                                 module's factors are their dim-0 slice `expert` (shapes are the slice's)
    part: str | None = None         # a fused PEFT expert LoRA (`formats.peft.experts`): the keys are the fused
    #                                 parameter's; this module is projection `part` of expert `expert` in it

    @property
    def weight_name(self) -> str:
        return f"{self.module}.weight"

    def factor_ref(self, ab: str) -> str:
        """Where factor A or B is read from: its key, or `key[e]` for an expert's slice of a stacked one."""
        key = self.a_key if ab == "A" else self.b_key
        if self.expert is None:
            return key
        return f"{key}[{self.expert}]" + (f".{self.part}" if self.part else "")


class LoraSource:
    kind: str
    path: Path
    modules: dict[str, LoraModule]
    full_tensors: dict[str, str]        # modules_to_save replacements: HF name -> source key
    alpha_source: str
    alpha: float | None
    use_rslora: bool = False
    warnings: tuple[str, ...] = ()
    slot: int | None = None
    resident_bytes: int = 0             # bytes held for the whole run (a .bin adapter is loaded whole)
    config_path: Path                   # what errors about its configuration name (adapter_config.json, .metadata)
    weights_path: Path                  # what errors about its weights name

    def read_key(self, key: str) -> torch.Tensor:
        raise NotImplementedError

    def key_facts(self, key: str) -> TensorFacts:
        raise NotImplementedError

    def read_ref(self, ref: str) -> torch.Tensor:
        """The tensor a `LoraModule.factor_ref` names."""
        refs = getattr(self, "_ref_map", None)
        if refs is None:   # built once: the refs do not change with --alpha
            refs = self._ref_map = {m.factor_ref(ab): (name, ab) for name, m in self.modules.items() for ab in "AB"}
        m, ab = refs[ref]
        return self.read_factor(m, ab)

    def read_factor(self, module: str, ab: str) -> torch.Tensor:
        """The stored A or B of one module (its expert's slice for grouped-expert LoRA), stored dtype."""
        m = self.modules[module]
        return self.read_key(m.a_key if ab == "A" else m.b_key)

    def read_pair(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 (A, B) of one module."""
        return self.read_factor(module, "A").to(torch.float32), self.read_factor(module, "B").to(torch.float32)

    def read_full(self, name: str) -> torch.Tensor:
        return self.read_key(self.full_tensors[name])

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def describe(self) -> dict:
        ranks = sorted({m.rank for m in self.modules.values()})
        scales = sorted({m.scale for m in self.modules.values()})
        return {"kind": self.kind, "path": str(self.path), "modules": len(self.modules),
                "rank": ranks[0] if len(ranks) == 1 else ranks, "alpha": self.alpha,
                "scale": scales[0] if len(scales) == 1 else scales, "alpha_source": self.alpha_source,
                "modules_to_save": sorted(self.full_tensors)}

    def with_alpha(self, alpha: float) -> None:
        """An explicit --alpha over the adapter's own (its ranks kept)."""
        self.alpha = check_alpha(alpha, "--alpha", error=UsageError)
        self.alpha_source = "--alpha (overrides adapter_config.json)"
        self.modules = {k: replace(m, scale=lora_scale(alpha, m.rank, self.use_rslora)) for k, m in self.modules.items()}


class PeftLoraSource(LoraSource):
    kind = "peft"

    def __init__(self, path: Path, *, adapter: PeftAdapter | None = None):
        self.adapter = adapter if adapter is not None else open_peft_adapter(path, strict=True)
        ad = self.adapter
        cfg = ad.config
        self.path = Path(path)
        self.alpha = cfg.lora_alpha
        self.use_rslora = cfg.use_rslora
        self.alpha_source = f"adapter_config.json (lora_alpha {cfg.lora_alpha:g}" + \
            (", rsLoRA" if cfg.use_rslora else "") + (", alpha/rank patterns" if cfg.alpha_pattern or cfg.rank_pattern else "") + ")"
        self.modules = {m.module: LoraModule(m.module, m.rank, m.scale, m.a_key, m.b_key,
                                             ad.factor_shape(m.module, "A"), ad.factor_shape(m.module, "B"),
                                             cfg.fan_in_fan_out, ad.dtypes[m.a_key],
                                             m.view.expert if m.view else None,
                                             m.view.fused.projs[m.view.part] if m.view else None)
                        for m in ad.modules.values()}
        self.full_tensors = dict(ad.full_tensors)
        self.resident_bytes = ad.nbytes if ad.weights_path.suffix == ".bin" else 0
        self.config_path, self.weights_path = cfg.path, ad.weights_path

    def read_key(self, key: str) -> torch.Tensor:
        return self.adapter.read(key)

    def read_factor(self, module: str, ab: str) -> torch.Tensor:
        return self.adapter.read_factor(module, ab)   # a fused expert LoRA's projection: its own slice

    @property
    def layout(self) -> str:
        return self.adapter.layout

    def key_facts(self, key: str) -> TensorFacts:
        return TensorFacts(key, self.adapter.dtypes[key], tuple(self.adapter.shapes[key]))


class DcpLoraSource(LoraSource):
    kind = "dcp"

    def __init__(self, path: Path, *, alpha: float | None, run_config: Path | None, slot: int = 0,
                 trust_pickle: bool = False, ckpt: DcpCheckpoint | None = None):
        self.ckpt = ckpt or DcpCheckpoint.open(path, trust_pickle=trust_pickle)
        self.path = self.ckpt.dir
        self.config_path = self.weights_path = self.ckpt.dir / METADATA_NAME
        self.slot = slot
        infos = [classify(k, e.path) for k, e in self.ckpt.entries.items()]
        require_known(infos, self.path / METADATA_NAME)
        lora = [i for i in infos if i.group == "lora"]
        slots = sorted({i.slot for i in lora})
        if not lora:
            raise FormatError("the checkpoint holds no LoRA parameters (no app.model.*.lora_A.<i> keys)",
                              path=self.path / METADATA_NAME,
                              hint="this is not a LoRA run; there is nothing to extract or merge")
        if slot not in slots:
            raise UsageError(f"adapter slot {slot} is not in the checkpoint (slots present: {slots})",
                             path=self.path, hint=f"pass --slot {slots[0]}")
        # (module, a key, b key, expert): a dense module's own keys, or one expert's slice of stacked keys
        found: list[tuple[str, str, str, int | None]] = []
        for m in sorted({i.module for i in lora if i.slot == slot and not i.stacked}):
            found.append((m, lora_key(m, "A", slot), lora_key(m, "B", slot), None))
        for experts, proj in sorted({(i.module, i.expert_proj) for i in lora if i.slot == slot and i.stacked}):
            ka, kb = stacked_lora_key(experts, proj, "A", slot), stacked_lora_key(experts, proj, "B", slot)
            n = self._stacked_experts(ka, kb)
            found.extend((expert_module(experts, x, proj), ka, kb, x) for x in range(n))
        shapes = {}
        for m, ka, kb, x in found:
            if ka not in self.ckpt.entries or kb not in self.ckpt.entries:
                raise FormatError(f"module {m} lacks lora_A.{slot} or lora_B.{slot}", path=self.path / METADATA_NAME)
            ea, eb = self.ckpt.entries[ka], self.ckpt.entries[kb]
            sa, sb = (tuple(ea.shape), tuple(eb.shape)) if x is None else (tuple(ea.shape[1:]), tuple(eb.shape[1:]))
            if len(sa) != 2 or len(sb) != 2 or sa[0] != sb[1]:
                raise FormatError(f"A {list(ea.shape)} and B {list(eb.shape)} do not share a rank",
                                  path=self.path / METADATA_NAME, key=ka)
            shapes[m] = (ka, kb, sa, sb, ea.dtype, x)
        uniq = sorted({s[2][0] for s in shapes.values()})
        res: AlphaResolution = resolve_alpha(alpha=alpha, run_config=run_config, ckpt_dir=self.path,
                                             rank=uniq[0] if len(uniq) == 1 else None)
        self.alpha = res.alpha
        self.alpha_source = res.source
        self.resolution = res
        self.warnings = res.warnings
        self.modules = {m: LoraModule(m, a_shape[0], lora_scale(res.alpha, a_shape[0]), ka, kb, a_shape, b_shape,
                                      False, a_dtype, x)
                        for m, (ka, kb, a_shape, b_shape, a_dtype, x) in shapes.items()}
        self.full_tensors = trained_full_tensors(self.ckpt)
        stacked = any(x is not None for *_, x in found) or any(v.endswith("]") for v in self.full_tensors.values())
        self._rows = DcpKeySource(ckpt=self.ckpt) if stacked else None
        # every factor is read: a remote checkpoint fetches adjacent items in one request (io.remote)
        self.ckpt.files.hint((c.file, c.offset, c.length) for _m, ka, kb, _x in found for k in (ka, kb)
                             for c in self.ckpt.entries[k].chunks if c.numel)

    def _stacked_experts(self, ka: str, kb: str) -> int:
        ea, eb = self.ckpt.entries.get(ka), self.ckpt.entries.get(kb)
        if ea is None or eb is None:
            raise FormatError("grouped-expert LoRA lacks its A or B factor", path=self.path / METADATA_NAME,
                              key=ka if ea is None else kb)
        if len(ea.shape) != 3 or len(eb.shape) != 3 or ea.shape[0] != eb.shape[0]:
            raise FormatError(f"grouped-expert LoRA A {list(ea.shape)} / B {list(eb.shape)} are not [E, r, in] / "
                              "[E, out, r] over the same experts", path=self.path / METADATA_NAME, key=ka)
        return ea.shape[0]

    def read_factor(self, module: str, ab: str) -> torch.Tensor:
        m = self.modules[module]
        key = m.a_key if ab == "A" else m.b_key
        if m.expert is None:
            return self.read_key(key)
        return self._rows.read_tensor(self._rows.expert_name(key, m.expert))   # exactly that expert's bytes

    def read_key(self, key: str) -> torch.Tensor:
        stem, expert = _split_ref(key)
        if expert is None:
            return self.ckpt.read_tensor(key)
        return self._rows.read_tensor(self._rows.expert_name(stem, expert))

    def key_facts(self, key: str) -> TensorFacts:
        stem, expert = _split_ref(key)
        e = self.ckpt.entry(stem)
        return TensorFacts(key, e.dtype, tuple(e.shape) if expert is None else tuple(e.shape[1:]))

    def lora_keys(self) -> list[str]:
        """The DCP keys of the LoRA factors (a stacked key once)."""
        return sorted({k for m in self.modules.values() for k in (m.a_key, m.b_key)})

    def close(self) -> None:
        self.ckpt.close()


def _split_ref(ref: str) -> tuple[str, int | None]:
    """`key` -> (key, None); `key[e]` (one expert's slice of a stacked tensor) -> (key, e)."""
    if ref.endswith("]") and "[" in ref:
        stem, _, idx = ref[:-1].rpartition("[")
        if idx.isdigit():
            return stem, int(idx)
    return ref, None


def trained_full_tensors(ckpt: DcpCheckpoint) -> dict[str, str]:
    """The base weights of a LoRA checkpoint that were trained whole: prime-rl HEAD's
    `lora.modules_to_save` (e.g. lm_head and model.norm), HF name -> DCP key (`key[e]` for one expert of
    a stacked tensor). Found from the optimizer state, the only mark training leaves: prime-rl optimizes
    every `requires_grad` param and freezes all else (HEAD trainer/lora.py, optim/__init__.py), so a base
    weight with `app.optimizers.state.<fqn>.*` was trained; never guessed from names. 16e747c's
    optimizer holds the LoRA only, so its checkpoints have none."""
    trained = trainable_params({k: e.path for k, e in ckpt.entries.items()})
    out: dict[str, str] = {}
    for key, e in ckpt.entries.items():
        ki = classify(key, e.path)
        if ki.group != "base" or key.removeprefix("app.model.") not in trained:
            continue
        if ki.stacked:
            for x in range(e.shape[0] if e.shape else 0):
                out[expert_hf_name(ki, x)] = f"{key}[{x}]"
        else:
            out[ki.hf_name] = key
    return dict(sorted(out.items()))


class NoLoraSource(LoraSource):
    """The "adapter" of a full fine-tune's export: no LoRA at all, the checkpoint's weights are the model."""
    kind = "none"

    def __init__(self, path: Path, *, tied_aliases: tuple[str, ...] = ()):
        self.path = Path(path)
        self.config_path = self.weights_path = self.path / METADATA_NAME
        self.tied_aliases = tied_aliases    # output embeddings trained as the input embedding (tied)
        self.modules, self.full_tensors = {}, {}
        self.alpha, self.alpha_source = None, "none (a full fine-tune: the trained weights are exported)"

    def read_key(self, key: str) -> torch.Tensor:
        raise FormatError("a full fine-tune has no adapter tensors", path=self.path, key=key)


def open_lora_source(path: str | Path, *, alpha: float | None = None, run_config: str | Path | None = None,
                     slot: int = 0, trust_pickle: bool = False) -> LoraSource:
    """A PEFT adapter dir or a prime-rl DCP checkpoint. For PEFT, alpha comes from its config
    (an explicit --alpha overrides it, with the adapter's own rank)."""
    p = Path(path)
    if is_checkpoint_path(p) and not p.name == METADATA_NAME:
        return DcpLoraSource(p, alpha=alpha, run_config=Path(run_config) if run_config else None, slot=slot,
                             trust_pickle=trust_pickle)
    if (p / ADAPTER_CONFIG).is_file():
        src = PeftLoraSource(p)
        if alpha is not None:
            src.with_alpha(alpha)
        return src
    raise UsageError("not a LoRA source: expected a PEFT adapter dir (adapter_config.json) or a prime-rl "
                     "DCP checkpoint (.metadata)", path=p)
