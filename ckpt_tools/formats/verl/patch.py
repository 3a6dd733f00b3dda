"""verl checkpoint surgery: a role dir equal to another but for a few scalars of its optimizer and scheduler
state (the lr, `ckpt set`'s values), each rank's optimizer and extra-state file rewritten with those bytes
changed where they lie and data.pkl's CRC-32 fixed in the zip, every other byte kept.

`plan_edits` turns {key: new value} into each file's (offset, old bytes, new bytes) edits
(`io.pickle_paths.encode_in_place`: a float's 8 bytes, an int in its opcode's room, a bool's opcode; a value
that does not fit is refused, naming the key), and checks the patched data.pkl decodes, through the
allow-list, to the new values. `write_patched` writes them: into a new OUT (`AtomicOutputDir`; every other
file of the dir hard-linked, each edited file cloned where the filesystem can, else copied, then edited), or
in place (`InPlaceDir`: the new role dir switched in atomically, the old one kept beside it as a backup of
hard links). Either way the result is read back (`state.VerlTrainState`) and must hold the new values at the
changed keys and the old ones everywhere else before it is committed.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...core.crc import crc32
from ...core.errors import FormatError, UsageError
from ...io.copy import copy_patched, link_input_tree
from ...io.inputs import OpenFiles, scan_tree
from ...io.pickle_paths import encode_in_place
from ...io.staging import AtomicOutputDir, InPlaceDir
from .archive import decode_data_pkl
from .state import StateFile, VerlTrainState, key_of, split_key

__all__ = ["FileEdits", "VerlPatchResult", "plan_edits", "write_patched"]


@dataclass(frozen=True)
class FileEdits:
    rel: str  # the rank file, relative to the role dir
    edits: tuple[tuple[int, bytes, bytes], ...]  # (offset in the file, old bytes, new bytes)


@dataclass
class VerlPatchResult:
    out: str
    in_place: bool
    changed_keys: int
    bytes_written: int  # the rewritten rank files
    linked: dict  # method -> files of the dir kept as they are (hardlink | reflink | copy)
    rewritten: dict  # method -> rank files rewritten with their edits (reflink | copy_file_range | ...)
    backup: str | None
    seconds: float
    files: list = field(default_factory=list)  # the rank files rewritten
    warnings: list = field(default_factory=list)
    format: str = "verl"
    patch_file: None = None  # a DCP patch's file: none here, the rank files themselves are rewritten

    def to_json(self) -> dict:
        return dict(self.__dict__)


def _leaves(path: tuple, value: Any):
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _leaves(path + (i,), v)
    else:
        yield path, value


def _file_edits(f: StateFile, changes: list[tuple[str, tuple, Any]]) -> FileEdits:
    pkl = bytearray(f.pkl_bytes)
    edits = []
    for _key, path, value in changes:
        for p, v in _leaves(path, value):
            s = f.scalar(p)
            if s is None:
                raise UsageError("names no scalar of the rank file", path=f.rel, key=key_of(f.kind, p))
            if s.pos in f.map.shared:
                raise FormatError(
                    "this value is shared with another field of the pickle: changing it would change both",
                    path=f.rel,
                    key=key_of(f.kind, p),
                )
            enc = encode_in_place(s, v)
            if enc is None:
                raise UsageError(
                    f"{v!r} does not fit where the old value {s.value!r} lies (a {s.op} opcode): the rank "
                    "files are changed in place, same length",
                    key=key_of(f.kind, p),
                    hint="a float takes any float; an int a value of its old width; a bool true or false",
                )
            at, raw = enc
            edits.append((f.pkl.offset + at, bytes(pkl[at : at + len(raw)]), raw))
            pkl[at : at + len(raw)] = raw
    _check_decoded(f, bytes(pkl), changes)
    if f.crc_at:
        old, new = struct.pack("<I", f.pkl.crc), struct.pack("<I", crc32(bytes(pkl)))
        edits.extend((at, old, new) for at in f.crc_at)
    return FileEdits(f.rel, tuple(sorted(edits)))


def _check_decoded(f: StateFile, pkl: bytes, changes: list[tuple[str, tuple, Any]]) -> None:
    """The patched data.pkl, through the allow-list, holds each new value (of its type) at its key."""
    obj = decode_data_pkl(pkl, f.rel)
    for key, path, value in changes:
        got = obj
        for p in path:
            got = got[p]
        if type(got) is not type(value) or got != value:
            raise FormatError(f"the patched pickle holds {got!r}, not {value!r}", path=f.rel, key=key)


def plan_edits(state: VerlTrainState, values: dict[str, Any]) -> list[FileEdits]:
    """Each rank file's edits that give every key of `values` its new value (the same on every rank)."""
    if not values:
        raise UsageError("nothing to change")
    by_kind: dict[str, list] = {}
    for key, value in sorted(values.items()):
        kind, path = split_key(key)
        state.value(key)  # a key of the state, the same on every rank
        by_kind.setdefault(kind, []).append((key, path, value))
    return [_file_edits(f, changes) for kind, changes in by_kind.items() for f in state.files[kind]]


