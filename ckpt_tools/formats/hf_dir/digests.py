"""Digests of the files of an HF model dir: what `ckpt verify --deep` proves the bytes against.

Every HF dir ckpt-tools writes (merge, export) carries `SHA256SUMS`: one line per file,
`<sha256 hex>  <name>`, sorted by name, covering every other file of the dir; it is the format
`sha256sum -c SHA256SUMS` reads, so the dir can be checked without ckpt-tools. Safetensors itself
stores no checksum, and a digest in its `__metadata__` would change the shard's bytes (they equal
`safetensors.torch.save_file`'s): a file beside them changes none.

A Hugging Face cache snapshot (`<repo>/snapshots/<rev>/<file> -> ../../blobs/<name>`) carries digests
of its own: an LFS file's blob is named by the sha256 of its content, a plain git file's by its git
blob id (sha1 of `blob <size>\\0` + content). `blob_digests` reads them from the links.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ...core.errors import FormatError
from ...io.inputs import as_input, list_names, real_name

__all__ = ["SUMS_NAME", "FileDigest", "blob_digests", "format_sums", "parse_sums"]

SUMS_NAME = "SHA256SUMS"
_LINE = re.compile(r"^([0-9a-fA-F]{64}) [ *](.+)$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_GIT_SHA1 = re.compile(r"^[0-9a-f]{40}$")

# (algorithm, hex digest, where it came from): "sha256" of the content, or "git-sha1" (git's blob id)
FileDigest = tuple


def format_sums(digests: dict[str, str]) -> str:
    """The SHA256SUMS text for {file name: sha256 hex} (sorted by name; `sha256sum -c` reads it)."""
    for name in digests:
        if "/" in name or "\n" in name or "\\" in name or name in (".", "..", SUMS_NAME):
            raise ValueError(f"{name!r} cannot be listed in {SUMS_NAME}")
    return "".join(f"{digests[n]}  {n}\n" for n in sorted(digests))


def parse_sums(text: str, path: Path) -> dict[str, str]:
    """{file name: sha256 hex} of a SHA256SUMS file; a malformed line is a FormatError naming it."""
    out: dict[str, str] = {}
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        m = _LINE.match(line)
        if m is None:
            raise FormatError(
                f"line {i} is not `<sha256>  <file>`: {line[:80]!r}",
                path=path,
                hint="the file was edited or damaged; it is what `sha256sum FILES > SHA256SUMS` writes",
            )
        digest, name = m.group(1).lower(), m.group(2)
        if "/" in name or name in (".", ".."):
            raise FormatError(f"line {i} names {name!r}, not a file of this directory", path=path)
        if name in out and out[name] != digest:
            raise FormatError(f"lists {name} twice with different digests", path=path)
        out[name] = digest
    return out


def blob_digests(model_dir: Path) -> dict[str, FileDigest] | None:
    """When `model_dir` is a snapshot of the HF cache (`.../snapshots/<rev>`), the digest each file's
    blob name gives (`("sha256", hex, blob)` for LFS files, `("git-sha1", hex, blob)` for others), for
    every file that links into the repo's `blobs/`; None when it is not a cache snapshot."""
    d = as_input(model_dir)
    if d.parent.name != "snapshots" or not (d.parent.parent / "blobs").is_dir():
        return None
    blobs = real_name(d.parent.parent / "blobs")
    out: dict[str, FileDigest] = {}
    for entry in list_names(d):
        p = d / entry
        if not p.is_symlink():
            continue
        real = os.path.realpath(p)
        if os.path.dirname(real) != blobs:
            continue
        name = os.path.basename(real)
        if _SHA256.match(name):
            out[entry] = ("sha256", name, real)
        elif _GIT_SHA1.match(name):
            out[entry] = ("git-sha1", name, real)
    return out
