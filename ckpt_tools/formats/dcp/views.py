"""The tensors of a DCP checkpoint as `Source`s: the views its handle offers (`DcpCheckpoint.base_weights()`,
`.by_key()`). `DcpBaseSource`: the base weights (`app.model.<name>`
tensors that are not LoRA params, fp32 masters in prime-rl) under their HF names, whatever the
generation wrote: prime-format stacked experts (`mlp.experts.w1` [E, inter, hidden]) appear as the HF
per-expert weights (`mlp.experts.<e>.gate_proj.weight`), each a contiguous slice of the stacked
tensor, and the router `mlp.router.gate.weight` as `mlp.gate.weight` (the key rule table,
`core.keys`). `DcpKeySource`: any tensor under its DCP key (the LoRA sources read expert rows of a
stacked factor through it). FSDP2 / expert-parallel row-block chunks are contiguous extents of the
tensor (each item decoded once, `formats.dcp.item`); any other chunk layout is read whole once,
through the checkpoint reader's torch.load fallback. Every payload byte read through an extent is
checked against its item's zip CRC-32 as it arrives (`DcpCheckpoint.check_piece`): a damaged item is
a ChecksumError, never a tensor."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ...core.errors import FormatError
from ...core.keys import classify, expert_hf_name
from ..handle import Extent, Source, TensorFacts
from .item import ItemError, is_row_block
from .layout import METADATA_NAME
from .model import TensorEntry

if TYPE_CHECKING:  # the handle makes its views (`DcpCheckpoint.base_weights()`, `.by_key()`), not the reverse
    from .reader import DcpCheckpoint

__all__ = ["DcpBaseSource", "DcpKeySource", "row_block_extents"]


def row_block_extents(ckpt: DcpCheckpoint, key: str) -> list[Extent] | None:
    """Where the row-major bytes of tensor `key` lie, when its chunks are dim-0 row blocks whose items
    hold the raw payload; None otherwise (the caller reads it whole)."""
    e = ckpt.tensor_entry(key)
    row_bytes = (math.prod(e.shape[1:]) if e.shape else 1) * e.itemsize
    out: list[Extent] = []
    for ch in sorted((c for c in e.chunks if c.numel), key=lambda c: c.offsets):
        if not is_row_block(ch.offsets, ch.sizes, e.shape):
            return None
        try:
            dec = ckpt.decode_chunk(key, ch)
        except ItemError:
            return None  # unusual item: let the reader's torch.load fallback decode it
        if not dec.payload_is(e.dtype, ch.sizes):
            return None
        start = (ch.offsets[0] * row_bytes) if ch.offsets else 0
        at = ch.offset + dec.payload_offset
        out.append(Extent(start, dec.payload_size, ch.file, at, (at, dec.payload_size, dec.layout.data_crc)))
    # the extents must tile the tensor exactly; anything else is for the reader to diagnose
    pos = 0
    for x in out:
        if x.start != pos:
            return None
        pos += x.nbytes
    return out if pos == e.nbytes else None


def _slice_extents(extents: list[Extent], start: int, nbytes: int) -> list[Extent]:
    """The extents of bytes [start, start + nbytes) of a tensor, renumbered from 0."""
    out = []
    for x in extents:
        lo, hi = max(start, x.start), min(start + nbytes, x.start + x.nbytes)
        if lo < hi:
            out.append(
                Extent(
                    lo - start,
                    hi - lo,
                    x.file,
                    x.offset + (lo - x.start),
                    x.record,
                    x.record_pos + (lo - x.start),
                )
            )
    return out


class _DcpSource(Source):
    """Names -> (DCP key, expert index or None): a name is a whole tensor or one dim-0 slice of it."""

    kind = "dcp"

    def __init__(self, ckpt: DcpCheckpoint, label: str | None):
        super().__init__()
        self._owns = False
        self.ckpt = ckpt
        self.path = ckpt.dir
        self.label = str(ckpt.dir) if label is None else label
        self._keys: dict[str, tuple[str, int | None]] = {}
        self._stacked_extents: dict[str, list[Extent] | None] = {}

    def owns_checkpoint(self, owned: bool) -> None:
        """Whether closing this view closes its checkpoint."""
        self._owns = owned

    def _add(self, name: str, key: str, e: TensorEntry, expert: int | None = None) -> None:
        self._keys[name] = (key, expert)
        shape = tuple(e.shape) if expert is None else tuple(e.shape[1:])
        self._facts[name] = TensorFacts(name, e.dtype, shape)

    def dcp_key(self, name: str) -> str:
        self.facts(name)
        return self._keys[name][0]

    def ref(self, name: str) -> str:
        """A unique reference of tensor `name` in the checkpoint: its DCP key (`key[e]`: an expert slice)."""
        key, expert = self._keys[self.facts(name).name]
        return key if expert is None else f"{key}[{expert}]"

    def expert_of(self, name: str) -> int | None:
        """The expert index when `name` is one slice of a stacked tensor."""
        self.facts(name)
        return self._keys[name][1]

    def _read_whole(self, name: str):
        key, expert = self._keys[name]
        t = self.ckpt.read_tensor(key)
        return t if expert is None else t[expert].clone()

    def _extents(self, name: str) -> list[Extent] | None:
        key, expert = self._keys[name]
        if expert is None:
            return row_block_extents(self.ckpt, key)
        # each expert is a slice of one decoding of the stacked tensor's items (`extents` holds the lock)
        if key not in self._stacked_extents:
            self._stacked_extents[key] = row_block_extents(self.ckpt, key)
        whole = self._stacked_extents[key]
        if whole is None:
            return whole
        per = self._facts[name].nbytes
        return _slice_extents(whole, expert * per, per)

    def _pread(self, file: str, offset: int, buf: memoryview, name: str) -> None:
        self.ckpt.files.read_into(file, offset, buf, self._keys[name][0] if name in self._keys else name)

    def _check_piece(self, e: Extent, pos: int, data, name: str) -> None:
        assert e.record is not None  # a DCP extent records its item (row_block_extents)
        at, size, crc = e.record
        self.ckpt.check_piece(
            e.file,
            at,
            size,
            crc,
            e.record_pos + pos,
            data,
            self._keys[name][0] if name in self._keys else name,
        )

    def close(self) -> None:
        super().close()
        if self._owns:
            self.ckpt.close()


class DcpBaseSource(_DcpSource):
    masters = True  # prime-rl's checkpoint holds the fp32 masters of the weights it trained

    def __init__(
        self,
        ckpt: DcpCheckpoint,
        label: str | None = None,
        *,
        empty_hint: str = "a slim checkpoint has none: `ckpt rehydrate` it, or compare the HF base instead",
    ):
        super().__init__(ckpt, label)
        self.stacked: dict[str, str] = {}  # HF per-expert name -> the stacked DCP key it is a slice of
        for key, e in self.ckpt.entries.items():
            ki = classify(key, e.path)
            if ki.group != "base" or not isinstance(e, TensorEntry):
                continue
            if ki.stacked:
                for x in range(e.shape[0] if e.shape else 0):
                    self._add(expert_hf_name(ki, x), key, e, x)
                    self.stacked[expert_hf_name(ki, x)] = key
            else:
                assert ki.hf_name is not None  # classify names every non-stacked base weight
                self._add(ki.hf_name, key, e)
        if not self._facts:
            raise FormatError(
                "the checkpoint holds no base weights (no app.model.<name> tensors)",
                path=self.path / METADATA_NAME,
                hint=empty_hint,
            )


class DcpKeySource(_DcpSource):
    """Every tensor of a checkpoint under its DCP key, and `key[e]` slices of stacked ones on request."""

    def __init__(self, ckpt: DcpCheckpoint, label: str | None = None):
        super().__init__(ckpt, label)
        for key, e in self.ckpt.entries.items():
            if isinstance(e, TensorEntry):
                self._add(key, key, e)

    def expert_name(self, key: str, expert: int) -> str:
        """The name of slice `expert` (dim 0) of tensor `key`, registered on first use."""
        name = f"{key}[{expert}]"
        if name not in self._facts:
            e = self.ckpt.tensor_entry(key)
            if not e.shape or not 0 <= expert < e.shape[0]:
                raise FormatError(
                    f"expert {expert} is outside the tensor's {list(e.shape)}", path=self.path, key=key
                )
            with self._lock:
                self._add(name, key, e, expert)  # facts only: `extents` takes the lock separately
        return name
