"""A streamed tensor item is torch.save's bytes exactly (formats/dcp/stream_item), and rebuilt rows are
checked against every original chunk's CRC-32 whatever chunks they are fed in (formats/slim/rowcheck)."""
from __future__ import annotations

import hashlib
import io
import zlib

import pytest
import torch

from ckpt_tools.core.crc import crc32
from ckpt_tools.formats.dcp.stream_item import tensor_item_parts
from ckpt_tools.formats.slim.rowcheck import RowCheck, Segment


def payload(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("dtype,shape", [
    (torch.float32, (41, 64)), (torch.float32, ()), (torch.bfloat16, (7, 3)), (torch.float16, (1, 2048)),
    (torch.int64, (5,)), (torch.float32, (3, 5, 7)), (torch.float32, (300, 70000)), (torch.bool, (9, 2)),
])
def test_a_streamed_item_is_byte_for_byte_what_torch_save_writes(dtype, shape):
    g = torch.Generator().manual_seed(len(shape))
    t = (torch.randn(shape, generator=g) * 100).to(dtype)
    buf = io.BytesIO()
    torch.save(t, buf)
    parts = tensor_item_parts(str(dtype).removeprefix("torch."), shape)
    assert parts is not None
    data = payload(t)
    got = parts.head + data + parts.tail(crc32(data))
    assert got == buf.getvalue()
    assert parts.size == len(got)
    back = torch.load(io.BytesIO(got), weights_only=True)
    assert back.dtype == dtype and torch.equal(back, t)


def test_an_empty_tensor_is_not_streamed():
    assert tensor_item_parts("float32", (0, 64)) is None


def rows_of(t: torch.Tensor, start: int, n: int) -> bytes:
    return payload(t[start:start + n])


def test_rowcheck_checks_each_original_chunk_through_chunks_that_straddle_them():
    t = torch.randn(10, 4)
    segs = tuple(Segment(s, n, zlib.crc32(rows_of(t, s, n))) for s, n in ((0, 3), (3, 3), (6, 4)))
    sha = hashlib.sha256(payload(t)).hexdigest()
    check = RowCheck(16, 10, sha, segs)
    for s, n in ((0, 5), (5, 5)):           # two new chunks over three original ones
        check.feed(s, rows_of(t, s, n))
    assert check.failed == [] and check.complete() and check.sha256_done() == sha and check.checked == 3

    bad = t.clone()
    bad[4, 1] += 1
    check = RowCheck(16, 10, None, segs)
    for s, n in ((0, 5), (5, 5)):
        check.feed(s, rows_of(bad, s, n))
    assert len(check.failed) == 1 and "rows 3..6" in check.failed[0]


def test_rowcheck_leaves_a_chunk_it_saw_in_part_unchecked():
    t = torch.randn(10, 4)
    segs = tuple(Segment(s, n, zlib.crc32(rows_of(t, s, n))) for s, n in ((0, 5), (5, 5)))
    check = RowCheck(16, 10, hashlib.sha256(payload(t)).hexdigest(), segs)
    check.feed(0, rows_of(t, 0, 5))
    check.feed(7, rows_of(t, 7, 3))         # rows 5..7 are another rank's
    assert check.checked == 1 and not check.complete() and check.sha256_done() is None and check.failed == []
