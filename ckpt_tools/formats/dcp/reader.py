"""An open DCP checkpoint: `.metadata` parsed, data files opened on first use, items read by range.
`DcpCheckpoint` is the format's one handle: its items by key here, its tensors as `Source` views
(`base_weights()`: the base weights under their HF names; `by_key()`: every tensor under its DCP key,
`formats.dcp.views`) and its LoRA (`lora(...)`: `formats.dcp.lora`).

Opening reads `.metadata` only (allow-list unpickling into torch-free stand-ins) and refuses the
first finding of the metadata model that makes it unreadable (`formats.dcp.model`). Tensors are
read one at a time by `pread` of exactly their chunks' byte ranges: FSDP2 row-block chunks
(`Shard(0)`) straight into their rows of the destination, anything else through `torch.load`
(weights_only) of the item (`formats.dcp.item`). Byte items (lr, scheduler, progress) load with
`torch.load(weights_only=True)`. Nothing returns "the whole state dict".
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from ...core.crc import PieceChecker, crc32
from ...core.dtypes import torch_dtype
from ...core.errors import ChecksumError, CkptError, FormatError, UnsafePickleError, UsageError
from ...core.keys import classify, require_known
from ...io.inputs import MAX_METADATA_BYTES, OpenFiles, as_input, read_input, register
from .item import (
    CRC_HINT,
    ItemError,
    check_record_crcs,
    crc_error,
    decode_chunk,
    is_row_block,
    load_byte_item,
    load_plain_item,
)
from .layout import METADATA_NAME, resolve_checkpoint_dir
from .metadata import load_metadata
from .model import BytesEntry, Chunk, Entry, TensorEntry, parse_metadata

if TYPE_CHECKING:  # annotations only: torch is imported where tensors are built
    import torch

__all__ = ["DcpCheckpoint"]


class DcpCheckpoint:
    """An open DCP checkpoint: metadata in memory, data files opened lazily (`OpenFiles`)."""

    def __init__(self, ckpt_dir: Path, metadata, *, trust_pickle: bool = False, known_keys_only: bool = True):
        self.dir = as_input(ckpt_dir)
        self.metadata = metadata
        self.trust_pickle = trust_pickle
        self.files = OpenFiles(
            self.dir,
            what="data file",
            missing_hint="copy the whole checkpoint directory; every rank's __<rank>_0.distcp is needed",
        )
        meta_path = self.dir / METADATA_NAME
        try:
            parsed = parse_metadata(metadata)
        except CkptError:
            raise
        except Exception as exc:  # a crafted or damaged Metadata of the allowed classes
            raise FormatError(
                f"malformed DCP metadata: {type(exc).__name__}: {exc}",
                path=meta_path,
                hint="the file is corrupt; run `ckpt verify`",
            ) from None
        bad = parsed.fatal()
        if bad is not None:
            raise FormatError(
                bad.message,
                path=meta_path if bad.file is None else self.dir / bad.file,
                key=bad.key,
                hint=bad.hint,
            )
        self.entries: dict[str, Entry] = parsed.entries
        # payloads read in pieces (row blocks, expert slices), checked against their zip CRC-32 as the
        # pieces arrive (`check_piece`)
        self.crc = PieceChecker()
        if known_keys_only:  # every command but the ones that list what is there (inspect, verify)
            require_known([classify(k, e.path) for k, e in self.entries.items()], meta_path)

    # ---------------------------------------------------------------- opening
    @classmethod
    def open(
        cls, path: str | Path, *, trust_pickle: bool = False, known_keys_only: bool = True
    ) -> DcpCheckpoint:
        """`known_keys_only`: refuse keys the prime-rl key model does not recognise (`core.keys`)."""
        ckpt_dir = resolve_checkpoint_dir(path)
        register(ckpt_dir)  # the whole checkpoint is an input: no OUT inside it
        meta_path = ckpt_dir / METADATA_NAME
        data = read_input(meta_path, root=ckpt_dir, what="DCP .metadata", max_bytes=MAX_METADATA_BYTES)
        if not data:
            raise FormatError(
                "empty .metadata (0 bytes)",
                path=meta_path,
                hint="the save was interrupted; use an earlier step",
            )
        md = load_metadata(data, str(meta_path), trust=trust_pickle)  # (both run with the cyclic GC paused)
        return cls(ckpt_dir, md, trust_pickle=trust_pickle, known_keys_only=known_keys_only)

    @property
    def stats(self):
        """Every byte range read from the data files (`inputs.ReadStats`)."""
        return self.files.stats

    def close(self) -> None:
        self.files.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # ---------------------------------------------------------------- views (each shares this handle's files)
    def base_weights(self, label: str | None = None, *, owned: bool = False, **kw):
        """The base weights (`app.model.<name>`, not LoRA) under their HF names: a `Source`
        (`views.DcpBaseSource`; `empty_hint=` what to say when there are none). `owned`: closing the view
        closes this checkpoint."""
        from .views import DcpBaseSource

        src = DcpBaseSource(self, label, **kw)
        src.owns_checkpoint(owned)
        return src

    def by_key(self):
        """Every tensor under its DCP key, and `key[e]` slices of stacked ones on request: a `Source`."""
        from .views import DcpKeySource

        return DcpKeySource(self)

    def lora(self, *, alpha: float | None = None, run_config: Path | None = None, slot: int = 0):
        """The LoRA factors of adapter `slot`, alpha resolved (`formats.primerl.alpha`): a `LoraSource`
        (`lora.DcpLoraSource`), which closes this checkpoint when it is closed."""
        from .lora import DcpLoraSource

        return DcpLoraSource(self, alpha=alpha, run_config=run_config, slot=slot)

    # ---------------------------------------------------------------- queries
    def keys(self) -> list[str]:
        return list(self.entries)

    def entry(self, key: str) -> Entry:
        try:
            return self.entries[key]
        except KeyError:
            raise FormatError(
                "no such item in the checkpoint",
                path=self.dir / METADATA_NAME,
                key=key,
                hint="`ckpt inspect --keys` lists every key",
            ) from None

    def tensor_entry(self, key: str) -> TensorEntry:
        """The entry of tensor `key` (a UsageError for a byte item)."""
        e = self.entry(key)
        if not isinstance(e, TensorEntry):
            raise UsageError("is a byte item, not a tensor", key=key)
        return e

    def tensor_entries(self) -> list[TensorEntry]:
        return [e for e in self.entries.values() if isinstance(e, TensorEntry)]

    def data_files(self) -> list[str]:
        return sorted({f for e in self.entries.values() for f in e.files})

    def file_size(self, rel: str, key: str = "") -> int:
        return self.files.size(rel, key)

    def hint_reads(self, ranges) -> None:
        """`ranges` ([(data file, offset, length)]) are about to be read, roughly in this order: a remote
        checkpoint (`io.remote`) fetches adjacent ones in one request; nothing for a local one."""
        self.files.hint(ranges)

    # ---------------------------------------------------------------- reading
    def read_item_bytes(self, rel: str, offset: int, length: int, key: str) -> bytes:
        """Raw bytes of one storage item (verbatim copies in surgery)."""
        return self.files.read(rel, offset, length, key)

    def read_item_checked(self, rel: str, offset: int, length: int, key: str) -> bytes:
        """Raw bytes of one storage item, every zip record checked against its CRC-32 (the bytes are in
        memory: no second read): what a verbatim copy (slim, rehydrate) writes. A ChecksumError names
        the file and key. An item that is not a zip archive at all (DCP writes a BytesIO state value as
        its raw bytes) has no CRC to check and is returned as it is."""
        raw = self.read_item_bytes(rel, offset, length, key)
        try:
            check_record_crcs(raw, path=self.dir / rel, key=key)
        except ItemError:
            pass
        except (ValueError, EOFError, struct.error, KeyError, IndexError) as exc:  # a zip that half-parses
            raise FormatError(
                f"storage item at byte {offset:,} is a damaged zip archive: {type(exc).__name__}: {exc}",
                path=self.dir / rel,
                key=key,
                hint=CRC_HINT,
            ) from None
        return raw

    def read_object(self, key: str):
        """A byte item (lr, scheduler field, progress...): plain values without torch, anything else with
        torch.load(weights_only=True)."""
        e = self.entry(key)
        if not isinstance(e, BytesEntry):
            raise UsageError("is a tensor, not a byte item", key=key)
        raw = self.read_item_bytes(e.file, e.offset, e.length, key)
        try:  # plain values (step, lr, scheduler fields) need no torch
            return load_plain_item(raw, path=self.dir / e.file, key=key)
        except ItemError:
            return load_byte_item(raw, trust=self.trust_pickle, path=self.dir / e.file, key=key)

    def decode_chunk(self, key: str, ch: Chunk):
        """The chunk's item decoded (`formats.dcp.item.decode_chunk`), errors naming its file and key:
        ItemError for a layout to read through torch.load instead; UnsafePickleError never falls back."""
        try:
            return decode_chunk(
                lambda off, n: self.read_item_bytes(ch.file, off, n, key), ch.offset, ch.length
            )
        except ChecksumError as exc:
            raise ChecksumError(
                f"chunk at {list(ch.offsets)}: {exc.message}", path=self.dir / ch.file, key=key, hint=exc.hint
            ) from None
        except UnsafePickleError as exc:
            raise UnsafePickleError(
                exc.message,
                path=self.dir / ch.file,
                key=key,
                hint="the item's data.pkl is not a plain tensor record; the checkpoint is damaged or crafted",
            ) from None

    def check_piece(
        self, rel: str, payload_offset: int, payload_size: int, crc: int, pos: int, data, key: str
    ) -> None:
        """Bytes [pos, pos + len(data)) of the payload record at `payload_offset` of data file `rel`
        (`payload_size` bytes, stored CRC `crc`), just read: once every piece of it is in, its CRC-32
        is compared (`core.crc.PieceChecker`); a mismatch is a ChecksumError naming the file and key."""
        if crc and not self.crc.feed((rel, payload_offset), payload_size, crc, pos, data):
            raise ChecksumError(
                f"the payload of the item at byte {payload_offset:,} fails its zip CRC-32 check "
                f"(stored {crc:#010x}): its bytes are damaged; nothing was written from them",
                path=self.dir / rel,
                key=key,
                hint=CRC_HINT,
            )

    def _tensor_entry_in_bounds(self, key: str) -> TensorEntry:
        """The tensor entry of `key`, every chunk of it checked to lie inside its file: before the
        destination is allocated, so a header's claim never sizes an allocation beyond the bytes on disk."""
        e = self.tensor_entry(key)
        for ch in e.chunks:
            if ch.numel:
                self.files.check_range(ch.file, ch.offset, ch.length, key)
        return e

    def read_tensor(self, key: str) -> torch.Tensor:

        import torch  # lazy: metadata commands (inspect, verify) import this module without torch (2-3 s)

        e = self._tensor_entry_in_bounds(key)
        dest = torch.empty(e.shape, dtype=torch_dtype(e.dtype))
        for ch in sorted(e.chunks, key=lambda c: (c.file, c.offset)):
            if ch.numel:  # FSDP ranks past the end of dim 0 hold empty chunks
                self._read_chunk_into(e, ch, dest)
        return dest

    def iter_tensors(self, keys: Iterable[str], *, threads: int = 1) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (key, full tensor) in the given order. With threads > 1, up to `threads` tensors
        are read ahead in parallel (memory: threads + 1 tensors)."""
        keys = list(keys)
        if threads <= 1:
            for k in keys:
                yield k, self.read_tensor(k)
            return
        pool = ThreadPoolExecutor(max_workers=threads)
        ok = False
        try:
            pending = []
            it = iter(keys)
            for k in it:
                pending.append((k, pool.submit(self.read_tensor, k)))
                if len(pending) >= threads:
                    break
            while pending:
                k, fut = pending.pop(0)
                nxt = next(it, None)
                if nxt is not None:
                    pending.append((nxt, pool.submit(self.read_tensor, nxt)))
                yield k, fut.result()
            ok = True
        finally:
            # on an error or a signal, do not wait for the reads in flight (each is bounded; they
            # end on their own): the command must stop now
            pool.shutdown(wait=ok, cancel_futures=True)

    def read_tensor_bytes(self, key: str) -> bytearray:
        """`read_tensor`'s row-major bytes, without torch: FSDP2 row-block chunks straight into their rows of
        a
        new buffer, each checked against its CRC-32 (the same reads as `read_tensor`'s); a chunk of any other
        layout makes it `read_tensor`'s (through torch)."""
        e = self._tensor_entry_in_bounds(key)
        dest = bytearray(e.nbytes)
        flat = memoryview(dest)
        for ch in sorted(e.chunks, key=lambda c: (c.file, c.offset)):
            if ch.numel and self._read_chunk_bytes(e, ch, flat) is not None:
                del flat
                from ..handle import tensor_bytes

                return bytearray(tensor_bytes(self.read_tensor(key).contiguous()))
        return dest

    def _read_chunk_into(self, e: TensorEntry, ch: Chunk, dest: torch.Tensor) -> None:

        import torch  # lazy: metadata commands (inspect, verify) import this module without torch (2-3 s)

        why = self._read_chunk_bytes(e, ch, dest.reshape(-1).view(torch.uint8).numpy().data)
        if why is not None:
            self._fallback_chunk(e, ch, dest, why)

    def _read_chunk_bytes(self, e: TensorEntry, ch: Chunk, flat: memoryview) -> str | None:
        """A row-block chunk's payload into its rows of `flat` (the tensor's bytes); else why it cannot be
        (the caller lets torch decode it)."""
        key = e.key
        try:
            dec = self.decode_chunk(key, ch)
        except ItemError as exc:
            return str(exc)
        if not (dec.payload_is(e.dtype, ch.sizes) and is_row_block(ch.offsets, ch.sizes, e.shape)):
            return "non row-block layout"
        row_bytes = (math.prod(e.shape[1:]) if e.shape else 1) * e.itemsize
        start = (ch.offsets[0] * row_bytes) if ch.offsets else 0
        target = flat[start : start + dec.payload_size]
        if dec.raw is not None:
            target[:] = dec.payload()  # (its CRC was checked by the decoder)
        else:
            self.files.read_into(ch.file, ch.offset + dec.payload_offset, memoryview(target), key)
            got = crc32(target)
            if dec.layout.data_crc and got != dec.layout.data_crc:
                raise ChecksumError(
                    f"chunk at {list(ch.offsets)}: "
                    + crc_error(f"{dec.layout.prefix}/data/0", dec.layout.data_crc, got).message,
                    path=self.dir / ch.file,
                    key=key,
                    hint=CRC_HINT,
                )
        return None

    def _fallback_chunk(self, e: TensorEntry, ch: Chunk, dest: torch.Tensor, why: str) -> None:
        """Any chunk layout torch.save can express: let torch decode it (weights_only)."""

        import torch  # lazy: metadata commands (inspect, verify) import this module without torch (2-3 s)

        raw = self.read_item_bytes(ch.file, ch.offset, ch.length, e.key)
        t = load_byte_item(raw, trust=self.trust_pickle, path=self.dir / ch.file, key=e.key)
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != ch.sizes or t.dtype != torch_dtype(e.dtype):
            got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
            raise FormatError(
                f"chunk at {list(ch.offsets)} holds {got}, metadata says {ch.sizes} torch.{e.dtype} ({why})",
                path=self.dir / ch.file,
                key=e.key,
            )
        region = dest[tuple(slice(o, o + s) for o, s in zip(ch.offsets, ch.sizes))] if ch.sizes else dest
        region.copy_(t)
