"""What the merge planner sees of its sources: plain facts (names, dtypes by name, shapes, files),
gathered from open sources by headers and metadata only. The planner (`plan.plan_from_facts`) is pure
over these, so it is tested on lists of facts like huggingface_hub's shard splitter."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...core.errors import FormatError, UsageError
from ...core.tied import TIED_PAIRS
from ...formats.handle import LoraSource, Source
from ...formats.hf_dir.carry import carry_files
from ...formats.hf_dir.config import config_mismatches, load_config
from ...formats.hf_dir.hub import resolve_model_dir
from ...formats.primerl.run_dir import resolve_run
from ...io.inputs import as_input

__all__ = [
    "AdapterFacts",
    "BaseFacts",
    "FullFact",
    "LoraFact",
    "SourceTensor",
    "adapter_facts",
    "dcp_base_facts",
    "hf_base_facts",
    "trained_on_problems",
]


@dataclass(frozen=True)
class SourceTensor:
    """One base tensor as the planner sees it."""

    name: str  # HF name
    dtype: str  # torch dtype name, e.g. "bfloat16"
    shape: tuple[int, ...]
    file: str | None  # HF shard file name; None for a DCP base
    key: str  # the HF name again, or the DCP key


@dataclass(frozen=True)
class LoraFact:
    module: str  # HF module FQN; merged into module + ".weight"
    rank: int
    scale: float
    fan_in_fan_out: bool
    a_key: str
    b_key: str
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]


@dataclass(frozen=True)
class FullFact:
    """A modules_to_save tensor of the adapter (replaces the base tensor of the same name)."""

    name: str
    key: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class BaseFacts:
    kind: str  # "hf" | "dcp"
    path: str
    tensors: tuple[SourceTensor, ...]  # in output order preference (HF: disk order)
    config: dict | None  # config.json of the output (from the base or --config-from)
    config_path: str | None
    files: tuple[tuple[str, int], ...]  # non-weight files to carry: (absolute path, bytes), by name
    skipped: tuple[str, ...] = ()  # entries of the config dir not carried (reported)


@dataclass(frozen=True)
class AdapterFacts:
    kind: str  # "peft" | "dcp"
    path: str
    slot: int | None
    modules: tuple[LoraFact, ...]
    full: tuple[FullFact, ...]
    describe: dict
    resident_bytes: int  # adapter bytes held for the whole run (.bin adapters)
    warnings: tuple[str, ...] = ()


def _with_sizes(paths) -> tuple[tuple[str, int], ...]:
    return tuple((str(p), as_input(p).stat().st_size) for p in paths)


def hf_base_facts(src: Source) -> BaseFacts:
    model = src
    tensors = []
    for name in model.disk_order():  # the logical face: a block-FP8 base's weights dequantized, float32
        f = model.facts(name)
        tensors.append(SourceTensor(name, f.dtype, tuple(f.shape), model.file_of(name), name))
    files = _with_sizes(model.non_weight_files())
    skipped = tuple(model.skipped_entries())
    config = model.config
    cfg_path = str(src.path / "config.json") if config is not None else None
    return BaseFacts("hf", str(src.path), tuple(tensors), config, cfg_path, files, skipped)


def dcp_base_facts(src: Source, config_from: str | Path | None) -> BaseFacts:
    """Base = the checkpoint's own fp32 masters (`app.model.<HF name>`); config/tokenizer from
    `config_from`, which must describe the checkpoint's model."""
    ckpt_dir = src.path
    if config_from is None and src.config_dir is not None:  # verl's huggingface/: the run's own config
        config_from = src.config_dir
    tensors = [
        SourceTensor(name, f.dtype, tuple(f.shape), None, src.ref(name))
        for name, f in ((n, src.facts(n)) for n in src.names())
    ]
    if config_from is None:
        outputs = resolve_run(ckpt_dir).outputs
        cands = sorted(outputs.glob("weights/step_*/config.json")) if outputs is not None else []
        hint = "pass --config-from DIR: the HF base model dir or hub id, or the run's outputs/weights/step_N"
        if cands:
            hint += f" (e.g. {cands[-1].parent})"
        raise UsageError(
            "--base-from-checkpoint needs --config-from: the checkpoint holds no config or tokenizer",
            path=ckpt_dir,
            hint=hint,
        )
    cdir = resolve_model_dir(config_from, need="config")
    config, cfg_path = load_config(
        cdir, required=True, hint="--config-from needs an HF model dir or the run's outputs/weights/step_N"
    )
    carry, skipped = carry_files(cdir)
    problems = config_mismatches(config, {t.name: t.shape for t in tensors})
    if problems:
        raise FormatError(
            "config does not describe the checkpoint's model: " + "; ".join(problems),
            path=cfg_path,
            hint="pass the --config-from of the model this run trained",
        )
    return BaseFacts(
        "dcp", str(ckpt_dir), tuple(tensors), config, cfg_path, _with_sizes(carry), tuple(skipped)
    )


def adapter_facts(src: LoraSource) -> AdapterFacts:
    """Facts of an open `LoraSource` (PEFT dir or DCP checkpoint)."""
    mods = [
        LoraFact(
            m,
            spec.rank,
            spec.scale,
            spec.fan_in_fan_out,
            spec.factor_ref("A"),
            spec.factor_ref("B"),
            spec.a_shape,
            spec.b_shape,
        )
        for m, spec in sorted(src.modules.items())
    ]
    full = []
    for name, key in sorted(src.full_tensors.items()):
        f = src.key_facts(key)
        full.append(FullFact(name, key, f.dtype, f.shape))
    return AdapterFacts(
        src.kind,
        str(src.path),
        src.slot,
        tuple(mods),
        tuple(full),
        src.describe(),
        src.resident_bytes,
        tuple(src.warnings),
    )


def trained_on_problems(base: BaseFacts, ckpt_base: Source) -> list[str]:
    """A DCP adapter records the base it trained on (fp32 masters): their names and shapes must
    match the HF base, or the merge would silently pair a LoRA with the wrong model."""
    by_name = {t.name: t for t in base.tensors}
    tied_out = {o for o, i in TIED_PAIRS if i in by_name and o not in by_name}
    problems = []
    for name in ckpt_base.names():
        shape = ckpt_base.facts(name).shape
        t = by_name.get(name)
        if t is None:
            if name not in tied_out:
                problems.append(f"{name} is in the checkpoint but not in the base")
        elif tuple(t.shape) != tuple(shape):
            problems.append(f"{name} is {list(shape)} in the checkpoint, {list(t.shape)} in the base")
    return problems
