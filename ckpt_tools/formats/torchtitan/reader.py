"""An open torchtitan checkpoint (`TorchtitanCheckpoint`, the format's one handle): a DCP checkpoint
(`formats.dcp.reader.DcpCheckpoint`: the same reads, checks and remote support) whose keys follow torchtitan's
key model (`keys`), and its model weights under their HF names (`TitanBaseSource`).

An HF name's bytes are the torchtitan tensor's, except llama3's wq / wk: HF row `h*hd + j*hd/2 + i` is
torchtitan row `h*hd + 2*i + j` (`Llama3StateDictAdapter._permute`: `w.view(n, hd/2, 2, dim).transpose(1, 2)`,
n the query or KV heads). Each row is still one contiguous range of the stored bytes, so the permuted tensor
is served by per-row extents (no copy, every byte CRC-checked); the head counts come from the HF config
(`num_attention_heads`, `num_key_value_heads`), which the checkpoint does not hold.
"""

from __future__ import annotations

import math
from pathlib import Path

from ...core.errors import FormatError, UsageError
from ..dcp.model import TensorEntry
from ..dcp.reader import DcpCheckpoint
from ..dcp.views import row_block_extents
from ..handle import Extent, Source, TensorFacts
from .keys import TitanKey, classify, family_of, require_known
from .layout import resolve_step_dir

__all__ = ["TitanBaseSource", "TorchtitanCheckpoint", "hf_row_source"]


def hf_row_source(row: int, rows: int, heads: int) -> int:
    """The torchtitan row that HF row `row` of a permuted [rows, dim] weight over `heads` heads comes from."""
    hd = rows // heads
    h, w = divmod(row, hd)
    j, i = divmod(w, hd // 2)
    return h * hd + 2 * i + j


def _slice(extents: list[Extent], start: int, nbytes: int, at: int) -> list[Extent]:
    """The extents of bytes [start, start + nbytes) of a tensor, placed at byte `at` of another."""
    out = []
    for x in extents:
        lo, hi = max(start, x.start), min(start + nbytes, x.start + x.nbytes)
        if lo < hi:
            shift = lo - x.start
            out.append(
                Extent(at + lo - start, hi - lo, x.file, x.offset + shift, x.record, x.record_pos + shift)
            )
    return out


class TorchtitanCheckpoint:
    """A torchtitan `step-N` dir: its DCP metadata, keys classified (an unknown one is an error naming it)."""

    kind = "torchtitan"

    def __init__(self, dcp: DcpCheckpoint):
        self.dcp = dcp
        self.dir = dcp.dir
        self.entries = dcp.entries
        self.files = dcp.files
        self.infos: dict[str, TitanKey] = {k: classify(k, e.path) for k, e in dcp.entries.items()}
        require_known(self.infos.values(), dcp.dir / ".metadata")
        self.family, self.permuted = family_of(self.infos.values())

    @classmethod
    def open(cls, path: str | Path, *, trust_pickle: bool = False) -> TorchtitanCheckpoint:
        dcp = DcpCheckpoint.open(resolve_step_dir(path), trust_pickle=trust_pickle, known_keys_only=False)
        try:
            return cls(dcp)
        except BaseException:
            dcp.close()
            raise

    has_lora = False

    @property
    def stats(self):
        return self.dcp.stats

    def read_object(self, key: str):
        return self.dcp.read_object(key)

    def close(self) -> None:
        self.dcp.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def base_weights(
        self, label: str | None = None, *, owned: bool = False, config: dict | None = None, **_kw
    ):
        return TitanBaseSource(self, label, owned=owned, config=config)

    def lora(self, **_kw):
        raise FormatError(
            "a torchtitan checkpoint holds no LoRA this tool reads",
            path=self.dir,
            hint="`ckpt export` writes its weights",
        )


class TitanBaseSource(Source):
    """The model weights under their HF names (fp32 masters: torchtitan trains in fp32 under FSDP's mixed
    precision)."""

    kind = "dcp"
    masters = True

    def __init__(self, ckpt: TorchtitanCheckpoint, label: str | None, *, owned: bool, config: dict | None):
        super().__init__()
        self.ckpt, self.path, self._owns, self.config = ckpt, ckpt.dir, owned, config
        self.label = str(ckpt.dir) if label is None else label
        self._keys: dict[str, TitanKey] = {}
        for key, info in ckpt.infos.items():
            e = ckpt.entries[key]
            if info.group == "model" and info.hf_name is not None and isinstance(e, TensorEntry):
                self._keys[info.hf_name] = info
                self._facts[info.hf_name] = TensorFacts(info.hf_name, e.dtype, tuple(e.shape))

    def ref(self, name: str) -> str:
        self.facts(name)
        return self._keys[name].key

    def _heads(self, info: TitanKey) -> int:
        cfg = self.config or {}
        n = cfg.get("num_attention_heads") if info.permute == "q" else cfg.get("num_key_value_heads")
        if info.permute == "kv" and n is None:
            n = cfg.get("num_attention_heads")
        if type(n) is not int or n < 1:
            raise UsageError(
                f"{info.key}: torchtitan's llama3 rows are permuted into HF's by head, and the "
                "checkpoint holds no head count",
                path=self.path,
                hint="pass --config-from the HF model dir of this model (its config.json: "
                "num_attention_heads, num_key_value_heads)",
            )
        return n

    def _extents(self, name: str) -> list[Extent] | None:
        info = self._keys[name]
        whole = row_block_extents(self.ckpt.dcp, info.key)
        if whole is None or info.permute is None or not self.ckpt.permuted:
            return whole
        f = self._facts[name]
        rows, heads = f.shape[0], self._heads(info)
        if rows % heads or (rows // heads) % 2:
            raise FormatError(
                f"{rows} rows do not split into {heads} heads of an even size", path=self.path, key=info.key
            )
        row = f.row_bytes
        out: list[Extent] = []
        for r in range(rows):
            out += _slice(whole, hf_row_source(r, rows, heads) * row, row, r * row)
        return out

    def _read_whole(self, name: str):
        info = self._keys[name]
        t = self.ckpt.dcp.read_tensor(info.key)
        if info.permute is None or not self.ckpt.permuted:
            return t
        import torch  # lazy

        rows, heads = t.shape[0], self._heads(info)
        return t[torch.tensor([hf_row_source(r, rows, heads) for r in range(rows)])].contiguous()

    def _pread(self, file: str, offset: int, buf: memoryview, name: str) -> None:
        self.ckpt.files.read_into(file, offset, buf, self.ref(name) if name in self._keys else name)

    def _check_piece(self, e: Extent, pos: int, data, name: str) -> None:
        assert e.record is not None
        at, size, crc = e.record
        self.ckpt.dcp.check_piece(e.file, at, size, crc, e.record_pos + pos, data, self.ref(name))

    def close(self) -> None:
        super().close()
        if self._owns:
            self.ckpt.close()


def model_bytes(ckpt: TorchtitanCheckpoint) -> int:
    return sum(
        math.prod(e.shape) * e.itemsize
        for k, e in ckpt.entries.items()
        if ckpt.infos[k].group == "model" and isinstance(e, TensorEntry)
    )
