"""The LoRA view of a DCP checkpoint (`DcpCheckpoint.lora(...)`): prime-rl stores A/B but not alpha,
resolved by `formats.primerl.alpha`, never guessed. Grouped-expert factors ([E, r, in] / [E, out, r]) are
read one expert's rows at a time through the checkpoint's key view (`views.DcpKeySource`). A full
fine-tune's checkpoint has no LoRA: `NoLoraSource` stands for it where an op takes one."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ...core.errors import FormatError, UsageError
from ...core.keys import classify, expert_hf_name, expert_module, lora_key, require_known, stacked_lora_key
from ...core.lora_math import lora_scale
from ...io.inputs import as_input
from ..handle import LoraModule, LoraSource, RawTensor, TensorFacts
from ..primerl.alpha import AlphaResolution, resolve_alpha
from ..primerl.optimizers import trained_params
from .layout import METADATA_NAME
from .views import DcpKeySource

if TYPE_CHECKING:  # annotations only: torch is imported where tensors are built; the handle makes this view
    import torch

    from .reader import DcpCheckpoint

__all__ = ["DcpLoraSource", "NoLoraSource", "trained_full_tensors"]


class DcpLoraSource(LoraSource):
    kind = "dcp"
    ckpt: DcpCheckpoint  # the handle viewed (a LoraSource's may be None: this one's never is)
    slot: int
    alpha: float  # resolved (`formats.primerl.alpha`), never None

    def __init__(self, ckpt: DcpCheckpoint, *, alpha: float | None, run_config: Path | None, slot: int = 0):
        self.ckpt = ckpt
        self.path = ckpt.dir
        self.config_path = self.weights_path = ckpt.dir / METADATA_NAME
        self.slot = slot
        found = self._factor_keys(slot)
        shapes = self._factor_shapes(found, slot)
        uniq = sorted({s[2][0] for s in shapes.values()})
        res: AlphaResolution = resolve_alpha(
            alpha=alpha, run_config=run_config, ckpt_dir=self.path, rank=uniq[0] if len(uniq) == 1 else None
        )
        self.alpha = res.alpha
        self.alpha_source = res.source
        self.resolution = res
        self.warnings = res.warnings
        self.modules = {
            m: LoraModule(
                m, a_shape[0], lora_scale(res.alpha, a_shape[0]), ka, kb, a_shape, b_shape, False, a_dtype, x
            )
            for m, (ka, kb, a_shape, b_shape, a_dtype, x) in shapes.items()
        }
        self.full_tensors = trained_full_tensors(self.ckpt)
        stacked = any(x is not None for *_, x in found) or any(
            v.endswith("]") for v in self.full_tensors.values()
        )
        self._rows = DcpKeySource(self.ckpt) if stacked else None
        # every factor is read: a remote checkpoint fetches adjacent items in one request (io.remote)
        self.ckpt.hint_reads(
            (c.file, c.offset, c.length)
            for _m, ka, kb, _x in found
            for k in (ka, kb)
            for c in self.ckpt.tensor_entry(k).chunks
            if c.numel
        )

    def _factor_keys(self, slot: int) -> list[tuple[str, str, str, int | None]]:
        """(module, A key, B key, expert) of adapter `slot`: a dense module's own keys, or one expert's slice
        of stacked keys; every key known, the slot present."""
        infos = [classify(k, e.path) for k, e in self.ckpt.entries.items()]
        require_known(infos, self.path / METADATA_NAME)
        lora = [i for i in infos if i.group == "lora"]
        slots = sorted({i.slot for i in lora if i.slot is not None})  # (classify gives every LoRA key one)
        if not lora:
            raise FormatError(
                "the checkpoint holds no LoRA parameters (no app.model.*.lora_A.<i> keys)",
                path=self.path / METADATA_NAME,
                hint="this is not a LoRA run; there is nothing to extract or merge",
            )
        if slot not in slots:
            raise UsageError(
                f"adapter slot {slot} is not in the checkpoint (slots present: {slots})",
                path=self.path,
                hint=f"pass --slot {slots[0]}",
            )
        found: list[tuple[str, str, str, int | None]] = []
        mine = [i for i in lora if i.slot == slot and i.module is not None]
        for m in sorted({i.module for i in mine if i.module is not None and i.expert_proj is None}):
            found.append((m, lora_key(m, "A", slot), lora_key(m, "B", slot), None))
        for experts, proj in sorted(
            {(i.module, i.expert_proj) for i in mine if i.module is not None and i.expert_proj is not None}
        ):
            ka, kb = stacked_lora_key(experts, proj, "A", slot), stacked_lora_key(experts, proj, "B", slot)
            n = self._stacked_experts(ka, kb)
            found.extend((expert_module(experts, x, proj), ka, kb, x) for x in range(n))
        return found

    def _factor_shapes(self, found: list[tuple[str, str, str, int | None]], slot: int) -> dict[str, tuple]:
        """module -> (A key, B key, A shape, B shape, A dtype, expert); both factors there, of one rank."""
        shapes = {}
        for m, ka, kb, x in found:
            if ka not in self.ckpt.entries or kb not in self.ckpt.entries:
                raise FormatError(
                    f"module {m} lacks lora_A.{slot} or lora_B.{slot}", path=self.path / METADATA_NAME
                )
            ea, eb = self.ckpt.tensor_entry(ka), self.ckpt.tensor_entry(kb)
            sa, sb = (
                (tuple(ea.shape), tuple(eb.shape))
                if x is None
                else (tuple(ea.shape[1:]), tuple(eb.shape[1:]))
            )
            if len(sa) != 2 or len(sb) != 2 or sa[0] != sb[1]:
                raise FormatError(
                    f"A {list(ea.shape)} and B {list(eb.shape)} do not share a rank",
                    path=self.path / METADATA_NAME,
                    key=ka,
                )
            shapes[m] = (ka, kb, sa, sb, ea.dtype, x)
        return shapes

    def _stacked_experts(self, ka: str, kb: str) -> int:
        if ka not in self.ckpt.entries or kb not in self.ckpt.entries:
            raise FormatError(
                "grouped-expert LoRA lacks its A or B factor",
                path=self.path / METADATA_NAME,
                key=ka if ka not in self.ckpt.entries else kb,
            )
        ea, eb = self.ckpt.tensor_entry(ka), self.ckpt.tensor_entry(kb)
        if len(ea.shape) != 3 or len(eb.shape) != 3 or ea.shape[0] != eb.shape[0]:
            raise FormatError(
                f"grouped-expert LoRA A {list(ea.shape)} / B {list(eb.shape)} are not [E, r, in] / "
                "[E, out, r] over the same experts",
                path=self.path / METADATA_NAME,
                key=ka,
            )
        return ea.shape[0]

    def read_factor(self, module: str, ab: str) -> torch.Tensor:
        m = self.modules[module]
        key = m.a_key if ab == "A" else m.b_key
        if m.expert is None:
            return self.read_key(key)
        rows = self._key_source()
        return rows.read_tensor(rows.expert_name(key, m.expert))  # exactly that expert's bytes

    def read_key(self, key: str) -> torch.Tensor:
        stem, expert = _split_ref(key)
        if expert is None:
            return self.ckpt.read_tensor(key)
        rows = self._key_source()
        return rows.read_tensor(rows.expert_name(stem, expert))

    def _key_source(self) -> DcpKeySource:
        """The checkpoint's tensors by key, for one expert's slice of a stacked tensor (made on first use)."""
        if self._rows is None:
            self._rows = DcpKeySource(self.ckpt)
        return self._rows

    # -- as bytes, without torch: the reads `read_key` makes (`DcpCheckpoint.read_tensor_bytes`; an expert's
    # slice
    # by its row-block extents, `DcpKeySource.read_span`), every payload's CRC-32 checked; a layout the reader
    # cannot place by rows is assembled by its torch fallback
    def read_raw_key(self, key: str) -> RawTensor:
        """`read_key`'s tensor as a `RawTensor` (a DCP key, or `key[e]`: one expert's slice)."""
        stem, expert = _split_ref(key)
        if expert is None:
            e = self.ckpt.tensor_entry(key)
            return RawTensor(e.dtype, tuple(e.shape), self.ckpt.read_tensor_bytes(key))
        rows = self._key_source()
        name = rows.expert_name(stem, expert)
        f = rows.facts(name)
        buf = bytearray(f.nbytes)
        if buf:
            rows.read_span(name, 0, buf)
        return RawTensor(f.dtype, tuple(f.shape), buf)

    def read_raw_factor(self, module: str, ab: str) -> RawTensor:
        """`read_factor` as a `RawTensor`."""
        m = self.modules[module]
        key = m.a_key if ab == "A" else m.b_key
        return self.read_raw_key(key if m.expert is None else f"{key}[{m.expert}]")

    def key_facts(self, key: str) -> TensorFacts:
        stem, expert = _split_ref(key)
        e = self.ckpt.tensor_entry(stem)
        return TensorFacts(key, e.dtype, tuple(e.shape) if expert is None else tuple(e.shape[1:]))

    def lora_keys(self) -> list[str]:
        """The DCP keys of the LoRA factors (a stacked key once)."""
        return sorted({k for m in self.modules.values() for k in (m.a_key, m.b_key)})

    def close(self) -> None:
        self.ckpt.close()


class NoLoraSource(LoraSource):
    """The "adapter" of a full fine-tune's export: no LoRA at all, the checkpoint's weights are the model."""

    kind = "none"

    def __init__(self, path: Path, *, tied_aliases: tuple[str, ...] = ()):
        self.path = as_input(path)
        self.config_path = self.weights_path = self.path / METADATA_NAME
        self.tied_aliases = tied_aliases  # output embeddings trained as the input embedding (tied)
        self.modules, self.full_tensors = {}, {}
        self.alpha, self.alpha_source = None, "none (a full fine-tune: the trained weights are exported)"

    def read_key(self, key: str) -> torch.Tensor:
        raise FormatError("a full fine-tune has no adapter tensors", path=self.path, key=key)


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
    trained = trained_params(ckpt)  # a stateless optimizer (SignSGD) leaves no state: its param groups
    out: dict[str, str] = {}
    for key, e in ckpt.entries.items():
        ki = classify(key, e.path)
        if ki.group != "base" or key.removeprefix("app.model.") not in trained:
            continue
        if ki.stacked:
            shape = ckpt.tensor_entry(key).shape
            for x in range(shape[0] if shape else 0):
                out[expert_hf_name(ki, x)] = f"{key}[{x}]"
        else:
            assert ki.hf_name is not None  # classify names every non-stacked base weight
            out[ki.hf_name] = key
    return dict(sorted(out.items()))
