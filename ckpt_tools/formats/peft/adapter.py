"""PEFT LoRA adapter dirs, read: `PeftAdapter`, the format's one handle (a context manager; its LoRA view for
the ops: `lora()`, `formats.peft.lora`). `adapter_config.json` (validated, `formats.peft.config`) and
`adapter_model.safetensors` (read by range) or `adapter_model.bin` (a torch pickle, loaded through the
allow-list and held whole: a .bin cannot be read by range). Every weight key is classified: LoRA A/B
of a module, a `modules_to_save` replacement, or unrecognized (refused when strict). A fused MoE expert
LoRA (`target_parameters`, `formats.peft.experts`) is presented as its per-expert modules
(`...mlp.experts.<e>.<proj>`), each a view into the fused tensors, so every op sees one naming.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from ...core.dtypes import dtype_name, itemsize
from ...core.errors import FormatError, UsageError
from ...core.keys import (
    PEFT_LORA_KEY,
    expert_index_clashes,
    expert_parts,
    fused_param_name,
    fused_peft_modules,
)
from ...io.inputs import as_input, lexists, read_input, register
from ..dcp.item import load_byte_item
from ..safetensors.header import read_header
from ..safetensors.read import read_tensor
from .config import ADAPTER_CONFIG, BIN_NAME, PEFT_PREFIX, SAFETENSORS_NAME, PeftConfig, parse_peft_config
from .experts import LAYOUT_FACTS, ExpertView, fused_params_of_config, parse_fused, read_view

if TYPE_CHECKING:  # annotations only: torch is imported where tensors are built
    import torch

__all__ = [
    "ADAPTER_CONFIG",
    "BIN_NAME",
    "MAX_ADAPTER_BIN_BYTES",
    "PEFT_PREFIX",
    "SAFETENSORS_NAME",
    "AdapterModule",
    "PeftAdapter",
    "load_adapter_bin",
    "open_peft_adapter",
]

MAX_ADAPTER_BIN_BYTES = 64 << 30


@dataclass(frozen=True)
class AdapterModule:
    module: str  # HF module FQN, e.g. model.layers.0.self_attn.q_proj
    a_key: str
    b_key: str
    rank: int  # from A's rows (the truth), checked against the config's
    scale: float
    view: ExpertView | None = (
        None  # a per-expert projection of a fused expert LoRA (a_key/b_key: the fused ones)
    )


class PeftAdapter:
    """An open PEFT adapter dir: config parsed, weight keys indexed, tensors read on demand."""

    def __init__(
        self,
        path: Path,
        config: PeftConfig,
        weights_path: Path,
        shapes: dict,
        dtypes: dict,
        loader,
        strict: bool,
    ):
        self.dir, self.config, self.weights_path = path, config, weights_path
        self.shapes: dict[str, tuple[int, ...]] = shapes  # key -> shape
        self.dtypes: dict[str, str] = dtypes  # key -> dtype name
        self._load = loader
        self._cache: dict[
            str, torch.Tensor
        ] = {}  # the last few fused tensors read (per-expert views of them)
        self.modules: dict[str, AdapterModule] = {}
        self.full_tensors: dict[str, str] = {}  # modules_to_save: HF name -> key
        self.unrecognized: list[str] = []
        pairs = self._classify_keys(shapes, config)
        problems = self._read_modules(pairs, shapes, config, weights_path)
        clash = expert_index_clashes(self.modules)
        if clash:  # one expert spelled two ways (`experts.3`, `experts.03`): which is expert 3 is ambiguous
            (x, y, expert), more = (
                clash[0],
                f" (and {len(clash) - 1} more such pairs)" if len(clash) > 1 else "",
            )
            problems.append(
                f"{self.modules[x].a_key} and {self.modules[y].a_key} both name expert "
                f"{expert}: ambiguous{more}"
            )
        if strict and (problems or self.unrecognized):
            self._refuse(problems, weights_path)
        self.problems = problems

    def _classify_keys(self, shapes: dict, config: PeftConfig) -> dict[str, dict[str, str]]:
        """module -> {A | B: key} of the LoRA factors in PEFT's spelling; modules_to_save tensors into
        `full_tensors`, every other key into `unrecognized`."""
        pairs: dict[str, dict[str, str]] = {}
        for k in shapes:
            name = k[len(PEFT_PREFIX) :] if k.startswith(PEFT_PREFIX) else None
            m = PEFT_LORA_KEY.match(k) if name else None
            if m and m["slot"] is None:  # PEFT's own spelling: the prefix, no adapter slot
                pairs.setdefault(m["module"], {})[m["ab"]] = k
            elif (
                name
                and "lora_" not in name
                and any(
                    name == f"{t}.weight"
                    or name.endswith(f".{t}.weight")
                    or name.endswith(f".{t}.bias")
                    or name == f"{t}.bias"
                    for t in config.modules_to_save
                )
            ):
                self.full_tensors[name] = k
            else:
                self.unrecognized.append(k)
        return pairs

    def _read_modules(
        self, pairs: dict[str, dict[str, str]], shapes: dict, config: PeftConfig, weights_path: Path
    ) -> list[str]:
        """`modules` from the factor pairs (a fused expert LoRA as its per-expert views); the problems."""
        problems = []
        params = fused_params_of_config(config.target_parameters)

        def fused_rank(experts: str, param: str) -> int | None:
            """The config's rank of another fused parameter of the block, when its LoRA is in the file."""
            saved = fused_peft_modules(experts, params).get(param)
            return config.rank_for(fused_param_name(experts, param)) if saved in pairs else None

        for mod, ab in sorted(pairs.items()):
            if set(ab) != {"A", "B"}:
                problems.append(f"{mod}: has lora_{''.join(ab)} without its partner")
                continue
            a_shape, b_shape = shapes[ab["A"]], shapes[ab["B"]]
            try:
                views = parse_fused(
                    mod, a_shape, b_shape, params, config.rank_for, fused_rank, weights_path, r=config.r
                )
            except FormatError as exc:
                problems.append(exc.message)
                continue
            if views is not None:
                for name, v in views:
                    self.modules[name] = AdapterModule(
                        name, ab["A"], ab["B"], v.fused.part_rank, config.scale_for(v.fused.name), v
                    )
                continue
            if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1]:
                problems.append(f"{mod}: A {list(a_shape)} and B {list(b_shape)} do not share a rank")
                continue
            rank = a_shape[0]
            if rank != config.rank_for(mod):
                problems.append(
                    f"{mod}: A has {rank} rows but the config's rank for it is {config.rank_for(mod)}"
                )
                continue
            self.modules[mod] = AdapterModule(mod, ab["A"], ab["B"], rank, config.scale_for(mod))
        return problems

    def _refuse(self, problems: list[str], weights_path: Path) -> None:
        """A strict open: every problem and unrecognized key in one FormatError."""
        lines = problems + [f"unrecognized key {k!r}" for k in self.unrecognized[:10]]
        more = len(self.unrecognized) - 10
        if more > 0:
            lines.append(f"... and {more} more")
        fixable = any(".lora_A.0." in k or not k.startswith(PEFT_PREFIX) for k in self.unrecognized)
        raise FormatError(
            "adapter weights do not follow PEFT's layout: " + "; ".join(lines),
            path=weights_path,
            hint="prime-rl exports need `ckpt fix-adapter SRC OUT` first"
            if fixable
            else "expected keys base_model.model.<module>.lora_A.weight / lora_B.weight",
        )

    def lora(self):
        """The adapter as a `LoraSource` (`formats.peft.lora.PeftLoraSource`) over this handle."""
        from .lora import PeftLoraSource

        return PeftLoraSource(self)

    def close(self) -> None:
        """Drop the fused tensors held for per-expert views (a safetensors adapter holds no open file)."""
        self._cache.clear()

    def __enter__(self) -> PeftAdapter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def read(self, key: str) -> torch.Tensor:
        return self._load(key)

    def read_factor(self, module: str, ab: str) -> torch.Tensor:
        """A or B of one module; of a fused expert LoRA's projection, its own slice (`read_view`)."""
        m = self.modules[module]
        key = m.a_key if ab == "A" else m.b_key
        if m.view is None:
            return self._load(key)
        t = self._cache.get(key)
        if t is None:
            if len(self._cache) >= 4:  # bounded: one block's fused A and B of gate_up and down
                self._cache.pop(next(iter(self._cache)))
            t = self._cache[key] = self._load(key)
        return read_view(m.view, ab, t, key=key, path=self.weights_path)

    def read_pair(self, module: str) -> tuple[torch.Tensor, torch.Tensor]:
        return self.read_factor(module, "A"), self.read_factor(module, "B")

    def factor_shape(self, module: str, ab: str) -> tuple[int, ...]:
        m = self.modules[module]
        if m.view is not None:
            return m.view.a_shape if ab == "A" else m.view.b_shape
        return tuple(self.shapes[m.a_key if ab == "A" else m.b_key])

    @property
    def layout(self) -> str:
        """`dense` (no expert LoRA: every layout is this file), `peft` (fused expert LoRA through
        target_parameters) or `per-expert` (`...experts.<e>.<proj>` modules: the vllm / prime-rl layout)."""
        if any(m.view is not None for m in self.modules.values()):
            return "peft"
        return "per-expert" if any(expert_parts(m) is not None for m in self.modules) else "dense"

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s) * itemsize(self.dtypes[k]) for k, s in self.shapes.items())

    def describe(self) -> dict:
        ranks = sorted({m.rank for m in self.modules.values()})
        scales = sorted({m.scale for m in self.modules.values()})
        return {
            "path": str(self.dir),
            "weights": self.weights_path.name,
            "modules": len(self.modules),
            "rank": ranks[0] if len(ranks) == 1 else ranks,
            "lora_alpha": self.config.lora_alpha,
            "scale": scales[0] if len(scales) == 1 else scales,
            "use_rslora": self.config.use_rslora,
            "targets": sorted({m.rsplit(".", 1)[-1] for m in self.modules}),
            "target_parameters": list(self.config.target_parameters),
            "layout": self.layout,
            "layouts": list(LAYOUT_FACTS[self.layout]["written_by"]),
            "consumers": dict(LAYOUT_FACTS[self.layout]["consumers"]),
            "modules_to_save": sorted(self.full_tensors),
            "dtypes": sorted(set(self.dtypes.values())),
            "bytes": self.nbytes,
            "base_model_name_or_path": self.config.base_model_name_or_path,
            "unrecognized_keys": len(self.unrecognized),
            "problems": self.problems,
        }


