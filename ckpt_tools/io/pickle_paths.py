"""Where each scalar of a pickle lies: a map from its path in the object (dict keys, list and tuple indices)
to the opcode that holds it, built from the opcodes alone (`pickletools.genops`: no object is built, no
global resolved, nothing runs).

`ckpt set-lr` of a checkpoint whose learning rate lives inside a `torch.save` pickle (verl's per-rank
optimizer and scheduler files) changes those few numbers where they lie, every other byte kept: a float is
the 8 bytes after a BINFLOAT wherever it sits, so the new value takes exactly the old one's place. This
module says which bytes those are (`scalar_map`) and encodes a new value in the old one's room
(`encode_in_place`, refusing one that does not fit). Containers are followed through the memo as the
unpickler would; anything built by a global (a tensor, a numpy array, a torch class) is opaque, its insides
not addressable. A scalar reached from two places (memo-shared) is marked `shared`: changing it changes
both, so callers refuse to.

Run it only on a pickle `check_pickle_bounds` accepted (bounded size, depth and tree, no cycle), and trust a
path only after checking the value the real (allow-list) unpickler gives there equals the one mapped here.
"""

from __future__ import annotations

import io
import pickletools
import struct
from dataclasses import dataclass
from typing import Any

from ..core.errors import UnsafePickleError

__all__ = ["PickleMap", "Scalar", "encode_in_place", "scalar_map"]


@dataclass(frozen=True)
class Scalar:
    """One scalar opcode: `op` at byte `pos` of the pickle, its value, and the byte range of its argument
    (`arg_at`, `arg_len`; NEWTRUE/NEWFALSE are their own opcode byte)."""

    pos: int
    op: str
    value: Any
    arg_at: int
    arg_len: int


@dataclass(frozen=True)
class PickleMap:
    scalars: dict[tuple, Scalar]  # path -> the scalar there
    opaque: frozenset[tuple]  # paths of objects a global built (tensors, arrays, torch classes)
    shared: frozenset[int]  # positions of scalars reached by more than one path


class _Opaque:
    __slots__ = ()


class _Mark:
    __slots__ = ()


_MARK = _Mark()
_NUMBERS = {"BINFLOAT", "FLOAT", "BININT", "BININT1", "BININT2", "INT", "LONG", "LONG1", "LONG4"}
_STRINGS = {
    "BINUNICODE",
    "SHORT_BINUNICODE",
    "BINUNICODE8",
    "UNICODE",
    "STRING",
    "BINSTRING",
    "SHORT_BINSTRING",
    "BINBYTES",
    "SHORT_BINBYTES",
    "BINBYTES8",
    "BYTEARRAY8",
}
_ARG_LEN = {"BINFLOAT": 8, "BININT": 4, "BININT1": 1, "BININT2": 2}
# opcode -> how many stack items it consumes to build an opaque object (None: down to the mark)
_OPAQUE_FROM = {
    "GLOBAL": 0,
    "PERSID": 0,
    "EXT1": 0,
    "EXT2": 0,
    "EXT4": 0,
    "NEXT_BUFFER": 0,
    "EMPTY_SET": 0,
    "STACK_GLOBAL": 2,
    "REDUCE": 2,
    "NEWOBJ": 2,
    "NEWOBJ_EX": 3,
    "BINPERSID": 1,
    "FROZENSET": None,
    "OBJ": None,
    "INST": None,
}
_NOOP = {"PROTO", "FRAME", "READONLY_BUFFER", "STOP"}


def _scalar(op: str, arg, pos: int, data: bytes) -> Scalar:
    if op in ("NEWTRUE", "NEWFALSE", "NONE"):
        return Scalar(pos, op, {"NEWTRUE": True, "NEWFALSE": False, "NONE": None}[op], pos, 1)
    if op == "LONG1":
        return Scalar(pos, op, arg, pos + 2, data[pos + 1])
    if op in _ARG_LEN:
        return Scalar(pos, op, arg, pos + 1, _ARG_LEN[op])
    return Scalar(pos, op, arg, pos + 1, 0)  # text forms, strings: mapped, never patched in place


def _pop_mark(stack: list) -> list:
    items: list = []
    while stack:
        v = stack.pop()
        if v is _MARK:
            items.reverse()
            return items
        items.append(v)
    raise UnsafePickleError("a pickle opcode pops past the stack's mark")


def _mutate(op: str, stack: list) -> None:
    """APPEND(S), SETITEM(S), ADDITEMS, BUILD: into the container below, or into nothing (an opaque one)."""
    if op == "APPEND":
        v = stack.pop()
        if isinstance(stack[-1], list):
            stack[-1].append(v)
    elif op == "APPENDS":
        items = _pop_mark(stack)
        if isinstance(stack[-1], list):
            stack[-1].extend(items)
    elif op == "SETITEM":
        v, k = stack.pop(), stack.pop()
        if isinstance(stack[-1], dict):
            stack[-1][id(k)] = (k, v)
    elif op == "SETITEMS":
        items = _pop_mark(stack)
        if isinstance(stack[-1], dict):
            for k, v in zip(items[::2], items[1::2]):
                stack[-1][id(k)] = (k, v)
    elif op == "ADDITEMS":
        _pop_mark(stack)
    else:  # BUILD: the state goes into an object built by a global
        stack.pop()


