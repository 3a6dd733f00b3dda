"""Unpickling DCP `.metadata` with an allow-list.

`.metadata` is a pickle, and stock `torch.distributed.checkpoint` unpickles it with the full
`pickle` module: a crafted checkpoint runs arbitrary code the moment it is opened. We resolve only
the globals a DCP metadata file is made of (measured on torch 2.9.1 and 2.13.0, see
docs/format.md); anything else raises UnsafePickleError naming the class, before anything runs.
"""
from __future__ import annotations

import io
import logging
import pickle
from pathlib import Path

from .errors import UnsafePickleError

log = logging.getLogger(__name__)

_DCP_METADATA = "torch.distributed.checkpoint.metadata"

# (module, name) pairs a DCP .metadata may reference. Everything here is a plain data class, an
# enum, or a function without side effects (`_get_layout` maps a name to a torch.layout).
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    (_DCP_METADATA, "Metadata"),
    (_DCP_METADATA, "TensorStorageMetadata"),
    (_DCP_METADATA, "ChunkStorageMetadata"),
    (_DCP_METADATA, "BytesStorageMetadata"),
    (_DCP_METADATA, "TensorProperties"),
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"),
    (_DCP_METADATA, "StorageMeta"),
    (_DCP_METADATA, "MetadataIndex"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    # storage_meta.checkpoint_id is the writer's path; Python 3.13 pickles it as pathlib._local.*
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
    ("pathlib._local", "PosixPath"),
    ("pathlib._local", "PurePosixPath"),
    ("pathlib._local", "WindowsPath"),
    ("pathlib._local", "PureWindowsPath"),
    ("collections", "OrderedDict"),
})

_TORCH_DTYPE_NAMES = frozenset({
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
    "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2", "uint16", "uint32",
    "uint64", "float8_e4m3fnuz", "float8_e5m2fnuz",
})

# pathlib classes are replaced by str: a Path in our in-memory metadata would later be pickled
# again by our writers, and Python <= 3.12 cannot unpickle 3.13's pathlib._local paths.
_PATH_NAMES = {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}


def _path_as_str(*parts):
    return str(Path(*parts)) if parts else ""


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, fh, source: str, trust: bool):
        super().__init__(fh)
        self._source = source
        self._trust = trust

    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED_GLOBALS:
            if module.startswith("pathlib") and name in _PATH_NAMES:
                return _path_as_str
            return super().find_class(module, name)
        if module == "torch" and name in _TORCH_DTYPE_NAMES:
            return super().find_class(module, name)
        if self._trust:
            log.warning("--trust-remote-pickle: resolving %s.%s from %s outside the allow-list",
                        module, name, self._source)
            return super().find_class(module, name)
        raise UnsafePickleError(
            f"refusing to unpickle global {module}.{name}: it is not a class a DCP .metadata "
            "file is made of, and unpickling it could run code",
            path=self._source,
            hint="if you wrote this checkpoint yourself and trust it, pass --trust-remote-pickle",
        )

    def persistent_load(self, pid):
        raise UnsafePickleError(f"unexpected persistent id {pid!r} in DCP metadata", path=self._source)


_MEMO_PUT_OPS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


def check_memo_bounds(data: bytes, source: str) -> None:
    """Refuse memo indices larger than the pickle itself. CPython's C unpickler keeps its memo in
    an array sized to the largest index and zero-fills it: one LONG_BINPUT of 0x21682b68 (a
    single flipped byte in a real .metadata did it) costs 9 GB of RSS before any error. A pickler
    numbers memo entries from 0, one per memoized object, so a genuine index is below len(data).
    (Protocol 4+ pickles, DCP's, memoize with MEMOIZE and carry no index at all.)"""
    import pickletools

    try:
        for op, arg, pos in pickletools.genops(data):
            if op.name in _MEMO_PUT_OPS and isinstance(arg, int) and not 0 <= arg <= len(data):
                raise UnsafePickleError(f"memo index {arg} at byte {pos} is larger than the pickle "
                                        f"({len(data)} bytes): a crafted or corrupt pickle", path=source)
    except UnsafePickleError:
        raise
    except Exception:
        return  # not even opcode-parseable: the unpickler reports it


def load_metadata_pickle(data: bytes, source: str, *, trust: bool = False):
    """Unpickle DCP metadata bytes with the allow-list. `source` names the file in errors."""
    if not trust:
        check_memo_bounds(data, source)
    try:
        return _AllowListUnpickler(io.BytesIO(data), source, trust).load()
    except UnsafePickleError:
        raise
    except Exception as exc:  # truncated/garbled pickle: any of a dozen exception types
        raise UnsafePickleError(f"cannot parse DCP metadata pickle: {type(exc).__name__}: {exc}",
                                path=source, hint="the file is corrupt or not a DCP .metadata") from None
