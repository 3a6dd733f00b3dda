"""`ckpt extract-adapter`: a prime-rl DCP checkpoint's LoRA -> a PEFT adapter directory.

Plan, then execute. `plan_extract(source, options)` works from `.metadata`, the run's orch.toml and
(optionally) the base model's safetensors headers; it decides every output key, dtype, shape and
byte count and the whole `adapter_config.json`. `run_extract(plan, source, progress)` then streams:
for each output tensor in key order, read that one LoRA tensor (exactly its chunks' byte ranges),
cast, write it at its precomputed offset in `adapter_model.safetensors`, drop it. Memory: one LoRA
tensor plus its cast copy (a Qwen3-32B r=32 `gate_proj` B is 25600x32 fp32 = 3.3 MB), never the
whole adapter.

Alpha is not in the checkpoint: it is resolved by `formats.primerl.alpha` (--alpha, --run-config, the
run's orch.toml or trainer.json) and written as `lora_alpha` such that lora_alpha / r is the scale
training used. The base comes from --base or the run's config (`formats.primerl.run_dir.run_base_of`).
Base weights the optimizer trained whole (prime-rl HEAD `lora.modules_to_save`, found by their AdamW
state) are written as PEFT `modules_to_save` tensors under their exact module names.
The PEFT dir itself is written by `formats.peft.writer.write_adapter` (as `ckpt fix-adapter`'s is).

`--layout` (`core.keys.LAYOUTS`) says how grouped-expert LoRA is written: `peft` (the default) as the
fused expert LoRA PEFT loads through `target_parameters` (`formats.peft.experts`: gate and up as one
exact rank-2r block LoRA; each fused tensor is built from the experts' factors, one tensor in flight),
`vllm` / `prime-rl` as per-expert modules. For a dense LoRA the three are one file, byte for byte.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..core.casts import bf16_round
from ..core.errors import CkptError, FormatError, UsageError
from ..core.keys import DEFAULT_LAYOUT
from ..core.lora_math import check_modules_fit_base
from ..core.progress import Progress
from ..formats.dcp.lora import DcpLoraSource
from ..formats.handle import LoraModule
from ..formats.hf_dir.hub import locate_model
from ..formats.hf_dir.model_dir import tensor_shapes
from ..formats.peft.experts import FusedParam, build_fused
from ..formats.peft.layout import FullTensor, ModuleFactors, check_layout, plan_adapter_layout
from ..formats.peft.writer import OutTensor, safetensors_file_bytes, write_adapter
from ..formats.primerl import run_dir
from ..formats.primerl.alpha import run_adapter_configs, run_outputs_dir
from ..formats.primerl.run_dir import run_base_of
from ..io.inputs import read_json

__all__ = ["ExtractOptions", "ExtractPlan", "ExtractReport", "plan_extract", "run_extract"]


@dataclass(frozen=True)
class ExtractOptions:
    out: str | Path
    base: str | None = None  # base_model_name_or_path, and the shapes to check (default: orch.toml's)
    dtype: str = "fp32"  # fp32 (exact) | bf16
    layout: str = DEFAULT_LAYOUT  # peft | vllm | prime-rl (core.keys.LAYOUTS): how expert LoRA is written


# ------------------------------------------------------------------------------------ the plan
@dataclass(frozen=True)
class ExtractPlan:
    checkpoint: Path
    out: Path
    slot: int
    dtype: str
    modules: int
    rank: int
    alpha: float
    alpha_source: str
    scale: float
    lora_alpha: float
    base_model_name_or_path: str | None
    base_checked: Path | None
    tensors: tuple[OutTensor, ...]
    config: dict = field(repr=False)
    layout: str = DEFAULT_LAYOUT
    fused: tuple[FusedParam, ...] = field(default=(), repr=False)  # --layout peft of a MoE: the fused LoRAs
    lora_item_bytes: int = 0  # stored bytes of the LoRA items read (what --json calls bytes to read)
    lora_payload_bytes: int = 0  # fp32 values in them
    out_file_bytes: int = 0
    warnings: tuple[str, ...] = ()

    def to_json(self) -> dict:
        d = asdict(self)
        d["checkpoint"], d["out"] = str(self.checkpoint), str(self.out)
        d["base_checked"] = str(self.base_checked) if self.base_checked else None
        d["tensors"] = [t.to_json() for t in self.tensors]
        d["warnings"] = list(self.warnings)
        d["fused"] = [
            {
                "name": f.name,
                "peft_module": f.peft_module,
                "experts": f.num_experts,
                "rank": f.rank,
                "projections": list(f.projs),
                "projection_rank": f.part_rank,
            }
            for f in self.fused
        ]
        return d


def plan_extract(src: DcpLoraSource, options: ExtractOptions) -> ExtractPlan:
    """Decide everything from metadata (see module docstring). `src` is an open DcpLoraSource
    (its alpha already resolved)."""
    if options.dtype not in ("fp32", "bf16"):
        raise UsageError(f"--dtype {options.dtype!r}: choose fp32 (exact) or bf16")
    check_layout(options.layout)
    ckpt = src.ckpt
    modules = sorted(src.modules)
    if not modules:  # DcpLoraSource refuses this already; a zero-module adapter must never be written
        raise FormatError("zero LoRA modules to export", path=ckpt.dir)
    warnings = list(src.warnings)
    rank, scale = _rank_and_scale(src, warnings)
    base_name, base_dir, base_shapes = _base(src, options.base, warnings)
    if base_shapes is not None and base_dir is not None:
        shapes = {m: (src.modules[m].a_shape, src.modules[m].b_shape) for m in modules}
        check_modules_fit_base(shapes, base_shapes, base_dir)
    # modules_to_save: the base weights the optimizer trained whole (prime-rl HEAD `lora.modules_to_save`),
    # found from its state by the source, written under their exact module names
    full = dict(src.full_tensors)
    dtype = options.dtype
    layout = plan_adapter_layout(
        {m: _factors(src.modules[m], dtype) for m in modules},
        {name: FullTensor(tuple(src.key_facts(ref).shape), dtype, ref) for name, ref in sorted(full.items())},
        layout=options.layout,
        base_model_name_or_path=base_name,
        rank=rank,
        scale=scale,
        base_shapes=base_shapes,
        base_dir=base_dir,
        path=ckpt.dir,
    )
    warnings += [w for w in (layout.target_warning, *layout.inexact_alphas, layout.full_warning) if w]
    warnings += _untrained_modules_to_save(ckpt.dir, full)
    _check_full_shapes(src, full, base_shapes)
    entries = [ckpt.entries[k] for k in src.lora_keys()] + [
        ckpt.entries[r.partition("[")[0]] for r in dict.fromkeys(full.values())
    ]
    return ExtractPlan(
        checkpoint=ckpt.dir,
        out=Path(options.out),
        slot=src.slot,
        dtype=dtype,
        modules=len(modules),
        rank=rank,
        alpha=src.alpha,
        alpha_source=src.alpha_source,
        scale=scale,
        lora_alpha=layout.lora_alpha,
        base_model_name_or_path=base_name,
        base_checked=base_dir,
        tensors=layout.tensors,
        config=layout.config,
        layout=options.layout,
        fused=layout.fused,
        lora_item_bytes=sum(e.stored_bytes for e in entries),
        lora_payload_bytes=sum(e.nbytes for e in entries),
        out_file_bytes=safetensors_file_bytes(list(layout.tensors)),
        warnings=tuple(warnings),
    )


def _factors(m: LoraModule, dtype: str) -> ModuleFactors:
    """A checkpoint's LoRA module as the adapter writes it: both factors in `dtype`, read by their refs."""
    return ModuleFactors(m.a_shape, m.b_shape, dtype, dtype, m.factor_ref("A"), m.factor_ref("B"))