def _step(op: str, arg, pos: int, data: bytes, stack: list, memo: dict) -> None:
    """One opcode on the model stack: scalars as `Scalar`, containers as lists / dicts of (key, value) by
    key identity / tuples, everything a global builds as one opaque object."""
    if op in _NUMBERS or op in _STRINGS or op in ("NEWTRUE", "NEWFALSE", "NONE"):
        stack.append(_scalar(op, arg, pos, data))
    elif op in ("EMPTY_LIST", "EMPTY_DICT", "EMPTY_TUPLE"):
        stack.append({"EMPTY_LIST": [], "EMPTY_DICT": {}, "EMPTY_TUPLE": ()}[op])
    elif op == "MARK":
        stack.append(_MARK)
    elif op in ("LIST", "TUPLE", "DICT"):
        items = _pop_mark(stack)
        built = {"LIST": list, "TUPLE": tuple}.get(op)
        stack.append(built(items) if built else {id(k): (k, v) for k, v in zip(items[::2], items[1::2])})
    elif op in ("TUPLE1", "TUPLE2", "TUPLE3"):
        n = int(op[-1])
        items = stack[-n:]
        del stack[-n:]
        stack.append(tuple(items))
    elif op in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
        memo[len(memo) if op == "MEMOIZE" else arg] = stack[-1]
    elif op in ("GET", "BINGET", "LONG_BINGET"):
        stack.append(memo[arg])
    elif op in ("APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"):
        _mutate(op, stack)
    elif op in _OPAQUE_FROM:
        arity = _OPAQUE_FROM[op]
        if arity is None:
            _pop_mark(stack)
        elif arity:
            del stack[-arity:]
        stack.append(_Opaque())
    elif op == "POP":
        stack.pop()
    elif op == "POP_MARK":
        _pop_mark(stack)
    elif op == "DUP":
        stack.append(stack[-1])
    elif op not in _NOOP:
        raise UnsafePickleError(f"pickle opcode {op} at byte {pos} is not one a torch.save pickle holds")


def _walk(node, path: tuple, out: dict, opaque: set, seen: dict, on_path: set) -> None:
    if isinstance(node, Scalar):
        out[path] = node
        seen[node.pos] = seen.get(node.pos, 0) + 1
        return
    if isinstance(node, _Opaque):
        opaque.add(path)
        return
    if id(node) in on_path:  # a cycle: check_pickle_bounds refuses these; never loop here
        return
    on_path.add(id(node))
    if isinstance(node, dict):
        children = [(k.value, v) for k, v in node.values() if isinstance(k, Scalar)]
    else:
        children = list(enumerate(node))
    for key, child in children:
        if isinstance(key, (str, int)):
            _walk(child, path + (key,), out, opaque, seen, on_path)
    on_path.discard(id(node))


def scalar_map(data: bytes) -> PickleMap:
    """The map of every scalar of the (bounds-checked) pickle `data` by its path. UnsafePickleError for an
    opcode stream this model does not follow."""
    stack: list = []
    memo: dict = {}
    try:
        for op, arg, pos in pickletools.genops(io.BytesIO(data)):
            _step(op.name, arg, pos or 0, data, stack, memo)
    except UnsafePickleError:
        raise
    except (IndexError, KeyError, ValueError, TypeError) as exc:
        raise UnsafePickleError(f"cannot follow the pickle's opcodes: {type(exc).__name__}: {exc}") from None
    if len(stack) != 1:
        raise UnsafePickleError("the pickle does not leave one object")
    out: dict[tuple, Scalar] = {}
    opaque: set[tuple] = set()
    seen: dict[int, int] = {}
    _walk(stack[0], (), out, opaque, seen, set())
    return PickleMap(out, frozenset(opaque), frozenset(p for p, n in seen.items() if n > 1))


def _int_bytes(op: str, value: int, width: int) -> bytes | None:
    if op == "BININT1":
        return bytes([value]) if 0 <= value < 256 else None
    if op == "BININT2":
        return struct.pack("<H", value) if 0 <= value < 1 << 16 else None
    if op == "BININT":
        return struct.pack("<i", value) if -(1 << 31) <= value < 1 << 31 else None
    if op == "LONG1" and width:
        lo, hi = -(1 << (8 * width - 1)), 1 << (8 * width - 1)
        return value.to_bytes(width, "little", signed=True) if lo <= value < hi else None
    return None


def encode_in_place(s: Scalar, value) -> tuple[int, bytes] | None:
    """(where, bytes) that make the pickle hold `value` instead of `s`'s, in exactly `s`'s bytes; None where
    it does not fit there (an int wider than its opcode's room, another type, a text opcode)."""
    if type(value) is bool and s.op in ("NEWTRUE", "NEWFALSE"):
        return s.pos, b"\x88" if value else b"\x89"  # NEWTRUE, NEWFALSE
    if type(value) is float and s.op == "BINFLOAT":
        return s.arg_at, struct.pack(">d", value)
    if type(value) is int and type(s.value) is int:
        raw = _int_bytes(s.op, value, s.arg_len)
        return None if raw is None else (s.arg_at, raw)
    return None
