"""An HF model dir (single file or sharded) or a hub id from the local HF cache, as a `Source`: every
tensor is one extent of one shard, read by range."""
from __future__ import annotations

import os
from pathlib import Path

from ..formats.hf_dir.hub import resolve_model_dir
from ..formats.hf_dir.model_dir import HFModelDir
from .base import Extent, Source, TensorFacts

__all__ = ["HFSource"]


class HFSource(Source):
    kind = "hf"

    def __init__(self, path: str | os.PathLike, label: str | None = None, *, model_dir: HFModelDir | None = None):
        super().__init__()
        self.model_dir = model_dir if model_dir is not None else HFModelDir.open(Path(path))
        self.path = self.model_dir.path
        self.label = str(path) if label is None else label
        for name, ti in self.model_dir.tensors.items():   # disk order: shard files by name, then offset
            self._facts[name] = TensorFacts(name, ti.dtype_name, tuple(ti.shape))

    @classmethod
    def open(cls, name_or_dir: str | os.PathLike, label: str | None = None) -> "HFSource":
        """A model dir, or a hub id resolved from the local HF cache (offline)."""
        return cls(resolve_model_dir(name_or_dir), str(name_or_dir) if label is None else label)

    @property
    def config(self) -> dict | None:
        return self.model_dir.config

    def disk_order(self) -> list[str]:
        """Tensor names in the order their bytes lie on disk (sequential reads)."""
        return list(self.model_dir.tensors)

    def info(self, name: str):
        """The safetensors `TensorInfo` of `name` (its shard and byte range)."""
        return self.model_dir.info(name)

    def _extents(self, name: str) -> list[Extent]:
        ti = self.model_dir.info(name)
        return [Extent(0, ti.nbytes, ti.path.name, ti.begin)]

    def _pread(self, file: str, offset: int, buf: memoryview, name: str) -> None:
        self.model_dir.files.read_into(file, offset, buf, name)

    def _read_whole(self, name: str):
        return self.model_dir.read_tensor(name)

    def open_all(self) -> None:
        """Open every shard's fd now (before worker threads start reading)."""
        for header in self.model_dir.headers.values():
            if header.tensors:
                self.model_dir.fd(next(iter(header.tensors)))

    def close(self) -> None:
        super().close()
        self.model_dir.close()
