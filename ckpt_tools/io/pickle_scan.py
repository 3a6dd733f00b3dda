"""The bounds scan that runs before any unpickler (`check_pickle_bounds`, used by `safe_pickle`).

It replays a pickle's opcodes on a model stack and refuses a pickle whose object would cost more to
build, hash or walk than its size allows (docs/reliability.md). The opcodes DCP metadata is made of
are decoded inline, the rest by pickletools; tests/test_pickle_scan.py holds the replay over
`pickletools.genops` this replaced and checks both agree.

`pickle_scan_c` (pickle_scan_c.c, built at install where a C compiler is at hand) runs the same model
~30x faster and answers only "within bounds, with these figures" or "ask the Python scan": every
refusal, figure and message is this module's. Without it, this module alone gives the same answers.
"""

from __future__ import annotations

import contextlib
import gc
import io
import pickletools
import struct

from ..core.accel import load_accelerator
from ..core.errors import UnsafePickleError

# Not built (no C compiler at install) or CKPT_TOOLS_PURE_PYTHON=1: the Python scan alone.
accelerator = load_accelerator("ckpt_tools.io.pickle_scan_c")

__all__ = [
    "MAX_INT_BITS",
    "MAX_PICKLE_DEPTH",
    "MAX_VALUE_KEYS",
    "MIN_TREE_NODES",
    "TREE_NODES_PER_BYTE",
    "accelerator",
    "check_pickle_bounds",
    "gc_paused",
    "reference_scan",
    "tree_budget",
]


