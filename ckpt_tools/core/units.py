"""Byte sizes, printed and parsed (HF convention: GB = 10**9, GiB = 2**30), and numbers printed as people
write them. Pure."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from .errors import UsageError

__all__ = ["human_bytes", "human_bytes_si", "human_number", "parse_size"]


def human_bytes(n: int | float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def human_bytes_si(n: int) -> str:
    """A size as `--max-shard-size` takes it (HF convention, GB = 10**9): 5000000000 -> "5GB"."""
    for unit, size in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n >= size:
            return f"{n / size:.4g}{unit}"
    return f"{n}B"


def human_number(x) -> str:
    """A number as people write it: at most 8 significant digits, no float noise, a short exponent.
    0.006666666700000001 -> 0.0066666667, 5e-06 -> 5e-6, 16.0 -> 16, 1200 -> 1200; ints and
    non-numbers are printed as they are."""
    if isinstance(x, bool) or not isinstance(x, float):
        return str(x)
    if x != x or x in (float("inf"), float("-inf")):
        return str(x)
    text = f"{x:.8g}"
    if "e" in text:
        mant, exp = text.split("e")
        text = f"{mant}e{int(exp)}"
    return text


_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes for "5GB" (HF convention: GB = 10**9), "500MB", "4GiB", "1.5GB", "123" or an int."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise UsageError(f"size {text} is negative")
        return text
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).upper() if m else None
    if not m or unit not in _SIZE_UNITS:
        raise UsageError(
            f"cannot parse size {text!r}",
            hint="use e.g. 5GB (10**9 bytes), 500MB, 4GiB (2**30 bytes) or a number of bytes",
        )
    try:
        return int(Decimal(m.group(1)) * _SIZE_UNITS[unit])
    except InvalidOperation:  # pragma: no cover - the regex admits only decimal numerals
        raise UsageError(f"cannot parse size {text!r}") from None