def _check_written(actor: Path, state: VerlTrainState, values: dict[str, Any]) -> None:
    """The role dir written, read back: every settable scalar holds its new value, or its old one."""
    new = {}
    for key, value in values.items():
        kind, path = split_key(key)
        new.update({key_of(kind, p): v for p, v in _leaves(path, value)})
    files = OpenFiles(actor, what="verl rank file")
    try:
        back = VerlTrainState(files, state.world_size, str(actor))
        for key in state.keys():
            want = new.get(key, state.value(key))
            got = back.value(key)
            if type(got) is not type(want) or got != want:
                raise FormatError(f"reads back as {got!r}, not {want!r}", path=actor, key=key)
    finally:
        files.close()


def _fill(tmp: Path, unit: Path, actor: Path, edits: list[FileEdits]) -> tuple[dict, dict, int]:
    """`tmp` := the dir `unit` (the role dir, or the global_step dir holding it) with the edited files."""
    edited = {actor / e.rel: e for e in edits}
    linked = link_input_tree(unit, tmp, root=unit, skip=frozenset(edited))
    rewritten: dict[str, int] = {}
    nbytes = 0
    for src, e in edited.items():
        dst = tmp / src.relative_to(unit)
        m = copy_patched(src, dst, root=unit, edits=list(e.edits), what="verl rank file")
        rewritten[m] = rewritten.get(m, 0) + 1
        nbytes += dst.stat().st_size
    return linked, rewritten, nbytes


def write_patched(
    state: VerlTrainState,
    actor: Path,
    values: dict[str, Any],
    edits: list[FileEdits],
    *,
    out: Path | None,
    unit: Path,
    overwrite: bool = False,
) -> VerlPatchResult:
    """Write the edited role dir: into the new dir `out` (a copy of `unit`: the role dir itself, or the
    global_step dir holding it), or with `out=None` in place of `actor` (its old tree kept as
    `actor.bak-<UTC time>`)."""
    t0 = time.perf_counter()
    need = sum(s for e in edits for _p, s in scan_tree(actor / e.rel, root=actor)) + (1 << 20)
    backup = None
    if out is None:
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
        with InPlaceDir(actor, backup=f"{actor.name}.bak-{stamp}", need_bytes=need) as tmp:
            linked, rewritten, nbytes = _fill(tmp, actor, actor, edits)
            _check_written(tmp, state, values)
        backup, where = str(actor.parent / f"{actor.name}.bak-{stamp}"), actor
    else:
        with AtomicOutputDir(out, inputs=[unit], need_bytes=need, overwrite=overwrite) as tmp:
            linked, rewritten, nbytes = _fill(tmp, unit, actor, edits)
            _check_written(tmp / actor.relative_to(unit), state, values)
        where = out
    return VerlPatchResult(
        out=str(where),
        in_place=out is None,
        changed_keys=len(values),
        bytes_written=nbytes,
        linked=linked,
        rewritten=rewritten,
        backup=backup,
        seconds=round(time.perf_counter() - t0, 4),
        files=sorted(e.rel for e in edits),
    )
