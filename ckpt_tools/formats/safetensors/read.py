"""Safetensors tensors, read by range: exactly one tensor's bytes (or one block of them), nothing
mmapped, so page cache pressure, not our RSS, is what a 100 GB model costs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ...core.errors import FormatError
from ...io.pread import pread_into
from .header import ByteCounter, OpenedFile, Source, TensorInfo, require_little_endian

if TYPE_CHECKING:  # annotations only: torch is imported where tensors are built
    import torch

    from .writer import StreamingSafetensorsWriter

__all__ = ["COPY_BLOCK_BYTES", "copy_raw", "read_raw", "read_tensor"]

# Block size for verbatim copies: bounded memory however large one tensor is (a 2 GB embedding
# costs 64 MB of RAM), large enough that syscall overhead is noise.
COPY_BLOCK_BYTES = 64 * 2**20


def read_raw(info: TensorInfo, source: Source = None, *, counter: ByteCounter | None = None) -> bytearray:
    """Exactly the bytes of `info` (a fresh buffer). `source`: an open fd (left open), a path, or
    None for `info.path`."""
    buf = bytearray(info.nbytes)
    if info.nbytes:
        with OpenedFile(source, info.path) as fd:
            pread_into(fd, buf, info.begin, path=info.path, key=info.name)
    if counter is not None:
        counter.add(info.nbytes)
    return buf


def read_tensor(
    info: TensorInfo, source: Source = None, *, counter: ByteCounter | None = None
) -> torch.Tensor:
    """A new CPU tensor (owning its memory) holding `info`'s bytes; nothing is cached."""

    import torch  # lazy: metadata commands (inspect, verify) import this module without torch (2-3 s)

    require_little_endian()
    dtype = info.torch_dtype
    if info.nbytes == 0:
        # torch.frombuffer rejects empty buffers
        if counter is not None:
            counter.add(0)
        return torch.empty(info.shape, dtype=dtype)
    buf = read_raw(info, source, counter=counter)
    return torch.frombuffer(buf, dtype=dtype).reshape(info.shape)


def copy_raw(
    src: TensorInfo,
    source: Source,
    writer: StreamingSafetensorsWriter,
    *,
    name: str | None = None,
    block_bytes: int = COPY_BLOCK_BYTES,
    counter: ByteCounter | None = None,
) -> None:
    """Copy tensor `src` verbatim (no decode) into `writer` as `name` (default: the same name),
    in blocks of at most `block_bytes`. The declared dtype and shape must match the source's."""
    dst = name if name is not None else src.name
    e = writer.declared(dst)
    if (e.dtype, e.shape) != (src.dtype, src.shape):
        raise FormatError(
            f"declared {e.dtype}{list(e.shape)} but the source {src.path} holds {src.dtype}{list(src.shape)}",
            path=writer.path,
            key=dst,
        )
    if block_bytes <= 0:
        raise ValueError("block_bytes must be positive")
    if src.nbytes == 0:
        writer.write(dst, b"")
        return
    buf = bytearray(min(block_bytes, src.nbytes))
    mv = memoryview(buf)
    with OpenedFile(source, src.path) as fd:
        done = 0
        while done < src.nbytes:
            n = min(len(buf), src.nbytes - done)
            pread_into(fd, mv[:n], src.begin + done, path=src.path, key=src.name)
            if counter is not None:
                counter.add(n)
            writer.write_chunk(dst, mv[:n])
            done += n
