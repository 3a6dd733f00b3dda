"""Exact dtype casts of raw little-endian bytes, with numpy (no torch): what the byte-moving commands (slim's
base check, extract-adapter) need, bit for bit as torch's CPU casts give them.

- bf16 -> fp32 is exact: a bf16 value is the top half of its fp32 (`uint16 << 16`, NaNs included).
- fp32 -> bf16 rounds to nearest, ties to even, on the bits: `(u + 0x7fff + ((u >> 16) & 1)) >> 16`
  (an overflow rounds to inf as it should); every NaN becomes 0xffff, as torch's vectorized CPU cast
  writes it (tests/test_casts.py checks both against torch on every class of value).
- the same dtype is a copy.
Any other pair is not here (`exact_cast` says so): a caller converts it with torch.
"""

from __future__ import annotations

__all__ = ["bf16_round", "cast_into", "exact_cast"]

_BF16_NAN = 0xFFFF

# (from, to) dtype names this module casts exactly
_PAIRS = frozenset({("bfloat16", "float32"), ("float32", "bfloat16")})


def exact_cast(src: str, dst: str) -> bool:
    """Whether `cast_into` casts dtype `src` to `dst` (names: "bfloat16") exactly as torch does."""
    return src == dst or (src, dst) in _PAIRS


def cast_into(src: str, dst: str, data, out) -> None:
    """Cast the values whose raw bytes are `data` (dtype `src`) into the buffer `out` (dtype `dst`, exactly
    as many values). Both are anything a memoryview takes; numpy releases the GIL, so threads run in
    parallel."""
    import numpy as np  # lazy: the metadata-only commands import this package without numpy

    if not exact_cast(src, dst):
        raise ValueError(f"no exact numpy cast from {src} to {dst}")
    raw = np.frombuffer(data, dtype=np.uint8)
    dest = np.frombuffer(out, dtype=np.uint8)
    if src == dst:
        if dest.size != raw.size:
            raise ValueError(f"{raw.size} bytes cast into a buffer of {dest.size}")
        dest[:] = raw
        return
    if (src, dst) == ("bfloat16", "float32"):
        u16, u32 = raw.view(np.uint16), dest.view(np.uint32)
        if u32.size != u16.size:
            raise ValueError(f"{u16.size} bf16 values cast into a buffer of {u32.size} fp32")
        np.left_shift(u16, 16, out=u32, dtype=np.uint32)
        return
    u32, u16 = raw.view(np.uint32), dest.view(np.uint16)  # float32 -> bfloat16
    if u16.size != u32.size:
        raise ValueError(f"{u32.size} fp32 values cast into a buffer of {u16.size} bf16")
    lsb = np.right_shift(u32, 16)
    np.bitwise_and(lsb, 1, out=lsb)
    lsb += 0x7FFF
    lsb += u32  # (wraps only for a NaN's bits, which are replaced below)
    np.right_shift(lsb, 16, out=lsb)
    u16[:] = lsb  # the low 16 bits
    nan = (u32 & 0x7FFFFFFF) > 0x7F800000
    if nan.any():
        u16[nan] = _BF16_NAN


def bf16_round(x: float) -> float:
    """x rounded to fp32, then to bf16 (what prime-rl's bf16 compute does to a scale), as a float."""
    import numpy as np

    with np.errstate(over="ignore"):
        f32 = np.array([x], dtype=np.float32)  # IEEE round to nearest even; beyond fp32's range: inf
    b16 = np.empty(1, dtype=np.uint16)
    cast_into("float32", "bfloat16", f32, b16)
    return float((b16.astype(np.uint32) << 16).view(np.float32)[0])
