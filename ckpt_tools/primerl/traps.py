"""The run-level traps `ckpt doctor` reports: one small function per trap, over plain facts.

Every trap is `check(facts) -> list[Finding]`, registered in `TRAPS` with its id. Facts are plain data
(`RunFacts`: the run's config view, its checkpoints' sizes and lrs, free disk, what diff-vs-base said
of `outputs/weights`), gathered by `ckpt_tools.ops.doctor`; nothing here reads a file. Each finding
carries the key as the user writes it in TOML, its value and default, why it bites (one line, with
the prime-rl source behind it) and the exact fix: a TOML snippet or a ckpt command.

Only what prime-rl's source supports is reported (shared/docs/primerl-config-traps.md for 16e747c,
primerl-head-format.md for HEAD). Where a trap of 16e747c does not exist at HEAD (the orchestrator's
alpha rule, the client timeout field, `outputs/weights`), its check returns nothing for HEAD runs.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..units import human_bytes
from .config import GEN_16E747C, GEN_HEAD, RunConfig, lora_settings, toml_key

ERROR, WARNING, INFO = "error", "warning", "info"
PROBLEM_SEVERITIES = (ERROR, WARNING)   # what makes `ckpt doctor` exit 3

# A loaded vLLM server's decode rate per sequence we assume when judging a client timeout (tokens/s).
# Deliberately low: at full batch a 32B model decodes each sequence at tens of tokens/s; a timeout
# that needs more than this per sequence is one a busy server misses. `--decode-rate` overrides it.
DEFAULT_DECODE_RATE = 5.0
# A checkpoint this large makes the start-up and checkpoint collectives slow enough to matter.
LARGE_CHECKPOINT_BYTES = 10 * 2**30
DIST_TIMEOUT_TRAP_S = 600


@dataclass(frozen=True)
class Finding:
    trap: str
    severity: str
    key: str                 # dotted path: trainer.optim.lr
    toml: str                # as the user writes it: [trainer.optim] lr
    value: Any
    default: Any
    why: str
    fix: str                 # a TOML snippet ("[table]\nkey = value") or a ckpt command
    source: str = ""         # prime-rl file:line behind the why
    file: str | None = None  # config file the value comes from, when it was written

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class StepFacts:
    step: int
    path: str                # the step's trainer dir
    complete: bool           # has .metadata
    slim: bool
    bytes: int
    unique_bytes: int | None = None
    lr: float | None = None
    initial_lr: float | None = None


@dataclass(frozen=True)
class WeightsExport:
    step: int
    path: str
    identical_to_base: bool | None     # diff-vs-base verdict; None: not compared
    base: str | None = None


@dataclass(frozen=True)
class AdapterConfig:
    path: str
    r: int
    lora_alpha: float


@dataclass(frozen=True)
class RunFacts:
    config: RunConfig | None
    steps: tuple[StepFacts, ...] = ()
    checkpoints_dir: str | None = None
    free_bytes: int | None = None
    weights: tuple[WeightsExport, ...] = ()
    weights_bytes: int = 0                  # size of the newest outputs/weights/step_N
    adapter_configs: tuple[AdapterConfig, ...] = ()
    model_available: bool | None = None     # the model is a local dir or in the local HF cache
    base: str | None = None                 # base model for fixes (--base, or the config's model name)
    fresh_lr: float | None = None           # lr a freshly built scheduler sets (HEAD offloaded resume)
    decode_rate: float = DEFAULT_DECODE_RATE

    def full_steps(self) -> list[StepFacts]:
        return [s for s in self.steps if s.complete and not s.slim]


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if v is None:
        return '"None"'
    return str(v)


def toml_fix(path: str, value) -> str:
    """The TOML that sets `path` to `value`: `[table]\\nkey = value` (or `key = value` at the top)."""
    table, _, leaf = path.rpartition(".")
    line = f"{leaf} = {toml_value(value)}"
    return f"[{table}]\n{line}" if table else line


def _finding(cfg: RunConfig | None, trap, severity, path, why, fix, source, *, value=None, default=None,
             use_config=True) -> Finding:
    if cfg is not None and use_config:
        value, default = cfg.value(path), cfg.default(path)
    f = cfg.where(path) if cfg is not None else None
    return Finding(trap, severity, path, toml_key(path), value, default, why, fix, source,
                   str(f) if f is not None else None)


def _has(facts: RunFacts, section: str, generation: str | None = None) -> RunConfig | None:
    cfg = facts.config
    if cfg is None or section not in cfg.sections or (generation and cfg.generation != generation):
        return None
    return cfg


# ------------------------------------------------------------------------------------------ config keys
def unknown_keys(facts: RunFacts) -> list[Finding]:
    cfg = facts.config
    if cfg is None:
        return []
    out = []
    from_run_dir = all(c.origin == "run dir" for c in cfg.files.files)
    for u in cfg.unknown:
        table, leaf = u.table, u.path.rpartition(".")[2]
        known = ", ".join(u.known)
        fix = f"remove `{leaf} = {toml_value(u.value)}` from [{table or 'the top level'}]; keys there: {known}"
        if cfg.generation == GEN_HEAD:
            out.append(Finding("unknown-key", INFO, u.path, toml_key(u.path), u.value, None,
                               "not a key of prime-rl 559b447's TrainerConfig: this run comes from another "
                               "prime-rl version; ckpt-tools did not check it", "none needed if prime-rl wrote "
                               "it", "configs/trainer.py", str(u.file)))
        elif from_run_dir:
            out.append(Finding("unknown-key", ERROR, u.path, toml_key(u.path), u.value, None,
                               "the trainer re-reads this orch.toml and deletes the run dir when it does not "
                               "validate, unknown keys included", fix, "trainer/runs.py:93-139", str(u.file)))
        elif u.policy == "drop":
            why = (f"[{table}] is a plain pydantic model: prime-rl drops unknown keys without a word, so "
                   f"`{leaf}` has no effect")
            if leaf == "timeout" and table.endswith("weight_broadcast"):
                why = ("only the NCCL weight broadcast has a timeout; with the filesystem broadcast (LoRA "
                       "runs) it is dropped silently")
            elif table == "trainer.optim":
                why += f": training runs at lr = {cfg.value('trainer.optim.lr'):g}"
            out.append(Finding("unknown-key", ERROR, u.path, toml_key(u.path), u.value, None, why, fix,
                               "trainer/config.py:309-376, utils/pydantic_config.py:18-19", str(u.file)))
        else:
            out.append(Finding("unknown-key", ERROR, u.path, toml_key(u.path), u.value, None,
                               "prime-rl refuses to start: `Extra inputs are not permitted` (its config "
                               "tables forbid unknown keys)", fix, "utils/pydantic_config.py:18-19", str(u.file)))
    return out


def shadowed_tables(facts: RunFacts) -> list[Finding]:
    cfg = facts.config
    if cfg is None:
        return []
    out = []
    for s in cfg.shadowed:
        out.append(Finding(
            "shadowed-table", ERROR, s.path, toml_key(s.path), s.value, None,
            f"{s.by_file.name} also has a [{s.table}] table and loads later; prime-rl merges its files per "
            f"top-level table, so {s.file.name}'s [{s.table}] is dropped whole and this key falls back to "
            f"{cfg.value(s.path)!r}",
            f"move `{toml_fix(s.path, s.value).splitlines()[-1]}` under [{s.path.rpartition('.')[0]}] in "
            f"{s.by_file.name}, or keep [{s.table}] in one file only",
            "pydantic-settings 2.10.1 sources/base.py:194-204 (`vars.update`); utils/pydantic_config.py:100-147",
            str(s.file)))
    for path, table in cfg.files.ignored_includes:
        out.append(Finding(
            "shadowed-table", WARNING, f"{table}.toml_files", f"[{table}] toml_files", None, None,
            "prime-rl reads `toml_files` only at a file's top level: the files listed here are never loaded",
            f"move `toml_files = [...]` to the top of {path.name}", "utils/pydantic_config.py:136-145", str(path)))
    return out


# ------------------------------------------------------------------------------------------ timeouts
def dist_timeout(facts: RunFacts) -> list[Finding]:
    cfg = _has(facts, "trainer")
    if cfg is None:
        return []
    v = cfg.value("trainer.dist_timeout_seconds")
    if v is None or v > DIST_TIMEOUT_TRAP_S:
        return []
    reasons = []
    full = facts.full_steps()
    big = [s for s in full if s.bytes >= LARGE_CHECKPOINT_BYTES]
    resume = _resume_step(cfg)
    if resume is not None and big:
        reasons.append(f"it resumes from checkpoints of {human_bytes(max(s.bytes for s in big))}")
    elif big:
        reasons.append(f"its checkpoints are {human_bytes(max(s.bytes for s in big))} each")
    if facts.model_available is False:
        reasons.append(f"model {cfg.value('trainer.model.name')!r} is neither a local dir nor in the HF cache: "
                       "every rank downloads it first")
    if not reasons:
        return []
    return [_finding(cfg, "dist-timeout", WARNING, "trainer.dist_timeout_seconds",
                     f"{v} s bounds every collective, and the start-up barrier waits for every rank's own "
                     f"download and load of the model while checkpoint loads/saves wait for the slowest rank; "
                     f"{'; '.join(reasons)}",
                     toml_fix("trainer.dist_timeout_seconds", 3600),
                     "trainer/model.py:199-252, trainer/ckpt.py:126,146, trainer/utils.py:46-55")]


def client_timeout(facts: RunFacts) -> list[Finding]:
    cfg = _has(facts, "orchestrator", GEN_16E747C)
    if cfg is None:
        return []
    tokens = cfg.value("orchestrator.sampling.max_tokens")
    bound = "[orchestrator.sampling] max_tokens"
    if tokens is None:
        tokens, bound = cfg.value("orchestrator.seq_len"), "orchestrator seq_len (max_tokens is unset)"
    out = []
    for path in ("orchestrator.client.timeout", "orchestrator.teacher_model.client.timeout"):
        if not cfg.enabled(path.rpartition(".")[0]):
            continue
        t = cfg.value(path)
        if not tokens or not t or tokens / t <= facts.decode_rate:
            continue
        need = math.ceil(tokens / facts.decode_rate / 600) * 600
        out.append(_finding(cfg, "client-timeout", WARNING, path,
                            f"a request may generate {tokens} tokens ({bound}); at {facts.decode_rate:g} tokens/s per "
                            f"sequence on a loaded server that is {tokens / facts.decode_rate:.0f} s > {t} s: it times "
                            "out, is regenerated from scratch (10 retries) and the rollout is dropped or masked while "
                            "still filling a batch slot", toml_fix(path, need),
                            "utils/config.py:27-32, utils/client.py:15-32, orchestrator/trajectories.py:19-31"))
    return out


# ------------------------------------------------------------------------------------------ disk
def _ckpt(cfg: RunConfig, key: str):
    side = "trainer" if "trainer" in cfg.sections else "orchestrator"
    if not cfg.enabled(f"{side}.ckpt"):
        return None
    return cfg.value(f"{side}.ckpt.{key}")


def _ckpt_on(cfg: RunConfig) -> bool:
    side = "trainer" if "trainer" in cfg.sections else "orchestrator"
    return cfg.enabled(f"{side}.ckpt")


def _ckpt_table(cfg: RunConfig) -> str:
    if cfg.generation == GEN_HEAD or not cfg.is_rl:
        return "trainer.ckpt" if "trainer" in cfg.sections else "orchestrator.ckpt"
    return "ckpt"


def _max_steps(cfg: RunConfig):
    return cfg.value("trainer.max_steps") if "trainer" in cfg.sections else cfg.value("orchestrator.max_steps")


def save_steps(max_steps: int, interval: int | None, after: int = 0) -> list[int]:
    """Steps prime-rl saves a checkpoint at after step `after`: every interval multiple before the end,
    and the final one (rl/train.py:222-231, 486-496)."""
    inner = [k for k in range(after + 1, max_steps) if interval and k % interval == 0]
    return inner + ([max_steps] if after < max_steps else [])


def _keep_cap(cfg: RunConfig, max_steps: int) -> int | None:
    keep_last, keep_interval = _ckpt(cfg, "keep_last"), _ckpt(cfg, "keep_interval")
    if keep_last is None and keep_interval is None:
        return None
    return (keep_last or 0) + (max_steps // keep_interval if keep_interval else 0)


def no_retention(facts: RunFacts) -> list[Finding]:
    cfg = facts.config
    if cfg is None or not _ckpt_on(cfg) or _ckpt(cfg, "keep_last") is not None \
            or _ckpt(cfg, "keep_interval") is not None:
        return []
    if _max_steps(cfg) is not None:
        return []   # a bounded run: `disk` weighs its saves against the free disk
    size = max((s.bytes for s in facts.full_steps()), default=0)
    count = "a checkpoint every interval without end (max_steps is unset)"
    each = f" of {human_bytes(size + facts.weights_bytes)} each" if size else ""
    table = _ckpt_table(cfg)
    ckdir = facts.checkpoints_dir or "outputs/checkpoints"
    return [_finding(cfg, "no-retention", WARNING, f"{table}.keep_last",
                     f"keep_last and keep_interval are unset: prime-rl deletes no checkpoint, {count}{each}",
                     f"{toml_fix(f'{table}.keep_last', 2)} ; or keep every step at its unique size: "
                     f"ckpt gc {ckdir} --keep-full 2" + (f" --base {facts.base}" if facts.base else ""),
                     "trainer/ckpt.py:202-205 (16e747c), trainer/ckpt.py:275-276 (HEAD)")]


def disk_space(facts: RunFacts) -> list[Finding]:
    cfg = facts.config
    full = facts.full_steps()
    if cfg is None or not full or facts.free_bytes is None or not _ckpt_on(cfg) or not _max_steps(cfg):
        return []
    ms = _max_steps(cfg)
    done = max(s.step for s in facts.steps)
    future = len(save_steps(ms, _ckpt(cfg, "interval"), after=done))
    cap = _keep_cap(cfg, ms)
    have = len(facts.steps)
    extra = future if cap is None else max(0, min(cap, have + future) - have)
    size = max(s.bytes for s in full) + facts.weights_bytes
    need = extra * size
    if need <= facts.free_bytes:
        return []
    keep = _ckpt(cfg, "keep_last") or 2
    unique = max((s.unique_bytes or 0) for s in full)
    table = _ckpt_table(cfg)
    on_disk = sum(s.bytes for s in facts.steps)
    return [_finding(cfg, "disk", ERROR, f"{table}.keep_last",
                     f"{extra} more checkpoint(s) of {human_bytes(size)} (steps {done + 1}..{ms}) need "
                     f"{human_bytes(need)}, {human_bytes(facts.free_bytes)} are free ({human_bytes(on_disk)} already "
                     f"in {facts.checkpoints_dir}): the run dies of a full disk mid-save",
                     f"ckpt gc {facts.checkpoints_dir} --keep-full {keep}" + (f" --base {facts.base}" if facts.base
                                                                             else "")
                     + (f"  (older steps shrink to ~{human_bytes(unique)} each)" if unique else ""),
                     "trainer/ckpt.py:56-69, 202-233 (16e747c)")]


# ------------------------------------------------------------------------------------------ model
def tokenizer_default(facts: RunFacts) -> list[Finding]:
    cfg = _has(facts, "trainer", GEN_16E747C)
    if cfg is None or not cfg.is_rl or not cfg.is_set("model.name") or cfg.is_set("trainer.model.name") \
            or cfg.is_set("trainer.tokenizer.name"):
        return []
    model = cfg.value("model.name")
    return [_finding(cfg, "tokenizer-default", ERROR, "trainer.tokenizer.name",
                     f"the trainer's tokenizer defaults to [trainer.model] name while [trainer] is parsed, before "
                     f"[model] name = {model!r} is copied down: the trainer loads "
                     f"{cfg.value('trainer.tokenizer.name')!r}'s tokenizer and saves it into every weights/step_N",
                     toml_fix("trainer.tokenizer.name", model), "trainer/rl/config.py:258-264, rl.py:334-345",
                     default=None, value=cfg.value("trainer.tokenizer.name"), use_config=False)]


def _resume_step(cfg: RunConfig):
    if cfg.generation == GEN_HEAD:
        return cfg.value("trainer.resume.step") if cfg.enabled("trainer.resume") else None
    return _ckpt(cfg, "resume_step")


def _step_for(facts: RunFacts, step) -> StepFacts | None:
    full = sorted(facts.full_steps(), key=lambda s: s.step)
    if not full:
        return None
    if step is None or step == -1:
        return full[-1]
    return next((s for s in full if s.step == step), None)


def resume_lr_restored(facts: RunFacts) -> list[Finding]:
    """16e747c: a resume restores the checkpoint's lr and schedule; the config's lr is ignored."""
    cfg = _has(facts, "trainer", GEN_16E747C)
    if cfg is None:
        return []
    step = _resume_step(cfg)
    if step is None:
        return []
    lr = cfg.value("trainer.optim.lr")
    s = _step_for(facts, step)
    src = "trainer/ckpt.py:71-79, 164-177; rl/train.py:145-170"
    if s is None or s.initial_lr is None:
        return [_finding(cfg, "resume-lr", INFO, "trainer.optim.lr",
                         f"resuming restores the checkpoint's lr and schedule; lr = {lr:g} here is ignored "
                         "(no checkpoint of that step found to compare)",
                         "ckpt inspect outputs/checkpoints/step_N/trainer  (shows the lr the resume will use)", src)]
    if math.isclose(s.initial_lr, lr, rel_tol=1e-9):
        return []
    return [_finding(cfg, "resume-lr", ERROR, "trainer.optim.lr",
                     f"resuming from step_{s.step} restores its optimizer and scheduler: it trains at the checkpoint's "
                     f"lr {s.lr:g} (base {s.initial_lr:g}), not this lr {lr:g}; RL has no skip_scheduler",
                     f"ckpt set-lr {s.path} --in-place --scale {lr / s.initial_lr:.6g}  ; or a fresh-LR restart: "
                     f"ckpt restart-prep {s.path} OUT --base {facts.base or 'BASE'} --lr {lr:g}", src)]


def resume_lr_offload(facts: RunFacts) -> list[Finding]:
    """HEAD: with the optimizer CPU-offloaded (the default) a resume does not restore the lr."""
    cfg = _has(facts, "trainer", GEN_HEAD)
    if cfg is None or not cfg.value("trainer.model.optim_cpu_offload") or facts.fresh_lr is None:
        return []
    step = _resume_step(cfg)
    max_steps = cfg.value("trainer.max_steps")
    if step is None:
        cands = [s for s in facts.full_steps() if max_steps is None or s.step < max_steps]
        s = max(cands, key=lambda x: x.step) if cands else None
    else:
        s = _step_for(facts, step)
    if s is None or s.lr is None or math.isclose(s.lr, facts.fresh_lr, rel_tol=1e-6, abs_tol=0.0):
        return []
    kind = cfg.value("trainer.scheduler.type")
    return [_finding(cfg, "resume-lr-offload", ERROR, "trainer.model.optim_cpu_offload",
                     f"with the optimizer CPU-offloaded a resume loads the AdamW state but not the param groups: "
                     f"step_{s.step} holds lr {s.lr:g}, the resumed run starts at {facts.fresh_lr:g} (what the "
                     f"freshly built {kind} scheduler sets from optim.lr {cfg.value('trainer.optim.lr'):g}); the "
                     "logged metrics do not show it",
                     toml_fix("trainer.model.optim_cpu_offload", False) + "  (for the resumed run: the checkpoint's "
                     "lr is then restored)", "trainer/ckpt.py:104-124 (559b447), trainer/scheduler.py")]


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
        bad = [a for a in facts.adapter_configs
               if not math.isclose(a.lora_alpha / a.r, ls.training_scale, rel_tol=1e-9)]
        if not bad:
            return []
        a = bad[0]
        return [_finding(cfg, "lora-alpha", ERROR, "orchestrator.model.lora.alpha",
                         f"training scale = orchestrator alpha {ls.training_alpha:g} / rank {ls.training_rank} = "
                         f"{ls.training_scale:g}, but {len(bad)} adapter_config.json file(s) such as {a.path} say "
                         f"lora_alpha {a.lora_alpha:g} / r {a.r} = {a.lora_alpha / a.r:g}: vLLM served a different "
                         "policy than the one trained, and PEFT loads the adapter at the wrong scale",
                         f"ckpt fix-adapter {Path(a.path).parent} OUT  (writes lora_alpha {ls.training_alpha:g}); for "
                         f"the next run: {toml_fix('orchestrator.model.lora.alpha', fix_alpha)}", src)]
    if ls.consistent or "trainer" not in cfg.sections:
        return []
    return [_finding(cfg, "lora-alpha", ERROR, "orchestrator.model.lora.alpha",
                     f"prime-rl trains at orchestrator alpha {ls.training_alpha:g} / rank {ls.training_rank} = "
                     f"{ls.training_scale:g} but serves adapters written with the trainer's alpha {ls.trainer_alpha:g} / "
                     f"{ls.trainer_rank} = {ls.served_scale:g}: rollouts come from a different policy than the trained one",
                     toml_fix("orchestrator.model.lora.alpha", fix_alpha), src)]


def weights_are_base(facts: RunFacts) -> list[Finding]:
    cfg = facts.config
    out = []
    for w in facts.weights:
        if not w.identical_to_base:
            continue
        ckpt = _step_for(facts, w.step) or _step_for(facts, None)
        src_ckpt = ckpt.path if ckpt else "outputs/checkpoints/step_N/trainer"
        out.append(Finding("weights-are-base", ERROR, "trainer.ckpt.weights", "[trainer.ckpt] weights",
                           w.path, None,
                           f"{w.path} is bitwise the base model: prime-rl's weight export drops the LoRA instead of "
                           "merging it, so this is not the trained model",
                           f"ckpt merge {w.base or facts.base or 'BASE'} {src_ckpt} merged-step{w.step}",
                           "trainer/weights.py:114-140, trainer/lora.py:220-234"))
    if out or cfg is None or cfg.generation != GEN_16E747C or "trainer" not in cfg.sections:
        return out
    if cfg.enabled("trainer.model.lora") and cfg.enabled("trainer.ckpt") and cfg.enabled("trainer.ckpt.weights"):
        out.append(_finding(cfg, "weights-are-base", WARNING, "trainer.ckpt.weights",
                            "with LoRA, every save also writes outputs/weights/step_N: ~2 bytes per parameter of base "
                            "weights that look like the trained model but are the base (the LoRA is dropped)",
                            toml_fix("trainer.ckpt.weights", None) + "  ; for a merged model: ckpt merge BASE "
                            "outputs/checkpoints/step_N/trainer OUT", "trainer/config.py:379-415, trainer/weights.py:114-140",
                            value="on (default)", default="on", use_config=False))
    return out


def linear_decay_crash(facts: RunFacts) -> list[Finding]:
    cfg = _has(facts, "trainer")
    if cfg is None or cfg.value("trainer.scheduler.type") != "linear" or cfg.value("trainer.scheduler.decay_steps") != 1:
        return []
    max_steps, warmup = cfg.value("trainer.max_steps"), cfg.value("trainer.scheduler.warmup_steps")
    when = f"after step {max_steps - 1}" if max_steps else "at the start of the decay phase"
    fix = 2 if (max_steps is None or max_steps - 2 >= (warmup or 0)) else 0
    line = 45 if cfg.generation == GEN_16E747C else 49
    return [_finding(cfg, "linear-decay-crash", ERROR, "trainer.scheduler.decay_steps",
                     f"the decay phase is LinearLR(total_iters = decay_steps - 1 = 0): the scheduler step that enters "
                     f"it ({when}) raises ZeroDivisionError; the config passes validation",
                     toml_fix("trainer.scheduler.decay_steps", fix), f"trainer/scheduler.py:{line}")]


# ------------------------------------------------------------------------------------------ migration
def max_model_len_noop(facts: RunFacts) -> list[Finding]:
    cfg = facts.config
    if cfg is None or cfg.generation != GEN_16E747C or not cfg.is_rl or not cfg.is_set("max_model_len"):
        return []
    v = cfg.value("max_model_len")
    return [_finding(cfg, "max-model-len-noop", WARNING, "max_model_len",
                     "the top-level max_model_len is never read; only [inference.model] max_model_len reaches vLLM",
                     toml_fix("inference.model.max_model_len", v), "rl.py:190-195, inference/config.py:59-64,243")]


def max_tokens_unset(facts: RunFacts) -> list[Finding]:
    cfg = _has(facts, "orchestrator", GEN_16E747C)
    if cfg is None:
        return []
    seq = cfg.value("orchestrator.seq_len")
    out = []
    if cfg.value("orchestrator.sampling.max_tokens") is None:
        out.append(_finding(cfg, "max-tokens", WARNING, "orchestrator.sampling.max_tokens",
                            f"unset, so each turn generates until it is cut at seq_len {seq}: cut turns train on "
                            "truncated text and the longest requests decide the step time",
                            f"[orchestrator.sampling]\nmax_tokens = {seq // 2}  # any N with prompt + N <= seq_len ({seq})",
                            "orchestrator/config.py:89-94, orchestrator.py:141"))
    mml = cfg.value("inference.model.max_model_len") if "inference" in cfg.sections else None
    if mml is not None and mml < seq:
        out.append(_finding(cfg, "max-tokens", WARNING, "inference.model.max_model_len",
                            f"vLLM's max_model_len {mml} is below the orchestrator's seq_len {seq}: long rollouts "
                            "fail at the server instead of being cut", toml_fix("inference.model.max_model_len", seq),
                            "inference/config.py:59-64"))
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
    return [_finding(cfg, "world-size", ERROR, f"trainer.model.{key}",
                     f"the trainer runs len(trainer_gpu_ids) = {n} ranks, not divisible by cp*tp*dp_replicate = {prod}: "
                     "dp_shard is not whole and the trainer fails at start-up (checked only at runtime)",
                     toml_fix(f"trainer.model.{key}", fit), "rl.py:729, trainer/parallel_dims.py:63-70,251-261")]


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
        out.append(_finding(cfg, "output-dir", WARNING, path,
                            f"replaced by the top-level output_dir {top!r}: this {path.split('.')[0]} writes to "
                            f"{cfg.value(path)!r}, not {mine!r}",
                            f"{toml_fix('output_dir', want)}  (at the top level; remove it from [{path.split('.')[0]}])",
                            "rl.py:369-378", value=mine, default=cfg.default(path), use_config=False))
    return out


TRAPS: tuple[tuple[str, Callable[[RunFacts], list[Finding]]], ...] = (
    ("unknown-key", unknown_keys),
    ("shadowed-table", shadowed_tables),
    ("dist-timeout", dist_timeout),
    ("client-timeout", client_timeout),
    ("no-retention", no_retention),
    ("disk", disk_space),
    ("tokenizer-default", tokenizer_default),
    ("resume-lr", resume_lr_restored),
    ("resume-lr-offload", resume_lr_offload),
    ("lora-alpha", lora_alpha),
    ("weights-are-base", weights_are_base),
    ("linear-decay-crash", linear_decay_crash),
    ("max-model-len-noop", max_model_len_noop),
    ("max-tokens", max_tokens_unset),
    ("world-size", world_size),
    ("output-dir", output_dir_overridden),
)


@dataclass
class Diagnosis:
    findings: list[Finding] = field(default_factory=list)

    @property
    def problems(self) -> list[Finding]:
        return [f for f in self.findings if f.severity in PROBLEM_SEVERITIES]


def diagnose(facts: RunFacts) -> Diagnosis:
    """Run every trap; findings sorted errors first, then by key."""
    out: list[Finding] = []
    for _name, check in TRAPS:
        out += check(facts)
    order = {ERROR: 0, WARNING: 1, INFO: 2}
    out.sort(key=lambda f: (order[f.severity], f.trap, f.key))
    return Diagnosis(out)
