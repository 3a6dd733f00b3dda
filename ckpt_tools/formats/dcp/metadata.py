"""DCP `.metadata`, read without torch: allow-list unpickling into light stand-ins of DCP's classes.

`.metadata` is a pickle of `torch.distributed.checkpoint.metadata.Metadata`, and stock DCP unpickles
it with the full `pickle` module: a crafted checkpoint runs code the moment it is opened. Here
`load_metadata` resolves only the `(module, name)` pairs a genuine `.metadata` is made of (measured on
torch 2.9.1 and 2.13.0, see docs/format.md), each to a stand-in defined below, through
`io.safe_pickle.load_allowed` (a bounds scan first); anything else is refused, naming the global,
before anything runs.

The stand-ins keep DCP's class and field names (`md.state_dict_metadata[key].chunks[0].offsets`), so
code reads them as it would read torch's; unlike torch's they need no torch: a dtype is its name
(a `DtypeName`, the str `"float32"`, distinct from a plain string a crafted pickle could put there), a
`torch.Size` a tuple of ints, a layout its name (`"torch.strided"`), a path a str
(a Path would be pickled again by our writers, and Python <= 3.12 cannot unpickle 3.13's pathlib
paths). They are read-only views of a file: pickling one is refused (`formats.dcp.writer` writes
torch's own classes).
"""

from __future__ import annotations

import enum
import operator
from collections import OrderedDict
from pathlib import Path

from ...core.dtypes import TORCH_DTYPE_NAMES
from ...io.safe_pickle import load_allowed

__all__ = [
    "ALLOWED_GLOBALS",
    "METADATA_NAME",
    "BytesStorageMetadata",
    "ChunkStorageMetadata",
    "Dims",
    "DtypeName",
    "Metadata",
    "MetadataIndex",
    "StorageInfo",
    "StorageMeta",
    "TensorProperties",
    "TensorStorageMetadata",
    "load_metadata",
]

METADATA_NAME = ".metadata"
_DCP = "torch.distributed.checkpoint.metadata"


class DtypeName(str):
    """A `torch.<name>` dtype global of the pickle, as its name. A subclass, so that a plain string in
    the dtype field (which torch's loader would not accept as a dtype) is still told apart and refused."""

    __slots__ = ()


class _StandIn:
    """A plain record filled by the unpickler (NEWOBJ + BUILD with the pickled field dict)."""

    _fields: tuple[str, ...] = ()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{f}={getattr(self, f, None)!r}' for f in self._fields)})"

    def __reduce_ex__(self, protocol):
        raise TypeError(
            f"{type(self).__name__} is a read-only stand-in of DCP's class; it is not pickled "
            "(formats.dcp.writer writes torch's own metadata classes)"
        )


class Metadata(_StandIn):
    _fields = ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version")
    state_dict_metadata = None
    planner_data = None
    storage_data = None
    storage_meta = None
    version = None


class TensorStorageMetadata(_StandIn):
    _fields = ("properties", "size", "chunks")
    properties = None
    size = None
    chunks = None


class ChunkStorageMetadata(_StandIn):
    _fields = ("offsets", "sizes")
    offsets = None
    sizes = None


class BytesStorageMetadata(_StandIn):
    pass


class _MemFormat(enum.Enum):
    """DCP's `_MEM_FORMAT_ENCODING` (what TensorProperties pickles in place of a torch.memory_format)."""

    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


_MEMORY_FORMATS = {
    _MemFormat.TORCH_CONTIGUOUS_FORMAT: "torch.contiguous_format",
    _MemFormat.TORCH_CHANNELS_LAST: "torch.channels_last",
    _MemFormat.TORCH_PRESERVE_FORMAT: "torch.preserve_format",
}


class TensorProperties(_StandIn):
    _fields = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")
    dtype = None
    layout = "torch.strided"
    requires_grad = False
    memory_format = "torch.contiguous_format"
    pin_memory = False

    def __setstate__(self, state) -> None:
        # torch's TensorProperties pickles a 5-tuple (dtype, layout, requires_grad, encoding, pin_memory)
        self.dtype, self.layout, self.requires_grad, encoding, self.pin_memory = state
        if encoding not in _MEMORY_FORMATS:
            raise RuntimeError(f"Invalid torch.memory_format encoding: {encoding}")
        self.memory_format = _MEMORY_FORMATS[encoding]


class StorageMeta(_StandIn):
    _fields = ("checkpoint_id", "save_id", "load_id", "modules")
    checkpoint_id = None
    save_id = None
    load_id = None
    modules = ()


