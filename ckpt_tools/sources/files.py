"""The tensors of one weights file, by key: a safetensors file (read by range) or a torch pickle
`.bin` (loaded whole through the allow-list: a pickle cannot be read by range). What `ckpt
fix-adapter` reads a prime-rl adapter export through, whatever its keys look like."""

from __future__ import annotations

from pathlib import Path

from ..core.dtypes import dtype_name
from ..formats.handle import Extent, Source, TensorFacts
from ..formats.peft.adapter import load_adapter_bin
from ..formats.safetensors.header import read_header
from ..io.inputs import OpenFiles, as_input

__all__ = ["TensorFileSource"]


class TensorFileSource(Source):
    kind = "file"

    def __init__(self, path: Path):
        super().__init__()
        self.path = as_input(path)
        self.label = str(path)
        self._bin = None
        self._files = None
        if self.path.name.endswith(".safetensors"):
            self._infos = read_header(self.path).tensors
            self._files = OpenFiles(self.path.parent, what="safetensors file")
            for k, i in self._infos.items():
                self._facts[k] = TensorFacts(k, i.dtype_name, tuple(i.shape))
        else:
            self._bin = load_adapter_bin(self.path)
            for k, v in self._bin.items():
                self._facts[k] = TensorFacts(k, dtype_name(v.dtype), tuple(v.shape))

    def _extents(self, name: str) -> list[Extent] | None:
        if self._bin is not None:
            return None
        i = self._infos[name]
        return [Extent(0, i.nbytes, self.path.name, i.begin)]

    def _pread(self, file: str, offset: int, buf: memoryview, name: str) -> None:
        assert self._files is not None  # extents are a safetensors file's
        self._files.read_into(file, offset, buf, name)

    def _read_whole(self, name: str):
        assert self._bin is not None  # a .bin file's tensors have no extents
        return self._bin[name].clone()  # a private copy: the caller may modify it

    def close(self) -> None:
        super().close()
        if self._files is not None:
            self._files.close()
