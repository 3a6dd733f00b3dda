"""PEFT `adapter_config.json`, validated completely before any tensor byte is read: peft_type, r,
lora_alpha, rsLoRA, rank/alpha patterns, fan_in_fan_out, modules_to_save, target_modules, target_parameters
(only the fused MoE expert parameters, `formats.peft.experts`), and the LoRA variants we do not convert
exactly (DoRA, LoRA bias, QALoRA, layer replication...), each refused with a message naming the field."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ...core.errors import FormatError
from ...core.keys import FUSED_EXPERT_PARAMS, peft_target
from ...core.lora_math import check_alpha, lora_scale
from ...io.inputs import as_input, lexists, read_json

__all__ = [
    "ADAPTER_CONFIG",
    "BIN_NAME",
    "MAX_RANK",
    "PEFT_PREFIX",
    "SAFETENSORS_NAME",
    "UNSUPPORTED_VARIANTS",
    "PeftConfig",
    "check_regex",
    "matches_target_modules",
    "parse_peft_config",
    "pattern_key",
]

PEFT_PREFIX = "base_model.model."
ADAPTER_CONFIG = "adapter_config.json"
SAFETENSORS_NAME = "adapter_model.safetensors"
BIN_NAME = "adapter_model.bin"
MAX_RANK = 1 << 16

# Config fields that switch on a LoRA variant whose math is not W + s*B@A. (field, "off" test)
UNSUPPORTED_VARIANTS: tuple[tuple[str, Callable[[object], bool]], ...] = (
    ("use_dora", lambda v: not v),
    ("lora_bias", lambda v: not v),
    ("use_qalora", lambda v: not v),
    ("use_bdlora", lambda v: not v),
    ("layer_replication", lambda v: v in (None, [], {})),
    # target_parameters: only transformers 5's fused MoE expert parameters (checked in parse_peft_config)
    ("trainable_token_indices", lambda v: v in (None, [], {})),
    ("alora_invocation_tokens", lambda v: v in (None, [], {})),
    ("megatron_config", lambda v: v in (None, {})),
)


# A regex from a downloaded config is matched against every module name: a crafted one must not
# hang us (Python's re backtracks). Refused: invalid syntax; a repeated group that itself repeats
# or alternates ("(a+)+$", "(.*.*)*q", "(a|a)*$": exponential time); more than 3 unbounded
# quantifiers ("x.*.*.*.*.*y": polynomial of high degree). Real patterns ("q_proj",
# "layers\.\d+\.mlp\..*", "(q|k|v)_proj") pass.
_NESTED_REPEAT = re.compile(r"\((?:[^()\\]|\\.)*[*+?}|](?:[^()\\]|\\.)*\)(?:[*+]|\{\d*,)")
_UNBOUNDED = re.compile(r"(?<!\\)(?:[*+]|\{\d*,\})")
_MAX_PATTERN_CHARS = 512


def check_regex(field: str, pattern: str, path: Path, *, compiled_as: str = "{}") -> None:
    """Raise FormatError unless `pattern` is a regex we can match safely (see above)."""
    bare = re.sub(r"\[(?:\\.|[^\]])*\]", "c", pattern)  # quantifier chars inside [...] are literals
    if len(pattern) > _MAX_PATTERN_CHARS or _NESTED_REPEAT.search(bare) or len(_UNBOUNDED.findall(bare)) > 3:
        raise FormatError(
            f"{field} pattern {pattern[:80]!r} has nested or many repetitions: matching it can take "
            "exponential time (a crafted config hangs any loader that uses it)",
            path=path,
            hint="use module names or simple patterns such as 'layers\\.\\d+\\.mlp\\..*'",
        )
    try:
        re.compile(compiled_as.replace("{}", pattern))
    except re.error as e:
        raise FormatError(
            f"{field} pattern {pattern[:80]!r} is not a valid regular expression: {e}", path=path
        ) from None


def pattern_key(patterns: dict, module: str) -> str | None:
    """PEFT's get_pattern_key: the first pattern p with re.match(rf"(.*\\.)?({p})$", module)."""
    for p in patterns:
        if re.match(rf"(.*\.)?({p})$", module):
            return p
    return None


def matches_target_modules(module: str, targets) -> bool | None:
    """PEFT's target_modules rule: a list matches a module named exactly or ending in '.<t>'; a
    string is a full-match regex. None when the config states no targets."""
    if targets is None:
        return None
    if isinstance(targets, str):
        if targets == "all-linear":
            return True
        return re.fullmatch(targets, module) is not None
    # `experts` selects every per-expert projection (`...mlp.experts.3.gate_proj`), as in prime-rl's MoE
    # broadcasts and vLLM's MoE LoRA (`core.keys.peft_target`)
    return any(module == t or module.endswith("." + t) or peft_target(module) == t for t in targets)


@dataclass(frozen=True)
class PeftConfig:
    path: Path
    r: int
    lora_alpha: float
    use_rslora: bool
    fan_in_fan_out: bool
    rank_pattern: dict
    alpha_pattern: dict
    target_modules: object
    modules_to_save: tuple[str, ...]
    base_model_name_or_path: str | None
    raw: dict = field(repr=False, hash=False, compare=False)
    target_parameters: tuple[str, ...] = ()  # fused MoE expert parameters (`formats.peft.experts`)

    def rank_for(self, module: str) -> int:
        p = pattern_key(self.rank_pattern, module)
        return int(self.rank_pattern[p]) if p is not None else self.r

    def alpha_for(self, module: str) -> float:
        p = pattern_key(self.alpha_pattern, module)
        return float(self.alpha_pattern[p]) if p is not None else self.lora_alpha

    def scale_for(self, module: str) -> float:
        return lora_scale(self.alpha_for(module), self.rank_for(module), self.use_rslora)


