"""Parsers of the /proc files the launcher reads (pure: text in, numbers out; stdlib only).

`launch.py` imports this under `python -S -E -s`, so it must stay free of third-party imports.
"""
from __future__ import annotations

IO_FIELDS = ("rchar", "wchar", "syscr", "syscw", "read_bytes", "write_bytes", "cancelled_write_bytes")


def parse_io(text: str) -> dict[str, int]:
    """/proc/<pid>/io: `name: value` lines. Bytes of read()/write() syscalls are rchar/wchar (page cache
    hits included, mmap reads not); read_bytes/write_bytes are what reached (or will reach) the block
    layer. For a zombie the counts include every descendant it reaped, since the kernel adds a child's
    counters to its parent's when the parent waits for it."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() in IO_FIELDS:
            out[name.strip()] = int(value.strip())
    missing = [f for f in ("rchar", "wchar", "read_bytes", "write_bytes") if f not in out]
    if missing:
        raise ValueError(f"/proc/<pid>/io lacks {missing}: got {text[:200]!r}")
    return out


def parse_stat(text: str) -> tuple[int, int, int]:
    """/proc/<pid>/stat -> (ppid, session id, resident pages). The command name (field 2) may hold
    spaces and parentheses, so fields are counted from the last ')'."""
    rest = text[text.rindex(")") + 2:].split()
    # rest[0] is field 3 (state): ppid is field 4, session field 6, rss field 24
    return int(rest[1]), int(rest[3]), int(rest[21])


def parse_status_kib(text: str, field: str) -> int | None:
    """A `Field:  N kB` line of /proc/<pid>/status, in KiB (None if absent, e.g. a kernel thread)."""
    for line in text.splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return None