def load_adapter_bin(binf: Path) -> dict[str, torch.Tensor]:
    """adapter_model.bin, a torch pickle: read through the input checks (no FIFO, no symlink out of
    the adapter dir, not sparse), loaded by `load_byte_item` (records stored, pickle bounded,
    torch's weights_only allow-list: no code runs, no tensor bigger than its bytes), and checked
    to be a dict of str -> tensor. Held whole in memory (a .bin cannot be read by range)."""

    import torch  # lazy: metadata commands (inspect, verify) import this module without torch (2-3 s)

    raw = read_input(binf, root=binf.parent, what=binf.name, max_bytes=MAX_ADAPTER_BIN_BYTES)
    sd = load_byte_item(raw, trust=False, path=binf, key="")
    del raw
    if not isinstance(sd, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in sd.items()
    ):
        bad = (
            next(
                (k for k, v in sd.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)), None
            )
            if isinstance(sd, dict)
            else None
        )
        raise FormatError(
            f"{binf.name} is not a dict of name -> tensor"
            + (
                f" (entry {bad!r}: {type(sd[bad]).__name__})"
                if bad is not None
                else f" (it holds a {type(sd).__name__})"
                if not isinstance(sd, dict)
                else ""
            ),
            path=binf,
            hint="an adapter .bin is torch.save({name: tensor, ...})",
        )
    return sd


def open_peft_adapter(path: str | Path, *, strict: bool = True) -> PeftAdapter:
    d = as_input(path)
    if not d.is_dir():
        raise UsageError("not a PEFT adapter directory", path=d)
    register(d)  # the whole adapter dir is an input: no OUT inside it
    config = parse_peft_config(d / ADAPTER_CONFIG)
    st, binf = d / SAFETENSORS_NAME, d / BIN_NAME
    if lexists(st):
        header = read_header(st)
        infos = header.tensors
        shapes = {k: tuple(i.shape) for k, i in infos.items()}
        dtypes = {k: i.dtype_name for k, i in infos.items()}
        return PeftAdapter(d, config, st, shapes, dtypes, lambda k: read_tensor(infos[k], st), strict)
    if lexists(binf):
        sd = load_adapter_bin(binf)
        shapes = {k: tuple(v.shape) for k, v in sd.items()}
        dtypes = {k: dtype_name(v.dtype) for k, v in sd.items()}
        return PeftAdapter(d, config, binf, shapes, dtypes, lambda k: sd[k], strict)
    raise FormatError(f"no {SAFETENSORS_NAME} or {BIN_NAME} next to adapter_config.json", path=d)
