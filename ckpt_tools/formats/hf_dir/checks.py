"""The invariants of a sharded HF model dir, checked once: `check_index(dir, index_path)` reads the index
and every shard's header (never a tensor byte) and returns each broken rule as a `core.problems.Finding`.
`ckpt verify` lists them all (`ops.verify.hf`); `HFModelDir.open` raises the first fatal one
(`IndexCheck.fatal`), the one-line refusal it always gave.

The rules, in the order an open refuses them:
  1. the index is JSON with a non-empty `weight_map` object (and a `metadata` object, when present);
  2. every `weight_map` value is a plain file name inside the dir (checked before any file is touched);
  3. every listed shard exists, and its header reads;
  4. the index and the headers agree both ways: each key in the file the index names, each tensor listed
     under its own file, no tensor in two shards.
Listed only (warnings): a `.safetensors` the index does not reference, a `metadata.total_size` other than
the headers' bytes.

The two readers phrase a broken rule differently: verify lists each key or file (`Finding.message`), an
open lists a rule's findings on one line (`Finding.error`, on the first fatal finding): both are written
here, where the rule is checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ...core.errors import CkptError, FormatError, MissingFileError
from ...core.problems import WARNING, Finding
from ...io.inputs import MAX_TABLE_VALUES, is_plain_file_name, lexists, read_json
from ..safetensors.header import SafetensorsHeader, TensorInfo, read_header

__all__ = ["IndexCheck", "check_index", "header_finding"]

_MAX_LISTED = 20


def _listing(problems: Sequence[str]) -> str:
    shown = "; ".join(problems[:_MAX_LISTED])
    if len(problems) > _MAX_LISTED:
        shown += f"; and {len(problems) - _MAX_LISTED} more"
    return shown


@dataclass
class IndexCheck:
    findings: list[Finding] = field(default_factory=list)  # every broken rule, as verify lists them
    refusals: list[Finding] = field(default_factory=list)  # the rules an open refuses, first broken first
    headers: dict[str, SafetensorsHeader] = field(default_factory=dict)  # the shards whose header read
    files: list[str] = field(default_factory=list)  # the plain shard names the index lists, sorted
    unreadable: list[str] = field(default_factory=list)  # those that are files whose header did not read
    weight_map: dict | None = None
    metadata: dict | None = None
    tensors: dict[str, TensorInfo] = field(default_factory=dict)  # name -> its first shard's entry

    def fatal(self) -> Finding | None:
        """The finding an open raises (its `error`), None when the dir opens."""
        return self.refusals[0] if self.refusals else None

    def problem(self, file, key: str | None, message: str, **kw) -> None:
        self.findings.append(Finding(str(file), key, message, **kw))

    def refuse(self, error: CkptError) -> None:
        self.refusals.append(Finding(error.path, error.key, error.message, hint=error.hint, error=error))


def header_finding(path: Path, exc: CkptError | OSError) -> Finding:
    """A shard header that did not read: verify's line and the reader's own error."""
    if isinstance(exc, CkptError):
        return Finding(exc.path or str(path), exc.key, exc.message, error=exc)
    return Finding(str(path), None, f"cannot read: {exc.strerror}", error=exc)


def check_index(root: Path, index_path: Path) -> IndexCheck:
    """Every rule of the module docstring checked on the sharded dir `root` (its index `index_path`); never
    raises for a damaged input: the index, the headers that read, and the findings."""
    out = IndexCheck()
    weight_map, metadata = _check_index_file(out, root, index_path)
    keys_of = _check_names(out, index_path, weight_map)
    failed = _read_headers(out, root, index_path.name, keys_of)
    total = metadata.get("total_size") if isinstance(metadata, dict) else None
    if isinstance(total, int) and not failed and len(out.headers) == len(out.files):
        have = sum(t.nbytes for h in out.headers.values() for t in h.tensors.values())
        if have != total:
            out.problem(
                index_path,
                None,
                f"metadata.total_size is {total} but the shards hold {have} bytes of tensor data",
                severity=WARNING,
            )
    _refuse_missing_or_unreadable(out, root, index_path, failed)
    _check_agreement(out, root, index_path.name, weight_map)
    if weight_map is not None and not out.refusals and len(out.headers) == len(out.files):
        _refuse_disagreement(out, index_path, weight_map)
    return out


def _check_index_file(out: IndexCheck, root: Path, index_path: Path) -> tuple[dict | None, object]:
    """Rule 1: the index read, its `weight_map` (None where there is none) and its `metadata` (None where
    the index did not read). Verify goes on without it: every .safetensors is then unreferenced."""
    try:
        index = read_json(index_path, root=root, what=index_path.name, max_values=MAX_TABLE_VALUES)
    except CkptError as exc:
        out.problem(index_path, None, exc.message, error=exc)
        out.refusals.append(out.findings[-1])
        index = None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if index is not None and (not isinstance(weight_map, dict) or not weight_map):
        out.problem(index_path, None, "has no non-empty 'weight_map' object")
        out.refuse(FormatError("has no non-empty 'weight_map' object", path=index_path))
    if not isinstance(weight_map, dict) or not weight_map:
        weight_map = None
    out.weight_map = weight_map
    metadata = (index.get("metadata") or {}) if isinstance(index, dict) else None
    if weight_map is not None and not isinstance(metadata, dict):  # loaders ignore it; an open refuses it
        out.refuse(FormatError("'metadata' is not an object", path=index_path))
    out.metadata = metadata if isinstance(metadata, dict) else None
    return weight_map, metadata


def _check_names(out: IndexCheck, index_path: Path, weight_map: dict | None) -> dict[str, list[str]]:
    """Rule 2: {shard name: its keys} of the weight_map values that are plain file names; each other one
    listed, and refused on one line."""
    keys_of: dict[str, list[str]] = {}
    for k, f in (weight_map or {}).items():
        if not is_plain_file_name(f):
            out.problem(index_path, k, f"weight_map points at {f!r}, not a file inside the model dir")
            continue
        keys_of.setdefault(f, []).append(k)
    unsafe = sorted({repr(f) for f in (weight_map or {}).values() if not is_plain_file_name(f)})
    if unsafe:
        out.refuse(
            FormatError(
                f"weight_map points outside the model directory or at non-file names: {_listing(unsafe)}",
                path=index_path,
                hint="weight_map values must be plain shard file names",
            )
        )
    return keys_of


def _read_headers(
    out: IndexCheck, root: Path, name: str, keys_of: dict[str, list[str]]
) -> dict[str, Finding]:
    """Rule 3 as verify sees it: each listed shard exists and its header reads (an open reads a listed name
    that is not a regular file, and the reader refuses it by name; verify calls it missing); a
    .safetensors the index does not list is warned about. Returns the findings of the headers that did
    not read, by shard."""
    out.files = sorted(keys_of)
    failed: dict[str, Finding] = {}
    for f in out.files:
        p = root / f
        if not p.is_file():
            keys = sorted(keys_of[f])
            out.problem(
                p,
                keys[0],
                f"shard listed in {name} is missing ({len(keys)} tensor(s) map to it; this is the first)",
            )
            continue
        try:
            out.headers[f] = read_header(p)
        except (CkptError, OSError) as exc:
            failed[f] = header_finding(p, exc)
            out.findings.append(failed[f])
            out.unreadable.append(f)
    for extra in sorted(n.name for n in root.glob("*.safetensors")):
        if extra not in keys_of:
            out.problem(root / extra, None, f"not referenced by {name}; loaders ignore it", severity=WARNING)
    return failed


def _refuse_missing_or_unreadable(
    out: IndexCheck, root: Path, index_path: Path, failed: dict[str, Finding]
) -> None:
    """Rule 3 as an open refuses it: the missing shards on one line, else the first header that does not
    read (where nothing before it was refused)."""
    missing = [f for f in out.files if not lexists(root / f)]
    if missing:
        out.refuse(
            MissingFileError(
                f"{len(missing)} shard(s) listed in the index are missing: {_listing(missing)}",
                path=index_path,
                hint="re-download the model or restore the missing shards",
            )
        )
    elif not out.refusals:
        for f in out.files:
            if f in failed:
                out.refusals.append(failed[f])
                break
            if f not in out.headers:  # there, but not a regular file: the reader's refusal
                try:
                    read_header(root / f)
                except (CkptError, OSError) as exc:
                    out.refusals.append(header_finding(root / f, exc))
                    break


def _check_agreement(out: IndexCheck, root: Path, name: str, weight_map: dict | None) -> None:
    """Rule 4 as verify lists it: each tensor in one shard, the one the index names, and each key of the
    index in its shard; `out.tensors` from the headers."""
    owner: dict[str, str] = {}
    for f, header in sorted(out.headers.items()):
        for k in header.tensors:
            if k in owner:
                out.problem(root / f, k, f"tensor also stored in {owner[k]}")
            owner.setdefault(k, f)
            if weight_map is None:
                continue
            mapped = weight_map.get(k)
            if mapped is None:
                out.problem(root / f, k, f"tensor is not listed in {name}: loaders will not find it")
            elif mapped != f:
                out.problem(root / f, k, f"tensor is in {f} but {name} maps it to {mapped}")
    for k, f in sorted((weight_map or {}).items()):
        h = out.headers.get(f) if isinstance(f, str) else None  # a non-name value is refused above
        if h is not None and k not in h.tensors and k not in owner:
            out.problem(root / f, k, f"{name} maps the tensor to {f}, which does not hold it")
    out.tensors = {k: out.headers[f].tensors[k] for k, f in owner.items()}


def _refuse_disagreement(out: IndexCheck, index_path: Path, weight_map: dict) -> None:
    """Rule 4 as an open refuses it, once every header read: the disagreements on one line, each seen
    from both sides."""
    lines = [
        f"index maps {k!r} to {f}, which has no such tensor"
        for k, f in weight_map.items()
        if k not in out.headers[f].tensors
    ]
    for f, header in out.headers.items():
        for k in header.tensors:
            mapped = weight_map.get(k)
            if mapped is None:
                lines.append(f"{f} holds {k!r}, which the index does not list")
            elif mapped != f:
                lines.append(f"{f} holds {k!r}, which the index maps to {mapped}")
    if lines:
        out.refuse(
            FormatError(
                f"index and shard headers disagree: {_listing(lines)}",
                path=index_path,
                hint="the directory mixes files from different saves; re-download or re-export it",
            )
        )
