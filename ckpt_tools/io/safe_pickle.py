"""Unpickling with an allow-list, after a bounds scan that builds nothing.

A pickle from a stranger runs code the moment a plain `pickle.loads` meets a global it names.
`load_allowed` resolves only the exact `(module, name)` pairs its caller allows (each mapped to what
the unpickler builds in its place: `formats.dcp.metadata` maps DCP's metadata classes to torch-free
stand-ins); anything else raises UnsafePickleError naming the global, before anything runs. Before
any unpickler runs, `check_pickle_bounds` replays the opcodes on a model stack and refuses a pickle
whose object would cost more to build, hash or walk than its size allows.
"""
from __future__ import annotations

import enum
import io
import logging
import pickle
import pickletools
from collections.abc import Mapping

from ..core.errors import UnsafePickleError

__all__ = ["MAX_PICKLE_DEPTH", "MIN_TREE_NODES", "TREE_NODES_PER_BYTE", "MAX_INT_BITS", "check_pickle_bounds",
           "AllowListUnpickler", "load_allowed"]

log = logging.getLogger(__name__)


class AllowListUnpickler(pickle.Unpickler):
    """Resolves a global only through `allowed` ({(module, name): object}); `trust` resolves any other
    one as plain pickle would (`--trust-remote-pickle`, logged). `what` names the file kind in errors
    ("a DCP .metadata file"), `short` in the persistent-id one ("DCP metadata")."""

    def __init__(self, fh, source: str, allowed: Mapping[tuple[str, str], object], *, trust: bool, what: str,
                 short: str | None = None):
        super().__init__(fh)
        self._source = source
        self._allowed = allowed
        self._trust = trust
        self._what = what
        self._short = short or what

    def find_class(self, module: str, name: str):
        if (module, name) in self._allowed:
            return self._allowed[(module, name)]
        if (module, name) == ("builtins", "getattr") and not self._trust:
            return self._enum_member

        if self._trust:
            log.warning("--trust-remote-pickle: resolving %s.%s from %s outside the allow-list",
                        module, name, self._source)
            return super().find_class(module, name)
        raise UnsafePickleError(
            f"refusing to unpickle global {module}.{name}: it is not a class {self._what} is made of, "
            "and unpickling it could run code",
            path=self._source,
            hint="if you wrote this checkpoint yourself and trust it, pass --trust-remote-pickle",
        )

    def _enum_member(self, cls, name):
        """`builtins.getattr` in the one form CPython 3.11.0-3.11.4 pickles an Enum member:
        `getattr(<enum class>, <member name>)` (enum `__reduce_ex__`; Debian's 3.11.2 wrote DCP's
        `_MEM_FORMAT_ENCODING` members so). Only an Enum class of this allow-list and one of its member
        names; any other getattr is refused, since it reaches any attribute of anything."""
        allowed_enum = isinstance(cls, type) and issubclass(cls, enum.Enum) and \
            any(cls is v for v in self._allowed.values())
        if allowed_enum and type(name) is str and name in cls.__members__:
            return cls.__members__[name]
        raise UnsafePickleError(
            f"refusing to unpickle builtins.getattr({getattr(cls, '__name__', type(cls).__name__)}, {name!r}): "
            f"only getattr(<allow-listed Enum class>, <member name>) is accepted in {self._what}, and "
            "anything else could reach any attribute",
            path=self._source, hint="if you wrote this checkpoint yourself and trust it, pass --trust-remote-pickle")

    def persistent_load(self, pid):
        raise UnsafePickleError(f"unexpected persistent id {pid!r} in {self._short}", path=self._source)


def load_allowed(data: bytes, source: str, allowed: Mapping[tuple[str, str], object], *, trust: bool = False,
                 what: str = "a pickle", short: str | None = None, parse_what: str = "pickle",
                 corrupt_hint: str = "the file is corrupt") -> object:
    """`check_pickle_bounds`, then unpickle `data` resolving globals only through `allowed`. Any
    failure is an UnsafePickleError naming `source`."""
    check_pickle_bounds(data, source, parse_what)
    try:
        return AllowListUnpickler(io.BytesIO(data), source, allowed, trust=trust, what=what, short=short).load()
    except UnsafePickleError:
        raise
    except Exception as exc:  # truncated/garbled pickle: any of a dozen exception types
        raise UnsafePickleError(f"cannot parse {parse_what}: {type(exc).__name__}: {exc}", path=source,
                                hint=corrupt_hint) from None


_MEMO_PUT_OPS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})

