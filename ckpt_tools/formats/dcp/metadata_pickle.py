"""DCP `.metadata` written without torch: the pickle of torch's `Metadata`, encoded here.

`.metadata` is a protocol-4 pickle of `torch.distributed.checkpoint.metadata.Metadata` naming torch's
classes (`Metadata`, `TensorStorageMetadata`, ..., `filesystem._StorageInfo`, `torch.Size`, the dtypes),
which prime-rl's loader unpickles. Pickling torch's own objects needs torch (a CUDA build takes seconds to
import) and is slow besides (`torch.Size.__reduce__` and the dataclasses' state run in Python per chunk).
Why this module is kept (measured, `bench/metadata_pickle.py`, results in
bench/results/2026-12-07-2core-metadata-pickle-startup.json): on a 2-core dev machine (load ~10), `ckpt
slim` of the tiny fixture took 1.37 s as shipped and 11.2 s when the interpreter first imports
`torch.distributed.checkpoint` (what torch's pickler needs), whose import alone took 9.4 s; median of 7,
interleaved. Every DCP writer (slim and gc's slims, set-lr's patches, adapter-to-dcp, rehydrate) encodes
`.metadata` here, so a slim (which moves bytes only) never imports torch. Here the same opcodes
are written straight from the writer's records: the classes are named as globals, each object is rebuilt the
way torch's would be (NEWOBJ and BUILD with its field dict, `torch.Size` and the layout and memory-format
enum by REDUCE, `TensorProperties` by its 5-tuple state, `_StorageInfo` without its None fields).

The bytes are those Python's reference pickler (`pickle._Pickler`) writes for torch's objects holding
the same strings: the same opcodes, memo (strings by identity, as it memoizes them; torch's module-name
strings as torch's classes share them) and 64 KiB framing (tests/test_metadata_pickle.py compares them
byte for byte, and torch's loader unpickles them to equal objects). The C pickler, which the old writer
used, can close a frame a few bytes elsewhere in a large pickle; frames are invisible to every reader.
"""

from __future__ import annotations

from dataclasses import dataclass
from struct import pack

__all__ = ["DCP_VERSION", "StorageRecord", "TensorRecord", "metadata_pickle"]

DCP_VERSION = "1.0.0"

_DCP = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
# torch names its dtypes' module and `torch.Size`'s with two distinct "torch" strings (the pickler memoizes
# strings by identity, so each is written once): kept distinct here, the bytes are then the same.
_DTYPE_MODULE = "torch"
_SIZE_MODULE = "".join(("to", "rch"))

# opcodes (pickletools' names)
_PROTO, _FRAME, _STOP = b"\x80", b"\x95", b"."
_MARK, _MEMOIZE, _BINGET, _LONG_BINGET = b"(", b"\x94", b"h", b"j"
_NONE, _NEWTRUE, _NEWFALSE = b"N", b"\x88", b"\x89"
_BININT1, _BININT2, _BININT, _LONG1, _LONG4 = b"K", b"M", b"J", b"\x8a", b"\x8b"
_SHORT_BINUNICODE, _BINUNICODE, _BINUNICODE8 = b"\x8c", b"X", b"\x8d"
_EMPTY_TUPLE, _TUPLE, _TUPLES = b")", b"t", (b"", b"\x85", b"\x86", b"\x87")
_EMPTY_LIST, _APPEND, _APPENDS = b"]", b"a", b"e"
_EMPTY_DICT, _SETITEM, _SETITEMS = b"}", b"s", b"u"
_STACK_GLOBAL, _REDUCE, _NEWOBJ, _BUILD = b"\x93", b"R", b"\x81", b"b"

_FRAME_TARGET = 64 * 1024  # pickle's _Framer: a frame closes before the first object past this size
_BATCH = 1000  # pickle's _BATCHSIZE: SETITEMS / APPENDS per MARK


