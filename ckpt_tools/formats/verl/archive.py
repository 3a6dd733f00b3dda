"""One `torch.save` archive of a verl checkpoint (`model_world_size_W_rank_R.pt`, `optim_...`,
`extra_state_...`),
decoded as data: no code runs, no tensor is built, no byte of tensor data is read.

torch.save writes a zip of STORED records: `<archive>/data.pkl` (the object, its tensors as persistent ids
naming a storage record `<archive>/data/<key>`), the storages, and a few markers. `open_archive` reads the
central directory (`formats.dcp.item.parse_item`: every record inside the file, uncompressed), then
`data.pkl` alone (bounded, CRC-checked), and unpickles it through the allow-list (`io.safe_pickle`, after
`check_pickle_bounds`) into stand-ins: a plain tensor is a `TensorRef` (its storage record, offset, size,
stride), a DTensor a `DTensorRef` (its rank-local `TensorRef`, the global shape, its placements as data),
and every other torch or numpy object torch pickles around them (DTensorSpec, DeviceMesh, TensorMeta, numpy's
RNG state) a `Stub` that keeps its arguments and state. A global outside the allow-list is an
UnsafePickleError naming it (`--trust-remote-pickle` does not apply: there is nothing here worth running).
"""

from __future__ import annotations

import io
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ...core.crc import crc32
from ...core.dtypes import ITEMSIZE, STORAGE_CLASSES, TORCH_DTYPE_NAMES
from ...core.errors import ChecksumError, FormatError, UnsafePickleError
from ...io.inputs import OpenFiles
from ...io.pickle_scan import gc_paused
from ...io.safe_pickle import AllowListUnpickler, check_pickle_bounds
from ..dcp.item import CRC_HINT, ItemError, ItemLayout, central_directory, crc_error, parse_item, window

__all__ = [
    "HEADER_READ_BYTES",
    "MAX_PICKLE_BYTES",
    "Archive",
    "DTensorRef",
    "Placement",
    "Record",
    "StorageRef",
    "Stub",
    "TensorRef",
    "decode_data_pkl",
    "open_archive",
    "storage_bytes_ok",
    "walk_records",
]

# data.pkl of a rank file holds one entry per parameter (~1 KiB with its DTensorSpec): a 1,000-layer model's
# is a few MiB. Anything past this is not read.
MAX_PICKLE_BYTES = 256 << 20
# What the zip directory walk reads ahead: one record's local header and name (30 + ~40 bytes in a rank file;
# its records are each read once, where the directory says, so more read-ahead is only fetched for nothing)
HEADER_READ_BYTES = 128


@dataclass(frozen=True)
class Record:
    """A zip record's payload: bytes [offset, offset + size) of the file, stored CRC-32 `crc`."""

    name: str
    offset: int
    size: int
    crc: int


@dataclass(frozen=True)
class StorageRef:
    key: str  # the record `<archive>/data/<key>`
    dtype: str
    numel: int


@dataclass(frozen=True)
class TensorRef:
    """A tensor as torch.save records it: a view of a storage."""

    storage: StorageRef
    offset: int  # in elements
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dtype(self) -> str:
        return self.storage.dtype

    @property
    def contiguous(self) -> bool:
        acc = 1
        for s, st in zip(reversed(self.size), reversed(self.stride)):
            if s > 1 and st != acc:
                return False
            acc *= s
        return True


@dataclass(frozen=True)
class Placement:
    kind: str  # "shard", "replicate", "partial", or the class name of anything else
    dim: int | None = None


@dataclass(frozen=True)
class DTensorRef:
    local: TensorRef
    shape: tuple[int, ...]  # the global shape
    dtype: str
    placements: tuple[Placement, ...]
    mesh_dims: tuple[str, ...]
    # the mesh's size along each dim, from its pickled `_layout` (torch 2.9+: one `_FlatLayout` per dim, its
    # `shape` and `stride`), and the saving rank's `_coordinate_on_dim`: () / None where the pickle lacks them
    mesh_shape: tuple[int, ...] = ()
    mesh_strides: tuple[int, ...] = ()
    mesh_coords: tuple[int, ...] | None = None


class Stub:
    """What an allow-listed class is built as: its constructor arguments and pickled state, nothing run."""

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __setstate__(self, state) -> None:
        self.state = state

    def get(self, name: str, default=None):
        return self.state.get(name, default) if isinstance(self.state, dict) else default


def _stub(name: str) -> type:
    return type(name, (Stub,), {})


class _Dtype(str):
    """A `torch.<dtype>` global, by name."""


class _WrapperMark:
    """`_rebuild_wrapper_subclass(cls, dtype, size, ...)`: the outer tensor of a subclass (its global
    facts)."""

    def __init__(self, cls, dtype, size, *rest):
        self.cls, self.dtype, self.size = cls, str(dtype), tuple(int(s) for s in size)