def _need(raw: dict, name: str, types, path: Path, default=None, required=True):
    if name not in raw or raw[name] is None:
        if required:
            raise FormatError(
                f"adapter_config.json has no {name!r}",
                path=path,
                hint="a PEFT LoRA config needs peft_type, r and lora_alpha",
            )
        return default
    v = raw[name]
    if not isinstance(v, types) or (
        isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,))
    ):
        raise FormatError(f"{name!r} is {v!r} ({type(v).__name__}), expected {types}", path=path)
    return v


def parse_peft_config(path: Path) -> PeftConfig:
    path = as_input(path)
    raw = _lora_config_json(path)
    r = _need(raw, "r", int, path)
    if not 0 < r <= MAX_RANK:
        raise FormatError(f"'r' must be in 1..{MAX_RANK}, got {r}", path=path)
    alpha = _need(raw, "lora_alpha", (int, float), path)
    check_alpha(alpha, "'lora_alpha'", path=path)
    rank_pattern = _need(raw, "rank_pattern", dict, path, {}, required=False)
    alpha_pattern = _need(raw, "alpha_pattern", dict, path, {}, required=False)
    _check_patterns(rank_pattern, alpha_pattern, path)
    tparams = _targets(raw, path)
    mts = raw.get("modules_to_save") or ()
    if not isinstance(mts, (list, tuple)) or not all(isinstance(m, str) for m in mts):
        raise FormatError(f"modules_to_save is {mts!r}, expected a list of names", path=path)
    return PeftConfig(
        path=path,
        r=r,
        lora_alpha=float(alpha),
        use_rslora=bool(_need(raw, "use_rslora", bool, path, False, required=False)),
        fan_in_fan_out=bool(_need(raw, "fan_in_fan_out", bool, path, False, required=False)),
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
        target_modules=raw.get("target_modules"),
        modules_to_save=tuple(mts),
        base_model_name_or_path=raw.get("base_model_name_or_path"),
        raw=raw,
        target_parameters=tuple(tparams),
    )


def _lora_config_json(path: Path) -> dict:
    """adapter_config.json as a JSON object: a plain LoRA (peft_type LORA, no variant this package does
    not convert, no trained biases)."""
    if not lexists(path):
        raise FormatError("missing adapter_config.json", path=path)
    raw = read_json(path, root=path.parent, what="adapter_config.json")
    if not isinstance(raw, dict):
        raise FormatError("adapter_config.json is not a JSON object", path=path)
    ptype = raw.get("peft_type")
    if ptype is None:
        raise FormatError("adapter_config.json has no 'peft_type'", path=path, hint='expected "LORA"')
    if ptype != "LORA":
        raise FormatError(f"peft_type {ptype!r} is not supported: only LoRA adapters are", path=path)
    for name, ok in UNSUPPORTED_VARIANTS:
        if name in raw and not ok(raw[name]):
            raise FormatError(
                f"{name}={raw[name]!r}: this LoRA variant is not plain W + s*B@A and is not "
                "converted/merged by ckpt-tools",
                path=path,
                hint=f"merge it with PEFT's merge_and_unload, or retrain without {name}",
            )
    bias = raw.get("bias", "none")
    if bias not in ("none", None):
        raise FormatError(f"bias={bias!r}: adapters that train biases are not supported", path=path)
    return raw


def _check_patterns(rank_pattern: dict, alpha_pattern: dict, path: Path) -> None:
    """Each rank_pattern value a rank, each alpha_pattern value an alpha, each key a regex PEFT compiles."""
    for pname, pat in (("rank_pattern", rank_pattern), ("alpha_pattern", alpha_pattern)):
        for k, v in pat.items():
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise FormatError(f"{pname}[{k!r}] is {v!r}, not a number", path=path)
            if pname == "rank_pattern" and (not isinstance(v, int) or not 0 < v <= MAX_RANK):
                raise FormatError(
                    f"rank_pattern[{k!r}] is {v!r}: a rank must be an integer in 1..{MAX_RANK}", path=path
                )
            if pname == "alpha_pattern":
                check_alpha(v, f"alpha_pattern[{k!r}]", path=path)
            check_regex(pname, k, path, compiled_as=r"(.*\.)?({})$")


def _targets(raw: dict, path: Path) -> list | tuple:
    """target_modules checked (a list of names, or a regex PEFT full-matches); returns target_parameters,
    which may name only the fused MoE experts' parameters."""
    targets = raw.get("target_modules")
    if isinstance(targets, str):  # PEFT: a string is a full-match regex over module names
        check_regex("target_modules", targets, path)
    elif targets is not None and not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        raise FormatError(
            f"target_modules is {targets!r}, expected a list of module names or a regex string", path=path
        )
    tparams = raw.get("target_parameters") or ()
    fused = {p for p, _ in FUSED_EXPERT_PARAMS}
    if not isinstance(tparams, (list, tuple)) or not all(isinstance(t, str) for t in tparams):
        raise FormatError(f"target_parameters is {tparams!r}, expected a list of parameter names", path=path)
    other = [t for t in tparams if t.rsplit(".", 1)[-1] not in fused]
    if other:
        raise FormatError(
            f"target_parameters={other!r}: a LoRA on a raw parameter other than the fused MoE experts' "
            f"{'/'.join(sorted(fused))} is not converted/merged by ckpt-tools",
            path=path,
            hint="merge it with PEFT's merge_and_unload",
        )
    return tparams