def _rank_and_scale(src: DcpLoraSource, warnings: list[str]) -> tuple[int, float]:
    """prime-rl trains one rank: the adapter's `r`, and the training scale alpha / r."""
    ranks = sorted({s.rank for s in src.modules.values()})
    if len(ranks) != 1:
        raise FormatError(
            f"LoRA ranks vary across modules ({ranks}); prime-rl trains one rank and "
            "this export writes one `r`",
            path=src.ckpt.dir,
        )
    rank = ranks[0]
    scale = src.alpha / rank
    if bf16_round(scale) != scale:
        warnings.append(
            f"scale {scale!r} (alpha {src.alpha:g} / r {rank}) is not exact in bf16; prime-rl "
            f"applied bf16({scale:.6g}) = {bf16_round(scale)!r} during training. The adapter keeps "
            "alpha / r exactly, as PEFT and vLLM compute it"
        )
    return rank, scale


def _base(
    src: DcpLoraSource, base: str | None, warnings: list[str]
) -> tuple[str | None, Path | None, dict[str, tuple[int, ...]] | None]:
    """The base model: its name (base_model_name_or_path: --base, else the run config's), the dir it
    resolves to here and its tensor shapes (None when not found: the shapes go unchecked)."""
    ckpt = src.ckpt
    base_name: str | None
    if base is not None:
        base_name = base
        base_dir, why = locate_model(base, run_root=None)
    else:
        run_base = run_base_of(ckpt.dir)
        config_path = src.resolution.config_path if src.resolution is not None else None
        if run_base is None and config_path is not None:  # --run-config named elsewhere
            run_base = run_dir.run_base(run_dir.resolve_run(ckpt.dir, config=config_path))
        base_name = run_base.name if run_base is not None else None
        base_dir, why = (run_base.dir, run_base.problem) if run_base is not None else (None, None)
    if base_name is None:
        warnings.append(
            "no base model name: pass --base NAME_OR_DIR (the run's config names no model.name); "
            "base_model_name_or_path is left null, so PEFT/vLLM users must supply the base"
        )
    if base_dir is not None:
        base_shapes, _cfg = tensor_shapes(base_dir)
        return base_name, base_dir, base_shapes
    if base_name is not None:
        warnings.append(
            f"base model {base_name!r} not found locally ({why}); LoRA shapes were not checked against it"
        )
    return base_name, None, None