class _DTensorClass:
    """The `torch.distributed.tensor.DTensor` class, as a marker."""


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False, hooks=None, *rest):
    if not isinstance(storage, StorageRef):
        raise UnsafePickleError(f"a tensor rebuilt from {type(storage).__name__}, not a storage record")
    return TensorRef(storage, int(storage_offset), tuple(int(s) for s in size), tuple(int(s) for s in stride))


def _rebuild_parameter(data, requires_grad=False, hooks=None, *rest):
    return data


def _placement(p) -> Placement:
    name = type(p).__name__
    if name == "Shard":
        return Placement("shard", int(p.get("dim")))
    return Placement(name.lower() if name in ("Replicate", "Partial") else name)


def _ints(value, n: int | None = None) -> tuple[int, ...] | None:
    """`value` as a tuple of non-negative ints (of length `n`), else None."""
    if not isinstance(value, tuple) or (n is not None and len(value) != n):
        return None
    if not all(type(x) is int and x >= 0 for x in value):
        return None
    return value


def _mesh_layout(mesh) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...] | None]:
    """(sizes, strides, the saving rank's coordinates) of a pickled DeviceMesh, each dim one `_FlatLayout` of
    one size and stride; ((), (), None) where it is not so (an older torch's pickle, or a layout this does not
    read)."""
    layout = mesh.get("_layout") if isinstance(mesh, Stub) else None
    axes = layout.get("axes") if isinstance(layout, Stub) else None
    if not isinstance(axes, tuple) or not all(isinstance(a, Stub) for a in axes):
        return (), (), None
    sizes, strides = [], []
    for a in axes:
        shape, stride = _ints(a.get("shape"), 1), _ints(a.get("stride"), 1)
        if shape is None or stride is None:
            return (), (), None
        sizes.append(shape[0])
        strides.append(stride[0])
    return tuple(sizes), tuple(strides), _ints(mesh.get("_coordinate_on_dim"), len(axes))


def _rebuild_from_type(func, new_type, args, state):
    """`torch._tensor._rebuild_from_type_v2`: only a DTensor (its local tensor and spec, as data)."""
    outer = func(*args)
    if (
        isinstance(state, tuple) and len(state) == 2
    ):  # (__dict__ state, __slots__ state), as copyreg writes it
        state = {**(state[0] or {}), **(state[1] or {})}
    if new_type is not _DTensorClass or not isinstance(outer, _WrapperMark) or not isinstance(state, dict):
        raise UnsafePickleError(
            f"a tensor subclass other than DTensor ({getattr(new_type, '__name__', new_type)})"
        )
    local, spec = state.get("_local_tensor"), state.get("_spec")
    if not isinstance(local, TensorRef) or not isinstance(spec, Stub):
        raise UnsafePickleError("a DTensor without a local tensor and a DTensorSpec")
    mesh = spec.get("mesh")
    dims = mesh.get("_mesh_dim_names") if isinstance(mesh, Stub) else None
    return DTensorRef(
        local,
        outer.size,
        str(outer.dtype).removeprefix("torch."),
        tuple(_placement(p) for p in spec.get("placements") or ()),
        tuple(str(d) for d in dims or ()),
        *_mesh_layout(mesh),
    )


def _codecs_encode(text, encoding="utf-8"):
    """Protocol-2 pickles write bytes as `_codecs.encode(str, "latin1")`: that one codec only."""
    if encoding not in ("latin1", "latin-1") or not isinstance(text, str):
        raise UnsafePickleError(f"_codecs.encode with {encoding!r}")
    return text.encode("latin1")


def _allowed() -> dict[tuple[str, str], object]:
    table: dict[tuple[str, str], object] = {
        ("collections", "OrderedDict"): OrderedDict,
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("torch._utils", "_rebuild_wrapper_subclass"): _WrapperMark,
        ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
        ("torch.distributed.tensor", "DTensor"): _DTensorClass,
        ("torch.serialization", "_get_layout"): str,
        ("torch", "device"): str,
        ("torch", "Size"): tuple,
        ("_codecs", "encode"): _codecs_encode,
    }
    table.update({("torch", n): ("storage-class", n) for n in STORAGE_CLASSES})
    table.update({("torch", n): _Dtype(n) for n in TORCH_DTYPE_NAMES})
    stubs = {
        "torch.distributed.tensor._dtensor_spec": ("DTensorSpec", "TensorMeta", "ShardOrderEntry"),
        "torch.distributed.device_mesh": ("DeviceMesh",),
        "torch.distributed._mesh_layout": ("_MeshLayout", "_FlatLayout"),
        "torch.distributed.tensor.placement_types": ("Shard", "Replicate", "Partial", "_StridedShard"),
        "numpy._core.multiarray": ("_reconstruct", "scalar"),
        "numpy.core.multiarray": ("_reconstruct", "scalar"),
        "numpy": ("ndarray", "dtype"),
    }
    for module, names in stubs.items():
        table.update({(module, n): _stub(n) for n in names})
    return table


ALLOWED = _allowed()


