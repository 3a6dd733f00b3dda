"""Hugging Face model directories, opened by their headers only: `HFModelDir`, the format's one handle
and a `Source` (`formats.handle`): every tensor is one extent of one shard, read by range.

`HFModelDir.open` reads config.json, the shard index and every shard's safetensors header (a few
KB each), validates them against each other (`checks.check_index`: the rules `ckpt verify` lists),
and reads no tensor bytes; tensors are then read one at a time by name (the fds of the dir through
`inputs.OpenFiles`, where a remote input plugs in). `HFModelDir.open_ref` takes a hub id too (the local
HF cache, offline).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from ...core.errors import FormatError, MissingFileError
from ...io.inputs import OpenFiles, as_input, lexists, list_names, register
from ...io.pread import RangeReader
from ..handle import ByteRange, Extent, Source, TensorFacts, tensor_bytes
from ..safetensors.header import ByteCounter, SafetensorsHeader, TensorInfo, read_header
from ..safetensors.read import read_raw, read_tensor
from .carry import carry_files, classify_entries
from .checks import check_index
from .config import load_config
from .fp8 import Fp8Scheme, fp8_scheme, quantized_pairs
from .hub import resolve_model_dir
from .names import INDEX_NAME, WEIGHTS_NAME

if TYPE_CHECKING:  # annotations only: torch is imported where tensors are built
    import torch

__all__ = ["HFModelDir", "tensor_shapes"]


class HFModelDir(Source):
    """An opened model directory: headers and config in memory, tensor bytes on disk; a `Source`.

    `keys()` lists tensors in disk order (shard files by name, then data offset). Shard files are
    opened on first read and kept open until `close()` (or the end of a `with` block)."""

    kind = "hf"

    def __init__(
        self,
        path: Path,
        config: dict | None,
        headers: dict[str, SafetensorsHeader],
        index_metadata: dict | None,
        label: str | None = None,
    ):
        super().__init__()
        self.path = path
        self.label = str(path) if label is None else label
        self.config = config  # parsed config.json, None when absent
        self.headers = headers  # shard file name -> header, sorted by name
        self.index_metadata = index_metadata  # the index's "metadata", None when unsharded
        self.tensors: dict[str, TensorInfo] = {}  # name -> where its bytes lie, in disk order
        for header in headers.values():
            self.tensors.update(header.tensors)
        self.files = OpenFiles(
            path,
            what="safetensors shard",
            missing_hint="the shard disappeared after the model was opened",
            truncated_hint="the shard shrank or is truncated; run `ckpt verify`",
        )
        for name, ti in self.tensors.items():  # disk order: shard files by name, then offset
            self._facts[name] = TensorFacts(name, ti.dtype_name, tuple(ti.shape))
        # A block-FP8 dir's logical face: each quantized weight a float32 of fl32(q * scale), its scale hidden
        # (`formats.hf_dir.fp8`); `keys()` / `info()` stay the stored tensors.
        self.fp8: Fp8Scheme | None = fp8_scheme(config)
        self.quantized: dict[str, str] = {}  # weight -> its weight_scale_inv, under `fp8`
        if self.fp8 is not None:
            pairs = quantized_pairs({n: ti.dtype_name for n, ti in self.tensors.items()})
            for w, s in pairs.items():
                if len(self.tensors[w].shape) == 2 and s in self._facts:
                    self._facts[w] = TensorFacts(w, "float32", tuple(self.tensors[w].shape))
                    del self._facts[s]
                    self.quantized[w] = s

    # -- construction
    @classmethod
    def open_ref(cls, name_or_dir: str | os.PathLike, label: str | None = None) -> HFModelDir:
        """A model dir, or a hub id resolved from the local HF cache (offline); `label` defaults to what
        was asked for."""
        return cls.open(resolve_model_dir(name_or_dir), str(name_or_dir) if label is None else label)

    @classmethod
    def open(cls, path: str | os.PathLike, label: str | None = None) -> HFModelDir:
        label = str(path) if label is None else label
        path = as_input(path)
        if not path.is_dir():
            raise MissingFileError("not a directory", path=path, hint="pass an HF model directory")
        register(path)  # the whole model dir is an input: no OUT inside it
        # lexists, not is_file: a config, shard or index that is a FIFO or a symlink out of the
        # model dir belongs to it and is refused by name when read (inputs.open_input)
        config, _cfg_path = load_config(path, required=False)
        single, index = path / WEIGHTS_NAME, path / INDEX_NAME
        if lexists(single) and lexists(index):
            raise FormatError(
                f"has both {WEIGHTS_NAME} and {INDEX_NAME}; loaders disagree on which wins",
                path=path,
                hint="delete the stale one",
            )
        if lexists(single):
            return cls(path, config, {WEIGHTS_NAME: read_header(single)}, None, label)
        if lexists(index):
            headers, metadata = _open_index(path, index)
            return cls(path, config, headers, metadata, label)
        pickles = sorted(n for n in list_names(path) if n.endswith(".bin"))
        hint = (
            f"it only has pickle weights ({', '.join(pickles[:3])}); convert them to safetensors first"
            if pickles
            else "is this a Hugging Face model directory?"
        )
        raise MissingFileError(f"no {WEIGHTS_NAME} or {INDEX_NAME}", path=path, hint=hint)

    # -- metadata (no tensor bytes)
    def keys(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __len__(self) -> int:
        return len(self.tensors)

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise FormatError("no such tensor in the model", path=self.path, key=name) from None

    @property
    def weight_files(self) -> list[Path]:
        return [self.path / n for n in self.headers]

    @property
    def total_bytes(self) -> int:
        """Sum of tensor data bytes (what an index's `metadata.total_size` records)."""
        return sum(t.nbytes for t in self.tensors.values())

    def non_weight_files(self) -> list[Path]:
        """Regular top-level files to carry into a derived model: config, generation config,
        tokenizer, chat template, README, ... Excludes our weights and index, any other weight-like
        file (see `skipped_entries`), hidden files and subdirectories. Sorted by name. Each is
        checked as an input now (a symlink out of the model dir is refused before anything runs)."""
        return carry_files(self.path, exclude=self.own_files())[0]

    def skipped_entries(self) -> list[str]:
        """Top-level names neither weights of this model nor carried by `non_weight_files`
        (extra weight files, subdirectories, hidden entries), for callers to report."""
        return [n for n, kind in classify_entries(self.path, self.own_files()) if kind == "skip"]

    def own_files(self) -> set[str]:
        """This model's weight files and index."""
        return set(self.headers) | ({INDEX_NAME} if self.index_metadata is not None else set())

    # -- tensor bytes (the `Source` reads: `read_into`, `read_rows`, `read_tensor`, ... through `_pread`)
    def fd(self, name: str) -> int | RangeReader:
        """The range reader of the file holding tensor `name` (an open fd, or a URL's object; owned by this
        object)."""
        return self.files.fd(self.info(name).path.name, name)

    def read_stored(self, name: str, *, counter: ByteCounter | None = None) -> torch.Tensor:
        """Tensor `name` read from its shard's fd in one pread (`safetensors.read.read_tensor`)."""
        return read_tensor(self.info(name), self.fd(name), counter=counter)

    def read_raw(self, name: str, *, counter: ByteCounter | None = None) -> bytearray:
        return read_raw(self.info(name), self.fd(name), counter=counter)

    def file_of(self, name: str) -> str:
        return self.info(name).path.name

    def copy_range(self, name: str) -> ByteRange | None:
        if name in self.quantized:  # stored as codes + scales: dequantized, never copied
            return None
        info = self.info(name)
        fd = self.files.check_range(info.path.name, info.begin, info.nbytes, name)
        return ByteRange(fd, info.begin, info.nbytes, info.path)

    def disk_order(self) -> list[str]:
        return [n for n in self.tensors if n in self._facts]

    def read_codes(self, name: str, start: int, count: int) -> torch.Tensor:
        import torch

        if name not in self.quantized:
            return super().read_codes(name, start, count)
        stored, cols = self.info(name), self.info(name).shape[1]
        codes = torch.empty(count * cols, dtype=torch.uint8)
        if count:
            self.files.read_into(stored.path.name, stored.begin + start * cols, tensor_bytes(codes), name)
        self._count(codes.numel())
        return codes

    def read_scales(self, name: str) -> torch.Tensor:
        import torch

        if name not in self.quantized:
            return super().read_scales(name)
        return self.read_stored(self.quantized[name]).to(torch.float32)

    def read_span(self, name: str, start: int, out) -> None:
        if name not in self.quantized:
            return super().read_span(name, start, out)
        self._read_dequantized(name, start, memoryview(out).cast("B"))

    def _read_dequantized(self, name: str, start: int, out: memoryview) -> None:
        """Bytes [start, start + len(out)) of the float32 fl32(q * scale) of a quantized weight: its stored
        rows that cover them (codes) and its scale grid read, dequantized (`core.fp8`)."""
        import torch

        from ...core.fp8 import dequantize_rows_into

        info, cols = self.facts(name), self.facts(name).shape[1]
        n = len(out)
        if start % 4 or n % 4 or start < 0 or start + n > info.nbytes:
            raise ValueError(
                f"byte range [{start}, {start + n}) is not whole float32 elements of tensor {name}"
            )
        if n == 0:
            return
        e0, e1 = start // 4, (start + n) // 4
        r0, r1 = e0 // cols, -(-e1 // cols)
        stored = self.info(name)
        codes = torch.empty((r1 - r0) * cols, dtype=torch.uint8)
        self.files.read_into(stored.path.name, stored.begin + r0 * cols, tensor_bytes(codes), name)
        scales = self.read_stored(self.quantized[name]).to(torch.float32)
        self._count(codes.numel() + scales.numel() * 4)
        aligned = e0 == r0 * cols and e1 == r1 * cols
        dest = torch.frombuffer(out, dtype=torch.float32) if aligned else torch.empty((r1 - r0) * cols)
        assert self.fp8 is not None
        dequantize_rows_into(
            codes.view(torch.float8_e4m3fn).view(r1 - r0, cols),
            scales,
            r0,
            dest.view(r1 - r0, cols),
            self.fp8.block,
        )
        if not aligned:
            out[:] = tensor_bytes(dest)[(e0 - r0 * cols) * 4 : (e1 - r0 * cols) * 4]

    def open_all(self) -> None:
        for header in self.headers.values():
            if header.tensors:
                self.fd(next(iter(header.tensors)))

    def _extents(self, name: str) -> list[Extent]:
        ti = self.info(name)
        return [Extent(0, ti.nbytes, ti.path.name, ti.begin)]

    def _pread(self, file: str, offset: int, buf: memoryview, name: str) -> None:
        self.files.read_into(file, offset, buf, name)

    def _read_whole(self, name: str) -> torch.Tensor:
        return self.read_stored(name)

    def close(self) -> None:
        super().close()
        self.files.close()

    def __repr__(self) -> str:
        return f"HFModelDir({str(self.path)!r}, {len(self)} tensors in {len(self.headers)} file(s))"


def _open_index(root: Path, index_path: Path) -> tuple[dict[str, SafetensorsHeader], dict]:
    """The shard headers and index metadata of a sharded dir; its first broken invariant raised (`checks`)."""
    check = check_index(root, index_path)
    bad = check.fatal()
    if bad is not None:
        assert bad.error is not None  # every refusal of check_index keeps its error
        raise bad.error
    assert check.metadata is not None  # an index that opens has a metadata object (or none: {})
    return check.headers, check.metadata


def tensor_shapes(model_dir: Path) -> tuple[dict[str, tuple[int, ...]], dict]:
    """{tensor name: shape} of a model dir from its headers only, and its config ({} when absent)."""
    with HFModelDir.open(model_dir) as m:
        return {k: tuple(m.info(k).shape) for k in m.keys()}, (m.config or {})
