"""PEFT adapter dirs written by us: `adapter_model.safetensors` (keys
`base_model.model.<module>.lora_A/B.weight`,
one tensor in flight) and an `adapter_config.json` in PEFT's own layout (`peft_config`), loadable as is
by PEFT and vLLM. `write_adapter` is the one way both `ckpt extract-adapter` and `ckpt fix-adapter`
write one: staged beside OUT, streamed, renamed into place when complete."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...core.dtypes import SHORT_NAMES, itemsize, torch_dtype
from ...core.errors import FormatError
from ...core.keys import peft_target
from ...core.progress import Progress, report
from ...io.files import hash_written_file, write_new_file
from ...io.remote_display import display
from ...io.remote_url import redact
from ...io.staging import AtomicOutputDir
from ..handle import RawTensor, is_torch_tensor
from ..hf_dir.digests import SUMS_NAME, format_sums
from ..safetensors.writer import StreamingSafetensorsWriter, build_header
from .config import ADAPTER_CONFIG, PEFT_PREFIX, SAFETENSORS_NAME

if TYPE_CHECKING:  # annotations only: a caller that reads torch tensors has imported torch
    import torch

__all__ = [
    "PEFT_CONFIG_DEFAULTS",
    "SAFETENSORS_METADATA",
    "VLLM_REFUSED_FULL",
    "AdapterDirReport",
    "OutTensor",
    "config_json",
    "exact_modules_to_save",
    "full_tensor_warning",
    "peft_config",
    "peft_key",
    "safetensors_file_bytes",
    "target_modules_for",
    "write_adapter",
]

SAFETENSORS_METADATA = {"format": "pt"}

# The tensors of an adapter are small: reserve this much beyond their exact bytes for the header and
# adapter_config.json in the disk-space pre-flight.
_SLACK_BYTES = 1 << 20

# adapter_config.json as PEFT's own `LoraConfig(...).to_dict()` writes it (the field set of the
# fixture's reference_peft_adapter, written by the peft library), with our values filled in by
# `peft_config`. A fixed table, not a live peft import: the output must not depend on which peft
# version happens to be installed, and every field here is one PEFT and vLLM accept.
PEFT_CONFIG_DEFAULTS: dict = {
    "alpha_pattern": {},
    "auto_mapping": None,
    "base_model_name_or_path": None,
    "bias": "none",
    "corda_config": None,
    "eva_config": None,
    "exclude_modules": None,
    "fan_in_fan_out": False,
    "inference_mode": True,
    "init_lora_weights": True,
    "layer_replication": None,
    "layers_pattern": None,
    "layers_to_transform": None,
    "loftq_config": {},
    "lora_alpha": None,
    "lora_bias": False,
    "lora_dropout": 0.0,
    "megatron_config": None,
    "megatron_core": "megatron.core",
    "modules_to_save": None,
    "peft_type": "LORA",
    "qalora_group_size": 16,
    "r": None,
    "rank_pattern": {},
    "revision": None,
    "target_modules": None,
    "target_parameters": None,
    "task_type": "CAUSAL_LM",
    "trainable_token_indices": None,
    "use_dora": False,
    "use_qalora": False,
    "use_rslora": False,
}


def peft_key(module: str, ab: str) -> str:
    """`model.layers.0.mlp.up_proj`, "A" -> `base_model.model.model.layers.0.mlp.up_proj.lora_A.weight`."""
    return f"{PEFT_PREFIX}{module}.lora_{ab}.weight"


def full_tensor_warning(modules: Sequence[str]) -> str | None:
    """The consumer warning for an adapter with these modules_to_save (None when it has none)."""
    if not modules:
        return None
    refused = [m for m in modules if m.rsplit(".", 1)[-1] in VLLM_REFUSED_FULL]
    text = f"the adapter holds trained full tensors (modules_to_save {list(modules)}): PEFT loads them"
    if refused:
        text += (
            f"; vLLM refuses an adapter whose modules_to_save holds embed_tokens/lm_head ({refused}): serve "
            f"the "
            "merged model there (`ckpt merge` / `ckpt export`)"
        )
    return text


def peft_config(
    *,
    r: int,
    lora_alpha: float,
    target_modules: list[str],
    base_model_name_or_path: str | None,
    modules_to_save: list[str] | None = None,
    fused: dict | None = None,
) -> dict:
    """`fused`: the target_parameters / rank_pattern / alpha_pattern of a fused MoE expert LoRA
    (`formats.peft.experts.fused_config`)."""
    cfg = dict(PEFT_CONFIG_DEFAULTS)
    cfg.update(
        r=int(r),
        lora_alpha=float(lora_alpha),
        target_modules=list(target_modules),
        # a base given as a URL is named as the URL, never by its local stand-in (io.remote)
        base_model_name_or_path=redact(display(base_model_name_or_path)),
        modules_to_save=sorted(modules_to_save) if modules_to_save else None,
    )
    if fused:
        cfg.update(
            target_parameters=list(fused["target_parameters"]),
            rank_pattern=dict(fused["rank_pattern"]),
            alpha_pattern={k: float(v) for k, v in fused["alpha_pattern"].items()},
        )
    return cfg


def config_json(cfg: dict) -> str:
    """PEFT's own layout: sorted keys, 2-space indent."""
    return json.dumps(cfg, indent=2, sort_keys=True, allow_nan=False) + "\n"