class _ArchiveUnpickler(AllowListUnpickler):
    def persistent_load(self, pid):
        ok = isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
        cls = pid[1] if ok else None
        if not ok or not (isinstance(cls, tuple) and cls[0] == "storage-class"):
            raise UnsafePickleError(f"unexpected persistent id {pid!r} in data.pkl", path=self._source)
        return StorageRef(str(pid[2]), STORAGE_CLASSES[cls[1]], int(pid[4]))


@dataclass(frozen=True)
class Archive:
    """One decoded archive: its object (stand-ins for tensors) and where each storage's bytes are."""

    file: str  # relative to the checkpoint dir
    prefix: str
    obj: Any
    storages: dict[str, Record]
    pkl: Record  # data.pkl: where its bytes are and its stored CRC-32

    def storage(self, ref: StorageRef, key: str) -> Record:
        rec = self.storages.get(ref.key)
        if rec is None:
            raise FormatError(
                f"data.pkl names storage {ref.key!r}, which the archive lacks", path=self.file, key=key
            )
        return rec


def decode_data_pkl(data: bytes, source: str) -> Any:
    """A rank file's data.pkl as data (stand-ins), through the allow-list after the bounds scan."""
    with gc_paused():
        check_pickle_bounds(data, source, "a torch.save data.pkl")
        try:
            return _ArchiveUnpickler(
                io.BytesIO(data),
                source,
                ALLOWED,
                trust=False,
                what="a verl checkpoint file",
                short="data.pkl",
            ).load()
        except (UnsafePickleError, FormatError):
            raise
        except Exception as exc:  # garbled pickle: any of a dozen exception types
            raise UnsafePickleError(
                f"cannot parse data.pkl: {type(exc).__name__}: {exc}", path=source, hint="the file is corrupt"
            ) from None


def walk_records(files: OpenFiles, rel: str) -> ItemLayout:
    """`parse_item` of rank file `rel` (its zip directory, then each record's local header where the
    directory says), the headers hinted first (`OpenFiles.hint`): at a URL they are fetched ahead,
    concurrently, instead of one round trip after another (a rank file holds one record per tensor)."""
    size = files.size(rel)
    kept: list[tuple[int, bytes]] = []  # the directory's bytes (its end record, then itself): read once

    def first(off: int, n: int) -> bytes:
        kept.append((off, files.read(rel, off, n, rel)))
        return kept[-1][1]

    try:
        offsets = sorted({e.header_offset for e in central_directory(first, size) if e.header_offset >= 0})
    except ItemError:  # parse_item below says what is wrong
        offsets = []
    files.hint([(rel, o, min(HEADER_READ_BYTES, size - o)) for o in offsets if 0 <= o < size])

    def again(off: int, n: int) -> bytes:
        for at, data in kept:
            if at <= off and off + n <= at + len(data):
                return data[off - at : off - at + n]
        return files.read(rel, off, n, rel)

    return parse_item(window(again, 0, size, HEADER_READ_BYTES))


def open_archive(files: OpenFiles, rel: str) -> Archive:
    """The archive `rel` of `files`: its central directory and data.pkl read (nothing else)."""
    path = files.root / rel
    try:
        layout = walk_records(files, rel)
    except ItemError as exc:
        raise FormatError(
            f"not a torch.save archive: {exc}", path=path, hint="the file is damaged or not verl's"
        ) from None
    if layout.pkl_size > MAX_PICKLE_BYTES:
        raise FormatError(
            f"data.pkl is {layout.pkl_size:,} bytes (a genuine one is far below {MAX_PICKLE_BYTES:,}): not "
            "read",
            path=path,
            hint="the file is crafted or damaged",
        )
    pkl = files.read(rel, layout.pkl_offset, layout.pkl_size, rel)
    pkl_name, stored = next((n, crc) for n, _o, _s, crc in layout.records if n.endswith("/data.pkl"))
    if stored and crc32(pkl) != stored:
        err = crc_error(f"{layout.prefix}/data.pkl", stored, crc32(pkl), path=path)
        raise ChecksumError(err.message, path=path, hint=CRC_HINT)
    storages = {
        name[len(layout.prefix) + 6 :]: Record(name, off, n, crc)
        for name, off, n, crc in layout.records
        if name.startswith(f"{layout.prefix}/data/")
    }
    record = Record(pkl_name, layout.pkl_offset, layout.pkl_size, stored)
    return Archive(rel, layout.prefix, decode_data_pkl(pkl, str(path)), storages, record)


def storage_bytes_ok(ref: TensorRef, rec: Record) -> bool:
    """The tensor's elements lie inside its storage record, and the record holds the storage's numel."""
    n = 1
    for s in ref.size:
        n *= s
    size = ITEMSIZE.get(ref.dtype)
    return (
        size is not None
        and rec.size == ref.storage.numel * size
        and ref.offset >= 0
        and (n == 0 or ref.offset + n <= ref.storage.numel)
    )
