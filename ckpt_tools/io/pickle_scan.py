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
        return _Scan(data, source, what).run()


class _Scan:
    """One scan of `data`: the model stack, marks and memo, and the tree budget they are held to.

    `run` is the fast loop: the opcodes DCP metadata is made of decoded inline (`_FAST`'s branches), the
    ones that build or grow a container by a method each; anything else by `slow` (pickletools' reader).
    Every step reads its argument before it changes any state, so that a failure leaves the loop's
    position at the opcode's start with the stack as it was; `failed` then names the failure as a replay
    over pickletools.genops would."""

    def __init__(self, data: bytes, source: str, what: str):
        self.data = data if isinstance(data, (bytes, bytearray)) else bytes(data)
        self.source, self.what = source, what
        self.n = len(self.data)
        self.budget = tree_budget(self.n)
        self.f = io.BytesIO(self.data)
        self.stack: list[list] = []
        self.marks: list[int] = []
        self.memo: dict[int, list] = {}
        self.hashed = 0  # dict keys and set members seen that are numbers, tuples or REDUCE results

    # ------------------------------------------------------------------ the refusals
    def refuse(self, why: str, pos: int) -> UnsafePickleError:
        return UnsafePickleError(
            f"refusing to unpickle: {why} (at byte {pos} of {self.n}): a crafted or corrupt pickle",
            path=self.source,
            hint="nothing was unpickled; use an intact copy of the file",
        )

    def too_big(self, pos: int) -> UnsafePickleError:
        return self.refuse(
            f"its objects expand to more than {self.budget:,} nodes when walked (shared references repeated)",
            pos,
        )

    def too_deep(self, pos: int) -> UnsafePickleError:
        return self.refuse(f"objects nest more than {MAX_PICKLE_DEPTH} levels deep", pos)

    def changed(self, pos: int) -> UnsafePickleError:
        return self.refuse("an object is changed after it was shared (a cycle or a crafted pickle)", pos)

    def unparsable(self, err: Exception) -> UnsafePickleError:
        return UnsafePickleError(
            f"cannot parse {self.what}: {type(err).__name__}: {str(err)[:200]}",
            path=self.source,
            hint="the file is corrupt or not a pickle",
        )

    # ------------------------------------------------------------------ the model
    def count_keys(self, keys, pos: int) -> None:
        self.hashed += sum(1 for a in keys if a is _NUM or len(a) > 3)
        if self.hashed > MAX_VALUE_KEYS:
            raise self.refuse(
                f"more than {MAX_VALUE_KEYS:,} dict keys or set members are numbers or tuples, whose "
                "hashes a pickle can make collide (building its dicts would take quadratic time)",
                pos,
            )

    def new(self, children, pos: int) -> list:
        """The model of a new container holding `children` (each now shared)."""
        size, depth = 1, 0
        for c in children:
            c[2] = True
            size += c[0]
            if c[1] > depth:
                depth = c[1]
        if size > self.budget:
            raise self.too_big(pos)
        if depth >= MAX_PICKLE_DEPTH:
            raise self.too_deep(pos)
        return [size, depth + 1, False]

    def grow(self, target: list, size: int, depth: int, pos: int) -> None:
        """`target` holds `size` more nodes, its children nesting `depth` deep."""
        target[0] += size
        if depth >= target[1]:
            target[1] = depth + 1
        if target[0] > self.budget:
            raise self.too_big(pos)
        if target[1] > MAX_PICKLE_DEPTH:
            raise self.too_deep(pos)

    def mutate(self, target: list, children, pos: int) -> None:
        if target[2] or any(c is target for c in children):
            raise self.changed(pos)
        grown = self.new(children, pos)  # checks the children's own bounds
        target[0] += grown[0] - 1
        if grown[1] > target[1]:
            target[1] = grown[1]
        if target[0] > self.budget:
            raise self.too_big(pos)
        if target[1] > MAX_PICKLE_DEPTH:
            raise self.too_deep(pos)

    def pop_mark(self, pos: int) -> list:
        if not self.marks:
            raise self.refuse("an opcode needs a MARK that is not there", pos)
        k = self.marks.pop()
        items = self.stack[k:]
        del self.stack[k:]
        return items

    def memo_put(self, idx, pos: int) -> None:
        if not isinstance(idx, int) or not 0 <= idx <= self.n:
            raise self.refuse(f"memo index {idx} is larger than the pickle", pos)
        self.memo[idx] = self.stack[-1]

    # ------------------------------------------------------------------ the fast loop
    def run(self) -> tuple[int, int]:
        """The scan: (tree size, depth) of the pickle's object, or the refusal."""
        data, n, stack, memo, marks = self.data, self.n, self.stack, self.memo, self.marks
        kinds, u32, leaf, num = _FAST, _U32, _LEAF, _NUM
        p = c = 0
        try:
            while True:
                c = data[p]
                k = kinds[c]
                if k == 1:  # LONG_BINGET
                    stack.append(memo[u32(data, p + 1)[0]])
                    p += 5
                elif k == 3:  # BINGET
                    stack.append(memo[data[p + 1]])
                    p += 2
                elif k == 4:  # BININT1
                    stack.append(num)
                    p += 2
                elif k == 6:  # MEMOIZE
                    memo[len(memo)] = stack[-1]
                    p += 1
                elif k == 7:  # MARK
                    marks.append(len(stack))
                    p += 1
                elif k == 11 or k == 15:  # SHORT_BINUNICODE / BINUNICODE
                    q = p + 2 + data[p + 1] if k == 11 else p + 5 + u32(data, p + 1)[0]
                    if q > n:
                        _replay(self.f, p)
                    str(data[p + (2 if k == 11 else 5) : q], "utf-8", "surrogatepass")
                    stack.append(leaf)
                    p = q
                elif k == 12:  # BININT2 / BININT / BINFLOAT
                    stack.append(num)
                    p += 3 if c == 0x4D else 5 if c == 0x4A else 9
                elif k == 13:  # NEWFALSE / NEWTRUE / NONE
                    stack.append(leaf)
                    p += 1
                elif k == 19:  # STOP
                    break
                elif k == 18:  # FRAME
                    p += 9
                else:
                    p = self.step(k, c, p)
                    if p < 0:
                        break
        except UnsafePickleError:
            raise
        except Exception as exc:
            raise self.failed(exc, p, c) from None
        top = stack[-1] if stack else leaf
        return top[0], top[1]

    def step(self, k: int, c: int, p: int) -> int:
        """The fast loop's opcodes that build or grow a container (branch `k` of `_FAST`), and any other
        by `slow`: the next opcode's position (-1: STOP)."""
        if k == 2:  # NEWOBJ / REDUCE / TUPLE2
            return self.pair(c, p)
        if k == 5:  # EMPTY_TUPLE / DICT / LIST / SET
            return self.empty(c, p)
        if k == 8:  # BUILD / APPEND
            return self.append(p)
        if k == 9:  # TUPLE1
            a = self.stack[-1]
            a[2] = True
            if a[0] + 1 > self.budget:
                raise self.too_big(p)
            if a[1] >= MAX_PICKLE_DEPTH:
                raise self.too_deep(p)
            self.stack[-1] = [a[0] + 1, a[1] + 1, False, 1]
            return p + 1
        if k == 10:  # SETITEMS / APPENDS
            return self.setitems(c, p)
        if k == 14:  # TUPLE / LIST / DICT / TUPLE3
            return self.sequence(c, p)
        if k == 16:  # BINPUT
            self.memo_put(self.data[p + 1], p)
            return p + 2
        if k == 17:  # LONG_BINPUT
            self.memo_put(_U32(self.data, p + 1)[0], p)
            return p + 5
        return self.slow(p)

    def pair(self, c: int, p: int) -> int:
        """NEWOBJ / REDUCE / TUPLE2: one object of the two on top (a tuple or REDUCE result: hashed)."""
        stack = self.stack
        a = stack[-2]
        b = stack[-1]
        a[2] = b[2] = True
        size = 1 + a[0] + b[0]
        depth = a[1] if a[1] > b[1] else b[1]
        if size > self.budget:
            raise self.too_big(p)
        if depth >= MAX_PICKLE_DEPTH:
            raise self.too_deep(p)
        del stack[-1]
        stack[-1] = [size, depth + 1, False] if c == 0x81 else [size, depth + 1, False, 1]
        return p + 1

    def empty(self, c: int, p: int) -> int:
        """EMPTY_TUPLE / DICT / LIST / SET; EMPTY_TUPLE NEWOBJ (`cls()`) as one step."""
        stack, data = self.stack, self.data
        if c == 0x29 and p + 1 < self.n and data[p + 1] == 0x81 and stack:
            a = stack[-1]
            a[2] = True
            depth = a[1] if a[1] > 1 else 1
            if a[0] + 2 > self.budget:
                raise self.too_big(p + 1)
            if depth >= MAX_PICKLE_DEPTH:
                raise self.too_deep(p + 1)
            stack[-1] = [a[0] + 2, depth + 1, False]
            return p + 2
        stack.append([1, 1, False])
        return p + 1

    def append(self, p: int) -> int:
        """BUILD / APPEND: the item on top goes into the object below it."""
        stack = self.stack
        item = stack[-1]
        t = stack[-2]
        del stack[-1]
        if t[2] or item is t:
            raise self.changed(p)
        item[2] = True
        if item[0] + 1 > self.budget:
            raise self.too_big(p)
        if item[1] >= MAX_PICKLE_DEPTH:
            raise self.too_deep(p)
        self.grow(t, item[0], item[1], p)
        return p + 1

    def setitems(self, c: int, p: int) -> int:
        """SETITEMS / APPENDS: the items since the last MARK go into the container below them."""
        items = self.pop_mark(p)
        if c == 0x75:
            self.count_keys(items[::2], p)
        t = self.stack[-1]
        if t[2]:
            raise self.changed(p)
        size = depth = 0
        for a in items:
            if a is t:
                raise self.changed(p)
            a[2] = True
            size += a[0]
            if a[1] > depth:
                depth = a[1]
        if size >= self.budget:
            raise self.too_big(p)
        if depth >= MAX_PICKLE_DEPTH:
            raise self.too_deep(p)
        self.grow(t, size, depth, p)
        return p + 1

    def sequence(self, c: int, p: int) -> int:
        """TUPLE / LIST / DICT (the items since the last MARK) and TUPLE3 (the three on top)."""
        stack = self.stack
        if c == 0x87:
            items = stack[-3:]
            if len(items) < 3:
                raise IndexError("TUPLE3 on a short stack")
            del stack[-3:]
        else:
            items = self.pop_mark(p)
            if c == 0x64:
                self.count_keys(items[::2], p)
        o = self.new(items, p)
        if c != 0x6C and c != 0x64:
            o.append(1)
        stack.append(o)
        return p + 1

    def slow(self, pos: int) -> int:
        """Any opcode the fast loop does not decode: read by pickletools, replayed by name."""
        op, arg, end = _replay(self.f, pos)
        name = op.name
        kind = _OP_KINDS.get(name, _K_UNKNOWN)
        if kind == _K_LEAF:
            if isinstance(arg, int) and name in ("LONG1", "LONG4") and arg.bit_length() > MAX_INT_BITS:
                raise self.refuse(f"an integer of {arg.bit_length()} bits", pos)
            self.stack.append(_NUM if name in _NUM_OPS else _LEAF)
        elif kind == _K_STOP:
            return -1
        elif kind in (_K_FIXED, _K_FROM_MARK, _K_MUTATE_FROM_MARK, _K_MUTATE1, _K_SETITEM):
            self.slow_container(kind, name, pos)
        else:
            self.slow_stack(kind, name, arg, pos)
        return end

    def slow_stack(self, kind: int, name: str, arg, pos: int) -> None:
        """A slow opcode that moves what is on the stack or in the memo, or builds nothing."""
        stack, marks = self.stack, self.marks
        if kind == _K_PUT:
            self.memo_put(len(self.memo) if name == "MEMOIZE" else arg, pos)
        elif kind == _K_GET:
            stack.append(self.memo[arg])
        elif kind == _K_MARK:
            marks.append(len(stack))
        elif kind == _K_EMPTY:
            stack.append([1, 1, False])
        elif kind == _K_DUP:
            stack.append(stack[-1])
        elif kind == _K_POP:
            if marks and marks[-1] == len(stack):
                marks.pop()
            else:
                stack.pop()
        elif kind == _K_POP_MARK:
            self.pop_mark(pos)
        elif kind != _K_NOOP:  # an opcode of a future protocol: we do not know what it builds
            raise self.refuse(f"unknown opcode {name}", pos)

    def slow_container(self, kind: int, name: str, pos: int) -> None:
        """A slow opcode that builds or grows a container."""
        stack = self.stack
        if kind == _K_FIXED:
            k = _FIXED_ARITY[name]
            if len(stack) < k:
                raise self.refuse(f"{name} on a stack of {len(stack)}", pos)
            items = stack[-k:]
            del stack[-k:]
            o = _LEAF if name == "STACK_GLOBAL" else self.new(items, pos)
            stack.append(o + [1] if name in _VALUE_HASHED else o)
        elif kind == _K_FROM_MARK:
            items = self.pop_mark(pos)
            if name in ("DICT", "FROZENSET"):
                self.count_keys(items[::2] if name == "DICT" else items, pos)
            stack.append(self.new(items, pos) + [1] if name == "TUPLE" else self.new(items, pos))
        elif kind == _K_MUTATE_FROM_MARK:
            items = self.pop_mark(pos)
            if name != "APPENDS":
                self.count_keys(items[::2] if name == "SETITEMS" else items, pos)
            self.mutate(stack[-1], items, pos)
        elif kind == _K_MUTATE1:
            item = stack.pop()
            self.mutate(stack[-1], (item,), pos)
        else:  # SETITEM
            v, k_ = stack.pop(), stack.pop()
            self.count_keys((k_,), pos)
            self.mutate(stack[-1], (k_, v), pos)

    def failed(self, exc: Exception, p: int, c: int) -> UnsafePickleError:
        """What a failure of the fast loop at `p` is, as a replay over pickletools.genops names it."""
        if p > self.n:  # an argument skipped unread ran past the end
            p -= 1 + _SKIP_LEN.get(c, 0)
        try:
            op, _, _ = _replay(self.f, p)
        except Exception as err:  # not a sequence of valid opcodes: genops' own words
            return self.unparsable(err)
        k = _FIXED_ARITY.get(op.name, 0)
        if len(self.stack) < k:
            return self.refuse(f"{op.name} on a stack of {len(self.stack)}", p)
        if isinstance(exc, (IndexError, KeyError)):
            return self.refuse("an opcode finds the stack or memo empty", p)
        return self.unparsable(exc)