def _untrained_modules_to_save(ckpt_dir: Path, full: dict[str, str]) -> list[str]:
    """The warning when the run's adapter configs list modules_to_save the optimizer never trained."""
    listed: set[str] = set()
    for c in run_adapter_configs(ckpt_dir):
        try:
            found = read_json(c, root=run_outputs_dir(ckpt_dir), what="adapter_config.json").get(
                "modules_to_save"
            )
            listed.update(m for m in (found or []) if isinstance(m, str))
        except (CkptError, AttributeError, TypeError):
            continue
    if not listed or full:
        return []
    return [
        f"the run's adapter configs list modules_to_save {sorted(listed)}, but the checkpoint's "
        "optimizer holds no state for any base weight: they were not trained (prime-rl 16e747c's "
        "optimizer updates the LoRA only, format §6.3), so the base's own values are the trained "
        "ones and this adapter holds the LoRA only"
    ]


def _check_full_shapes(
    src: DcpLoraSource, full: dict[str, str], base_shapes: dict[str, tuple[int, ...]] | None
) -> None:
    """Each trained full tensor has its base weight's shape."""
    for name, ref in full.items():
        f = src.key_facts(ref)
        if base_shapes is not None and tuple(base_shapes.get(name, ())) != tuple(f.shape):
            raise FormatError(
                f"trained full tensor {name} is {list(f.shape)}, the base's is "
                f"{list(base_shapes.get(name, [])) or 'absent'}",
                path=src.ckpt.dir,
                key=ref,
                hint="pass the base model the run trained (--base)",
            )


@dataclass(frozen=True)
class ExtractReport:
    plan: ExtractPlan
    written_file_bytes: int | None = None  # None: a dry run
    bytes_read: int = 0
    seconds: float = 0.0

    def to_json(self) -> dict:
        rep = self.plan.to_json()
        if self.written_file_bytes is None:
            rep["dry_run"] = True
            return rep
        p = self.plan
        rep.update(
            written_file_bytes=self.written_file_bytes,
            bytes_read=self.bytes_read,
            seconds=self.seconds,
            read_ratio=round(self.bytes_read / p.lora_item_bytes, 4) if p.lora_item_bytes else None,
        )
        return rep


def run_extract(
    plan: ExtractPlan, src: DcpLoraSource, progress: Progress | None = None, *, overwrite: bool = False
) -> ExtractReport:
    """Execute `plan`: one LoRA tensor in flight (`progress`: one event per tensor), OUT written whole or
    not at all (`write_adapter`)."""
    t0 = time.perf_counter()
    before = src.ckpt.stats.bytes_read
    inputs = [plan.checkpoint] + ([plan.base_checked] if plan.base_checked else [])  # --base is read too
    full_refs = set(src.full_tensors.values())
    fused = {f.source(ab): (f, ab) for f in plan.fused for ab in "AB"}

    refs = {m.factor_ref(ab): (name, ab) for name, m in src.modules.items() for ab in "AB"}

    def read(t: OutTensor):  # bytes (`RawTensor`): no torch; write_adapter casts them to the planned dtype
        if t.source in fused:  # a fused expert LoRA: placed from every expert's factor of the block
            f, ab = fused[t.source]
            return build_fused(f, ab, src.read_raw_factor)
        return src.read_raw_key(t.source) if t.source in full_refs else src.read_raw_factor(*refs[t.source])

    size = write_adapter(
        plan.out,
        plan.tensors,
        read,
        plan.config,
        inputs=inputs,
        overwrite=overwrite,
        progress=progress,
        stage="extract",
    )
    return ExtractReport(plan, size, src.ckpt.stats.bytes_read - before, round(time.perf_counter() - t0, 3))