@contextlib.contextmanager
def gc_paused():
    """The cyclic GC paused: the scan's model and a metadata are ~10^6 small acyclic objects it would
    re-walk for nothing. On the way out they go to the oldest generation (freeze, unfreeze), else the
    first allocation after `gc.enable()` walks them all (0.15-0.4 s after a 32B checkpoint's metadata);
    unless the program froze objects of its own (`gc.freeze()` before a fork)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            if gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()


_MEMO_PUT_OPS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})

# Bounds on the object a pickle builds, checked by `check_pickle_bounds` BEFORE any unpickler
# runs. A genuine DCP `.metadata` nests 11 levels and its tree (shared references counted each time
# they are reached) has 0.21 nodes per byte (measured on every fixture, torch 2.13; tested in
# tests/test_hostile_files.py): the limits leave 5x and 19x of headroom.
MAX_PICKLE_DEPTH = 64
MIN_TREE_NODES = 1 << 16  # tree budget: max(this, TREE_NODES_PER_BYTE * len(data))
TREE_NODES_PER_BYTE = 4
MAX_INT_BITS = 256  # LONG1/LONG4: a 64-bit offset needs 65; a 100 MB int is a bomb
# Dict keys / set members whose hash the pickle chooses (numbers: hash(k * (2**61 - 1)) == 0; tuples and
# REDUCE results: their members'), unlike str/bytes (seeded): N of one hash cost N^2/2 compares in the C
# unpickler, signals held (40,000 int keys: 18 s). Genuine DCP pickles have none (tested on every fixture).
MAX_VALUE_KEYS = 1000

_LEAF_OPS = frozenset(
    {
        "INT",
        "BININT",
        "BININT1",
        "BININT2",
        "LONG",
        "LONG1",
        "LONG4",
        "STRING",
        "BINSTRING",
        "SHORT_BINSTRING",
        "BINBYTES",
        "SHORT_BINBYTES",
        "BINBYTES8",
        "BYTEARRAY8",
        "UNICODE",
        "SHORT_BINUNICODE",
        "BINUNICODE",
        "BINUNICODE8",
        "FLOAT",
        "BINFLOAT",
        "NONE",
        "NEWTRUE",
        "NEWFALSE",
        "GLOBAL",
        "NEXT_BUFFER",
        "EXT1",
        "EXT2",
        "EXT4",
        "PERSID",
    }
)
_NO_STACK_OPS = frozenset({"PROTO", "FRAME", "READONLY_BUFFER"})
_FIXED_ARITY = {
    "TUPLE1": 1,
    "TUPLE2": 2,
    "TUPLE3": 3,
    "REDUCE": 2,
    "NEWOBJ": 2,
    "NEWOBJ_EX": 3,
    "STACK_GLOBAL": 2,
    "BINPERSID": 1,
}
_FROM_MARK = frozenset({"TUPLE", "LIST", "DICT", "FROZENSET", "OBJ", "INST"})
_MUTATE_FROM_MARK = frozenset({"APPENDS", "SETITEMS", "ADDITEMS"})
(
    _K_UNKNOWN,
    _K_LEAF,
    _K_PUT,
    _K_GET,
    _K_MARK,
    _K_EMPTY,
    _K_FIXED,
    _K_FROM_MARK,
    _K_MUTATE_FROM_MARK,
    _K_MUTATE1,
    _K_SETITEM,
    _K_NOOP,
    _K_STOP,
    _K_DUP,
    _K_POP,
    _K_POP_MARK,
) = range(16)
_OP_KINDS: dict[str, int] = {
    **dict.fromkeys(_LEAF_OPS, _K_LEAF),
    **dict.fromkeys(_NO_STACK_OPS, _K_NOOP),
    **dict.fromkeys(_MEMO_PUT_OPS | {"MEMOIZE"}, _K_PUT),
    **dict.fromkeys(("GET", "BINGET", "LONG_BINGET"), _K_GET),
    "MARK": _K_MARK,
    **dict.fromkeys(("EMPTY_LIST", "EMPTY_DICT", "EMPTY_SET", "EMPTY_TUPLE"), _K_EMPTY),
    **dict.fromkeys(_FIXED_ARITY, _K_FIXED),
    **dict.fromkeys(_FROM_MARK, _K_FROM_MARK),
    **dict.fromkeys(_MUTATE_FROM_MARK, _K_MUTATE_FROM_MARK),
    "APPEND": _K_MUTATE1,
    "BUILD": _K_MUTATE1,
    "SETITEM": _K_SETITEM,
    "STOP": _K_STOP,
    "DUP": _K_DUP,
    "POP": _K_POP,
    "POP_MARK": _K_POP_MARK,
}


# The scan's model of one object the pickle builds: [tree size (every reference of a shared child
# counted: what hashing, repr or a recursive walk of it costs), depth, shared]. Every leaf is the one
# list _LEAF, marked shared so that it can never be changed.
_LEAF = [1, 0, True]
_NUM = [1, 0, True]  # a number; tuples and REDUCE results carry a 4th field: what MAX_VALUE_KEYS counts
_NUM_OPS = frozenset({"INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT"})
_VALUE_HASHED = frozenset({"TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "REDUCE"})
_U32 = struct.Struct("<I").unpack_from
# The fast loop's branch (1, 2, ...) of each opcode byte, 0 for the general one (the opcodes' names are
# beside each branch in `_scan`).
_BRANCHES = (
    b"j",
    b"\x81R\x86",
    b"h",
    b"K",
    b")}]\x8f",
    b"\x94",
    b"(",
    b"ba",
    b"\x85",
    b"ue",
    b"\x8c",
    b"MJG",
    b"\x89\x88N",
    b"tld\x87",
    b"X",
    b"q",
    b"r",
    b"\x95",
    b".",
)
_FAST = bytes(next((k for k, ops in enumerate(_BRANCHES, 1) if b in ops), 0) for b in range(256))
# Opcodes the fast loop skips without reading their fixed-size argument: if that runs past the end,
# the next read fails past it, and the opcode's start is found back from the length.
_SKIP_LEN = {ord(k): v for k, v in (("K", 1), ("M", 2), ("J", 4), ("G", 8), ("\x95", 8))}


def _replay(f: io.BytesIO, pos: int):
    """The opcode at `pos` as pickletools.genops reads it (same argument, same exception)."""
    f.seek(pos)
    op, arg, _ = next(pickletools.genops(f))
    return op, arg, f.tell()


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
      - more than MAX_VALUE_KEYS dict keys and set members that are numbers, tuples or REDUCE results
        (hashes a pickle can make collide: 40,000 int keys of one hash took the C unpickler 18 s);
      - ints wider than MAX_INT_BITS, and anything that is not a sequence of valid opcodes.
    Linear in the pickle, in Python (signals are delivered). Returns (tree size, depth) of its object.
    DCP's opcodes are decoded inline (a branch table; strings only checked for UTF-8); any other opcode
    or failure goes through pickletools' reader at that position, so verdict, figures and message are
    a replay over pickletools.genops' (tests/test_pickle_scan.py). `accelerator` (the C fast path)
    answers first where built; wherever it does not vouch, `reference_scan` decides."""
    if accelerator is not None:
        vouched = accelerator.scan(data, tree_budget(len(data)), MAX_PICKLE_DEPTH, MAX_VALUE_KEYS)
        if vouched is not None:
            return vouched
    return reference_scan(data, source, what)


def tree_budget(nbytes: int) -> int:
    """The most tree nodes a pickle of `nbytes` may expand to."""
    return max(MIN_TREE_NODES, TREE_NODES_PER_BYTE * nbytes)