def target_modules_for(
    modules: list[str], base_shapes: dict[str, tuple[int, ...]] | None
) -> tuple[list[str], str | None]:
    """PEFT target_modules: the sorted suffixes when they select exactly our modules in the base
    (or when there is no base to check); else the explicit module names (PEFT matches an exact
    name too), so PEFT creates no LoRA layer that has no weights."""
    suffixes = sorted({peft_target(m) for m in modules})
    if base_shapes is None:
        return suffixes, None
    selected = {
        k[: -len(".weight")]
        for k, s in base_shapes.items()
        if k.endswith(".weight") and len(s) == 2 and peft_target(k[: -len(".weight")]) in suffixes
    }
    if selected == set(modules):
        return suffixes, None
    return sorted(modules), (
        f"the LoRA covers {len(modules)} of the {len(selected)} base modules named "
        f"{', '.join(suffixes)}; target_modules lists the {len(modules)} module names "
        "explicitly"
    )


# vLLM's LoRA loader refuses an adapter whose modules_to_save holds these (it supports LoRA deltas only).
VLLM_REFUSED_FULL = ("embed_tokens", "lm_head", "wte")


def exact_modules_to_save(
    names: Sequence[str], base_names: Collection[str] | None, *, path: Path | None = None
) -> list[str]:
    """PEFT `modules_to_save` entries that select exactly the modules of `names` (HF tensor names, e.g.
    `lm_head.weight`, `model.norm.weight`): each tensor's full module name.

    PEFT 0.21 wraps every module whose name *ends with* an entry as a string
    (`peft.utils.other._set_trainable`:
    `key.endswith(target_key)`), so `["norm"]` would wrap model.norm, every `q_norm` and every
    `input_layernorm`; the full name `model.norm` ends no other module's name. With `base_names` (the base's
    tensor names) that is checked: an entry another base module's name also ends with is an error."""
    mods = sorted({n.rsplit(".", 1)[0] if n.endswith((".weight", ".bias")) else n for n in names})
    if base_names is not None:
        all_modules = {".".join(n.split(".")[:i]) for n in base_names for i in range(1, n.count(".") + 1)}
        for m in mods:
            others = sorted(o for o in all_modules if o != m and o.endswith(m))
            if others:
                raise FormatError(
                    f"modules_to_save entry {m!r} cannot select only {m}: PEFT matches entries as name "
                    f"suffixes and {others[0]} also ends with it",
                    path=path,
                    key=m,
                    hint="merge the checkpoint instead (`ckpt merge` / `ckpt export`)",
                )
    return mods


