"""The pickle bounds scan (`safe_pickle.check_pickle_bounds`, a hand-written opcode decoder) against
the scan it replaced (a replay over `pickletools.genops`, kept below verbatim as the reference): the
same verdict, the same (size, depth), the same message, on every pickle of the hostile tests, on every
genuine `.metadata` fixture, and on 2,000 seeded random mutations of a real `.metadata`.

The C fast path (`pickle_scan.accelerator`) runs first inside `check_pickle_bounds`; on every pickle
here it is also asked alone: it may only answer None (the Python scan decides) or exactly the figures
the reference accepts the pickle with, and it must vouch for every genuine `.metadata`."""
from __future__ import annotations

import pickle
import pickletools
import random
import struct

import pytest

from ckpt_tools.core.accel import pure_python
from ckpt_tools.core.errors import UnsafePickleError
from ckpt_tools.io import pickle_scan
from ckpt_tools.io.pickle_scan import MAX_VALUE_KEYS
from ckpt_tools.io.safe_pickle import MAX_INT_BITS, MAX_PICKLE_DEPTH, MIN_TREE_NODES, TREE_NODES_PER_BYTE, \
    check_pickle_bounds

from . import hardening_util as hu
from .conftest import FIXTURES, TRAINER

_MEMO_PUT_OPS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})

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
    __slots__ = ("size", "depth", "shared", "hashv")

    def __init__(self, size: int, depth: int, hashv: bool = False):
        self.size, self.depth, self.shared, self.hashv = size, depth, False, hashv


