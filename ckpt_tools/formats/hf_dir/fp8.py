"""Block-FP8 model directories (`quantization_config.quant_method = "fp8"` with `weight_block_size`), read and
written: the scheme a config declares, which stored tensors pair as (weight, weight_scale_inv), the rules a
directory must keep (what `ckpt verify` lists and `ckpt inspect` shows), and the config an FP8 output gets.

The on-disk layout (`core.fp8` has the arithmetic): a quantized `X.weight` [O, I] is float8_e4m3fn, beside it
`X.weight_scale_inv` float32 [ceil(O/bn), ceil(I/bk)] (`weight_block_size` [bn, bk]); everything else is
stored
as usual. `HFModelDir` reads such a directory under its logical face (`Source`: each quantized weight a
float32
[O, I] of fl32(q * scale), the scales hidden) and keeps its stored face (`keys`, `info`, the headers); this
module is what both faces and the checks share. Helpers for other commands (inspect's `step_N/weights-FP8`):
`fp8_scheme`, `quantized_pairs`, `fp8_problems`, `scale_value_problems`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from ...core.fp8 import BLOCK, FP8_DTYPE, SCALE_SUFFIX, grid_shape

__all__ = [
    "Fp8Scheme",
    "fp8_problems",
    "fp8_quantization_config",
    "fp8_scheme",
    "not_converted",
    "quantized_pairs",
    "scale_value_problems",
    "unsupported_quantization",
]


@dataclass(frozen=True)
class Fp8Scheme:
    """What a config's block-FP8 `quantization_config` declares."""

    block: tuple[int, int]
    fmt: str
    activation_scheme: str
    modules_to_not_convert: tuple[str, ...]

    def to_json(self) -> dict:
        return {
            "quant_method": "fp8",
            "fmt": self.fmt,
            "activation_scheme": self.activation_scheme,
            "weight_block_size": list(self.block),
            "modules_to_not_convert": list(self.modules_to_not_convert),
        }


def _qc(config: Mapping | None) -> Mapping | None:
    qc = (config or {}).get("quantization_config")
    return qc if isinstance(qc, Mapping) else None


def unsupported_quantization(config: Mapping | None) -> str | None:
    """Why a config's quantization is not block FP8 this package reads (None: it is, or there is none)."""
    qc = (config or {}).get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, Mapping):
        return "quantization_config is not a JSON object"
    method = qc.get("quant_method")
    if method != "fp8":
        return f"quant_method {method!r} (only block FP8, quant_method 'fp8' with weight_block_size, is read)"
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        return f"weight_block_size {block!r}: per-tensor FP8 (no blocks) is not read, only [bn, bk] blocks"
    if qc.get("fmt", "e4m3") != "e4m3":
        return f"fmt {qc.get('fmt')!r} (only e4m3)"
    if qc.get("scale_fmt", "float") not in ("float", None):
        return f"scale_fmt {qc.get('scale_fmt')!r} (only float32 scales)"
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        scheme = qc.get("activation_scheme")
        return f"activation_scheme {scheme!r} (only dynamic: static input scales are not read)"
    return None


def fp8_scheme(config: Mapping | None) -> Fp8Scheme | None:
    """The block-FP8 scheme of a config, or None (no quantization, or one `unsupported_quantization`
    names)."""
    qc = _qc(config)
    if qc is None or unsupported_quantization(config) is not None:
        return None
    skip = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ()
    bn, bk = qc["weight_block_size"]
    return Fp8Scheme(
        (bn, bk),
        "e4m3",
        str(qc.get("activation_scheme", "dynamic")),
        tuple(str(s) for s in skip if isinstance(s, str)),
    )


def quantized_pairs(dtypes: Mapping[str, str]) -> dict[str, str]:
    """{weight name: its scale's name} for every float8_e4m3fn tensor whose `<name>_scale_inv` is stored."""
    return {n: n + SCALE_SUFFIX for n, d in dtypes.items() if d == FP8_DTYPE and n + SCALE_SUFFIX in dtypes}


