"""A verl checkpoint's training state beside its weights, read as data: every rank's optimizer file
(`optim_world_size_W_rank_R.pt`: torch's `optimizer.state_dict()`, the per-parameter moments as tensors and
`param_groups` with `lr`, `initial_lr`, ...) and extra-state file (`extra_state_...`: `{"lr_scheduler":
scheduler.state_dict(), "rng": ...}`), written by `FSDPCheckpointManager.save_checkpoint` and loaded back by
its `load_checkpoint` (`optimizer.load_state_dict`, `lr_scheduler.load_state_dict`), verl 0.9.1.

Each file's data.pkl is decoded through the allow-list (`archive.open_archive`: nothing runs) and mapped
opcode by opcode (`io.pickle_paths.scalar_map`), so every scalar of `param_groups` and `lr_scheduler` has a
key (`optim.param_groups.0.lr`, `extra_state.lr_scheduler.base_lrs`), a value (the same in both decodings,
checked) and a place: the byte range of its argument in the rank file. The zip stores data.pkl's CRC-32 in
its central directory and in a data descriptor after the payload (torch.save's writer; the local header's is
0): `crc_fields` finds each and checks it holds the CRC of the bytes read. A change is then a few bytes
written where they lie and the CRC-32 fixed in those places, every other byte kept (`formats.verl.patch`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

from ...core.crc import crc32
from ...core.errors import FormatError, UsageError
from ...io.inputs import OpenFiles
from ...io.pickle_paths import PickleMap, Scalar, scalar_map
from ..dcp.item import ItemError, central_directory
from ..dcp.lr_schedule import SchedState
from .archive import Record, open_archive
from .layout import rank_file

__all__ = ["KINDS", "SETTABLE", "StateFile", "VerlTrainState", "key_of", "split_key"]

KINDS = ("optim", "extra_state")
# The subtrees `ckpt set` may change: the optimizer's param groups and the scheduler's state. Not the
# per-parameter state (tensors) nor the RNG states.
SETTABLE = {"optim": "param_groups", "extra_state": "lr_scheduler"}
_HINT = "the file is damaged or was not written by verl's FSDPCheckpointManager (torch.save)"


def key_of(kind: str, path: tuple) -> str:
    return ".".join([kind, *(str(p) for p in path)])


def split_key(key: str) -> tuple[str, tuple]:
    """(file kind, path in its object) of a key; list indices as ints."""
    kind, _, rest = key.partition(".")
    parts = tuple(int(p) if p.isdigit() else p for p in rest.split(".")) if rest else ()
    return kind, parts


@dataclass(frozen=True)
class StateFile:
    """One rank's optimizer or extra-state file: its object (stand-ins), data.pkl and its map, and the file
    offsets that hold data.pkl's CRC-32."""

    rel: str
    kind: str
    rank: int
    obj: Any
    pkl: Record
    pkl_bytes: bytes
    map: PickleMap
    crc_at: tuple[int, ...]

    def scalar(self, path: tuple) -> Scalar | None:
        return self.map.scalars.get(path)


def _local_header(files: OpenFiles, rel: str, e, pkl: Record) -> tuple[int, int]:
    """(flags, stored CRC) of data.pkl's local header, after checking it leads to the payload read."""
    hdr = files.read(rel, e.header_offset, 30, rel) if e.header_offset >= 0 else b""
    if len(hdr) != 30 or hdr[:4] != b"PK\x03\x04":
        raise FormatError(f"no local header for {pkl.name} where the directory says", path=rel, hint=_HINT)
    flags, crc = struct.unpack_from("<H", hdr, 6)[0], struct.unpack_from("<I", hdr, 14)[0]
    nlen, xlen = struct.unpack_from("<HH", hdr, 26)
    if e.header_offset + 30 + nlen + xlen != pkl.offset:
        raise FormatError(f"{pkl.name}'s local header does not lead to its payload", path=rel, hint=_HINT)
    return flags, crc


def crc_fields(files: OpenFiles, rel: str, pkl: Record) -> tuple[int, ...]:
    """Every offset of file `rel` that holds data.pkl's CRC-32 (its central directory entry, the data
    descriptor after the payload, the local header where it is not 0), each checked to hold `pkl.crc`.
    Empty where the CRC was not computed (0: torch.serialization.set_crc32_options(False))."""
    if pkl.crc == 0:
        return ()
    try:
        entries = central_directory(lambda off, n: files.read(rel, off, n, rel), files.size(rel))
    except ItemError as exc:
        raise FormatError(f"zip directory: {exc}", path=rel, hint=_HINT) from None
    e = next((e for e in entries if e.name == pkl.name.encode()), None)
    if e is None or e.crc != pkl.crc:
        raise FormatError(f"the zip directory's entry for {pkl.name} disagrees", path=rel, hint=_HINT)
    at = [e.at + 16]
    flags, local_crc = _local_header(files, rel, e, pkl)
    if local_crc:
        if local_crc != pkl.crc:
            raise FormatError(f"{pkl.name}'s local header holds another CRC-32", path=rel, hint=_HINT)
        at.append(e.header_offset + 14)
    if flags & 8:  # a data descriptor follows the payload: [signature] crc csize usize
        desc = files.read(rel, pkl.offset + pkl.size, 8, rel)
        pos = pkl.offset + pkl.size + (4 if desc[:4] == b"PK\x07\x08" else 0)
        if files.read(rel, pos, 4, rel) != struct.pack("<I", pkl.crc):
            raise FormatError(f"{pkl.name}'s data descriptor holds another CRC-32", path=rel, hint=_HINT)
        at.append(pos)
    elif not local_crc:
        raise FormatError(f"{pkl.name}'s CRC-32 is in no header", path=rel, hint=_HINT)
    return tuple(sorted(at))


