"""The base weights of a DCP checkpoint (`app.model.<HF name>` tensors that are not LoRA params,
fp32 masters in prime-rl) as a `Source` under their HF names. FSDP2 row-block chunks are contiguous
extents of the tensor (each item decoded once, `formats.dcp.item`); any other chunk layout is read
whole once, through the checkpoint reader's torch.load fallback."""
from __future__ import annotations

import math
from pathlib import Path

from ..core.errors import FormatError
from ..core.keys import classify
from ..formats.dcp.item import ItemError, is_row_block
from ..formats.dcp.layout import METADATA_NAME
from ..formats.dcp.model import TensorEntry
from ..formats.dcp.reader import DcpCheckpoint
from .base import Extent, Source, TensorFacts

__all__ = ["DcpBaseSource"]


class DcpBaseSource(Source):
    kind = "dcp"

    def __init__(self, path: str | Path, label: str | None = None, *, trust_pickle: bool = False,
                 ckpt: DcpCheckpoint | None = None,
                 empty_hint: str = "a slim checkpoint has none: `ckpt rehydrate` it, or compare the HF base instead"):
        super().__init__()
        self._owns = ckpt is None
        self.ckpt = ckpt if ckpt is not None else DcpCheckpoint.open(path, trust_pickle=trust_pickle)
        self.path = self.ckpt.dir
        self.label = str(path) if label is None else label
        self._keys: dict[str, str] = {}
        for key, e in self.ckpt.entries.items():
            ki = classify(key, e.path)
            if ki.group == "base" and isinstance(e, TensorEntry):
                self._keys[ki.hf_name] = key
                self._facts[ki.hf_name] = TensorFacts(ki.hf_name, e.dtype, e.shape)
        if not self._facts:
            raise FormatError("the checkpoint holds no base weights (no app.model.<name> tensors)",
                              path=self.path / METADATA_NAME, hint=empty_hint)

    def dcp_key(self, name: str) -> str:
        self.facts(name)
        return self._keys[name]

    def _read_whole(self, name: str):
        return self.ckpt.read_tensor(self.dcp_key(name))

    def _extents(self, name: str) -> list[Extent] | None:
        key = self.dcp_key(name)
        e = self.ckpt.entries[key]
        row_bytes = (math.prod(e.shape[1:]) if e.shape else 1) * e.itemsize
        out: list[Extent] = []
        for ch in sorted((c for c in e.chunks if c.numel), key=lambda c: c.offsets):
            if not is_row_block(ch.offsets, ch.sizes, e.shape):
                return None
            try:
                dec = self.ckpt.decode_chunk(key, ch)
            except ItemError:
                return None  # unusual item: let the reader's torch.load fallback decode it
            if not dec.payload_is(e.dtype, ch.sizes):
                return None
            start = (ch.offsets[0] * row_bytes) if ch.offsets else 0
            out.append(Extent(start, dec.payload_size, ch.file, ch.offset + dec.payload_offset))
        # the extents must tile the tensor exactly; anything else is for the reader to diagnose
        pos = 0
        for x in out:
            if x.start != pos:
                return None
            pos += x.nbytes
        return out if pos == e.nbytes else None

    def _pread(self, file: str, offset: int, buf: memoryview, name: str) -> None:
        self.ckpt.files.read_into(file, offset, buf, self._keys.get(name, name))

    def close(self) -> None:
        super().close()
        if self._owns:
            self.ckpt.close()
