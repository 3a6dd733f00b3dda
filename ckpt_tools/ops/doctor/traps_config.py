"""The traps a config shows by itself (no checkpoint needed): keys prime-rl refuses or drops, files
that shadow each other, the trainer tokenizer's early default, the LoRA alpha rule, a scheduler that
crashes, and migration traps (16e747c). One function per trap, `check(facts) -> [Finding]`."""

from __future__ import annotations

import math
from pathlib import Path

from ...formats.primerl.config import GEN_16E747C, GEN_HEAD, lora_settings, toml_key
from ...io.inputs import as_input
from .facts import (
    ERROR,
    INFO,
    WARNING,
    Finding,
    RunFacts,
    ckpt_command,
    finding,
    section_config,
    toml_fix,
    toml_value,
)

__all__ = [
    "linear_decay_crash",
    "lora_alpha",
    "max_model_len_noop",
    "max_tokens_unset",
    "output_dir_overridden",
    "shadowed_tables",
    "tokenizer_default",
    "unknown_keys",
    "world_size",
]


# ------------------------------------------------------------------------------------------ config keys
def unknown_keys(facts: RunFacts) -> list[Finding]:
    cfg = facts.config
    if cfg is None:
        return []
    from_run_dir = all(c.origin == "run dir" for c in cfg.files.files)
    out = []
    for u in cfg.unknown:
        severity, why, fix, where = _unknown_key_verdict(cfg, u, from_run_dir)
        out.append(
            Finding(
                "unknown-key", severity, u.path, toml_key(u.path), u.value, None, why, fix, where, str(u.file)
            )
        )
    return out


def _unknown_key_verdict(cfg, u, from_run_dir: bool) -> tuple[str, str, str, str]:
    """(severity, why, fix, where in prime-rl) of an unknown key `u` of the run config: what prime-rl does
    with it depends on the generation, on who reads the file, and on its table's policy."""
    table, leaf = u.table, u.path.rpartition(".")[2]
    known = ", ".join(u.known)
    fix = f"remove `{leaf} = {toml_value(u.value)}` from [{table or 'the top level'}]; keys there: {known}"
    if cfg.generation == GEN_HEAD:
        return (
            INFO,
            "not a key of prime-rl 559b447's TrainerConfig: this run comes from another "
            "prime-rl version; ckpt-tools did not check it",
            "none needed if prime-rl wrote it",
            "configs/trainer.py",
        )
    if from_run_dir:
        return (
            ERROR,
            "the trainer re-reads this orch.toml and deletes the run dir when it does not "
            "validate, unknown keys included",
            fix,
            "trainer/runs.py:93-139",
        )
    if u.policy == "drop":
        why = (
            f"[{table}] is a plain pydantic model: prime-rl drops unknown keys without a word, so "
            f"`{leaf}` has no effect"
        )
        if leaf == "timeout" and table.endswith("weight_broadcast"):
            why = (
                "only the NCCL weight broadcast has a timeout; with the filesystem broadcast (LoRA "
                "runs) it is dropped silently"
            )
        elif table == "trainer.optim":
            why += f": training runs at lr = {cfg.value('trainer.optim.lr'):g}"
        return ERROR, why, fix, "trainer/config.py:309-376, utils/pydantic_config.py:18-19"
    return (
        ERROR,
        "prime-rl refuses to start: `Extra inputs are not permitted` (its config tables forbid unknown keys)",
        fix,
        "utils/pydantic_config.py:18-19",
    )


def shadowed_tables(facts: RunFacts) -> list[Finding]:
    cfg = facts.config
    if cfg is None:
        return []
    out = []
    for s in cfg.shadowed:
        out.append(
            Finding(
                "shadowed-table",
                ERROR,
                s.path,
                toml_key(s.path),
                s.value,
                None,
                f"{s.by_file.name} also has a [{s.table}] table and loads later; prime-rl merges its files "
                f"per "
                f"top-level table, so {s.file.name}'s [{s.table}] is dropped whole and this key falls back "
                f"to "
                f"{cfg.value(s.path)!r}",
                f"move `{toml_fix(s.path, s.value).splitlines()[-1]}` under [{s.path.rpartition('.')[0]}] in "
                f"{s.by_file.name}, or keep [{s.table}] in one file only",
                "pydantic-settings 2.10.1 sources/base.py:194-204 (`vars.update`); "
                "utils/pydantic_config.py:100-147",
                str(s.file),
            )
        )
    for path, table in cfg.files.ignored_includes:
        out.append(
            Finding(
                "shadowed-table",
                WARNING,
                f"{table}.toml_files",
                f"[{table}] toml_files",
                None,
                None,
                "prime-rl reads `toml_files` only at a file's top level: the files listed here are never "
                "loaded",
                f"move `toml_files = [...]` to the top of {path.name}",
                "utils/pydantic_config.py:136-145",
                str(path),
            )
        )
    return out


