"""Reading PEFT LoRA adapter dirs (adapter_config.json + adapter_model.safetensors|.bin).

The config is validated completely before any tensor byte is read: peft_type, r, lora_alpha,
rsLoRA, rank/alpha patterns, fan_in_fan_out, modules_to_save, and the LoRA variants we do not
convert exactly (DoRA, LoRA bias, QALoRA, layer replication, target_parameters...) are refused
with a message naming the field.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .alpha import check_alpha
from .errors import FormatError, UsageError
from .inputs import read_input, read_json, register
from .lora_math import lora_scale

PEFT_PREFIX = "base_model.model."
MAX_RANK = 1 << 16
MAX_ADAPTER_BIN_BYTES = 64 << 30
ADAPTER_CONFIG = "adapter_config.json"
SAFETENSORS_NAME = "adapter_model.safetensors"
BIN_NAME = "adapter_model.bin"
_LORA_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")

# Config fields that switch on a LoRA variant whose math is not W + s*B@A. (field, "off" test)
UNSUPPORTED_VARIANTS: tuple[tuple[str, object], ...] = (
    ("use_dora", lambda v: not v),
    ("lora_bias", lambda v: not v),
    ("use_qalora", lambda v: not v),
    ("use_bdlora", lambda v: not v),
    ("layer_replication", lambda v: v in (None, [], {})),
    ("target_parameters", lambda v: v in (None, [], {})),
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
    bare = re.sub(r"\[(?:\\.|[^\]])*\]", "c", pattern)   # quantifier chars inside [...] are literals
    if len(pattern) > _MAX_PATTERN_CHARS or _NESTED_REPEAT.search(bare) or len(_UNBOUNDED.findall(bare)) > 3:
        raise FormatError(f"{field} pattern {pattern[:80]!r} has nested or many repetitions: matching it can take "
                          "exponential time (a crafted config hangs any loader that uses it)", path=path,
                          hint="use module names or simple patterns such as 'layers\\.\\d+\\.mlp\\..*'")
    try:
        re.compile(compiled_as.replace("{}", pattern))
    except re.error as e:
        raise FormatError(f"{field} pattern {pattern[:80]!r} is not a valid regular expression: {e}",
                          path=path) from None


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
    return any(module == t or module.endswith("." + t) for t in targets)


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
            raise FormatError(f"adapter_config.json has no {name!r}", path=path,
                              hint="a PEFT LoRA config needs peft_type, r and lora_alpha")
        return default
    v = raw[name]
    if not isinstance(v, types) or isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise FormatError(f"{name!r} is {v!r} ({type(v).__name__}), expected {types}", path=path)
    return v


def parse_peft_config(path: Path) -> PeftConfig:
    path = Path(path)
    if not os.path.lexists(path):
        raise FormatError("missing adapter_config.json", path=path)
    raw = read_json(path, root=path.parent, what="adapter_config.json")
    if not isinstance(raw, dict):
        raise FormatError("adapter_config.json is not a JSON object", path=path)
    ptype = raw.get("peft_type")
    if ptype is None:
        raise FormatError("adapter_config.json has no 'peft_type'", path=path, hint="expected \"LORA\"")
    if ptype != "LORA":
        raise FormatError(f"peft_type {ptype!r} is not supported: only LoRA adapters are", path=path)
    for name, ok in UNSUPPORTED_VARIANTS:
        if name in raw and not ok(raw[name]):
            raise FormatError(f"{name}={raw[name]!r}: this LoRA variant is not plain W + s*B@A and is not "
                              "converted/merged by ckpt-tools", path=path,
                              hint=f"merge it with PEFT's merge_and_unload, or retrain without {name}")
    bias = raw.get("bias", "none")
    if bias not in ("none", None):
        raise FormatError(f"bias={bias!r}: adapters that train biases are not supported", path=path)
    r = _need(raw, "r", int, path)
    if not 0 < r <= MAX_RANK:
        raise FormatError(f"'r' must be in 1..{MAX_RANK}, got {r}", path=path)
    alpha = _need(raw, "lora_alpha", (int, float), path)
    check_alpha(alpha, "'lora_alpha'", path=path)
    rank_pattern = _need(raw, "rank_pattern", dict, path, {}, required=False)
    alpha_pattern = _need(raw, "alpha_pattern", dict, path, {}, required=False)
    for pname, pat in (("rank_pattern", rank_pattern), ("alpha_pattern", alpha_pattern)):
        for k, v in pat.items():
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise FormatError(f"{pname}[{k!r}] is {v!r}, not a number", path=path)
            if pname == "rank_pattern" and (not isinstance(v, int) or not 0 < v <= MAX_RANK):
                raise FormatError(f"rank_pattern[{k!r}] is {v!r}: a rank must be an integer in 1..{MAX_RANK}",
                                  path=path)
            if pname == "alpha_pattern":
                check_alpha(v, f"alpha_pattern[{k!r}]", path=path)
            check_regex(pname, k, path, compiled_as=r"(.*\.)?({})$")
    targets = raw.get("target_modules")
    if isinstance(targets, str):   # PEFT: a string is a full-match regex over module names
        check_regex("target_modules", targets, path)
    elif targets is not None and not (isinstance(targets, list) and all(isinstance(t, str) for t in targets)):
        raise FormatError(f"target_modules is {targets!r}, expected a list of module names or a regex string",
                          path=path)
    mts = raw.get("modules_to_save") or ()
    if not isinstance(mts, (list, tuple)) or not all(isinstance(m, str) for m in mts):
        raise FormatError(f"modules_to_save is {mts!r}, expected a list of names", path=path)
    return PeftConfig(path=path, r=r, lora_alpha=float(alpha),
                      use_rslora=bool(_need(raw, "use_rslora", bool, path, False, required=False)),
                      fan_in_fan_out=bool(_need(raw, "fan_in_fan_out", bool, path, False, required=False)),
                      rank_pattern=rank_pattern, alpha_pattern=alpha_pattern,
                      target_modules=raw.get("target_modules"), modules_to_save=tuple(mts),
                      base_model_name_or_path=raw.get("base_model_name_or_path"), raw=raw)


@dataclass(frozen=True)
class AdapterModule:
    module: str        # HF module FQN, e.g. model.layers.0.self_attn.q_proj
    a_key: str
    b_key: str
    rank: int          # from A's rows (the truth), checked against the config's
    scale: float


class PeftAdapter:
    """An open PEFT adapter dir: config parsed, weight keys indexed, tensors read on demand."""

    def __init__(self, path: Path, config: PeftConfig, weights_path: Path, shapes: dict, dtypes: dict,
                 loader, strict: bool):
        self.dir, self.config, self.weights_path = path, config, weights_path
        self._shapes, self._dtypes, self._load = shapes, dtypes, loader
        self.modules: dict[str, AdapterModule] = {}
        self.full_tensors: dict[str, str] = {}     # modules_to_save: HF name -> key
        self.unrecognized: list[str] = []
        pairs: dict[str, dict[str, str]] = {}
        for k in shapes:
            name = k[len(PEFT_PREFIX):] if k.startswith(PEFT_PREFIX) else None
            m = _LORA_KEY.match(name) if name else None
            if m:
                pairs.setdefault(m["module"], {})[m["ab"]] = k
            elif name and "lora_" not in name and any(
                    name == f"{t}.weight" or name.endswith(f".{t}.weight") or name.endswith(f".{t}.bias")
                    or name == f"{t}.bias" for t in config.modules_to_save):
                self.full_tensors[name] = k
            else:
                self.unrecognized.append(k)
        problems = []
        for mod, ab in sorted(pairs.items()):
            if set(ab) != {"A", "B"}:
                problems.append(f"{mod}: has lora_{''.join(ab)} without its partner")
                continue
            a_shape, b_shape = shapes[ab["A"]], shapes[ab["B"]]
            if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1]:
                problems.append(f"{mod}: A {list(a_shape)} and B {list(b_shape)} do not share a rank")
                continue
            rank = a_shape[0]
            if rank != config.rank_for(mod):
                problems.append(f"{mod}: A has {rank} rows but the config's rank for it is {config.rank_for(mod)}")
                continue
            self.modules[mod] = AdapterModule(mod, ab["A"], ab["B"], rank, config.scale_for(mod))
        if strict and (problems or self.unrecognized):
            lines = problems + [f"unrecognized key {k!r}" for k in self.unrecognized[:10]]
            more = len(self.unrecognized) - 10
            if more > 0:
                lines.append(f"... and {more} more")
            fixable = any(".lora_A.0." in k or not k.startswith(PEFT_PREFIX) for k in self.unrecognized)
            raise FormatError("adapter weights do not follow PEFT's layout: " + "; ".join(lines),
                              path=weights_path,
                              hint="prime-rl exports need `ckpt fix-adapter SRC OUT` first" if fixable else
                              "expected keys base_model.model.<module>.lora_A.weight / lora_B.weight")
        self.problems = problems

    def read(self, key: str) -> torch.Tensor:
        return self._load(key)

    def read_pair(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        m = self.modules[module]
        return self._load(m.a_key), self._load(m.b_key)

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) * self._dtypes[k].itemsize for k, s in self._shapes.items())

    def describe(self) -> dict:
        ranks = sorted({m.rank for m in self.modules.values()})
        scales = sorted({m.scale for m in self.modules.values()})
        return {"path": str(self.dir), "weights": self.weights_path.name, "modules": len(self.modules),
                "rank": ranks[0] if len(ranks) == 1 else ranks, "lora_alpha": self.config.lora_alpha,
                "scale": scales[0] if len(scales) == 1 else scales, "use_rslora": self.config.use_rslora,
                "targets": sorted({m.rsplit(".", 1)[-1] for m in self.modules}),
                "modules_to_save": sorted(self.full_tensors),
                "dtypes": sorted({str(d).replace("torch.", "") for d in self._dtypes.values()}),
                "bytes": self.nbytes, "base_model_name_or_path": self.config.base_model_name_or_path,
                "unrecognized_keys": len(self.unrecognized), "problems": self.problems}


def load_adapter_bin(binf: Path) -> dict[str, torch.Tensor]:
    """adapter_model.bin, a torch pickle: read through the input checks (no FIFO, no symlink out of
    the adapter dir, not sparse), loaded by `load_byte_item` (records stored, pickle bounded,
    torch's weights_only allow-list: no code runs, no tensor bigger than its bytes), and checked
    to be a dict of str -> tensor. Held whole in memory (a .bin cannot be read by range)."""
    from .dcp.reader import load_byte_item

    raw = read_input(binf, root=binf.parent, what=binf.name, max_bytes=MAX_ADAPTER_BIN_BYTES)
    sd = load_byte_item(raw, trust=False, path=binf, key="")
    del raw
    if not isinstance(sd, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                           for k, v in sd.items()):
        bad = next((k for k, v in sd.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)), None) \
            if isinstance(sd, dict) else None
        raise FormatError(f"{binf.name} is not a dict of name -> tensor"
                          + (f" (entry {bad!r}: {type(sd[bad]).__name__})" if bad is not None else
                             f" (it holds a {type(sd).__name__})" if not isinstance(sd, dict) else ""),
                          path=binf, hint="an adapter .bin is torch.save({name: tensor, ...})")
    return sd


def open_peft_adapter(path: str | Path, *, strict: bool = True) -> PeftAdapter:
    d = Path(path)
    if not d.is_dir():
        raise UsageError("not a PEFT adapter directory", path=d)
    register(d)   # the whole adapter dir is an input: no OUT inside it
    config = parse_peft_config(d / ADAPTER_CONFIG)
    st, binf = d / SAFETENSORS_NAME, d / BIN_NAME
    if os.path.lexists(st):
        from .formats.safetensors_io import read_header, read_tensor

        header = read_header(st)
        infos = header.tensors
        shapes = {k: tuple(i.shape) for k, i in infos.items()}
        dtypes = {k: i.torch_dtype for k, i in infos.items()}
        return PeftAdapter(d, config, st, shapes, dtypes, lambda k: read_tensor(infos[k], st), strict)
    if os.path.lexists(binf):
        sd = load_adapter_bin(binf)
        shapes = {k: tuple(v.shape) for k, v in sd.items()}
        dtypes = {k: v.dtype for k, v in sd.items()}
        return PeftAdapter(d, config, binf, shapes, dtypes, lambda k: sd[k], strict)
    raise FormatError(f"no {SAFETENSORS_NAME} or {BIN_NAME} next to adapter_config.json", path=d)
