"""`ckpt export CKPT OUT`: a prime-rl DCP checkpoint -> an HF model dir of whatever it holds.

- a LoRA run: the merged model, exactly `merge --base-from-checkpoint` (the fp32 masters + s * B @ A
  in fp32, one rounding, per expert for MoE);
- a full fine-tune (optimizer state on the base weights, no LoRA): the trained fp32 masters, rounded
  once to bf16 (or `--dtype`);
prime-format MoE weights come out under the HF per-expert names (`DcpCheckpoint.base_weights`).

The same contract and pipeline as merge, not a copy: `open_export_sources` opens the checkpoint once
(a `MergeSources` whose adapter is the checkpoint's LoRA, or `NoLoraSource`), `plan_export` returns a
`MergePlan` (so `--dry-run --json`, the work units and multi-rank execution are merge's), and
It runs as a merge does (`pipeline.run_merge`): streaming, bounded, atomic.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ...core.errors import FormatError, UsageError
from ...core.keys import classify
from ...core.tied import TIED_PAIRS
from ...formats.dcp.layout import METADATA_NAME
from ...formats.dcp.lora import NoLoraSource
from ...formats.dcp.reader import DcpCheckpoint
from ...formats.primerl.optimizers import trained_params
from ...formats.primerl.run_dir import run_base_of
from ...formats.trainers import open_trainer_for_export
from ...io.inputs import as_input
from .plan import DEFAULT_MAX_SHARD, MergePlan
from .prepare import MergeOptions, MergeSources, plan_merge

__all__ = ["ExportOptions", "open_export_sources", "plan_export"]


@dataclass(frozen=True)
class ExportOptions:
    out: str = ""
    config_from: str | None = None  # HF model dir or hub id: config.json, tokenizer (the checkpoint has none)
    alpha: float | None = None
    run_config: str | None = None
    slot: int = 0
    dtype: str | None = None  # default bf16 (one rounding from the fp32 masters)
    max_shard_size: str | int = DEFAULT_MAX_SHARD
    threads: int | None = None
    trust_pickle: bool = False
    allow_zero_delta: bool = False

    def merge_options(self) -> MergeOptions:
        return MergeOptions(
            out=self.out,
            base_from_checkpoint=True,
            config_from=self.config_from,
            alpha=self.alpha,
            run_config=self.run_config,
            slot=self.slot,
            dtype=self.dtype,
            max_shard_size=self.max_shard_size,
            threads=self.threads,
            trust_pickle=self.trust_pickle,
            allow_zero_delta=self.allow_zero_delta,
        )


def open_export_sources(ckpt_path: str | Path, options: ExportOptions) -> MergeSources:
    """The checkpoint opened once: its base weights, and its LoRA (alpha resolved) or none."""
    trainer, weights = open_trainer_for_export(
        ckpt_path, config_dir=options.config_from, trust_pickle=options.trust_pickle
    )
    if trainer is not None:  # verl, torchtitan: their LoRA, or the full fine-tune's weights
        try:
            adapter = trainer.lora(alpha=options.alpha, slot=options.slot) if trainer.has_lora else None
        except BaseException:
            weights.close()
            raise
        return MergeSources(weights, adapter or NoLoraSource(trainer.dir))
    ckpt = DcpCheckpoint.open(ckpt_path, trust_pickle=options.trust_pickle)
    try:
        infos = [classify(k, e.path) for k, e in ckpt.entries.items()]
        if any(i.group == "lora" for i in infos):
            adapter = ckpt.lora(
                alpha=options.alpha,
                run_config=as_input(options.run_config) if options.run_config else None,
                slot=options.slot,
            )
        else:
            trained = trained_params(ckpt)
            base_fqns = {i.key.removeprefix("app.model.") for i in infos if i.group == "base"}
            if not trained & base_fqns:
                raise FormatError(
                    "the checkpoint holds neither LoRA parameters nor trained base weights (no "
                    "optimizer state for any app.model tensor, and no param group lists one): exporting "
                    "it would write an untrained model",
                    path=ckpt.dir / METADATA_NAME,
                    hint="export a checkpoint of a LoRA or full fine-tuning run",
                )
            # A tied output embedding is the input embedding's Parameter: FSDP's state dict lists it under
            # both
            # names, the optimizer (named_parameters, deduplicated) only under the input embedding's.
            tied = {o for o, i in TIED_PAIRS if o in base_fqns - trained and i in trained}
            untrained = base_fqns - trained - tied
            if untrained:
                raise FormatError(
                    f"{len(untrained)} base weight(s) have no optimizer state (e.g. "
                    f"{sorted(untrained)[0]}) and there is no LoRA: a partial fine-tune "
                    "this export does not know how to treat",
                    path=ckpt.dir / METADATA_NAME,
                )
            adapter = NoLoraSource(ckpt.dir, tied_aliases=tuple(sorted(tied)))
        base = ckpt.base_weights()
    except BaseException:
        ckpt.close()
        raise
    return MergeSources(base, adapter)


def run_base_model(ckpt_dir: Path) -> str | None:
    """The base model the run trained, from its own config where prime-rl writes it (HEAD trainer.json
    `model.name`, or 16e747c orch.toml `[model] name`), resolved the way prime-rl did
    (`formats.primerl.run_dir.run_base_of`, the one run-dir rule). None when not found."""
    found = run_base_of(ckpt_dir)
    return None if found is None or found.dir is None else str(found.dir)


def plan_export(sources: MergeSources, options: ExportOptions) -> MergePlan:
    """Merge's plan over the checkpoint's own weights (see the module docstring). Without --config-from,
    config and tokenizer come from the run's base model (`run_base_model`)."""
    if options.config_from is None:
        carried = sources.base.config_dir  # verl's huggingface/: the run's own config
        found = str(carried) if carried is not None else run_base_model(sources.base.path)
        if found is None:
            raise UsageError(
                "export needs --config-from: the checkpoint holds no config or tokenizer, and the "
                "run's config names no base model found locally",
                path=sources.base.path,
                hint="pass --config-from DIR_OR_HUB_ID: the HF base model the run trained",
            )
        options = dataclasses.replace(options, config_from=found)
    plan = plan_merge(sources, options.merge_options())
    _check_tie_convention(sources, plan)
    return plan


def _check_tie_convention(sources: MergeSources, plan: MergePlan) -> None:
    """A full fine-tune whose output embedding has no optimizer state trained it as the input embedding
    (tied): the config must tie them too, or the export would ship the untrained alias as lm_head."""
    aliases = getattr(sources.adapter, "tied_aliases", ())
    if not aliases:
        return
    flag = plan.tie_word_embeddings[0]
    written = {j.name for j in plan.jobs}
    if flag is not True or written & set(aliases):
        raise FormatError(
            f"{', '.join(aliases)} has no optimizer state: the run trained it tied to the input "
            f"embedding, but the config (tie_word_embeddings={flag!r}) does not tie them",
            path=sources.base.path,
            hint="pass --config-from the tied base model the run trained (tie_word_embeddings: true)",
        )