def tokenizer_default(facts: RunFacts) -> list[Finding]:
    cfg = section_config(facts, "trainer", GEN_16E747C)
    if (
        cfg is None
        or not cfg.is_rl
        or not cfg.is_set("model.name")
        or cfg.is_set("trainer.model.name")
        or cfg.is_set("trainer.tokenizer.name")
    ):
        return []
    model = cfg.value("model.name")
    return [
        finding(
            cfg,
            "tokenizer-default",
            ERROR,
            "trainer.tokenizer.name",
            f"the trainer's tokenizer defaults to [trainer.model] name while [trainer] is parsed, before "
            f"[model] name = {model!r} is copied down: the trainer loads "
            f"{cfg.value('trainer.tokenizer.name')!r}'s tokenizer and saves it into every weights/step_N",
            toml_fix("trainer.tokenizer.name", model),
            "trainer/rl/config.py:258-264, rl.py:334-345",
            default=None,
            value=cfg.value("trainer.tokenizer.name"),
            use_config=False,
        )
    ]


def lora_alpha(facts: RunFacts) -> list[Finding]:
    cfg = facts.config
    if cfg is None or cfg.generation != GEN_16E747C:
        return []
    ls = lora_settings(cfg)
    if ls is None:
        return []
    fix_alpha = ls.trainer_alpha * ls.training_rank / ls.trainer_rank
    src = "rl.py:422-430, rl/train.py:101-116, trainer/lora.py:237-279"
    if facts.adapter_configs:
        bad = [
            a
            for a in facts.adapter_configs
            if not math.isclose(a.lora_alpha / a.r, ls.training_scale, rel_tol=1e-9)
        ]
        if not bad:
            return []
        a = bad[0]
        return [
            finding(
                cfg,
                "lora-alpha",
                ERROR,
                "orchestrator.model.lora.alpha",
                f"training scale = orchestrator alpha {ls.training_alpha:g} / rank {ls.training_rank} = "
                f"{ls.training_scale:g}, but {len(bad)} adapter_config.json file(s) such as {a.path} say "
                f"lora_alpha {a.lora_alpha:g} / r {a.r} = {a.lora_alpha / a.r:g}: vLLM served a different "
                "policy than the one trained, and PEFT loads the adapter at the wrong scale",
                f"{ckpt_command('fix-adapter', as_input(a.path).parent, 'OUT')}  (writes lora_alpha "
                f"{ls.training_alpha:g}); for "
                f"the next run: {toml_fix('orchestrator.model.lora.alpha', fix_alpha)}",
                src,
            )
        ]
    if ls.consistent or "trainer" not in cfg.sections:
        return []
    return [
        finding(
            cfg,
            "lora-alpha",
            ERROR,
            "orchestrator.model.lora.alpha",
            f"prime-rl trains at orchestrator alpha {ls.training_alpha:g} / rank {ls.training_rank} = "
            f"{ls.training_scale:g} but serves adapters written with the trainer's alpha "
            f"{ls.trainer_alpha:g} / "
            f"{ls.trainer_rank} = {ls.served_scale:g}: rollouts come from a different policy than the "
            f"trained one",
            toml_fix("orchestrator.model.lora.alpha", fix_alpha),
            src,
        )
    ]


def linear_decay_crash(facts: RunFacts) -> list[Finding]:
    cfg = section_config(facts, "trainer")
    if (
        cfg is None
        or cfg.value("trainer.scheduler.type") != "linear"
        or cfg.value("trainer.scheduler.decay_steps") != 1
    ):
        return []
    max_steps, warmup = cfg.value("trainer.max_steps"), cfg.value("trainer.scheduler.warmup_steps")
    when = f"after step {max_steps - 1}" if max_steps else "at the start of the decay phase"
    fix = 2 if (max_steps is None or max_steps - 2 >= (warmup or 0)) else 0
    line = 45 if cfg.generation == GEN_16E747C else 49
    return [
        finding(
            cfg,
            "linear-decay-crash",
            ERROR,
            "trainer.scheduler.decay_steps",
            f"the decay phase is LinearLR(total_iters = decay_steps - 1 = 0): the scheduler step that enters "
            f"it ({when}) raises ZeroDivisionError; the config passes validation",
            toml_fix("trainer.scheduler.decay_steps", fix),
            f"trainer/scheduler.py:{line}",
        )
    ]