@dataclass(frozen=True)
class OutTensor:
    name: str  # key in adapter_model.safetensors
    shape: tuple[int, ...]
    dtype: str  # "fp32" | "bf16"
    source: str  # where it comes from (DCP key, source file key)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(SHORT_NAMES[self.dtype])

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "source": self.source}


def safetensors_file_bytes(tensors: list[OutTensor]) -> int:
    entries = [(t.name, SHORT_NAMES[t.dtype], t.shape) for t in tensors]
    return len(build_header(entries, SAFETENSORS_METADATA)) + sum(t.nbytes for t in tensors)


def write_adapter(
    out: Path,
    tensors: Sequence[OutTensor],
    read: Callable[[OutTensor], torch.Tensor | RawTensor],
    config: dict,
    *,
    inputs: list[Path],
    overwrite: bool = False,
    progress: Progress | None = None,
    stage: str,
) -> int:
    """Write the PEFT adapter dir `out`: adapter_model.safetensors (tensors in the given order, which
    callers sort by name; `read` returns one at a time, a torch.Tensor or a `RawTensor` (bytes: no torch),
    cast to its planned dtype here, identically either way) and
    adapter_config.json from `config`. Staged in an `AtomicOutputDir` (disk space checked first; OUT
    may not be or hold any of `inputs`; replaced only under `overwrite`) and renamed into place when
    complete. `progress` gets one `stage` event per tensor. Returns the safetensors file size."""
    tensors = list(tensors)
    done = 0

    def read_counted(t: OutTensor) -> torch.Tensor | RawTensor:
        nonlocal done
        value = read(t)
        done += 1
        report(progress, stage, done, len(tensors), unit="tensors", name=t.name)
        return value

    need = safetensors_file_bytes(tensors) + _SLACK_BYTES
    with AtomicOutputDir(out, inputs=inputs, need_bytes=need, overwrite=overwrite) as tmp:
        size = _write_files(tmp, tensors, read_counted, config)
    return size


def _write_files(
    directory: Path,
    tensors: list[OutTensor],
    read: Callable[[OutTensor], torch.Tensor | RawTensor],
    config: dict,
) -> int:
    entries = [(t.name, SHORT_NAMES[t.dtype], t.shape) for t in tensors]
    with StreamingSafetensorsWriter(directory / SAFETENSORS_NAME, entries, SAFETENSORS_METADATA) as w:
        for t in tensors:
            got = read(t)
            value: torch.Tensor | RawTensor
            if is_torch_tensor(got):
                value = got.to(torch_dtype(SHORT_NAMES[t.dtype])).contiguous()
            else:  # bytes, cast as torch casts them (`core.casts`)
                value = RawTensor.of(got).cast(SHORT_NAMES[t.dtype])
            del got
            if tuple(value.shape) != t.shape:
                raise FormatError(f"read {list(value.shape)}, planned {list(t.shape)}", key=t.source)
            w.write(t.name, value if is_torch_tensor(value) else value.data)
            del value
        size = w.file_bytes
    write_new_file(directory / ADAPTER_CONFIG, config_json(config))
    # SHA256SUMS (`formats.hf_dir.digests`): `verify --deep` and `sha256sum -c` prove the bytes later
    write_new_file(
        directory / SUMS_NAME,
        format_sums({n: hash_written_file(directory / n) for n in (SAFETENSORS_NAME, ADAPTER_CONFIG)}),
    )
    return size


@dataclass(frozen=True)
class AdapterDirReport:
    """What a command that writes one PEFT adapter dir reports (fix-adapter, average, resize-adapter): its
    plan's JSON, and unless a dry run the bytes written and the seconds. Each op subclasses it with its
    plan."""

    plan: Any
    written_file_bytes: int | None = None  # None: a dry run
    seconds: float = 0.0

    def to_json(self) -> dict:
        rep = self.plan.to_json()
        if self.written_file_bytes is None:
            rep["dry_run"] = True
        else:
            rep.update(written_file_bytes=self.written_file_bytes, seconds=self.seconds)
        return rep
