"""Dtypes by name: item sizes, safetensors codes, the spellings users type (pure; torch only to convert).

Every layer names a dtype the way torch prints it without its prefix (`"bfloat16"`): the DCP
metadata model, the sources' tensor facts and every plan carry names, so a command that only reads
metadata never needs torch. `torch_dtype(name)` is where a name becomes a `torch.dtype`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import FormatError, UsageError

__all__ = [
    "CLI_SPELLINGS",
    "EXPONENT_MASKS",
    "FP8_SPELLINGS",
    "ITEMSIZE",
    "SAFETENSORS",
    "SHORT_NAMES",
    "STORAGE_CLASSES",
    "TORCH_DTYPE_NAMES",
    "DtypeSpec",
    "ShapedBytes",
    "config_dtype_code",
    "dtype_name",
    "is_floating",
    "itemsize",
    "parse_cli_dtype",
    "safetensors_code",
    "short_name",
    "torch_dtype",
]


@dataclass(frozen=True)
class DtypeSpec:
    code: str  # the safetensors spelling, e.g. "BF16"
    name: str  # torch's name without "torch.", e.g. "bfloat16"
    itemsize: int  # bytes per element
    rank: int  # position in safetensors' Dtype enum (save_file sorts by it, descending)

    @property
    def torch_dtype(self):
        return torch_dtype(self.name)


# Listed in the order of safetensors' Dtype enum: that order is the `rank` save_file sorts by. Sub-byte
# codes (F4, F6_*) are absent: torch has no per-element dtype for them, so they cannot be read or checked.
_SAFETENSORS_ROWS = (
    ("BOOL", "bool", 1),
    ("U8", "uint8", 1),
    ("I8", "int8", 1),
    ("F8_E5M2", "float8_e5m2", 1),
    ("F8_E4M3", "float8_e4m3fn", 1),
    ("F8_E8M0", "float8_e8m0fnu", 1),
    ("I16", "int16", 2),
    ("U16", "uint16", 2),
    ("F16", "float16", 2),
    ("BF16", "bfloat16", 2),
    ("I32", "int32", 4),
    ("U32", "uint32", 4),
    ("F32", "float32", 4),
    ("C64", "complex64", 8),
    ("F64", "float64", 8),
    ("I64", "int64", 8),
    ("U64", "uint64", 8),
)
SAFETENSORS: dict[str, DtypeSpec] = {
    code: DtypeSpec(code, name, size, rank) for rank, (code, name, size) in enumerate(_SAFETENSORS_ROWS)
}
_CODE_BY_NAME = {s.name: s.code for s in SAFETENSORS.values()}

# Every dtype name a DCP `.metadata` may reference as a `torch.<name>` global (the allow-list's).
ITEMSIZE: dict[str, int] = {
    **{s.name: s.itemsize for s in SAFETENSORS.values()},
    "complex128": 16,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
}
TORCH_DTYPE_NAMES = frozenset(
    {
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
        "complex64",
        "complex128",
        "float8_e4m3fn",
        "float8_e5m2",
        "uint16",
        "uint32",
        "uint64",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
    }
)
_FLOATING = frozenset(
    {
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "float8_e4m3fn",
        "float8_e5m2",
        "float8_e8m0fnu",
        "float8_e4m3fnuz",
        "float8_e5m2fnuz",
    }
)

# IEEE layouts: a value is inf/nan iff all its exponent bits are set (one integer pass, no float decode).
# The fp8 kinds are not here: e4m3fn has no inf and one NaN pattern per sign, e8m0 no sign.
EXPONENT_MASKS: dict[str, int] = {
    "float16": 0x7C00,
    "bfloat16": 0x7F80,
    "float32": 0x7F800000,
    "float64": 0x7FF0000000000000,
}

# torch.save names a storage by class; the class name carries the dtype.
STORAGE_CLASSES: dict[str, str] = {
    "FloatStorage": "float32",
    "DoubleStorage": "float64",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
}

# What users type for `--dtype` (merge) and the short names plans print (extract, fix-adapter).
CLI_SPELLINGS: dict[str, str] = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
}
# `--dtype fp8` of the commands that write block-FP8 weights (core.fp8)
FP8_SPELLINGS = ("fp8", "float8_e4m3fn", "e4m3")
SHORT_NAMES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# config.json's `dtype` / `torch_dtype` spellings -> safetensors code (verify's dtype cross-check)
_CONFIG_CODES = {
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float64": "F64",
    "fp32": "F32",
    "fp16": "F16",
    "bf16": "BF16",
}


def dtype_name(dtype) -> str:
    """`torch.bfloat16` or `"bfloat16"` -> `"bfloat16"` (no torch import: torch prints dtypes so)."""
    return str(dtype).removeprefix("torch.")


def itemsize(dtype) -> int:
    name = dtype_name(dtype)
    try:
        return ITEMSIZE[name]
    except KeyError:
        raise FormatError(f"unknown dtype {name!r}") from None


def is_floating(dtype) -> bool:
    return dtype_name(dtype) in _FLOATING


def torch_dtype(dtype):
    """The `torch.dtype` of a name (or a torch dtype, returned as is). The one place a name meets torch:
    imported here, on first use, so that reading names and sizes never imports torch."""
    import torch  # lazy: names and sizes above work without torch (metadata-only commands)

    if isinstance(dtype, torch.dtype):
        return dtype
    dt = getattr(torch, dtype_name(dtype), None)
    if not isinstance(dt, torch.dtype):
        raise FormatError(f"unknown dtype {dtype!r}")
    return dt


def safetensors_code(dtype) -> str:
    """The safetensors code ("BF16") of a dtype (name or torch dtype), or a code validated as known."""
    if isinstance(dtype, str):
        if dtype in SAFETENSORS:
            return dtype
        if dtype in _CODE_BY_NAME:  # a dtype name: "bfloat16"
            return _CODE_BY_NAME[dtype]
        raise FormatError(f"unknown safetensors dtype {dtype!r} (known: {', '.join(SAFETENSORS)})")
    code = _CODE_BY_NAME.get(dtype_name(dtype))
    if code is None:
        raise FormatError(
            f"torch dtype {dtype} has no safetensors code",
            hint="convert the tensor to a supported dtype first",
        )
    return code


def parse_cli_dtype(text: str, *, fp8: bool = False) -> str:
    """`--dtype bf16|fp16|fp32` (and their long spellings) -> a dtype name; with `fp8` (a command that writes
    block-FP8 weights: merge, export) also `fp8` -> "float8_e4m3fn"."""
    key = str(text).lower()
    if fp8 and key in FP8_SPELLINGS:
        return "float8_e4m3fn"
    try:
        return CLI_SPELLINGS[key]
    except KeyError:
        raise UsageError(
            f"unknown --dtype {text!r}", hint="use bf16, fp16, fp32" + (" or fp8" if fp8 else "")
        ) from None


def short_name(dtype) -> str | None:
    """ "float32" -> "fp32" (the names plans print), None for a dtype without one."""
    name = dtype_name(dtype)
    return next((k for k, v in SHORT_NAMES.items() if v == name), None)


def config_dtype_code(value) -> str | None:
    """The safetensors code a config.json `dtype` / `torch_dtype` value names, None if it names none."""
    return _CONFIG_CODES.get(value) if isinstance(value, str) else None


class ShapedBytes:
    """Sizes of a tensor described by name (`dtype`, a torch dtype name) and `shape`: the one home of
    numel / itemsize / nbytes for the metadata classes of every format (a mixin for dataclasses)."""

    __slots__ = ()
    dtype: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize
