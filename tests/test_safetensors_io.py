"""formats/safetensors against files written by safetensors itself (and corrupted copies of them)."""
from __future__ import annotations

import json
import math
import os
import struct

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save, save_file

from ckpt_tools.core.errors import FormatError, OutputExistsError, TruncatedFileError
from ckpt_tools.core.dtypes import SAFETENSORS as DTYPES
from ckpt_tools.core.dtypes import safetensors_code
from ckpt_tools.formats.safetensors.header import ByteCounter, read_header
from ckpt_tools.formats.safetensors.read import copy_raw, read_raw, read_tensor
from ckpt_tools.formats.safetensors.writer import StreamingSafetensorsWriter, build_header, safetensors_save_order

CODES = list(DTYPES)


def sample(code: str, shape=(3, 5), seed: int = 0) -> torch.Tensor:
    """Values with every bit pattern class we care about (random, negative, large)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 300
    dt = DTYPES[code].torch_dtype
    if dt == torch.bool:
        return x > 0
    if dt == torch.complex64:
        return torch.complex(x.float(), -x.float())
    if code.startswith("U"):
        return x.abs().to(torch.int64).to(dt)
    return x.to(dt)


def bits(t: torch.Tensor) -> bytes:
    """The raw bytes of a tensor, for bit-exact comparison (NaN-safe, any dtype)."""
    t = t.contiguous().reshape(-1)
    return bytes(t.view(torch.uint8).tolist()) if t.numel() else b""


def rewrite_header(src, dst, mutate) -> None:
    """Copy a real safetensors file with its header JSON edited by `mutate` (data untouched)."""
    raw = src.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    mutate(header)
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    dst.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n:])


@pytest.fixture
def three(tmp_path):
    """A real file: a [0,16) b [16,32) c [32,48), all F32."""
    p = tmp_path / "three.safetensors"
    save_file({"a": sample("F32", (4,), 1), "b": sample("F32", (4,), 2), "c": sample("F32", (2, 2), 3)}, p)
    return p


# ------------------------------------------------------------------------------------ reading

def test_header_of_a_save_file_output_lists_tensors_in_file_order_with_absolute_offsets(tmp_path):
    ts = {f"t_{c}": sample(c, seed=i) for i, c in enumerate(CODES)}
    ts["scalar"] = torch.tensor(1.5, dtype=torch.bfloat16)
    ts["empty"] = torch.zeros(0, 7)
    p = tmp_path / "m.safetensors"
    save_file(ts, p, metadata={"format": "pt"})

    h = read_header(p)
    assert h.metadata == {"format": "pt"}
    assert h.file_bytes == p.stat().st_size
    assert set(h.tensors) == set(ts)
    begins = [i.begin for i in h.tensors.values()]
    assert begins == sorted(begins) and begins[0] == h.data_start
    raw = p.read_bytes()
    for name, info in h.tensors.items():
        assert info.dtype == safetensors_code(ts[name].dtype)
        assert info.shape == tuple(ts[name].shape)
        assert raw[info.begin:info.end] == bits(ts[name])


@pytest.mark.parametrize("code", CODES)
def test_read_tensor_is_bit_identical_to_safe_open(tmp_path, code):
    p = tmp_path / "x.safetensors"
    save_file({"w": sample(code, (4, 6)), "z": sample("F32")}, p)
    info = read_header(p).tensors["w"]
    with safe_open(p, "pt") as f:
        ref = f.get_tensor("w")
    got = read_tensor(info)
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert bits(got) == bits(ref)


def test_read_tensor_returns_a_fresh_writable_tensor_and_handles_scalars_and_empties(tmp_path):
    p = tmp_path / "x.safetensors"
    save_file({"s": torch.tensor(3.0), "e": torch.zeros(2, 0, dtype=torch.bfloat16)}, p)
    h = read_header(p)
    s = read_tensor(h.tensors["s"])
    assert s.shape == () and s.item() == 3.0
    s += 1  # owns its memory: the file is not touched
    assert read_tensor(h.tensors["s"]).item() == 3.0
    e = read_tensor(h.tensors["e"])
    assert e.shape == (2, 0) and e.dtype == torch.bfloat16


def test_byte_counter_counts_exactly_the_bytes_of_the_tensors_read(tmp_path):
    p = tmp_path / "x.safetensors"
    save_file({"big": torch.zeros(1000, 10), "small": torch.ones(3, dtype=torch.bfloat16)}, p)
    h = read_header(p)
    c = ByteCounter()
    read_tensor(h.tensors["small"], counter=c)
    assert (c.bytes_read, c.reads) == (6, 1)
    fd = os.open(p, os.O_RDONLY)
    try:
        assert bytes(read_raw(h.tensors["small"], fd, counter=c)) == bits(torch.ones(3, dtype=torch.bfloat16))
    finally:
        os.close(fd)
    assert (c.bytes_read, c.reads) == (12, 2)


def test_read_header_reads_only_the_header(tmp_path, monkeypatch):
    p = tmp_path / "x.safetensors"
    save_file({"big": torch.zeros(100_000)}, p)
    asked = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, off: asked.append(sum(map(len, bufs))) or real(fd, bufs, off))
    h = read_header(p)
    assert sum(asked) == h.data_start  # 8-byte length + JSON, nothing of the 400 kB data


# -------------------------------------------------------------------------------- malformed input

def test_truncated_shard_is_reported_with_promised_and_held_bytes(tmp_path, three):
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(three.read_bytes()[:-10])
    with pytest.raises(TruncatedFileError) as ei:
        read_header(cut)
    msg = str(ei.value)
    assert str(cut) in msg and "key 'c'" in msg
    assert "header promises 48 bytes of tensor data, file holds 38" in msg


def test_file_shorter_than_its_length_field_is_truncated(tmp_path, three):
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(three.read_bytes()[:20])
    with pytest.raises(TruncatedFileError, match="file holds only 12"):
        read_header(cut)
    tiny = tmp_path / "tiny.safetensors"
    tiny.write_bytes(b"\x01\x02")
    with pytest.raises(TruncatedFileError, match="too short"):
        read_header(tiny)


def test_absurd_header_length_is_rejected_before_allocating(tmp_path, three):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", 2**62) + three.read_bytes()[8:])
    with pytest.raises(FormatError, match="above the 100000000-byte limit"):
        read_header(bad)


@pytest.mark.parametrize("patch,expect", [
    (lambda h: h.replace(b"{", b"[", 1), "not a JSON object"),
    (lambda h: h.replace(b'"F32"', b'"X32"', 1), "unknown dtype 'X32'"),
    (lambda h: h[:-3] + b"\xff\xfe ", "not valid UTF-8"),
    (lambda h: h.replace(b"}}", b"},", 1), "not valid JSON"),
])
def test_header_bytes_that_are_not_a_valid_json_object_are_rejected(tmp_path, three, patch, expect):
    raw = three.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = patch(raw[8:8 + n])
    assert len(header) == n
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(raw[:8] + header + raw[8 + n:])
    with pytest.raises(FormatError, match=expect) as ei:
        read_header(bad)
    assert str(bad) in str(ei.value)


@pytest.mark.parametrize("mutate,key,expect", [
    (lambda h: h["b"].update(shape=[-1, 4]), "b", "not a list of non-negative integers"),
    (lambda h: h["b"].update(shape=["4"]), "b", "not a list of non-negative integers"),
    (lambda h: h["b"].update(shape=[True, 4]), "b", "not a list of non-negative integers"),
    (lambda h: h["b"].update(shape=[5]), "b", "span 16 bytes but shape [5] of F32 needs 20"),
    (lambda h: h["b"].update(data_offsets=[16]), "b", "is not [begin, end]"),
    (lambda h: h["b"].update(data_offsets=["16", "32"]), "b", "is not [begin, end]"),
    (lambda h: h["b"].update(data_offsets=[32, 16]), "b", "is not [begin, end]"),
    (lambda h: h["b"].pop("dtype"), "b", "has no 'dtype'"),
    (lambda h: h.update(b=[1, 2]), "b", "not a JSON object"),
    (lambda h: h["b"].update(data_offsets=[8, 24]), "b", "overlap tensor 'a'"),
    (lambda h: h.pop("b"), "c", "gap: data bytes [16, 32) after tensor 'a' belong to no tensor"),
    (lambda h: h.pop("a"), "b", "gap: data bytes [0, 16) at the start"),
    (lambda h: h.update(__metadata__={"n": 1}), "__metadata__", "must map strings to strings"),
])
def test_inconsistent_tensor_entries_are_rejected_naming_file_and_key(tmp_path, three, mutate, key, expect):
    bad = tmp_path / "bad.safetensors"
    rewrite_header(three, bad, mutate)
    with pytest.raises(FormatError) as ei:
        read_header(bad)
    msg = str(ei.value)
    assert expect in msg and str(bad) in msg and f"key {key!r}" in msg


def test_trailing_bytes_after_the_last_tensor_are_rejected_like_safetensors_does(tmp_path, three):
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(three.read_bytes() + b"\0" * 8)
    with pytest.raises(FormatError, match="8 trailing bytes"):
        read_header(bad)
    with pytest.raises(Exception):  # safetensors agrees the file is invalid
        load_file(bad)


def test_duplicate_tensor_names_in_the_header_are_rejected(tmp_path, three):
    raw = three.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    text = raw[8:8 + n].decode().rstrip()
    # a second "c" entry covering the same bytes; json.loads alone would silently keep one
    entry = text[text.index('"c":'):-1]
    body = (text[:-1] + "," + entry + "}").encode()
    body += b" " * (-len(body) % 8)
    bad = tmp_path / "dup.safetensors"
    bad.write_bytes(struct.pack("<Q", len(body)) + body + raw[8 + n:])
    with pytest.raises(FormatError, match="duplicate key 'c'"):
        read_header(bad)


def test_a_file_truncated_after_its_header_was_read_fails_the_tensor_read(tmp_path, three):
    info = read_header(three).tensors["c"]
    os.truncate(three, three.stat().st_size - 4)
    with pytest.raises(TruncatedFileError, match="shrank or was truncated") as ei:
        read_tensor(info)
    assert "key 'c'" in str(ei.value)


# ------------------------------------------------------------------------------------ writing

def write_all(path, tensors: dict, order=None, metadata=None, **kw) -> None:
    entries = [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()]
    if order == "save_file":
        entries = safetensors_save_order(entries)
    with StreamingSafetensorsWriter(path, entries, metadata, **kw) as w:
        for name, _, _ in entries:
            w.write(name, tensors[name])


def test_writer_output_loads_with_safe_open_and_load_file_for_every_dtype(tmp_path):
    ts = {f"t_{c}": sample(c, (2, 3), i) for i, c in enumerate(DTYPES)}
    ts["scalar"] = torch.tensor(-2.0, dtype=torch.float64)
    ts["empty"] = torch.zeros(0, 3, dtype=torch.bfloat16)
    p = tmp_path / "ours.safetensors"
    write_all(p, ts, metadata={"format": "pt"})
    with safe_open(p, "pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert f.keys() == sorted(ts)
        for k in ts:
            assert bits(f.get_tensor(k)) == bits(ts[k]), k
    assert {k: bits(v) for k, v in load_file(p).items()} == {k: bits(v) for k, v in ts.items()}
    h = read_header(p)
    for k, v in ts.items():
        got = read_tensor(h.tensors[k])
        assert got.dtype == v.dtype and bits(got) == bits(v), k
    assert list(h.tensors) == list(ts)  # the given order is the file order


@pytest.mark.parametrize("metadata", [None, {"format": "pt"}, {}])
def test_writer_in_save_file_order_is_byte_identical_to_save_file(tmp_path, metadata):
    ts = {f"w{i}_{c}": sample(c, (i + 1, 2), i) for i, c in enumerate(CODES)}
    ts["b.scalar"] = torch.tensor(7, dtype=torch.int32)
    ts["a.empty"] = torch.zeros(3, 0, dtype=torch.float16)
    ref, ours = tmp_path / "ref.safetensors", tmp_path / "ours.safetensors"
    save_file(ts, ref, metadata=metadata)
    write_all(ours, ts, order="save_file", metadata=metadata)
    assert ours.read_bytes() == ref.read_bytes()


names = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=12).filter(
    lambda s: s != "__metadata__")
tensor_specs = st.dictionaries(
    names, st.tuples(st.sampled_from(CODES), st.lists(st.integers(0, 3), max_size=3)), min_size=1, max_size=6)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(specs=tensor_specs, meta=st.one_of(st.none(), st.dictionaries(names, names, max_size=1)))
def test_header_matches_safetensors_serializer_for_arbitrary_names_dtypes_and_shapes(specs, meta):
    ts = {k: sample(c, tuple(shape), i) for i, (k, (c, shape)) in enumerate(specs.items())}
    ref = save(ts, metadata=meta)
    entries = safetensors_save_order([(k, v.dtype, tuple(v.shape)) for k, v in ts.items()])
    header = build_header(entries, meta)
    assert ref[:len(header)] == header


def test_two_writes_of_the_same_tensors_are_byte_identical_whatever_the_metadata_dict_order(tmp_path):
    ts = {"x": sample("BF16"), "y": sample("F32")}
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    write_all(a, ts, metadata={"b": "2", "a": "1", "format": "pt"})
    write_all(b, ts, metadata={"format": "pt", "a": "1", "b": "2"})
    assert a.read_bytes() == b.read_bytes()


def test_out_of_order_writes_need_strict_order_off_and_give_the_same_file(tmp_path):
    ts = {"a": sample("F32", (3,)), "b": sample("BF16", (5,)), "c": sample("I64", (2,))}
    entries = [(k, v.dtype, v.shape) for k, v in ts.items()]
    ref = tmp_path / "ref.safetensors"
    write_all(ref, ts)
    with StreamingSafetensorsWriter(tmp_path / "strict.safetensors", entries) as w:
        with pytest.raises(FormatError, match="written out of order: expected 'a' next"):
            w.write("c", ts["c"])
        for k in ts:
            w.write(k, ts[k])
    loose = tmp_path / "loose.safetensors"
    with StreamingSafetensorsWriter(loose, entries, strict_order=False) as w:
        for k in reversed(ts):
            w.write(k, ts[k])
    assert loose.read_bytes() == ref.read_bytes()


def test_writer_rejects_tensors_that_do_not_match_their_declaration(tmp_path):
    entries = [("w", "BF16", (2, 3))]
    with StreamingSafetensorsWriter(tmp_path / "x.safetensors", entries) as w:
        with pytest.raises(FormatError, match="declared BF16, got a tensor of torch.float32"):
            w.write("w", torch.zeros(2, 3))
        with pytest.raises(FormatError, match=r"declared shape \[2, 3\], got \[3, 2\]"):
            w.write("w", torch.zeros(3, 2, dtype=torch.bfloat16))
        with pytest.raises(FormatError, match="not contiguous") as ei:
            w.write("w", torch.zeros(3, 2, dtype=torch.bfloat16).t())
        assert "`.contiguous()`" in str(ei.value)
        with pytest.raises(FormatError, match="13 bytes supplied, declared size is 12"):
            w.write_chunk("w", b"\0" * 13)
        with pytest.raises(FormatError, match="was not declared"):
            w.write("v", b"")
        w.write("w", torch.ones(2, 3, dtype=torch.bfloat16))
        with pytest.raises(FormatError, match="already written"):
            w.write("w", torch.ones(2, 3, dtype=torch.bfloat16))
    assert bits(load_file(tmp_path / "x.safetensors")["w"]) == bits(torch.ones(2, 3, dtype=torch.bfloat16))


def test_closing_with_tensors_missing_fails_and_deletes_the_partial_file(tmp_path):
    p = tmp_path / "x.safetensors"
    w = StreamingSafetensorsWriter(p, [("a", "F32", (2,)), ("b", "F32", (2,)), ("c", "F32", (1,))])
    w.write("a", torch.zeros(2))
    w.write_chunk("b", b"\0" * 4)
    with pytest.raises(FormatError, match="2 of 3 declared tensors were not written: 'b', 'c'"):
        w.close()
    assert not p.exists()


def test_an_exception_inside_the_writer_block_deletes_the_partial_file(tmp_path):
    p = tmp_path / "x.safetensors"
    with pytest.raises(RuntimeError):
        with StreamingSafetensorsWriter(p, [("a", "F32", (2,))]):
            assert p.exists()
            raise RuntimeError("boom")
    assert not p.exists()


def test_writer_never_overwrites_an_existing_file(tmp_path):
    p = tmp_path / "x.safetensors"
    p.write_bytes(b"precious")
    with pytest.raises(OutputExistsError, match="refusing to overwrite"):
        StreamingSafetensorsWriter(p, [("a", "F32", (2,))])
    assert p.read_bytes() == b"precious"


def test_declarations_are_validated(tmp_path):
    with pytest.raises(ValueError, match="declared twice"):
        build_header([("a", "F32", (1,)), ("a", "F32", (1,))])
    with pytest.raises(ValueError, match="reserved"):
        build_header([("__metadata__", "F32", (1,))])
    with pytest.raises(FormatError, match="unknown safetensors dtype 'F7'"):
        build_header([("a", "F7", (1,))])
    with pytest.raises(ValueError, match="non-negative"):
        build_header([("a", "F32", (-1,))])


# --------------------------------------------------------------------------------- raw copies

def test_copy_raw_copies_verbatim_in_bounded_blocks(tmp_path):
    emb = sample("BF16", (250, 40))             # 20_000 bytes
    norm = sample("F32", (40,), 1)
    src = tmp_path / "src.safetensors"
    save_file({"emb": emb, "norm": norm}, src)
    h = read_header(src)

    dst = tmp_path / "dst.safetensors"
    entries = [(n, i.dtype, i.shape) for n, i in h.tensors.items()]
    counter = ByteCounter()
    chunks = []
    fd = os.open(src, os.O_RDONLY)
    try:
        with StreamingSafetensorsWriter(dst, entries) as w:
            real = w.write_chunk
            w.write_chunk = lambda name, buf: (chunks.append((name, len(buf))), real(name, buf))
            for name, info in h.tensors.items():
                copy_raw(info, fd, w, block_bytes=3000, counter=counter)
    finally:
        os.close(fd)
    assert dst.read_bytes() == src.read_bytes()
    emb_chunks = [n for name, n in chunks if name == "emb"]
    assert max(emb_chunks) == 3000 and len(emb_chunks) == math.ceil(20_000 / 3000)
    assert counter.bytes_read == 20_000 + 160
    assert counter.reads == len(emb_chunks) + 1


def test_copy_raw_refuses_a_declaration_with_another_dtype_or_shape(tmp_path):
    src = tmp_path / "src.safetensors"
    save_file({"w": torch.zeros(4, dtype=torch.bfloat16)}, src)
    info = read_header(src).tensors["w"]
    with StreamingSafetensorsWriter(tmp_path / "d1.safetensors", [("w", "F16", (4,))], strict_order=False) as w:
        with pytest.raises(FormatError, match=r"declared F16\[4\] but the source .* holds BF16\[4\]"):
            copy_raw(info, None, w)
        w.write("w", torch.zeros(4, dtype=torch.float16))
    with StreamingSafetensorsWriter(tmp_path / "d2.safetensors", [("v", "BF16", (4,))]) as w:
        copy_raw(info, None, w, name="v")  # renaming on the way is allowed
    assert bits(load_file(tmp_path / "d2.safetensors")["v"]) == bits(torch.zeros(4, dtype=torch.bfloat16))