def reference_scan(data: bytes, source: str, what: str = "pickle") -> tuple[int, int]:
    """The scan in Python: the reference the C fast path is checked against, and the one that refuses."""
    with gc_paused():
        return _scan(data, source, what)


def _scan(data: bytes, source: str, what: str) -> tuple[int, int]:
    if not isinstance(data, (bytes, bytearray)):
        data = bytes(data)
    budget = tree_budget(len(data))
    n = len(data)
    f = io.BytesIO(data)
    max_depth, leaf, num = MAX_PICKLE_DEPTH, _LEAF, _NUM
    hashed = 0  # dict keys and set members seen that are numbers, tuples or REDUCE results

    def refuse(why: str, pos: int) -> UnsafePickleError:
        return UnsafePickleError(
            f"refusing to unpickle: {why} (at byte {pos} of {n}): a crafted or corrupt pickle",
            path=source,
            hint="nothing was unpickled; use an intact copy of the file",
        )

    def too_big(pos: int) -> UnsafePickleError:
        return refuse(
            f"its objects expand to more than {budget:,} nodes when walked (shared references repeated)", pos
        )

    def too_deep(pos: int) -> UnsafePickleError:
        return refuse(f"objects nest more than {MAX_PICKLE_DEPTH} levels deep", pos)

    def count_keys(keys, pos: int) -> None:
        nonlocal hashed
        hashed += sum(1 for a in keys if a is num or len(a) > 3)
        if hashed > MAX_VALUE_KEYS:
            raise refuse(
                f"more than {MAX_VALUE_KEYS:,} dict keys or set members are numbers or tuples, whose "
                "hashes a pickle can make collide (building its dicts would take quadratic time)",
                pos,
            )

    stack: list[list] = []
    marks: list[int] = []
    memo: dict[int, list] = {}

    def changed(pos: int) -> UnsafePickleError:
        return refuse("an object is changed after it was shared (a cycle or a crafted pickle)", pos)

    def new(children, pos: int) -> list:
        size, depth = 1, 0
        for c in children:
            c[2] = True
            size += c[0]
            if c[1] > depth:
                depth = c[1]
        if size > budget:
            raise too_big(pos)
        if depth >= max_depth:
            raise too_deep(pos)
        return [size, depth + 1, False]

    def mutate(target: list, children, pos: int) -> None:
        if target[2] or any(c is target for c in children):
            raise changed(pos)
        grown = new(children, pos)  # checks the children's own bounds
        target[0] += grown[0] - 1
        if grown[1] > target[1]:
            target[1] = grown[1]
        if target[0] > budget:
            raise too_big(pos)
        if target[1] > max_depth:
            raise too_deep(pos)

    def pop_mark(pos: int) -> list:
        if not marks:
            raise refuse("an opcode needs a MARK that is not there", pos)
        k = marks.pop()
        items = stack[k:]
        del stack[k:]
        return items

    def memo_put(idx, pos: int) -> None:
        if not isinstance(idx, int) or not 0 <= idx <= n:
            raise refuse(f"memo index {idx} is larger than the pickle", pos)
        memo[idx] = stack[-1]

    def slow(pos: int) -> int:
        """Any opcode the fast loop does not decode: read by pickletools, replayed by name."""
        op, arg, end = _replay(f, pos)
        name = op.name
        kind = _OP_KINDS.get(name, _K_UNKNOWN)
        if kind == _K_LEAF:
            if isinstance(arg, int) and name in ("LONG1", "LONG4") and arg.bit_length() > MAX_INT_BITS:
                raise refuse(f"an integer of {arg.bit_length()} bits", pos)
            stack.append(num if name in _NUM_OPS else leaf)
        elif kind == _K_PUT:
            memo_put(len(memo) if name == "MEMOIZE" else arg, pos)
        elif kind == _K_GET:
            stack.append(memo[arg])
        elif kind == _K_MARK:
            marks.append(len(stack))
        elif kind == _K_EMPTY:
            stack.append([1, 1, False])
        elif kind == _K_FIXED:
            k = _FIXED_ARITY[name]
            if len(stack) < k:
                raise refuse(f"{name} on a stack of {len(stack)}", pos)
            items = stack[-k:]
            del stack[-k:]
            o = leaf if name == "STACK_GLOBAL" else new(items, pos)
            stack.append(o + [1] if name in _VALUE_HASHED else o)
        elif kind == _K_FROM_MARK:
            items = pop_mark(pos)
            if name in ("DICT", "FROZENSET"):
                count_keys(items[::2] if name == "DICT" else items, pos)
            stack.append(new(items, pos) + [1] if name == "TUPLE" else new(items, pos))
        elif kind == _K_MUTATE_FROM_MARK:
            items = pop_mark(pos)
            if name != "APPENDS":
                count_keys(items[::2] if name == "SETITEMS" else items, pos)
            mutate(stack[-1], items, pos)
        elif kind == _K_MUTATE1:
            item = stack.pop()
            mutate(stack[-1], (item,), pos)
        elif kind == _K_SETITEM:
            v, k = stack.pop(), stack.pop()
            count_keys((k,), pos)
            mutate(stack[-1], (k, v), pos)
        elif kind == _K_STOP:
            return -1
        elif kind == _K_DUP:
            stack.append(stack[-1])
        elif kind == _K_POP:
            if marks and marks[-1] == len(stack):
                marks.pop()
            else:
                stack.pop()
        elif kind == _K_POP_MARK:
            pop_mark(pos)
        elif kind != _K_NOOP:  # an opcode of a future protocol: we do not know what it builds
            raise refuse(f"unknown opcode {name}", pos)
        return end

    p = c = 0
    u32 = _U32
    kinds = _FAST
    try:
        # Every branch reads its argument before it changes any state, so that a failure leaves
        # `p` at the opcode's start with the stack as it was (see the except clauses). A MEMOIZE
        # right after an opcode that builds an object is done in that opcode's branch.
        while True:
            c = data[p]
            k = kinds[c]
            if k == 1:  # LONG_BINGET
                stack.append(memo[u32(data, p + 1)[0]])
                p += 5
            elif k == 2:  # NEWOBJ / REDUCE / TUPLE2
                a = stack[-2]
                b = stack[-1]
                a[2] = b[2] = True
                size = 1 + a[0] + b[0]
                depth = a[1] if a[1] > b[1] else b[1]
                if size > budget:
                    raise too_big(p)
                if depth >= max_depth:
                    raise too_deep(p)
                del stack[-1]
                stack[-1] = o = [size, depth + 1, False] if c == 0x81 else [size, depth + 1, False, 1]
                p += 1
                if data[p] == 0x94:
                    memo[len(memo)] = o
                    p += 1
            elif k == 3:  # BINGET
                stack.append(memo[data[p + 1]])
                p += 2
            elif k == 4:  # BININT1
                if p + 4 < n and data[p + 2] == 0x4B and data[p + 4] == 0x86:  # BININT1 BININT1 TUPLE2
                    stack.append(o := [3, 1, False, 1])
                    p += 5
                    if data[p] == 0x94:
                        memo[len(memo)] = o
                        p += 1
                else:
                    stack.append(num)
                    p += 2
            elif k == 5:  # EMPTY_TUPLE / DICT / LIST / SET
                if c == 0x29 and p + 1 < n and data[p + 1] == 0x81 and stack:  # EMPTY_TUPLE NEWOBJ: cls()
                    a = stack[-1]
                    a[2] = True
                    depth = a[1] if a[1] > 1 else 1
                    if a[0] + 2 > budget:
                        raise too_big(p + 1)
                    if depth >= max_depth:
                        raise too_deep(p + 1)
                    stack[-1] = o = [a[0] + 2, depth + 1, False]
                    p += 2
                else:
                    o = [1, 1, False]
                    stack.append(o)
                    p += 1
                if data[p] == 0x94:
                    memo[len(memo)] = o
                    p += 1
                    if data[p] == 0x28:  # ... MEMOIZE MARK
                        marks.append(len(stack))
                        p += 1
            elif k == 6:  # MEMOIZE
                memo[len(memo)] = stack[-1]
                p += 1
            elif k == 7:  # MARK
                marks.append(len(stack))
                p += 1
            elif k == 8:  # BUILD / APPEND
                item = stack[-1]
                t = stack[-2]
                del stack[-1]
                if t[2] or item is t:
                    raise changed(p)
                item[2] = True
                if item[0] + 1 > budget:
                    raise too_big(p)
                if item[1] >= max_depth:
                    raise too_deep(p)
                t[0] += item[0]
                if item[1] >= t[1]:
                    t[1] = item[1] + 1
                if t[0] > budget:
                    raise too_big(p)
                if t[1] > max_depth:
                    raise too_deep(p)
                p += 1
            elif k == 9:  # TUPLE1
                a = stack[-1]
                a[2] = True
                if a[0] + 1 > budget:
                    raise too_big(p)
                if a[1] >= max_depth:
                    raise too_deep(p)
                stack[-1] = o = [a[0] + 1, a[1] + 1, False, 1]
                p += 1
                if data[p] == 0x94:
                    memo[len(memo)] = o
                    p += 1
            elif k == 10:  # SETITEMS / APPENDS
                if not marks:
                    raise refuse("an opcode needs a MARK that is not there", p)
                k = marks.pop()
                items = stack[k:]
                del stack[k:]
                if c == 0x75:
                    count_keys(items[::2], p)
                t = stack[-1]
                if t[2]:
                    raise changed(p)
                size = depth = 0
                for a in items:
                    if a is t:
                        raise changed(p)
                    a[2] = True
                    size += a[0]
                    if a[1] > depth:
                        depth = a[1]
                if size >= budget:
                    raise too_big(p)
                if depth >= max_depth:
                    raise too_deep(p)
                t[0] += size
                if depth >= t[1]:
                    t[1] = depth + 1
                if t[0] > budget:
                    raise too_big(p)
                if t[1] > max_depth:
                    raise too_deep(p)
                p += 1
                if data[p] == 0x62 and len(stack) > 1:  # ... BUILD: t is the state of the object below
                    o = stack[-2]
                    del stack[-1]
                    if o[2] or o is t:
                        raise changed(p)
                    t[2] = True
                    if t[0] + 1 > budget:
                        raise too_big(p)
                    if t[1] >= max_depth:
                        raise too_deep(p)
                    o[0] += t[0]
                    if t[1] >= o[1]:
                        o[1] = t[1] + 1
                    if o[0] > budget:
                        raise too_big(p)
                    if o[1] > max_depth:
                        raise too_deep(p)
                    p += 1
            elif k == 11:  # SHORT_BINUNICODE
                q = p + 2 + data[p + 1]
                if q > n:
                    _replay(f, p)
                str(data[p + 2 : q], "utf-8", "surrogatepass")
                stack.append(leaf)
                p = q
                if data[p] == 0x94:
                    memo[len(memo)] = leaf
                    p += 1
            elif k == 12:  # BININT2 / BININT / BINFLOAT
                stack.append(num)
                p += 3 if c == 0x4D else 5 if c == 0x4A else 9
            elif k == 13:  # NEWFALSE / NEWTRUE / NONE
                stack.append(leaf)
                p += 1
            elif k == 14:  # TUPLE / LIST / DICT / TUPLE3
                if c == 0x87:
                    a = stack[-3]
                    items = stack[-3:]
                    del stack[-3:]
                else:
                    items = pop_mark(p)
                    if c == 0x64:
                        count_keys(items[::2], p)
                o = new(items, p)
                if c != 0x6C and c != 0x64:
                    o.append(1)
                stack.append(o)
                p += 1
                if data[p] == 0x94:
                    memo[len(memo)] = o
                    p += 1
            elif k == 15:  # BINUNICODE
                q = p + 5 + u32(data, p + 1)[0]
                if q > n:
                    _replay(f, p)
                str(data[p + 5 : q], "utf-8", "surrogatepass")
                stack.append(leaf)
                p = q
            elif k == 16:  # BINPUT
                memo_put(data[p + 1], p)
                p += 2
            elif k == 17:  # LONG_BINPUT
                memo_put(u32(data, p + 1)[0], p)
                p += 5
            elif k == 18:  # FRAME
                p += 9
            elif k == 19:  # STOP
                break
            else:
                p = slow(p)
                if p < 0:
                    break
    except UnsafePickleError:
        raise
    except Exception as exc:
        if p > n:  # an argument skipped unread ran past the end
            p -= 1 + _SKIP_LEN.get(c, 0)
        try:
            op, _, _ = _replay(f, p)
        except Exception as err:  # not a sequence of valid opcodes: genops' own words
            raise UnsafePickleError(
                f"cannot parse {what}: {type(err).__name__}: {str(err)[:200]}",
                path=source,
                hint="the file is corrupt or not a pickle",
            ) from None
        k = _FIXED_ARITY.get(op.name, 0)
        if len(stack) < k:
            raise refuse(f"{op.name} on a stack of {len(stack)}", p) from None
        if isinstance(exc, (IndexError, KeyError)):
            raise refuse("an opcode finds the stack or memo empty", p) from None
        raise UnsafePickleError(
            f"cannot parse {what}: {type(exc).__name__}: {str(exc)[:200]}",
            path=source,
            hint="the file is corrupt or not a pickle",
        ) from None
    top = stack[-1] if stack else leaf
    return top[0], top[1]