# ------------------------------------------------------------------------------------------ migration
def max_model_len_noop(facts: RunFacts) -> list[Finding]:
    cfg = facts.config
    if cfg is None or cfg.generation != GEN_16E747C or not cfg.is_rl or not cfg.is_set("max_model_len"):
        return []
    v = cfg.value("max_model_len")
    return [
        finding(
            cfg,
            "max-model-len-noop",
            WARNING,
            "max_model_len",
            "the top-level max_model_len is never read; only [inference.model] max_model_len reaches vLLM",
            toml_fix("inference.model.max_model_len", v),
            "rl.py:190-195, inference/config.py:59-64,243",
        )
    ]


def max_tokens_unset(facts: RunFacts) -> list[Finding]:
    cfg = section_config(facts, "orchestrator", GEN_16E747C)
    if cfg is None:
        return []
    seq = cfg.value("orchestrator.seq_len")
    out = []
    if cfg.value("orchestrator.sampling.max_tokens") is None:
        out.append(
            finding(
                cfg,
                "max-tokens",
                WARNING,
                "orchestrator.sampling.max_tokens",
                f"unset, so each turn generates until it is cut at seq_len {seq}: cut turns train on "
                "truncated text and the longest requests decide the step time",
                f"[orchestrator.sampling]\nmax_tokens = {seq // 2}  # any N with prompt + N <= seq_len "
                f"({seq})",
                "orchestrator/config.py:89-94, orchestrator.py:141",
            )
        )
    mml = cfg.value("inference.model.max_model_len") if "inference" in cfg.sections else None
    if mml is not None and mml < seq:
        out.append(
            finding(
                cfg,
                "max-tokens",
                WARNING,
                "inference.model.max_model_len",
                f"vLLM's max_model_len {mml} is below the orchestrator's seq_len {seq}: long rollouts "
                "fail at the server instead of being cut",
                toml_fix("inference.model.max_model_len", seq),
                "inference/config.py:59-64",
            )
        )
    return out


def world_size(facts: RunFacts) -> list[Finding]:
    cfg = facts.config
    if cfg is None or cfg.generation != GEN_16E747C or not cfg.is_rl:
        return []
    n = len(cfg.value("trainer_gpu_ids") or [])
    dims = {k: cfg.value(f"trainer.model.{k}") or 1 for k in ("cp", "tp", "dp_replicate")}
    prod = math.prod(dims.values())
    if n == 0 or n % prod == 0:
        return []
    key = max(dims, key=lambda k: dims[k])
    rest = prod // dims[key]
    fit = max(d for d in range(1, dims[key] + 1) if n % (d * rest) == 0) if n % rest == 0 else 1
    return [
        finding(
            cfg,
            "world-size",
            ERROR,
            f"trainer.model.{key}",
            f"the trainer runs len(trainer_gpu_ids) = {n} ranks, not divisible by cp*tp*dp_replicate = "
            f"{prod}: "
            "dp_shard is not whole and the trainer fails at start-up (checked only at runtime)",
            toml_fix(f"trainer.model.{key}", fit),
            "rl.py:729, trainer/parallel_dims.py:63-70,251-261",
        )
    ]


def output_dir_overridden(facts: RunFacts) -> list[Finding]:
    cfg = facts.config
    if cfg is None or cfg.generation != GEN_16E747C or not cfg.is_rl:
        return []
    out = []
    top = cfg.value("output_dir")
    for path in ("trainer.output_dir", "orchestrator.output_dir"):
        if not cfg.is_set(path):
            continue
        mine = str(cfg.written[path].value)
        want = str(Path(mine).parent) if path.startswith("orchestrator") else mine
        out.append(
            finding(
                cfg,
                "output-dir",
                WARNING,
                path,
                f"replaced by the top-level output_dir {top!r}: this {path.split('.')[0]} writes to "
                f"{cfg.value(path)!r}, not {mine!r}",
                f"{toml_fix('output_dir', want)}  (at the top level; remove it from [{path.split('.')[0]}])",
                "rl.py:369-378",
                value=mine,
                default=cfg.default(path),
                use_config=False,
            )
        )
    return out