@dataclass(frozen=True)
class TensorRecord:
    """One tensor of `state_dict_metadata`: its dtype (a name), global size and chunks ((offsets, sizes))."""

    dtype: str
    size: tuple[int, ...]
    chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]


@dataclass(frozen=True)
class StorageRecord:
    """One item of `storage_data`: `MetadataIndex(fqn, offset, index)` -> `_StorageInfo(rel, offset, length)`.
    `chunk_offsets` None: a byte item (its index has no offset)."""

    fqn: str
    chunk_offsets: tuple[int, ...] | None
    index: int | None
    relative_path: str
    offset: int
    length: int


class _Global:
    """A class or function of torch's, written by name (STACK_GLOBAL) and memoized on first use."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name


_METADATA, _TENSOR_MD, _CHUNK_MD = (
    _Global(_DCP, "Metadata"),
    _Global(_DCP, "TensorStorageMetadata"),
    _Global(_DCP, "ChunkStorageMetadata"),
)
_BYTES_MD, _PROPERTIES, _MEM_FORMAT = (
    _Global(_DCP, "BytesStorageMetadata"),
    _Global(_DCP, "TensorProperties"),
    _Global(_DCP, "_MEM_FORMAT_ENCODING"),
)
_STORAGE_META, _INDEX, _STORAGE_INFO = (
    _Global(_DCP, "StorageMeta"),
    _Global(_DCP, "MetadataIndex"),
    _Global(_FS, "_StorageInfo"),
)
_GET_LAYOUT, _SIZE = _Global("torch.serialization", "_get_layout"), _Global(_SIZE_MODULE, "Size")
_DTYPES: dict[str, _Global] = {}
# torch.strided and the contiguous memory format: one object each in torch, so memoized after first use
_STRIDED, _CONTIGUOUS = object(), object()
_STRIDED_NAME = "torch.strided"

# the field names of torch's dataclasses, one string object each (memoized once, as the interned names are)
_F = {
    n: n
    for n in (
        "state_dict_metadata",
        "planner_data",
        "storage_data",
        "storage_meta",
        "version",
        "properties",
        "size",
        "chunks",
        "offsets",
        "sizes",
        "checkpoint_id",
        "save_id",
        "load_id",
        "modules",
        "fqn",
        "index",
        "offset",
        "relative_path",
        "length",
    )
}


def _dtype_global(name: str) -> _Global:
    g = _DTYPES.get(name)
    if g is None:
        g = _DTYPES.setdefault(name, _Global(_DTYPE_MODULE, name))
    return g


_SMALL_INTS = [_BININT1 + bytes((i,)) for i in range(256)]


def _int_opcode(n: int) -> bytes:
    """pickle's save_long (protocol 4)."""
    if 0 <= n <= 0xFF:
        return _SMALL_INTS[n]
    if 0 <= n <= 0xFFFF:
        return _BININT2 + pack("<H", n)
    if -0x80000000 <= n <= 0x7FFFFFFF:
        return _BININT + pack("<i", n)
    enc = n.to_bytes((8 + n.bit_length()) // 8, "little", signed=True)  # pickle.encode_long
    return (_LONG1 + bytes((len(enc),)) if len(enc) < 256 else _LONG4 + pack("<i", len(enc))) + enc


class _Encoder:
    """pickle._Pickler's protocol-4 output for the objects below. `_save()` is the start of its `save()`: a
    frame past 64 KiB closes there (`_cut`). The opcodes go into one buffer, cut into frames at `finish`.
    Only what a later reference can name is kept in the memo (strings, torch's classes, the two singletons);
    every other object is new, so it only counts (`n`: the memo index the next MEMOIZE gets)."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.segments: list[tuple[int, int, bool]] = []  # (start, end, framed) of each closed segment
        self.start = 0  # the open frame's first byte
        self.limit = _FRAME_TARGET  # where the open frame is full
        self.memo: dict[int, tuple[bytes, object]] = {}  # id -> (its BINGET, the object, kept alive)
        self.n = 0

    # ---------------------------------------------------------------- pickle's machinery
    def _cut(self) -> None:
        """pickle's commit_frame: the open frame ends here (an empty one is nothing)."""
        end = len(self.buf)
        if end > self.start:
            self.segments.append((self.start, end, True))
        self.start, self.limit = end, end + _FRAME_TARGET

    def _save(self) -> None:
        if len(self.buf) >= self.limit:
            self._cut()

    def _memo_new(self) -> None:
        """MEMOIZE an object no later reference names."""
        self.buf += _MEMOIZE
        self.n += 1

    def _memo_keep(self, obj) -> None:
        i = self.n
        self.memo[id(obj)] = (_BINGET + bytes((i,)) if i < 256 else _LONG_BINGET + pack("<I", i), obj)
        self.buf += _MEMOIZE
        self.n += 1

    def _ref(self, obj) -> bool:
        """At the start of saving `obj` (after `_save`): True when it is in the memo (its BINGET written)."""
        hit = self.memo.get(id(obj))
        if hit is None:
            return False
        self.buf += hit[0]
        return True

    def finish(self) -> bytes:
        self.buf += _STOP
        self._cut()
        out: list[bytes | memoryview] = [_PROTO + b"\x04"]
        view = memoryview(self.buf)
        for s, e, framed in self.segments:
            if framed and e - s >= 4:  # pickle frames only 4 bytes or more
                out.append(_FRAME + pack("<Q", e - s))
            out.append(view[s:e])
        data = b"".join(out)
        del view
        return data

    # ---------------------------------------------------------------- values
    def value(self, x) -> None:
        """A plain value of the metadata: None, bool, int, str, a tuple of them."""
        if x is None:
            self._save()
            self.buf += _NONE
        elif x is True or x is False:
            self._save()
            self.buf += _NEWTRUE if x else _NEWFALSE
        elif isinstance(x, int):
            self._save()
            self.buf += _int_opcode(x)
        elif isinstance(x, str):
            self.string(x)
        elif isinstance(x, tuple):
            self.tuple_of(x)
        else:
            raise TypeError(f"no .metadata encoding for {type(x).__name__}")

    def string(self, s: str) -> None:
        """pickle's save_str: memoized by identity (a string shared by two places is written once)."""
        buf = self.buf
        if len(buf) >= self.limit:
            self._cut()
        hit = self.memo.get(id(s))
        if hit is not None:
            buf += hit[0]
            return
        enc = s.encode("utf-8", "surrogatepass")
        n = len(enc)
        if n <= 0xFF:
            self.buf += _SHORT_BINUNICODE + bytes((n,)) + enc
        elif n < _FRAME_TARGET:
            self.buf += _BINUNICODE + pack("<I", n) + enc
        else:  # pickle's write_large_bytes: the frame ends, the string goes unframed
            self._cut()
            self.buf += (
                (_BINUNICODE8 + pack("<Q", n)) if n > 0xFFFFFFFF else (_BINUNICODE + pack("<I", n))
            ) + enc
            self.segments.append((self.start, len(self.buf), False))
            self.start, self.limit = len(self.buf), len(self.buf) + _FRAME_TARGET
        self._memo_keep(s)

    def tuple_of(self, t: tuple) -> None:
        """pickle's save_tuple, memoized by identity (a planner path)."""
        self._save()
        if self._ref(t):
            return
        if not t:
            self.buf += _EMPTY_TUPLE
            return
        if len(t) > 3:
            self.buf += _MARK
        for v in t:
            self.value(v)
        self.buf += _TUPLE if len(t) > 3 else _TUPLES[len(t)]
        self._memo_keep(t)

    def ints(self, dims: tuple) -> None:
        """A new tuple of ints (never a memo hit)."""
        buf = self.buf
        if len(buf) >= self.limit:
            self._cut()
        if not dims:
            buf += _EMPTY_TUPLE
            return
        if len(dims) > 3:
            buf += _MARK
        for d in dims:
            if len(buf) >= self.limit:
                self._cut()
            buf += _int_opcode(d)
        buf += _TUPLE if len(dims) > 3 else _TUPLES[len(dims)]
        self.buf += _MEMOIZE
        self.n += 1

    def global_(self, g: _Global) -> None:
        buf = self.buf
        if len(buf) >= self.limit:
            self._cut()
        hit = self.memo.get(id(g))
        if hit is not None:
            buf += hit[0]
            return
        self.string(g.module)
        self.string(g.name)
        self.buf += _STACK_GLOBAL
        self._memo_keep(g)

    def new_object(self, cls: _Global) -> None:
        """A new instance of `cls` by NEWOBJ without arguments (a dataclass's reduce); its state follows."""
        self._save()
        self.global_(cls)
        self._save()
        self.buf += _EMPTY_TUPLE + _NEWOBJ + _MEMOIZE
        self.n += 1

    def fields(self, items: list, emit) -> None:
        """A dataclass's state: a new {field: value} dict (`emit(value)` writes each value), then BUILD."""
        self._save()
        self.buf += _EMPTY_DICT + _MEMOIZE
        self.n += 1
        self._setitems(items, self.string, emit)
        self.buf += _BUILD

    def _setitems(self, items: list, emit_key, emit) -> None:
        """pickle's _batch_setitems: MARK k v ... SETITEMS per 1000, SETITEM for a batch of one."""
        for s in range(0, len(items), _BATCH):
            batch = items[s : s + _BATCH]
            if len(batch) > 1:
                self.buf += _MARK
            for k, v in batch:
                emit_key(k)
                emit(v)
            self.buf += _SETITEMS if len(batch) > 1 else _SETITEM

    def dict_of(self, items: list, emit_key, emit) -> None:
        self._save()
        self.buf += _EMPTY_DICT + _MEMOIZE
        self.n += 1
        self._setitems(items, emit_key, emit)

    def list_of(self, items: list, emit) -> None:
        self._save()
        self.buf += _EMPTY_LIST + _MEMOIZE
        self.n += 1
        for s in range(0, len(items), _BATCH):
            batch = items[s : s + _BATCH]
            if len(batch) > 1:
                self.buf += _MARK
            for v in batch:
                emit(v)
            self.buf += _APPENDS if len(batch) > 1 else _APPEND

    # ---------------------------------------------------------------- torch's objects
    def size(self, dims: tuple) -> None:
        """`torch.Size(dims)`: REDUCE of torch.Size over (tuple(dims),), a new tuple."""
        self._save()
        self.global_(_SIZE)
        self._save()
        self.ints(dims)
        self.buf += _TUPLES[1] + _MEMOIZE + _REDUCE + _MEMOIZE
        self.n += 2

    def _reduce_singleton(self, marker, func: _Global, arg) -> None:
        self._save()
        if self._ref(marker):
            return
        self.global_(func)
        self._save()
        self.value(arg)
        self.buf += _TUPLES[1] + _MEMOIZE + _REDUCE
        self.n += 1
        self._memo_keep(marker)

    def properties(self, dtype: str) -> None:
        """TensorProperties(dtype): NEWOBJ, then its __getstate__ 5-tuple (dtype, layout, requires_grad,
        memory-format encoding, pin_memory) and BUILD."""
        self.new_object(_PROPERTIES)
        self._save()
        self.buf += _MARK
        self.global_(_dtype_global(dtype))
        self._reduce_singleton(_STRIDED, _GET_LAYOUT, _STRIDED_NAME)
        self.value(False)
        self._reduce_singleton(_CONTIGUOUS, _MEM_FORMAT, 0)
        self.value(False)
        self.buf += _TUPLE + _MEMOIZE + _BUILD
        self.n += 1

    def chunk(self, chunk: tuple) -> None:
        self.new_object(_CHUNK_MD)
        self.fields([(_F["offsets"], chunk[0]), (_F["sizes"], chunk[1])], self.size)

    def tensor(self, rec: TensorRecord) -> None:
        self.new_object(_TENSOR_MD)
        self._save()
        self.buf += _EMPTY_DICT + _MEMOIZE + _MARK
        self.n += 1
        self.string(_F["properties"])
        self.properties(rec.dtype)
        self.string(_F["size"])
        self.size(rec.size)
        self.string(_F["chunks"])
        self.list_of(rec.chunks, self.chunk)
        self.buf += _SETITEMS + _BUILD

    def bytes_item(self) -> None:
        self.new_object(_BYTES_MD)  # an empty __dict__: no state, no BUILD

    def storage_key(self, rec: StorageRecord) -> None:
        """MetadataIndex: its __dict__ is fqn, index, then offset (set last, and only when not None)."""
        self.new_object(_INDEX)
        self._save()
        self.buf += _EMPTY_DICT + _MEMOIZE + _MARK
        self.n += 1
        self.string(_F["fqn"])
        self.string(rec.fqn)
        self.string(_F["index"])
        self.value(rec.index)
        if rec.chunk_offsets is not None:
            self.string(_F["offset"])
            self.size(rec.chunk_offsets)
        self.buf += _SETITEMS + _BUILD

    def storage_info(self, rec: StorageRecord) -> None:
        """_StorageInfo: its __getstate__ drops the None fields (transform_descriptors)."""
        self.new_object(_STORAGE_INFO)
        self._save()
        self.buf += _EMPTY_DICT + _MEMOIZE + _MARK
        self.n += 1
        self.string(_F["relative_path"])
        self.string(rec.relative_path)
        self.string(_F["offset"])
        self.value(rec.offset)
        self.string(_F["length"])
        self.value(rec.length)
        self.buf += _SETITEMS + _BUILD


def metadata_pickle(
    tensors: dict[str, TensorRecord],
    byte_keys,
    planner: dict[str, tuple],
    storage: list[StorageRecord],
    *,
    save_id: str,
    version: str = DCP_VERSION,
) -> bytes:
    """The `.metadata` bytes of a checkpoint: `state_dict_metadata` over `tensors` and `byte_keys` in sorted
    key order, `planner_data` (key -> path tuple) and `storage_data` (in the given orders), and
    `storage_meta` (no checkpoint_id: a path there is a pathlib object older Pythons cannot unpickle)."""
    enc = _Encoder()
    byte_keys = set(byte_keys)
    keys = sorted(set(tensors) | byte_keys)

    def sdm_value(key: str) -> None:
        if key in byte_keys:
            enc.bytes_item()
        else:
            enc.tensor(tensors[key])

    enc.new_object(_METADATA)
    enc._save()
    enc.buf += _EMPTY_DICT + _MEMOIZE + _MARK
    enc.n += 1
    enc.string(_F["state_dict_metadata"])
    enc.dict_of([(k, k) for k in keys], enc.string, sdm_value)
    enc.string(_F["planner_data"])
    enc.dict_of(list(planner.items()), enc.string, enc.value)
    enc.string(_F["storage_data"])
    enc.dict_of([(r, r) for r in storage], enc.storage_key, enc.storage_info)
    enc.string(_F["storage_meta"])
    enc.new_object(_STORAGE_META)
    enc.fields(
        [(_F["checkpoint_id"], None), (_F["save_id"], save_id), (_F["load_id"], None), (_F["modules"], [])],
        lambda v: enc.list_of(v, enc.value) if isinstance(v, list) else enc.value(v),
    )
    enc.string(_F["version"])
    enc.value(version)
    enc.buf += _SETITEMS + _BUILD
    return enc.finish()