class MetadataIndex(_StandIn):
    """A key of `storage_data`: equal by (fqn, offset), like DCP's (its `index` is a hint). Hashed by the
    offset's text, not its ints: an int's hash is the pickle's choice (`k * (2**61 - 1)` hashes to 0
    for every k), so 10,000 chunks of one fqn at such offsets would cost 5e7 `__eq__` calls while the
    dict is built; a str's hash is seeded."""

    _fields = ("fqn", "offset", "index")
    fqn = None
    offset = None
    index = None

    def __eq__(self, other) -> bool:
        return isinstance(other, MetadataIndex) and (self.fqn, self.offset) == (other.fqn, other.offset)

    def __hash__(self) -> int:
        return hash((self.fqn, repr(self.offset)))


class StorageInfo(_StandIn):
    """DCP's `filesystem._StorageInfo`: where one storage item lies (file name, offset, length)."""

    _fields = ("relative_path", "offset", "length", "transform_descriptors")
    relative_path = None
    offset = None
    length = None
    transform_descriptors = None


class Dims(tuple):
    """A `torch.Size` of the pickle: a tuple whose every dim is an int (checked as it was built), which
    `formats.dcp.model` need not convert again (a 32B checkpoint's metadata has ~46k of them)."""

    __slots__ = ()

    def __reduce_ex__(self, protocol):  # like the stand-ins: a file we write names no class of ours
        raise TypeError(
            "Dims is a read-only view of a .metadata's torch.Size; pass torch.Size(dims) or "
            "tuple(dims) to what is pickled"
        )


def _size(dims=()) -> Dims:
    """`torch.Size(dims)`: a tuple of ints (anything else is refused, as torch.Size refuses it)."""
    return Dims(map(operator.index, dims))


_LAYOUTS = frozenset(
    {
        "torch.strided",
        "torch.sparse_coo",
        "torch.sparse_csr",
        "torch.sparse_csc",
        "torch.sparse_bsr",
        "torch.sparse_bsc",
        "torch._mkldnn",
        "torch.jagged",
    }
)


def _layout(name):
    """`torch.serialization._get_layout(name)`: a layout by its name (an unknown one is a KeyError)."""
    if name not in _LAYOUTS:
        raise KeyError(name)
    return name


def _path_as_str(*parts):
    return str(Path(*parts)) if parts else ""


_PATH_CLASSES = ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")

# (module, name) -> what the unpickler builds for it. Everything a genuine `.metadata` references
# (torch 2.9.1 and 2.13.0), plus torch's dtype names; storage_meta.checkpoint_id is the writer's path,
# which Python 3.13 pickles as pathlib._local.*.
ALLOWED_GLOBALS: dict[tuple[str, str], object] = {
    (_DCP, "Metadata"): Metadata,
    (_DCP, "TensorStorageMetadata"): TensorStorageMetadata,
    (_DCP, "ChunkStorageMetadata"): ChunkStorageMetadata,
    (_DCP, "BytesStorageMetadata"): BytesStorageMetadata,
    (_DCP, "TensorProperties"): TensorProperties,
    (_DCP, "_MEM_FORMAT_ENCODING"): _MemFormat,
    (_DCP, "StorageMeta"): StorageMeta,
    (_DCP, "MetadataIndex"): MetadataIndex,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): StorageInfo,
    ("torch.serialization", "_get_layout"): _layout,
    ("torch", "Size"): _size,
    **{(mod, cls): _path_as_str for mod in ("pathlib", "pathlib._local") for cls in _PATH_CLASSES},
    ("collections", "OrderedDict"): OrderedDict,
    **{("torch", name): DtypeName(name) for name in TORCH_DTYPE_NAMES},
}


def load_metadata(data: bytes, source: str, *, trust: bool = False) -> object:
    """Unpickle `.metadata` bytes into stand-ins (see the module docstring). `source` names the file
    in errors; `trust` (`--trust-remote-pickle`) resolves any other global too. What the pickle holds is
    returned as it is: a `Metadata` in a genuine file, anything allowed in a crafted one
    (`formats.dcp.model.parse_metadata` checks its shape)."""
    return load_allowed(
        data,
        source,
        ALLOWED_GLOBALS,
        trust=trust,
        what="a DCP .metadata file",
        short="DCP metadata",
        parse_what="DCP metadata pickle",
        corrupt_hint="the file is corrupt or not a DCP .metadata",
    )
