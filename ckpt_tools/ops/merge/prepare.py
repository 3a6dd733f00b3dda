"""`ckpt merge`'s sources and plan: open the base and the adapter (headers and metadata only), then
`plan_merge(sources, options)`: resolve alpha, refuse what would merge wrongly (`guards`), and plan
every output tensor from facts (`plan.plan_from_facts`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ...core.dtypes import parse_cli_dtype
from ...core.errors import FormatError, UsageError
from ...core.units import parse_size
from ...formats.dcp.layout import is_checkpoint_path, resolve_checkpoint_dir
from ...formats.dcp.reader import DcpCheckpoint
from ...formats.handle import LoraSource, Source
from ...formats.hf_dir.model_dir import HFModelDir
from ...formats.trainers import open_trainer, trainer_dir, trainer_kind
from ...io.inputs import as_input
from ...io.staging import AtomicOutputDir
from ...sources.open import open_lora_source
from .facts import adapter_facts, dcp_base_facts, hf_base_facts, trained_on_problems
from .guards import check_masters_match_base, check_target_modules, default_out_dtype
from .plan import DEFAULT_MAX_SHARD, DEFAULT_THREADS, MergePlan, plan_from_facts

__all__ = ["MergeOptions", "MergeSources", "check_output", "open_merge_sources", "plan_merge"]

_NO_BASE_HINT = "a slim checkpoint has none: `ckpt rehydrate` it first, or merge into the HF base"


@dataclass(frozen=True)
class MergeOptions:
    """What the user asked for. `base`: an HF model dir or hub id (local HF cache only); with
    `base_from_checkpoint`, a DCP checkpoint whose fp32 masters are the base (None: the adapter itself,
    which must then be a DCP checkpoint), config and tokenizer from `config_from`. `dtype` None: an fp16
    base stays fp16, else bf16 (`guards.default_out_dtype`)."""

    out: str = ""
    base_from_checkpoint: bool = False
    config_from: str | None = None
    alpha: float | None = None
    run_config: str | None = None
    slot: int = 0
    dtype: str | None = None
    max_shard_size: str | int = DEFAULT_MAX_SHARD
    threads: int | None = None
    trust_pickle: bool = False
    allow_zero_delta: bool = False


@dataclass
class MergeSources:
    base: Source  # an HF dir, or a checkpoint's base weights (--base-from-checkpoint)
    adapter: LoraSource  # a PEFT adapter's or a checkpoint's LoRA

    def close(self) -> None:
        for s in {id(x): x for x in (self.adapter, self.base)}.values():
            s.close()

    def __enter__(self) -> MergeSources:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def open_merge_sources(base: str | Path | None, adapter: str | Path, options: MergeOptions) -> MergeSources:
    """Open the adapter (alpha resolved; a PEFT adapter whose target_modules misses its own modules is
    refused before the base is opened), then the base, by headers and metadata only."""
    if not options.base_from_checkpoint and options.config_from is not None:
        raise UsageError(
            "--config-from applies only with --base-from-checkpoint (an HF base brings its own "
            "config and tokenizer)"
        )
    if options.base_from_checkpoint:
        base = adapter if base is None else base
        if not is_checkpoint_path(as_input(base)) and trainer_kind(base) is None:
            raise UsageError(
                "--base-from-checkpoint: not a DCP checkpoint (no .metadata here or in trainer/)",
                path=base,
                hint="pass the trainer dir, e.g. outputs/checkpoints/step_N/trainer",
            )
    elif base is None:
        raise UsageError(
            "no BASE given", hint="pass an HF model dir or hub id, or use --base-from-checkpoint"
        )
    lora = open_lora_source(
        adapter,
        alpha=options.alpha,
        run_config=options.run_config,
        slot=options.slot,
        trust_pickle=options.trust_pickle,
    )
    try:
        if lora.adapter is not None:
            check_target_modules(lora.adapter)
        if options.base_from_checkpoint:
            src = _checkpoint_base(base, lora, options)
        else:
            src = HFModelDir.open_ref(base)
    except BaseException:
        lora.close()
        raise
    return MergeSources(src, lora)


def _checkpoint_base(base, lora: LoraSource, options: MergeOptions) -> Source:
    """--base-from-checkpoint: the fp32 masters of a prime-rl, verl or torchtitan checkpoint (the adapter's
    own handle when it is the same checkpoint)."""
    trainer = trainer_kind(base) is not None
    where = trainer_dir(base) if trainer else resolve_checkpoint_dir(base)
    if lora.ckpt is not None and as_input(lora.path).resolve() == where.resolve():
        return lora.ckpt.base_weights(str(lora.path), empty_hint=_NO_BASE_HINT)
    if trainer:
        return open_trainer(base, trust_pickle=options.trust_pickle).base_weights(str(base), owned=True)
    return DcpCheckpoint.open(base, trust_pickle=options.trust_pickle).base_weights(
        str(base), owned=True, empty_hint=_NO_BASE_HINT
    )


def plan_merge(sources: MergeSources, options: MergeOptions) -> MergePlan:
    """The merge as data, before a byte of tensor data is read (but a few rows of the checkpoint's
    masters, compared with the HF base it claims: `guards.check_masters_match_base`)."""
    out_dtype = None if options.dtype is None else parse_cli_dtype(options.dtype, fp8=True)
    max_shard_bytes = parse_size(options.max_shard_size)
    if max_shard_bytes <= 0:
        raise UsageError("--max-shard-size must be positive")
    threads = DEFAULT_THREADS if options.threads is None else int(options.threads)
    afacts = adapter_facts(sources.adapter)
    masters = None
    if sources.base.masters:  # a checkpoint's own fp32 masters are the base
        bfacts = dcp_base_facts(sources.base, options.config_from)
        if as_input(sources.base.path).resolve() == as_input(sources.adapter.path).resolve():
            # the checkpoint's trained full tensors (modules_to_save) ARE its base weights here: no
            # replacement
            base_keys = {t.key for t in bfacts.tensors}
            afacts = dataclasses.replace(afacts, full=tuple(f for f in afacts.full if f.key not in base_keys))
    else:
        bfacts = hf_base_facts(sources.base)
        if sources.adapter.ckpt is not None:  # a checkpoint's LoRA records the base it trained on
            ckpt_base = sources.adapter.ckpt.base_weights(str(sources.adapter.path))
            problems = trained_on_problems(bfacts, ckpt_base)
            if problems:
                raise FormatError(
                    f"the checkpoint was not trained on this base: {len(problems)} difference(s): "
                    + "; ".join(problems[:6]),
                    path=bfacts.path,
                    hint="merge into the base model the run trained (prime-rl's [model] name)",
                )
            masters = check_masters_match_base(sources.base, sources.adapter.ckpt)
    reason = f"--dtype {out_dtype}" if out_dtype is not None else ""
    if out_dtype is None:
        out_dtype, reason = default_out_dtype(bfacts, afacts)
    plan = plan_from_facts(
        bfacts,
        afacts,
        out_dtype=out_dtype,
        max_shard_bytes=max_shard_bytes,
        threads=threads,
        trust_pickle=options.trust_pickle,
        out=options.out,
    )
    warnings = plan.warnings + ((reason,) if out_dtype == "float16" and not options.dtype else ())
    return dataclasses.replace(
        plan,
        out_dtype_reason=reason,
        allow_zero_delta=bool(options.allow_zero_delta),
        masters_checked=masters,
        warnings=warnings,
    )


def check_output(plan: MergePlan, out: str | Path, *, overwrite: bool = False) -> None:
    """Refuse early (before any reading) what `AtomicOutputDir` would refuse at the start of
    writing: OUT exists, OUT inside an input (or an input inside OUT), too little free disk."""
    AtomicOutputDir(out, inputs=plan.inputs, need_bytes=plan.write_bytes, overwrite=overwrite).preflight()
