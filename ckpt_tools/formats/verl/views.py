"""The tensors of a verl checkpoint as `Source`s (the views `VerlCheckpoint.base_weights()` / `.by_key()`
offer).

A piece sharded on dim 0 (FSDP's rule for every weight verl saves) is one contiguous range of the tensor's
row-major bytes: an `Extent` straight into its storage record, its bytes checked against the record's zip
CRC-32
as they arrive. A piece sharded on another dim has no such range: the tensor is assembled whole once (memory:
that tensor), piece by piece, then served from that copy.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from ...core.dtypes import ITEMSIZE, torch_dtype
from ...core.errors import FormatError
from ..handle import Extent, Source, TensorFacts, tensor_bytes

if TYPE_CHECKING:  # the handle imports these views lazily: no import cycle
    from .reader import VerlCheckpoint, VerlEntry

__all__ = ["VerlBaseSource", "VerlKeySource", "entry_extents"]


def entry_extents(e: VerlEntry) -> list[Extent] | None:
    """The row-major byte ranges of `e`, when each piece is a block of whole dim-0 rows; else None."""
    row = (math.prod(e.shape[1:]) if e.shape else 1) * ITEMSIZE[e.dtype]
    out = []
    for p in sorted(e.pieces, key=lambda p: p.offsets):
        if any(o for o in p.offsets[1:]) or tuple(p.sizes[1:]) != tuple(e.shape[1:]):
            return None
        item = ITEMSIZE[e.dtype]
        rec = p.record
        pos = p.local.offset * item
        start = p.offsets[0] * row if p.offsets else 0
        out.append(
            Extent(
                start,
                math.prod(p.sizes) * item,
                p.file,
                rec.offset + pos,
                (rec.offset, rec.size, rec.crc),
                pos,
            )
        )
    return out


class _VerlSource(Source):
    kind = "verl"

    def __init__(self, ckpt: VerlCheckpoint, label: str | None, owned: bool):
        super().__init__()
        self.ckpt = ckpt
        self.path = ckpt.dir
        self.label = str(ckpt.dir) if label is None else label
        self._owns = owned
        self._keys: dict[str, str] = {}

    def _add(self, name: str, key: str) -> None:
        e = self.ckpt.entries[key]
        self._keys[name] = key
        self._facts[name] = TensorFacts(name, e.dtype, e.shape)

    def ref(self, name: str) -> str:
        self.facts(name)
        return self._keys[name]

    def _extents(self, name: str) -> list[Extent] | None:
        return entry_extents(self.ckpt.entries[self._keys[name]])

    def _pread(self, file: str, offset: int, buf: memoryview, name: str) -> None:
        self.ckpt.files.read_into(file, offset, buf, self._keys.get(name, name))

    def _check_piece(self, e: Extent, pos: int, data, name: str) -> None:
        assert e.record is not None
        at, size, crc = e.record
        if crc and not self.ckpt.crc.feed((e.file, at), size, crc, e.record_pos + pos, data):
            from ...core.errors import ChecksumError
            from ..dcp.item import CRC_HINT

            raise ChecksumError(
                "a storage record fails its zip CRC-32 check: its bytes are damaged; nothing was written "
                "from them",
                path=self.ckpt.dir / e.file,
                key=self._keys.get(name, name),
                hint=CRC_HINT,
            )

    def _read_whole(self, name: str):
        """Every piece into its region of a new tensor (a layout with no row-block extents)."""
        import torch  # lazy: metadata commands import this module without torch

        e = self.ckpt.entries[self._keys[name]]
        out = torch.empty(e.shape, dtype=torch_dtype(e.dtype))
        for p in e.pieces:
            part = torch.empty(p.sizes, dtype=out.dtype)
            if part.numel():
                self.ckpt.read_piece(p, 0, tensor_bytes(part), e.key)
            out[tuple(slice(o, o + s) for o, s in zip(p.offsets, p.sizes))] = part
        return out

    def close(self) -> None:
        super().close()
        if self._owns:
            self.ckpt.close()


class VerlBaseSource(_VerlSource):
    """The model's weights under their HF names (`keys.KEY_RULES`), LoRA factors aside: the trainer's fp32
    masters (verl trains the actor in fp32, `FSDPEngine._build_module`)."""

    masters = True

    def __init__(self, ckpt: VerlCheckpoint, label: str | None = None, *, owned: bool = False):
        super().__init__(ckpt, label, owned)
        self.config_dir = ckpt.hf_config_dir
        for key, info in ckpt.infos.items():
            if info.group == "base" and info.hf_name is not None:
                if info.hf_name in self._keys:
                    raise FormatError(f"two keys map to {info.hf_name}", path=ckpt.dir, key=key)
                self._add(info.hf_name, key)
        if not self._facts:
            raise FormatError("the checkpoint holds no base weights", path=ckpt.dir)


class VerlKeySource(_VerlSource):
    """Every tensor under its key in the model file."""

    def __init__(self, ckpt: VerlCheckpoint, label: str | None = None, *, owned: bool = False):
        super().__init__(ckpt, label, owned)
        for key in ckpt.entries:
            self._add(key, key)
