"""An open verl FSDP checkpoint (`VerlCheckpoint`, the format's one handle): every rank's model file decoded
as data (`archive.open_archive`), its tensors assembled from the ranks' DTensor shards by their placements.

verl saves `model.state_dict()` per rank (FSDP2, or FSDP1 with a device mesh: DTensors; verl 0.9.1 passes its
mesh to both). A DTensor on verl's 1-D mesh `("fsdp",)` with `Shard(d)` holds rank r's `torch.chunk` piece of
dim d: rows [r * ceil(n / W), ...) clipped to n (the rule `torch.distributed.tensor.placement_types.Shard`
splits by, and verl's `model_merger` concatenates by); `Replicate` is the whole tensor on every rank (rank 0's
is read); a plain tensor is replicated. On HSDP's `("ddp", "fsdp")` mesh, `(Replicate(), Shard(0))`: the
ddp-0 ranks' pieces, each placed by its coordinates on the mesh (checked against its rank: `_mesh`). Opening
reads each rank file's zip directory and data.pkl only, and refuses, naming the key, what it cannot place
exactly: ranks that disagree on keys, shapes or dtypes, pieces that do not tile the tensor, a mesh that is not
row-major over the ranks or a file whose coordinates are not its rank's, `Partial` or any other placement.
Nothing returns "the whole state dict": the views (`views`) read one tensor, or a row range, at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...core.crc import PieceChecker
from ...core.dtypes import ITEMSIZE
from ...core.errors import ChecksumError, FormatError
from ...io.inputs import OpenFiles, as_input, read_json, register
from ..dcp.item import CRC_HINT
from .archive import Archive, DTensorRef, Record, TensorRef, open_archive, storage_bytes_ok
from .keys import VerlKey, require_known
from .layout import FSDP_CONFIG, HF_DIR, LORA_META, rank_file, resolve_actor_dir

__all__ = ["Piece", "VerlCheckpoint", "VerlEntry", "chunk_span"]


@dataclass(frozen=True)
class Piece:
    """One rank's part of a tensor: region [offsets, offsets + sizes) of the global tensor, stored row-major
    at
    element `local.offset` of storage record `record` of `file`."""

    file: str
    record: Record
    local: TensorRef
    offsets: tuple[int, ...]

    @property
    def sizes(self) -> tuple[int, ...]:
        return self.local.size


@dataclass(frozen=True)
class VerlEntry:
    key: str
    dtype: str
    shape: tuple[int, ...]
    pieces: tuple[Piece, ...]
    placement: str  # "shard(0)", "replicate", "plain"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]

    @property
    def stored_bytes(self) -> int:
        """The bytes its pieces take in the rank files (each rank's shard; a replica once)."""
        return sum(math.prod(p.sizes) * ITEMSIZE[self.dtype] for p in self.pieces)

    @property
    def path(self) -> tuple[str, ...]:
        """Its path in the saved object (what the DCP entries' planner paths are): the model file's one
        level."""
        return ("model", self.key)


def chunk_span(n: int, world: int, rank: int) -> tuple[int, int]:
    """(offset, length) of rank `rank`'s `Shard` piece of a dim of size `n` over `world` ranks
    (torch.chunk)."""
    chunk = -(-n // world) if world else n
    start = min(rank * chunk, n)
    return start, max(0, min(n, start + chunk) - start)


def _piece(arch: Archive, key: str, local: TensorRef, offsets: tuple[int, ...]) -> Piece:
    rec = arch.storage(local.storage, key)
    if not local.contiguous or not storage_bytes_ok(local, rec):
        raise FormatError(
            f"the local tensor {list(local.size)} (offset {local.offset}, stride {list(local.stride)}) does "
            "not lie "
            f"whole and row-major in its {rec.size:,}-byte storage record",
            path=arch.file,
            key=key,
            hint="the file is damaged or was not written by verl's FSDPCheckpointManager",
        )
    return Piece(arch.file, rec, local, offsets)


def _mesh(
    arch: Archive, key: str, v: DTensorRef, world: int, rank: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the sizes of `v`'s mesh, this rank's coordinates on it). verl's 1-D `("fsdp",)` mesh is the `world`
    ranks in order; a mesh of more dims (HSDP: `("ddp", "fsdp")`, `create_device_mesh` with `fsdp_size` < W)
    is read where it is `init_device_mesh`'s row-major layout of the `world` ranks, as its pickled `_layout`
    must say, and the file's own `_coordinate_on_dim` must be the rank's place in it."""
    if len(v.placements) == 1 and len(v.mesh_dims) <= 1:
        return (world,), (rank,)
    sizes = v.mesh_shape
    row_major = tuple(math.prod(sizes[i + 1 :]) for i in range(len(sizes)))
    if (
        not sizes
        or len(v.placements) != len(sizes)
        or math.prod(sizes) != world
        or v.mesh_strides != row_major
    ):
        raise FormatError(
            f"a DTensor on mesh {list(v.mesh_dims)} (sizes {list(sizes)}, strides {list(v.mesh_strides)}) "
            f"with placements {[p.kind for p in v.placements]}: only a row-major mesh of the {world} ranks "
            "is read",
            path=arch.file,
            key=key,
            hint="the file is damaged, or its mesh is one verl does not build",
        )
    coords = tuple((rank // st) % n for st, n in zip(row_major, sizes))
    if v.mesh_coords != coords:
        raise FormatError(
            f"the file's mesh coordinates are {v.mesh_coords}; rank {rank} of mesh {list(sizes)} is at "
            f"{list(coords)}",
            path=arch.file,
            key=key,
            hint="the rank files are misnamed or damaged",
        )
    return sizes, coords


def _dtensor_piece(arch: Archive, key: str, v: DTensorRef, world: int, rank: int) -> tuple[Piece | None, str]:
    """This rank's piece of DTensor `v` (None for a replica: coordinate > 0 on a `Replicate` mesh dim; or for
    an empty shard) and the placements' names. Each `Shard(d)` mesh dim splits tensor dim d by `torch.chunk`'s
    rule at the rank's coordinate (`compute_local_shape_and_global_offset`); one per tensor dim."""
    sizes, coords = _mesh(arch, key, v, world, rank)
    offsets, want, names, replica = [0] * len(v.shape), list(v.shape), [], False
    for p, n, c in zip(v.placements, sizes, coords):
        if p.kind == "replicate":
            replica = replica or c > 0
            names.append("replicate")
            continue
        if p.kind != "shard" or p.dim is None or not 0 <= p.dim < len(v.shape) or f"shard({p.dim})" in names:
            raise FormatError(
                f"placement {p.kind}{'' if p.dim is None else f'({p.dim})'} is not read",
                path=arch.file,
                key=key,
            )
        start, want[p.dim] = chunk_span(want[p.dim], n, c)
        offsets[p.dim] += start
        names.append(f"shard({p.dim})")
    if v.local.size != tuple(want) or v.local.dtype != v.dtype:
        raise FormatError(
            f"rank {rank}'s shard is {list(v.local.size)} {v.local.dtype}; {', '.join(names)} of "
            f"{list(v.shape)} on mesh {list(sizes)} at {list(coords)} is {want} {v.dtype}",
            path=arch.file,
            key=key,
        )
    piece = None if replica or not math.prod(want) else _piece(arch, key, v.local, tuple(offsets))
    return piece, ",".join(names)


def _entry(key: str, values: list[tuple[Archive, Any]], world: int) -> VerlEntry:
    pieces: list[Piece] = []
    first = values[0][1]
    for rank, (arch, v) in enumerate(values):
        if isinstance(v, DTensorRef):
            if not isinstance(first, DTensorRef) or (v.shape, v.dtype) != (first.shape, first.dtype):
                raise FormatError(f"rank {rank} disagrees with rank 0 on the tensor", path=arch.file, key=key)
            piece, placement = _dtensor_piece(arch, key, v, world, rank)
        elif isinstance(v, TensorRef) and isinstance(first, TensorRef) and v.size == first.size:
            piece, placement = (_piece(arch, key, v, (0,) * len(v.size)) if rank == 0 else None), "plain"
        else:
            raise FormatError(
                f"rank {rank} holds {type(v).__name__} here: a verl model file holds tensors only",
                path=arch.file,
                key=key,
            )
        if piece is not None:
            pieces.append(piece)
    shape, dtype = (first.shape, first.dtype) if isinstance(first, DTensorRef) else (first.size, first.dtype)
    covered = sum(math.prod(p.sizes) for p in pieces)
    if covered != math.prod(shape):
        raise FormatError(
            f"the ranks' pieces hold {covered:,} of the tensor's {math.prod(shape):,} elements",
            path=values[0][0].file,
            key=key,
        )
    return VerlEntry(key, dtype, tuple(shape), tuple(pieces), placement)


def _world_size(actor: Path) -> tuple[int, int | None]:
    """(world size, FSDP version) from fsdp_config.json, or from the rank files' names when it is absent."""
    cfg = actor / FSDP_CONFIG
    if cfg.is_file():
        data = read_json(cfg, root=actor, what="verl fsdp_config.json")
        world = data.get("world_size") if isinstance(data, dict) else None
        if type(world) is not int or world < 1:
            raise FormatError("world_size is not a positive integer", path=cfg)
        version = data.get("FSDP_version")
        return world, version if type(version) is int else None
    worlds = {int(c.name.split("_")[3]) for c in actor.glob("model_world_size_*_rank_*.pt")}
    if len(worlds) != 1:
        raise FormatError(
            f"no {FSDP_CONFIG}, and the rank files name {len(worlds)} world sizes",
            path=actor,
            hint="copy the whole dir",
        )
    return worlds.pop(), None


class VerlCheckpoint:
    """An open verl role dir (`global_step_N/actor`): metadata in memory, rank files read by range."""

    kind = "verl"

    def __init__(self, actor_dir: Path):
        self.dir = as_input(actor_dir)
        self.files = OpenFiles(
            self.dir,
            what="verl rank file",
            missing_hint="copy the whole global_step_N/actor dir: every rank's file",
        )
        self.world_size, self.fsdp_version = _world_size(self.dir)
        self.crc = PieceChecker()
        self.archives = [
            open_archive(self.files, rank_file("model", self.world_size, r)) for r in range(self.world_size)
        ]
        self.entries = self._assemble()
        self.infos: dict[str, VerlKey] = {
            i.key: i for i in require_known(self.entries, self.dir / self.archives[0].file)
        }

    @classmethod
    def open(cls, path: str | Path, *, trust_pickle: bool = False) -> VerlCheckpoint:
        """`trust_pickle` is accepted for the one signature and ignored: nothing in these files is worth
        running."""
        actor = resolve_actor_dir(path)
        register(actor)  # the whole checkpoint is an input: no OUT inside it
        return cls(actor)

    def _assemble(self) -> dict[str, VerlEntry]:
        objs = [a.obj for a in self.archives]
        for a, o in zip(self.archives, objs):
            if not isinstance(o, dict):
                raise FormatError(f"holds a {type(o).__name__}, not a state dict", path=self.dir / a.file)
        keys = list(objs[0])
        for a, o in zip(self.archives[1:], objs[1:]):
            diff = sorted(set(o) ^ set(keys))
            if diff:
                raise FormatError(
                    "the ranks' model files hold different keys", path=self.dir / a.file, key=diff[0]
                )
        return {k: _entry(k, [(a, o[k]) for a, o in zip(self.archives, objs)], self.world_size) for k in keys}

    # ---------------------------------------------------------------- facts
    @property
    def stats(self):
        return self.files.stats

    @property
    def hf_config_dir(self) -> Path | None:
        """`huggingface/` with the model's config.json, as the manager wrote it on rank 0."""
        d = self.dir / HF_DIR
        return d if (d / "config.json").is_file() else None

    def lora_meta(self) -> dict | None:
        """lora_train_meta.json (verl >= 0.8: r, lora_alpha, task_type), None where the run wrote none."""
        p = self.dir / LORA_META
        if not p.is_file():
            return None
        data = read_json(p, root=self.dir, what="verl lora_train_meta.json")
        if not isinstance(data, dict):
            raise FormatError("not a JSON object", path=p)
        return data

    @property
    def has_lora(self) -> bool:
        return any(i.group == "lora" for i in self.infos.values())

    def entry(self, key: str) -> VerlEntry:
        try:
            return self.entries[key]
        except KeyError:
            raise FormatError("no such key in the checkpoint", path=self.dir, key=key) from None

    # ---------------------------------------------------------------- bytes
    def read_piece(self, piece: Piece, start: int, out, key: str) -> None:
        """Bytes [start, start + len(out)) of the piece's row-major contents into `out`, CRC checked as it
        comes."""
        item = ITEMSIZE[piece.local.dtype]
        at = piece.record.offset + piece.local.offset * item + start
        self.files.read_into(piece.file, at, out, key)
        pos = piece.local.offset * item + start
        if piece.record.crc and not self.crc.feed(
            (piece.file, piece.record.offset), piece.record.size, piece.record.crc, pos, out
        ):
            raise ChecksumError(
                f"storage record {piece.record.name} fails its zip CRC-32 check: its bytes are damaged; "
                "nothing "
                "was written from them",
                path=self.dir / piece.file,
                key=key,
                hint=CRC_HINT,
            )

    def close(self) -> None:
        self.files.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- views
    def base_weights(self, label: str | None = None, *, owned: bool = False, **_kw):
        """The model's weights under their HF names (LoRA factors aside): a `Source` of fp32 masters."""
        from .views import VerlBaseSource

        return VerlBaseSource(self, label, owned=owned)

    def by_key(self):
        from .views import VerlKeySource

        return VerlKeySource(self)

    def lora(self, *, alpha: float | None = None, run_config: Path | None = None, slot: int = 0):
        from .lora import VerlLoraSource

        return VerlLoraSource(self, alpha=alpha, slot=slot)
