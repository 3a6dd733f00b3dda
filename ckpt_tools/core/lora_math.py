"""LoRA rules, in one place (pure: numbers and shapes, no tensors).

The scale every command applies is `lora_scale(alpha, r)` = alpha / r (rsLoRA: alpha / sqrt(r)); the
merge kernels that apply it to tensors are in `core.tensor_math`. An alpha read from any file or flag
goes through `check_alpha`; LoRA factors are checked against their base weight by `check_shapes`.
"""

from __future__ import annotations

import math
from pathlib import Path

from .errors import FormatError

__all__ = [
    "MAX_ALPHA",
    "check_alpha",
    "check_modules_fit_base",
    "check_shapes",
    "lora_alpha_for_scale",
    "lora_scale",
]

MAX_ALPHA = 65536.0  # far above any real run's alpha (~2 r); 1e30 overflows bf16 weights


def lora_scale(alpha: float, rank: int, rslora: bool = False) -> float:
    """PEFT's scaling: alpha / r, or alpha / sqrt(r) for rsLoRA."""
    if rank <= 0:
        raise ValueError(f"LoRA rank must be positive, got {rank}")
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def check_alpha(value, what: str, *, path=None, key: str | None = None, error=FormatError) -> float:
    """A LoRA alpha must be a finite number in (0, MAX_ALPHA]: 0 makes the merge the base itself,
    a negative one flips the update, NaN or 1e30 destroys the weights. Returns it as a float."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise error(f"{what} is {value!r}, not a number", path=path, key=key) from None
    if isinstance(value, bool) or not math.isfinite(v) or not 0 < v <= MAX_ALPHA:
        why = (
            "0 makes the LoRA update zero: the result would equal the base"
            if v == 0
            else "it must be a finite number"
            if not math.isfinite(v)
            else f"it must be in (0, {MAX_ALPHA:g}]"
        )
        raise error(
            f"{what} is {value!r}: {why}",
            path=path,
            key=key,
            hint="use the alpha the run trained with (prime-rl: orch.toml [model.lora] alpha)",
        )
    return v


def check_shapes(
    weight_shape: tuple, a_shape: tuple, b_shape: tuple, *, fan_in_fan_out: bool = False, name: str = ""
) -> None:
    """A [r, in] and B [out, r] fit the weight [out, in] ([in, out] for fan_in_fan_out)."""
    if len(weight_shape) != 2:
        # a LoRA on a norm, a bias or a stacked expert tensor: B @ A is a matrix, the weight is not one
        raise FormatError(
            f"a LoRA (A {list(a_shape)}, B {list(b_shape)}) targets {name or 'a weight'} of shape "
            f"{list(weight_shape)}: LoRA applies only to 2-D linear weights [out, in]",
            key=name,
            hint="drop this module from the adapter (and from target_modules); a trained norm or "
            "embedding belongs in modules_to_save as a full tensor",
        )
    out_f, in_f = (weight_shape[1], weight_shape[0]) if fan_in_fan_out else (weight_shape[0], weight_shape[1])
    if (
        len(weight_shape) != 2
        or len(a_shape) != 2
        or len(b_shape) != 2
        or a_shape[0] != b_shape[1]
        or a_shape[1] != in_f
        or b_shape[0] != out_f
    ):
        raise FormatError(
            f"LoRA shapes do not fit the base weight: base {list(weight_shape)}, "
            f"A {list(a_shape)} (expect [r, {in_f}]), B {list(b_shape)} (expect [{out_f}, r])",
            key=name,
            hint="the adapter was trained on a different base model",
        )


def lora_alpha_for_scale(scale: float, r: int) -> float:
    """lora_alpha such that lora_alpha / r == scale (an integer value when it is one)."""
    a = scale * r
    return float(round(a)) if math.isclose(a, round(a), rel_tol=0, abs_tol=1e-9) else a


def check_modules_fit_base(
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]],
    base_shapes: dict[str, tuple[int, ...]],
    base_dir: Path,
) -> None:
    """Every module's A [r, in] / B [out, r] must fit `<module>.weight` [out, in] of the base.
    All problems in one error; zero matching modules is an error too."""
    problems = []
    matched = 0
    for module, (a, b) in sorted(shapes.items()):
        w = base_shapes.get(f"{module}.weight")
        if w is None:
            problems.append(f"{module}: the base has no {module}.weight")
        elif len(w) != 2 or a[1] != w[1] or b[0] != w[0]:
            problems.append(
                f"{module}: A {list(a)} / B {list(b)} do not fit the base weight {list(w)} "
                f"(expect A [r, {w[1] if len(w) == 2 else '?'}], B [{w[0]}, r])"
            )
        else:
            matched += 1
    if matched == 0 or problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise FormatError(
            f"{matched} of {len(shapes)} LoRA modules match the base model: {shown}",
            path=base_dir,
            hint="the adapter was trained on a different base model; pass the right one with --base",
        )
