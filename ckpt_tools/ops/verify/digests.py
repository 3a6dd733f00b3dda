"""`ckpt verify --deep` of an HF model dir against the digests it carries: its `SHA256SUMS` (every HF
dir ckpt-tools writes has one) or, in the HF cache, its blob names (`formats.hf_dir.digests`).

A digested file is read once, sequentially: every byte goes into its hash, and every float of the
tensors it holds is also counted for inf/nan on the way (one read does both checks). A dir with no
digest at all can only be proven well formed and finite: `integrity` says so, in words, and never
claims more.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

from ...core.dtypes import itemsize
from ...core.errors import CkptError
from ...core.problems import VerifyReport
from ...core.progress import Progress
from ...core.progress import report as report_progress
from ...dist import Group, map_units
from ...formats.hf_dir.digests import SUMS_NAME, blob_digests, parse_sums
from ...io.inputs import OpenFiles, lexists, list_names, read_text

__all__ = ["NO_DIGEST", "check_digests", "expected_digests", "prove"]

NO_DIGEST = (
    "no digest covers these files (no SHA256SUMS, not a Hugging Face cache snapshot): verify proves "
    "structure and finite values only; a flipped bit that leaves a value finite is not detectable"
)
_BLOCK_BYTES = 1 << 20


def expected_digests(
    path: Path, report: VerifyReport
) -> tuple[dict[str, list[tuple[str, str, str]]], list[str]]:
    """{file: [(algorithm, hex digest, where it came from)]} from SHA256SUMS and the HF cache's blob names,
    and the words saying where they came from. Listed files that are missing, and files that no digest
    covers, are reported (a problem, a warning)."""
    out: dict[str, list[tuple[str, str, str]]] = {}
    sources = []
    sums_path = path / SUMS_NAME
    if lexists(sums_path):
        try:
            sums = parse_sums(read_text(sums_path, root=path, what=SUMS_NAME), sums_path)
        except CkptError as exc:
            report.problem(exc.path or sums_path, exc.key, exc.message)
            sums = {}
        for name, digest in sums.items():
            if not lexists(path / name):
                report.problem(path / name, None, f"listed in {SUMS_NAME} but missing")
                continue
            out.setdefault(name, []).append(("sha256", digest, SUMS_NAME))
        sources.append(SUMS_NAME)
    blobs = blob_digests(path)
    if blobs:
        for name, (algorithm, digest, _real) in blobs.items():
            out.setdefault(name, []).append((algorithm, digest, f"its Hub cache blob name {digest[:12]}…"))
        sources.append("Hub cache blob names")
    if out:
        for name in list_names(path):
            if name not in out and name != SUMS_NAME and not name.startswith(".") and (path / name).is_file():
                report.warn(
                    path / name,
                    None,
                    "no digest covers this file (not in SHA256SUMS, not a Hub blob): "
                    "its bytes are not proven",
                )
    return out, sources


def _hasher(algorithm: str, size: int):
    if algorithm == "git-sha1":  # git's blob id: sha1 of "blob <size>\0" + content
        h = hashlib.sha1(usedforsecurity=False)
        h.update(b"blob %d\0" % size)
        return h
    return hashlib.new(algorithm)


def check_digests(
    path: Path,
    expected: dict,
    tensors_by_file: dict[str, list],
    counter_for,
    report: VerifyReport,
    progress: Progress | None,
    group: Group | None,
) -> int:
    """Read every file of `expected` once: its digests compared, and the tensors it holds
    (`tensors_by_file`, TensorInfos) counted for inf/nan (`counter_for(dtype) -> count(view)`). Split
    over ranks and threads, one unit a file. Returns the files whose digests matched."""
    files = OpenFiles(path, what="model file")
    local = threading.local()
    sizes: dict[str, int] = {}
    for n in sorted(expected):
        try:
            sizes[n] = files.size(n)
        except CkptError as exc:
            report.problem(exc.path or path / n, None, exc.message)
    names = list(sizes)
    total = sum(sizes.values())
    done_bytes = 0

    def one(k: int) -> list:
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = bytearray(_BLOCK_BYTES)
        name = names[k]
        return _digest_file(
            files, name, sizes[name], expected[name], tensors_by_file.get(name, ()), counter_for, buf
        )

    def done(k: int, _r) -> None:
        nonlocal done_bytes
        done_bytes += sizes[names[k]]
        report_progress(progress, "read", done_bytes, total)

    try:
        results = map_units(one, [sizes[n] for n in names], group, done=done)
    finally:
        files.close()
    if results is None:
        return 0
    return _report_digests(path, names, expected, results, report)


def _digest_file(
    files: OpenFiles, name: str, size: int, expected: list, tensors, counter_for, buf: bytearray
) -> list:
    """One file read once, in blocks of `buf`, into each of its digests, its tensors' floats counted for
    inf/nan on the way: ["ok", [hex digest per expected digest], [(tensor, non-finite count)]], or
    ["error", why] (plain values, for gather)."""
    hashers = [_hasher(a, size) for a, _d, _s in expected]
    bad: dict[str, int] = {}
    pos = 0

    def feed(upto: int, item: int = 1, counter=None, tensor: str = "") -> None:
        nonlocal pos
        block = max(item, _BLOCK_BYTES // item * item)
        while pos < upto:
            n = min(block, upto - pos)
            view = memoryview(buf)[:n]
            files.read_into(name, pos, view, tensor)
            for h in hashers:
                h.update(view)
            if counter is not None:  # after the hash: the counter may overwrite the view
                c = counter(view)
                if c:
                    bad[tensor] = bad.get(tensor, 0) + c
            pos += n

    try:
        for t in sorted(tensors, key=lambda t: t.begin):
            if t.begin < pos:  # (headers refuse overlaps; never trusted here)
                raise ValueError(f"tensor {t.name} overlaps the bytes before it")
            feed(t.begin)
            feed(t.begin + t.nbytes, itemsize(t.dtype_name), counter_for(t.dtype_name), t.name)
        feed(size)
    except Exception as exc:
        return ["error", f"cannot read the file: {type(exc).__name__}: {exc}"]
    return ["ok", [h.hexdigest() for h in hashers], sorted(bad.items())]


def _report_digests(path: Path, names: list[str], expected: dict, results: list, report: VerifyReport) -> int:
    """Each file's digests that differ, and its non-finite values, as problems; returns the files that
    matched."""
    matched = 0
    for name, r in zip(names, results):
        if r[0] == "error":
            report.problem(path / name, None, r[1])
            continue
        ok = True
        for (algorithm, want, source), got in zip(expected[name], r[1]):
            if got != want:
                ok = False
                report.problem(
                    path / name,
                    None,
                    f"{algorithm} {got[:16]}… differs from {source} ({want[:16]}…): the file's bytes changed "
                    "after the digest was taken (a flipped bit, a partial copy or download); re-copy or "
                    "re-download it",
                )
        matched += ok
        for tensor, count in r[2]:
            report.problem(path / name, tensor, f"{count} non-finite value(s) (inf/nan)")
    return matched


def prove(
    path: Path,
    report: VerifyReport,
    *,
    deep: bool,
    weight_files: set[str],
    tensors_by_file: dict,
    counter_for,
    progress: Progress | None = None,
    group: Group | None = None,
) -> set[str]:
    """The integrity part of verifying the dir `path` (HF model or PEFT adapter): with `deep`, every file
    with a digest read once against it (`check_digests`); `report.integrity` says, in words, what is
    proven: every weight file (`weight_files`) matched, or why not. Returns the files read here."""
    present = lexists(path / SUMS_NAME) or bool(blob_digests(path))
    if not deep:
        report.integrity = {
            "proven": False,
            "by": None,
            "statement": "digests are present; `--deep` reads every byte against them"
            if present
            else NO_DIGEST,
        }
        return set()
    expected, sources = expected_digests(path, report)
    matched = (
        check_digests(path, expected, tensors_by_file, counter_for, report, progress, group)
        if expected
        else 0
    )
    uncovered = sorted(weight_files - set(expected))
    report.checked.update({"files_digested": len(expected), "files_digest_matched": matched})
    if not expected:
        report.integrity = {"proven": False, "by": None, "statement": NO_DIGEST}
    elif uncovered or matched != len(expected):
        report.integrity = {
            "proven": False,
            "by": sources,
            "statement": f"{matched} of {len(expected)} digested file(s) matched"
            + (f"; {len(uncovered)} weight file(s) have no digest, e.g. {uncovered[0]}" if uncovered else ""),
        }
    else:
        report.integrity = {
            "proven": True,
            "by": sources,
            "statement": f"every byte of {matched} file(s) matched {' and '.join(sources)}",
        }
    return set(expected)