# Bounds on the object a pickle builds, checked by `check_pickle_bounds` BEFORE any unpickler
# runs. A genuine DCP `.metadata` nests 11 levels and its tree (shared references counted each time
# they are reached) has 0.21 nodes per byte (measured on every fixture, torch 2.13; tested in
# tests/test_hostile_files.py): the limits leave 5x and 19x of headroom.
MAX_PICKLE_DEPTH = 64
MIN_TREE_NODES = 1 << 16          # tree budget: max(this, TREE_NODES_PER_BYTE * len(data))
TREE_NODES_PER_BYTE = 4
MAX_INT_BITS = 256                 # LONG1/LONG4: a 64-bit offset needs 65; a 100 MB int is a bomb

_LEAF_OPS = frozenset({
    "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "STRING", "BINSTRING", "SHORT_BINSTRING",
    "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8", "UNICODE", "SHORT_BINUNICODE", "BINUNICODE",
    "BINUNICODE8", "FLOAT", "BINFLOAT", "NONE", "NEWTRUE", "NEWFALSE", "GLOBAL", "NEXT_BUFFER", "EXT1", "EXT2",
    "EXT4", "PERSID",
})
_NO_STACK_OPS = frozenset({"PROTO", "FRAME", "READONLY_BUFFER"})
_FIXED_ARITY = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3, "REDUCE": 2, "NEWOBJ": 2, "NEWOBJ_EX": 3,
                "STACK_GLOBAL": 2, "BINPERSID": 1}
_FROM_MARK = frozenset({"TUPLE", "LIST", "DICT", "FROZENSET", "OBJ", "INST"})
_MUTATE_FROM_MARK = frozenset({"APPENDS", "SETITEMS", "ADDITEMS"})
(_K_UNKNOWN, _K_LEAF, _K_PUT, _K_GET, _K_MARK, _K_EMPTY, _K_FIXED, _K_FROM_MARK, _K_MUTATE_FROM_MARK, _K_MUTATE1,
 _K_SETITEM, _K_NOOP, _K_STOP, _K_DUP, _K_POP, _K_POP_MARK) = range(16)
_OP_KINDS: dict[str, int] = {
    **{o: _K_LEAF for o in _LEAF_OPS}, **{o: _K_NOOP for o in _NO_STACK_OPS},
    **{o: _K_PUT for o in _MEMO_PUT_OPS | {"MEMOIZE"}}, **{o: _K_GET for o in ("GET", "BINGET", "LONG_BINGET")},
    "MARK": _K_MARK, **{o: _K_EMPTY for o in ("EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET", "EMPTY_TUPLE")},
    **{o: _K_FIXED for o in _FIXED_ARITY}, **{o: _K_FROM_MARK for o in _FROM_MARK},
    **{o: _K_MUTATE_FROM_MARK for o in _MUTATE_FROM_MARK}, "APPEND": _K_MUTATE1, "BUILD": _K_MUTATE1,
    "SETITEM": _K_SETITEM, "STOP": _K_STOP, "DUP": _K_DUP, "POP": _K_POP, "POP_MARK": _K_POP_MARK,
}


class _Obj:
    """What the scan knows of one object the pickle builds: its tree size (every reference of a
    shared child counted: what hashing, repr or a recursive walk of it costs) and depth."""
    __slots__ = ("size", "depth", "shared")

    def __init__(self, size: int, depth: int):
        self.size, self.depth, self.shared = size, depth, False


_LEAF = _Obj(1, 0)