def not_converted(module: str, patterns: tuple[str, ...]) -> bool:
    """Whether `module` is kept unquantized by `modules_to_not_convert` (transformers' rule: a pattern
    matching
    from the start up to a module boundary, or a suffix)."""
    return any(module == p or module.startswith(p + ".") or module.endswith("." + p) for p in patterns)


def fp8_problems(
    scheme: Fp8Scheme, tensors: Mapping[str, tuple[str, tuple[int, ...]]]
) -> list[tuple[str, str]]:
    """(tensor, problem) for every broken rule of a block-FP8 dir, from headers alone: an fp8 weight
    without its
    scale, a scale without its weight, a scale not float32 or not on the weight's grid, a quantized tensor
    that
    is not 2-D, or one that modules_to_not_convert says stays unquantized (loaders then read it as plain)."""
    dtypes = {n: d for n, (d, _s) in tensors.items()}
    pairs = quantized_pairs(dtypes)
    problems = []
    for name, (dtype, _shape) in sorted(tensors.items()):
        if dtype == FP8_DTYPE and name not in pairs:
            problems.append(
                (name, f"float8_e4m3fn without its {name + SCALE_SUFFIX}: no loader can dequantize it")
            )
        if name.endswith(SCALE_SUFFIX) and name.removesuffix(SCALE_SUFFIX) not in pairs:
            w = name.removesuffix(SCALE_SUFFIX)
            what = "is missing" if w not in tensors else f"is {tensors[w][0]}, not float8_e4m3fn"
            problems.append((name, f"a scale whose weight {w} {what}"))
    for w, s in sorted(pairs.items()):
        shape, (sdt, sshape) = tensors[w][1], tensors[s]
        if len(shape) != 2:
            problems.append(
                (w, f"a quantized weight of shape {list(shape)}: block FP8 quantizes 2-D weights")
            )
            continue
        grid = grid_shape(shape, scheme.block)
        if sdt != "float32":
            problems.append((s, f"{sdt} scales; the format's weight_scale_inv is float32"))
        if tuple(sshape) != grid:
            problems.append(
                (
                    s,
                    f"shape {list(sshape)}, but a {list(shape)} weight in {list(scheme.block)} blocks "
                    f"has a {list(grid)} grid",
                )
            )
        if not_converted(w.removesuffix(".weight"), scheme.modules_to_not_convert):
            problems.append(
                (
                    w,
                    "stored as fp8 but modules_to_not_convert keeps this module unquantized: loaders "
                    "build an unquantized layer and misread its bytes",
                )
            )
    return problems


def scale_value_problems(values) -> str | None:
    """What is wrong with a weight_scale_inv's values (a 1-D sequence of floats): not finite, or not positive
    (a zero or negative scale dequantizes every code of its block wrongly). None when all are good."""
    bad = [v for v in values if not (math.isfinite(v) and v > 0)]
    if not bad:
        return None
    return f"{len(bad)} scale(s) are not finite and positive (e.g. {bad[0]!r})"


def fp8_quantization_config(kept_modules) -> dict:
    """The `quantization_config` of an FP8 output: block e4m3 [128, 128], dynamic activations, and every
    module
    whose weight stays unquantized listed (vLLM and transformers build plain layers for them)."""
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
        "modules_to_not_convert": sorted(set(kept_modules)),
    }


def describe_fp8(scheme: Fp8Scheme, tensors: Mapping[str, tuple[str, tuple[int, ...]]]) -> dict:
    """What `ckpt inspect` shows of a block-FP8 dir (from headers): its scheme, how many weights are quantized
    and kept, and the rules it breaks (`fp8_problems`)."""
    pairs = quantized_pairs({n: d for n, (d, _s) in tensors.items()})
    kept = [n for n in tensors if n not in pairs and n not in pairs.values()]
    return {
        **scheme.to_json(),
        "quantized": len(pairs),
        "kept": len(kept),
        "kept_dtypes": sorted({tensors[n][0] for n in kept}),
        "problems": [f"{n}: {m}" for n, m in fp8_problems(scheme, tensors)],
    }