def _value_at(obj: Any, path: tuple) -> Any:
    for p in path:
        obj = obj[p]
    return obj


def open_state_file(files: OpenFiles, rel: str, kind: str, rank: int) -> StateFile:
    """One rank's optimizer or extra-state file, decoded and mapped; the map checked against the decoding
    at every settable scalar (the two readings must agree before a byte is written by it)."""
    arch = open_archive(files, rel)
    raw = files.read(rel, arch.pkl.offset, arch.pkl.size, rel)
    if arch.pkl.crc and crc32(raw) != arch.pkl.crc:  # open_archive checked it: the file changed since
        raise FormatError(
            "data.pkl changed while it was read", path=rel, hint="retry once the writer is done"
        )
    m = scalar_map(raw)
    for path, s in m.scalars.items():
        if path[:1] != (SETTABLE[kind],):
            continue
        try:
            got = _value_at(arch.obj, path)
        except (KeyError, IndexError, TypeError):
            got = None
        if type(got) is not type(s.value) or got != s.value:
            raise FormatError(
                f"the pickle's opcodes put {s.value!r} at {key_of(kind, path)}, its decoding {got!r}",
                path=rel,
                hint=_HINT,
            )
    return StateFile(rel, kind, rank, arch.obj, arch.pkl, raw, m, crc_fields(files, rel, arch.pkl))


class VerlTrainState:
    """The optimizer and extra-state files of every rank of one verl role dir (those that exist)."""

    def __init__(self, files: OpenFiles, world_size: int, source: str):
        self.source = source
        self.world_size = world_size
        self.files: dict[str, list[StateFile]] = {}
        for kind in KINDS:
            rels = [rank_file(kind, world_size, r) for r in range(world_size)]
            present = [(files.root / rel).is_file() for rel in rels]
            if any(present) and not all(present):
                missing = rels[present.index(False)]
                raise FormatError(
                    f"{missing} is missing while other ranks have theirs",
                    path=files.root / missing,
                    hint="copy the whole global_step_N/actor dir: every rank's file",
                )
            if all(present):
                self.files[kind] = [open_state_file(files, rel, kind, r) for r, rel in enumerate(rels)]

    def object(self, kind: str, rank: int = 0) -> Any:
        return self.files[kind][rank].obj if kind in self.files else None

    def keys(self) -> list[str]:
        """Every settable scalar's key (rank 0's)."""
        return [
            key_of(kind, p)
            for kind, fs in self.files.items()
            for p in fs[0].map.scalars
            if p[:1] == (SETTABLE[kind],)
        ]

    def value(self, key: str) -> Any:
        """The value at `key`, the same on every rank (else a FormatError naming the rank file that differs):
        a scalar, or a list/tuple of them."""
        kind, path = split_key(key)
        fs = self.files.get(kind)
        if not fs or path[:1] != (SETTABLE.get(kind),):
            raise UsageError(f"not a key of {self.source}'s optimizer or scheduler state", key=key)
        try:
            v0 = _value_at(fs[0].obj, path)
        except (KeyError, IndexError, TypeError):
            raise UsageError(
                "no such key in the checkpoint's optimizer or scheduler state", key=key
            ) from None
        for f in fs[1:]:
            try:
                v = _value_at(f.obj, path)
            except (KeyError, IndexError, TypeError):
                v = "<absent>"
            if type(v) is not type(v0) or v != v0:
                raise FormatError(
                    f"rank {f.rank} holds {v!r} where rank 0 holds {v0!r}: the ranks disagree, and a change "
                    "would have to pick one",
                    path=f.rel,
                    key=key,
                    hint="the ranks of one verl checkpoint hold the same optimizer and scheduler settings; "
                    "this one was edited or mixed from two runs",
                )
        return v0

    def sched_state(self) -> SchedState:
        """The param groups' and the scheduler's fields (rank 0's, the ranks checked to agree on every lr
        field), keyed as `sources.lr_plan` plans them."""
        optim = self.object("optim")
        groups = optim.get("param_groups") if isinstance(optim, dict) else None
        if not isinstance(groups, list) or not groups:
            raise FormatError(
                "has no optimizer param_groups",
                path=self.source,
                hint="set-lr needs the optimizer files (checkpoint.save_contents with 'optimizer')",
            )
        keys: dict[tuple, str] = {}
        pgs: dict[int, dict] = {}
        for i, g in enumerate(groups):
            fields = [f for f in (g if isinstance(g, dict) else {}) if isinstance(f, str) and f != "params"]
            pgs[i] = {f: self.value(key_of("optim", ("param_groups", i, f))) for f in fields}
            keys.update({("pg", i, f): key_of("optim", ("param_groups", i, f)) for f in fields})
        top, subs = self._scheduler(keys)
        return SchedState(pgs, top, subs, keys)

    def _scheduler(self, keys: dict) -> tuple[dict, dict]:
        extra = self.object("extra_state")
        sched = extra.get("lr_scheduler") if isinstance(extra, dict) else None
        if not isinstance(sched, dict):
            return {}, {}
        top = {}
        for f in sched:
            if isinstance(f, str) and f != "_schedulers":
                top[f] = self.value(key_of("extra_state", ("lr_scheduler", f)))
                keys[("top", None, f)] = key_of("extra_state", ("lr_scheduler", f))
        subs: dict[int, dict] = {}
        for j, sub in enumerate(sched.get("_schedulers") or []):
            path = ("lr_scheduler", "_schedulers", j)
            for f in sub if isinstance(sub, dict) else {}:
                subs.setdefault(j, {})[f] = self.value(key_of("extra_state", path + (f,)))
                keys[("sub", j, f)] = key_of("extra_state", path + (f,))
        return top, subs