def check_pickle_bounds(data: bytes, source: str, what: str = "pickle") -> tuple[int, int]:
    """Refuse, before any unpickler runs, a pickle whose object would cost more to build, hash or
    walk than its size allows. The scan replays the opcodes on a model stack (no object is built):
      - memo indices larger than the pickle (CPython's C unpickler zero-fills a memo array up to
        the largest index: one flipped byte of a real .metadata cost 9 GB of RSS);
      - nesting deeper than MAX_PICKLE_DEPTH (a 200,000-deep list: RecursionError in every walk);
      - a tree larger than max(MIN_TREE_NODES, TREE_NODES_PER_BYTE * len(data)) nodes, shared
        references counted each time: a DAG of 2 bytes per level is 2^N nodes to repr or walk,
        and a tuple DAG used as a dict key costs 2^N to HASH inside the C unpickler, where no
        signal is delivered (N=60 ignored SIGTERM);
      - a container changed after it was put into another one (a cycle, or a way to grow an object
        the scan already counted; pickle.dump never does it for acyclic data such as DCP's);
      - ints wider than MAX_INT_BITS, and anything that is not a sequence of valid opcodes.
    The scan runs in Python (signals are delivered), in time linear in the pickle. Returns the
    (tree size, depth) of the object the pickle builds."""
    budget = max(MIN_TREE_NODES, TREE_NODES_PER_BYTE * len(data))
    n = len(data)

    def refuse(why: str, pos: int) -> UnsafePickleError:
        return UnsafePickleError(f"refusing to unpickle: {why} (at byte {pos} of {n}): a crafted or corrupt "
                                 "pickle", path=source, hint="nothing was unpickled; use an intact copy of the file")

    stack: list[_Obj] = []
    marks: list[int] = []
    memo: dict[int, _Obj] = {}

    def new(children, pos: int) -> _Obj:
        size, depth = 1, 0
        for c in children:
            if c is not _LEAF:
                c.shared = True
            size += c.size
            if c.depth > depth:
                depth = c.depth
        if size > budget:
            raise refuse(f"its objects expand to more than {budget:,} nodes when walked (shared references "
                         "repeated)", pos)
        if depth + 1 > MAX_PICKLE_DEPTH:
            raise refuse(f"objects nest more than {MAX_PICKLE_DEPTH} levels deep", pos)
        return _Obj(size, depth + 1)

    def mutate(target: _Obj, children, pos: int) -> None:
        if target is _LEAF or target.shared or any(c is target for c in children):
            raise refuse("an object is changed after it was shared (a cycle or a crafted pickle)", pos)
        grown = new(children, pos)   # checks the children's own bounds
        target.size += grown.size - 1
        target.depth = max(target.depth, grown.depth)
        if target.size > budget:
            raise refuse(f"its objects expand to more than {budget:,} nodes when walked (shared references "
                         "repeated)", pos)
        if target.depth > MAX_PICKLE_DEPTH:
            raise refuse(f"objects nest more than {MAX_PICKLE_DEPTH} levels deep", pos)

    def pop_mark(pos: int) -> list[_Obj]:
        if not marks:
            raise refuse("an opcode needs a MARK that is not there", pos)
        k = marks.pop()
        items = stack[k:]
        del stack[k:]
        return items

    pos = 0
    kinds = _OP_KINDS
    try:
        for op, arg, pos in pickletools.genops(data):
            kind = kinds.get(op.name, _K_UNKNOWN)
            if kind == _K_LEAF:
                if isinstance(arg, int) and op.name in ("LONG1", "LONG4") and arg.bit_length() > MAX_INT_BITS:
                    raise refuse(f"an integer of {arg.bit_length()} bits", pos)
                stack.append(_LEAF)
            elif kind == _K_PUT:
                idx = len(memo) if op.name == "MEMOIZE" else arg
                if not isinstance(idx, int) or not 0 <= idx <= n:
                    raise refuse(f"memo index {idx} is larger than the pickle", pos)
                memo[idx] = stack[-1]
            elif kind == _K_GET:
                stack.append(memo[arg])
            elif kind == _K_MARK:
                marks.append(len(stack))
            elif kind == _K_EMPTY:
                stack.append(_Obj(1, 1))
            elif kind == _K_FIXED:
                k = _FIXED_ARITY[op.name]
                if len(stack) < k:
                    raise refuse(f"{op.name} on a stack of {len(stack)}", pos)
                items = stack[-k:]
                del stack[-k:]
                stack.append(_LEAF if op.name == "STACK_GLOBAL" else new(items, pos))
            elif kind == _K_FROM_MARK:
                stack.append(new(pop_mark(pos), pos))
            elif kind == _K_MUTATE_FROM_MARK:
                items = pop_mark(pos)
                mutate(stack[-1], items, pos)
            elif kind == _K_MUTATE1:
                item = stack.pop()
                mutate(stack[-1], (item,), pos)
            elif kind == _K_SETITEM:
                v, k = stack.pop(), stack.pop()
                mutate(stack[-1], (k, v), pos)
            elif kind == _K_NOOP:
                continue
            elif kind == _K_STOP:
                break
            elif kind == _K_DUP:
                stack.append(stack[-1])
            elif kind == _K_POP:
                if marks and marks[-1] == len(stack):
                    marks.pop()
                else:
                    stack.pop()
            elif kind == _K_POP_MARK:
                pop_mark(pos)
            else:   # an opcode of a future protocol: we do not know what it builds
                raise refuse(f"unknown opcode {op.name}", pos)
    except UnsafePickleError:
        raise
    except (IndexError, KeyError):
        raise refuse("an opcode finds the stack or memo empty", pos) from None
    except Exception as exc:   # not a sequence of valid opcodes (ValueError from genops, ...)
        raise UnsafePickleError(f"cannot parse {what}: {type(exc).__name__}: {str(exc)[:200]}", path=source,
                                hint="the file is corrupt or not a pickle") from None
    top = stack[-1] if stack else _LEAF
    return top.size, top.depth