_LEAF = _Obj(1, 0)
# Added with issue 27 (MAX_VALUE_KEYS): numbers, tuples and REDUCE results (hashes a pickle chooses)
# are counted where they become dict keys or set members.
_NUM = _Obj(1, 0, True)
_NUM_OPS = frozenset({"INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT"})
_VALUE_HASHED = frozenset({"TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "REDUCE"})


def reference_scan(data: bytes, source: str, what: str = "pickle") -> tuple[int, int]:
    """The scan as it was before the fast decoder (pickletools.genops), kept verbatim as the reference."""
    budget = max(MIN_TREE_NODES, TREE_NODES_PER_BYTE * len(data))
    n = len(data)

    def refuse(why: str, pos: int) -> UnsafePickleError:
        return UnsafePickleError(f"refusing to unpickle: {why} (at byte {pos} of {n}): a crafted or corrupt "
                                 "pickle", path=source, hint="nothing was unpickled; use an intact copy of the file")

    stack: list[_Obj] = []
    marks: list[int] = []
    memo: dict[int, _Obj] = {}
    hashed = [0]

    def count_keys(keys, pos: int) -> None:
        hashed[0] += sum(1 for k in keys if k.hashv)
        if hashed[0] > MAX_VALUE_KEYS:
            raise refuse(f"more than {MAX_VALUE_KEYS:,} dict keys or set members are numbers or tuples, whose "
                         "hashes a pickle can make collide (building its dicts would take quadratic time)", pos)

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
                stack.append(_NUM if op.name in _NUM_OPS else _LEAF)
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
                o = _LEAF if op.name == "STACK_GLOBAL" else new(items, pos)
                if op.name in _VALUE_HASHED:
                    o.hashv = True
                stack.append(o)
            elif kind == _K_FROM_MARK:
                items = pop_mark(pos)
                if op.name in ("DICT", "FROZENSET"):
                    count_keys(items[::2] if op.name == "DICT" else items, pos)
                o = new(items, pos)
                o.hashv = op.name == "TUPLE"
                stack.append(o)
            elif kind == _K_MUTATE_FROM_MARK:
                items = pop_mark(pos)
                if op.name != "APPENDS":
                    count_keys(items[::2] if op.name == "SETITEMS" else items, pos)
                mutate(stack[-1], items, pos)
            elif kind == _K_MUTATE1:
                item = stack.pop()
                mutate(stack[-1], (item,), pos)
            elif kind == _K_SETITEM:
                v, k = stack.pop(), stack.pop()
                count_keys((k,), pos)
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


def verdict(scan, data: bytes):
    try:
        return ("accepted", *scan(data, "src", "a test pickle"))
    except UnsafePickleError as exc:
        return ("refused", str(exc))


def vouched(data: bytes):
    """The C fast path's answer alone: (tree size, depth), or None (it leaves the verdict to Python, or
    it is not loaded: CKPT_TOOLS_PURE_PYTHON=1)."""
    if pickle_scan.accelerator is None:
        return None
    return pickle_scan.accelerator.scan(data, pickle_scan.tree_budget(len(data)), MAX_PICKLE_DEPTH, MAX_VALUE_KEYS)


def same(data: bytes, name: str) -> tuple:
    new, ref = verdict(check_pickle_bounds, data), verdict(reference_scan, data)
    assert new == ref, f"{name}: {len(data)} bytes {data[:80]!r}"
    fast = vouched(data)
    assert fast is None or ref == ("accepted", *fast), f"{name}: the C scan vouched {fast} for {ref}"
    return new


# The tests that need the C scan's own answer; under CKPT_TOOLS_PURE_PYTHON=1 (CI's second pass) the rest
# check the Python scan against the genops reference with no fast path in front of it.
needs_c = pytest.mark.skipif(pure_python(), reason="CKPT_TOOLS_PURE_PYTHON=1: the C scan is not loaded")


def test_the_c_fast_path_is_built_unless_turned_off():
    """`make install` compiles ckpt_tools/io/pickle_scan_c.c (gcc is on every machine we run on): without
    it every test below would check the Python scan twice and `inspect` would be 10x slower to scan.
    CKPT_TOOLS_PURE_PYTHON=1 must keep it unloaded (this says which path the run tested)."""
    if pure_python():
        assert pickle_scan.accelerator is None, "CKPT_TOOLS_PURE_PYTHON=1 but pickle_scan_c was loaded"
    else:
        assert pickle_scan.accelerator is not None, "pickle_scan_c was not built: `make install` with gcc at hand"


def test_the_python_scan_equals_its_reference_on_every_genuine_pickle(monkeypatch):
    """With no C scan in front of it, the Python scan's verdict and figures on every genuine `.metadata`
    (at several protocols) and every genuine item pickle are the genops reference's."""
    monkeypatch.setattr(pickle_scan, "accelerator", None)
    metas = sorted(FIXTURES.glob("**/.metadata"))
    assert len(metas) >= 5
    for meta in metas:
        data = meta.read_bytes()
        assert same(data, str(meta))[0] == "accepted"
        for proto in (2, 5):
            same(pickle.dumps(pickle.loads(data), protocol=proto), f"{meta} at protocol {proto}")
    pickles = _item_pickles()
    assert len(pickles) >= 100
    for i, data in enumerate(pickles):
        assert same(data, f"item pickle {i}")[0] == "accepted"


def _small_metadata(keep: int = 3):
    """A real DCP Metadata (the fixture's) cut down to `keep` tensors and their storage: small enough
    for the reference scan to run thousands of times."""
    md = pickle.loads((TRAINER / ".metadata").read_bytes())   # the genuine fixture: trusted
    keys = sorted(md.state_dict_metadata)[:keep] + ["app.progress.step"]
    md.state_dict_metadata = {k: md.state_dict_metadata[k] for k in keys if k in md.state_dict_metadata}
    md.storage_data = {i: v for i, v in md.storage_data.items() if i.fqn in md.state_dict_metadata}
    md.planner_data = {k: v for k, v in md.planner_data.items() if k in md.state_dict_metadata}
    return md


def test_the_same_on_every_genuine_metadata():
    metas = sorted(FIXTURES.glob("**/.metadata"))
    assert len(metas) >= 5
    for meta in metas:
        data = meta.read_bytes()
        assert same(data, str(meta))[0] == "accepted"
        assert pure_python() or vouched(data) is not None, f"the C scan leaves the genuine {meta} to Python"
        for proto in (0, 1, 2, 3, 5):
            same(pickle.dumps(pickle.loads(data), protocol=proto), f"{meta} at protocol {proto}")


def test_the_same_on_every_hostile_pickle(tmp_path):
    canary = tmp_path / "canary"
    cases = dict(hu.payload_bytes(canary, plant=False))
    md_bytes = pickle.dumps(_small_metadata(), protocol=4)
    for i, (name, evil) in enumerate(hu.payload_objects(canary, plant=False).items()):
        for site in ("modules", "version", "planner"):
            md = pickle.loads(md_bytes)
            if site == "modules":
                md.storage_meta.modules = [evil]
            elif site == "version":
                md.version = evil
            else:
                md.planner_data[sorted(md.planner_data)[0]] = evil
            for proto in (2, 4):
                cases[f"{name} at {site} (p{proto})"] = pickle.dumps(md, protocol=proto)
    x = ["s"]
    for _ in range(40):
        x = [x, x]
    cases["dag"] = pickle.dumps(x, protocol=4)
    cases["tuple key"] = b"\x80\x04}" + b")" + b"2\x86" * 60 + b"K\x01s."
    cases["deep"] = b"\x80\x02" + b"(" * 200_000 + b"]" + b"l" * 200_000 + b"."
    cases["cycle"] = b"\x80\x02]q\x00h\x00a."
    cases["memo"] = b"\x80\x02N" + b"r" + (0x21682B68).to_bytes(4, "little") + b"."
    cases["long"] = b"\x80\x02\x8b" + (4096).to_bytes(4, "little") + b"\x01" * 4096 + b"."
    cases["garbage"] = b"\x80\x02\xff\xfe"
    cases["BINPUT past the end"] = b"\x80\x02Nq\xff."
    for levels in (31, 60):   # test_hostile_files: a tuple-DAG planner_data key inside the metadata
        md = _small_metadata()
        md.planner_data["ZZPLACEHOLDERZZ"] = ("x",)
        data = pickle.dumps(md, protocol=2)
        token = b"X" + struct.pack("<I", 15) + b"ZZPLACEHOLDERZZ"
        cases[f"tuple-DAG key {levels}"] = data.replace(token, b")" + b"2\x86" * levels)
        cases[f"200k-deep list {levels}"] = data.replace(token, b"(" * 200_000 + b"]" + b"l" * 200_000)
    m61 = 2 ** 61 - 1       # issue 27: keys of one hash (hash(k * m61) == 0)
    for proto in (2, 4):
        for n in (MAX_VALUE_KEYS, MAX_VALUE_KEYS + 1, 5000):
            cases[f"{n} int keys p{proto}"] = pickle.dumps({k * m61: 0 for k in range(min(n, 1200))} if n < 2000
                                                           else dict.fromkeys(range(n)), protocol=proto)
            cases[f"{n} tuple keys p{proto}"] = pickle.dumps(dict.fromkeys((k, "x") for k in range(n)), protocol=proto)
            cases[f"{n} float set p{proto}"] = pickle.dumps({k + 0.5 for k in range(n)}, protocol=proto)
            cases[f"{n} int frozenset p{proto}"] = pickle.dumps([frozenset(range(n))], protocol=proto)
            cases[f"{n} str keys p{proto}"] = pickle.dumps({str(k): k for k in range(n)}, protocol=proto)
        md = _small_metadata()
        md.planner_data["x"] = dict.fromkeys(range(MAX_VALUE_KEYS + 1))
        cases[f"int keys in a metadata p{proto}"] = pickle.dumps(md, protocol=proto)
    cases["empty"] = b""
    cases["just STOP"] = b"."
    cases["ok"] = pickle.dumps({"a": [1, 2, (3, 4)], "b": "x" * 100}, protocol=4)
    assert check_pickle_bounds(cases["ok"], "ok") == (10, 3)
    seen = {same(data, name)[0] for name, data in cases.items()}
    assert seen == {"accepted", "refused"}


# Opcode bytes a mutation may plant (every opcode, so every branch meets the stack it gets).
_OPCODES = [ord(op.code) for op in pickletools.opcodes]


def _mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.choice((1, 1, 1, 2, 3))):
        at = rng.randrange(len(b) + 1) if rng.random() < 0.3 else rng.randrange(len(b))
        what = rng.random()
        byte = rng.choice(_OPCODES) if rng.random() < 0.5 else rng.randrange(256)
        if what < 0.4 and at < len(b):
            b[at] = byte                                 # flip
        elif what < 0.7:
            b[at:at] = bytes([byte] * rng.choice((1, 1, 2, 4)))   # insert
        else:
            del b[at:at + rng.choice((1, 1, 2, 5))]      # delete
    if rng.random() < 0.1:
        del b[rng.randrange(len(b)):]                    # truncate
    return bytes(b)


@pytest.mark.parametrize("proto", [2, 4])
def test_the_same_on_seeded_mutations_of_a_real_metadata(proto):
    base = pickle.dumps(_small_metadata(), protocol=proto)
    assert same(base, "unmutated")[0] == "accepted"
    rng = random.Random(1300 + proto)
    counts = {"accepted": 0, "refused": 0, "vouched": 0}
    for i in range(1000):
        data = _mutate(rng, base)
        counts[same(data, f"mutation {i} of p{proto}")[0]] += 1
        counts["vouched"] += vouched(data) is not None
    assert counts["accepted"] > 20 and counts["refused"] > 500, counts
    assert pure_python() or counts["vouched"] > 20, counts


@needs_c
@pytest.mark.parametrize("proto", [2, 4])
def test_the_c_scan_vouches_only_for_what_python_accepts(proto):
    """20,000 more seeded mutations, the C scan against the Python one it speeds up (itself checked
    against the genops reference above): never a figure of its own, never a pickle Python refuses."""
    base = pickle.dumps(_small_metadata(), protocol=proto)
    rng = random.Random(4100 + proto)
    counts = {"vouched": 0, "left to Python": 0}
    for i in range(10_000):
        data = _mutate(rng, base)
        fast = vouched(data)
        if fast is None:
            counts["left to Python"] += 1
            continue
        counts["vouched"] += 1
        assert verdict(pickle_scan.reference_scan, data) == ("accepted", *fast), f"mutation {i}: {data[:80]!r}"
    assert counts["vouched"] > 200 and counts["left to Python"] > 5000, counts


def test_the_same_on_seeded_mutations_of_tiny_pickles():
    """Pickles shorter than a one-byte memo index, every protocol: the branches' bounds at small sizes."""
    rng = random.Random(7)
    bases = [pickle.dumps(o, protocol=proto) for proto in range(6)
             for o in ({"a": [1, 2, (3, 4)], "b": "x" * 10}, [[], [[]], (1,), (1, 2, 3)], {1.5, None, True})]
    for i in range(2000):
        same(_mutate(rng, rng.choice(bases)), f"tiny mutation {i}")


def _item_pickles(limit: int = 200) -> list[bytes]:
    """The `data.pkl` of real DCP items (torch.save of each tensor chunk and byte item, protocol 2:
    GLOBAL, BINPUT, BINPERSID), read from the genuine fixture's data files."""
    import io
    import zipfile

    out = []
    md = pickle.loads((TRAINER / ".metadata").read_bytes())   # the genuine fixture: trusted
    for f in sorted(TRAINER.glob("__*_0.distcp")):
        raw = f.read_bytes()
        for info in md.storage_data.values():
            if info.relative_path != f.name or len(out) >= limit:
                continue
            z = zipfile.ZipFile(io.BytesIO(raw[info.offset:info.offset + info.length]))
            out.append(z.read(next(n for n in z.namelist() if n.endswith("data.pkl"))))
    return out


@needs_c
def test_the_c_scan_vouches_for_every_genuine_item_pickle_and_its_mutations():
    pickles = _item_pickles()
    assert len(pickles) >= 100
    for i, data in enumerate(pickles):
        assert same(data, f"item pickle {i}")[0] == "accepted"
        assert vouched(data) is not None, f"the C scan leaves genuine item pickle {i} to Python: {data[:80]!r}"
    rng = random.Random(77)
    counts = {"accepted": 0, "refused": 0, "vouched": 0}
    tensors = [p for p in pickles if len(p) > 64]   # (a byte item's pickle can be 5 bytes: nothing to mutate)
    for i in range(3000):
        data = _mutate(rng, rng.choice(tensors))
        counts[same(data, f"item pickle mutation {i}")[0]] += 1
        counts["vouched"] += vouched(data) is not None
    assert counts["vouched"] > 100 and counts["refused"] > 1000, counts
