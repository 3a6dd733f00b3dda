"""The traps that need a run's disk as well as its config: timeouts that a large model or checkpoint
trips, retention and free disk, the lr a resume really uses (16e747c restores the checkpoint's; HEAD
with an offloaded optimizer keeps the fresh scheduler's), and `outputs/weights` being the base."""

from __future__ import annotations

import math

from ...core.units import human_bytes
from ...formats.primerl.config import GEN_16E747C, GEN_HEAD, RunConfig
from .facts import (
    ERROR,
    INFO,
    WARNING,
    Finding,
    RunFacts,
    StepFacts,
    ckpt_command,
    finding,
    section_config,
    toml_fix,
)

__all__ = [
    "DIST_TIMEOUT_TRAP_S",
    "LARGE_CHECKPOINT_BYTES",
    "broadcast_modules_to_save",
    "client_timeout",
    "disk_space",
    "dist_timeout",
    "no_retention",
    "resume_lr_offload",
    "resume_lr_restored",
    "saves_after",
    "weights_are_base",
]

# A checkpoint this large makes the start-up and checkpoint collectives slow enough to matter.
LARGE_CHECKPOINT_BYTES = 10 * 2**30
DIST_TIMEOUT_TRAP_S = 600


# ------------------------------------------------------------------------------------------ timeouts
def dist_timeout(facts: RunFacts) -> list[Finding]:
    cfg = section_config(facts, "trainer")
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
        reasons.append(
            f"model {cfg.value('trainer.model.name')!r} is neither a local dir nor in the HF cache: "
            "every rank downloads it first"
        )
    if not reasons:
        return []
    return [
        finding(
            cfg,
            "dist-timeout",
            WARNING,
            "trainer.dist_timeout_seconds",
            f"{v} s bounds every collective, and the start-up barrier waits for every rank's own "
            f"download and load of the model while checkpoint loads/saves wait for the slowest rank; "
            f"{'; '.join(reasons)}",
            toml_fix("trainer.dist_timeout_seconds", 3600),
            "trainer/model.py:199-252, trainer/ckpt.py:126,146, trainer/utils.py:46-55",
        )
    ]


def client_timeout(facts: RunFacts) -> list[Finding]:
    cfg = section_config(facts, "orchestrator", GEN_16E747C)
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
        out.append(
            finding(
                cfg,
                "client-timeout",
                WARNING,
                path,
                f"a request may generate {tokens} tokens ({bound}); at {facts.decode_rate:g} tokens/s per "
                f"sequence on a loaded server that is {tokens / facts.decode_rate:.0f} s > {t} s: it times "
                "out, is regenerated from scratch (10 retries) and the rollout is dropped or masked while "
                "still filling a batch slot",
                toml_fix(path, need),
                "utils/config.py:27-32, utils/client.py:15-32, orchestrator/trajectories.py:19-31",
            )
        )
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
    return (
        cfg.value("trainer.max_steps") if "trainer" in cfg.sections else cfg.value("orchestrator.max_steps")
    )


def saves_after(max_steps: int, interval: int | None, after: int = 0) -> int:
    """How many checkpoints prime-rl writes after step `after`: one at every interval multiple before
    the end, and the final one (rl/train.py:222-231, 486-496)."""
    inner = max(0, (max_steps - 1) // interval - after // interval) if interval else 0
    return inner + (1 if after < max_steps else 0)


def _keep_cap(cfg: RunConfig, max_steps: int) -> int | None:
    keep_last, keep_interval = _ckpt(cfg, "keep_last"), _ckpt(cfg, "keep_interval")
    if keep_last is None and keep_interval is None:
        return None
    return (keep_last or 0) + (max_steps // keep_interval if keep_interval else 0)


def no_retention(facts: RunFacts) -> list[Finding]:
    cfg = facts.config
    if (
        cfg is None
        or not _ckpt_on(cfg)
        or _ckpt(cfg, "keep_last") is not None
        or _ckpt(cfg, "keep_interval") is not None
    ):
        return []
    if _max_steps(cfg) is not None:
        return []  # a bounded run: `disk` weighs its saves against the free disk
    size = max((s.bytes for s in facts.full_steps()), default=0)
    count = "a checkpoint every interval without end (max_steps is unset)"
    each = f" of {human_bytes(size + facts.weights_bytes)} each" if size else ""
    table = _ckpt_table(cfg)
    ckdir = facts.checkpoints_dir or "outputs/checkpoints"
    return [
        finding(
            cfg,
            "no-retention",
            WARNING,
            f"{table}.keep_last",
            f"keep_last and keep_interval are unset: prime-rl deletes no checkpoint, {count}{each}",
            f"{toml_fix(f'{table}.keep_last', 2)} ; or keep every step at its unique size: "
            + ckpt_command("gc", ckdir, "--keep-full", 2, *(("--base", facts.base) if facts.base else ())),
            "trainer/ckpt.py:202-205 (16e747c), trainer/ckpt.py:275-276 (HEAD)",
        )
    ]


def disk_space(facts: RunFacts) -> list[Finding]:
    cfg = facts.config
    full = facts.full_steps()
    if cfg is None or not full or facts.free_bytes is None or not _ckpt_on(cfg) or not _max_steps(cfg):
        return []
    ms = _max_steps(cfg)
    done = max(s.step for s in facts.steps)
    future = saves_after(ms, _ckpt(cfg, "interval"), after=done)
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
    return [
        finding(
            cfg,
            "disk",
            ERROR,
            f"{table}.keep_last",
            f"{extra} more checkpoint(s) of {human_bytes(size)} (steps {done + 1}..{ms}) need "
            f"{human_bytes(need)}, {human_bytes(facts.free_bytes)} are free ({human_bytes(on_disk)} already "
            f"in {facts.checkpoints_dir}): the run dies of a full disk mid-save",
            ckpt_command(
                "gc",
                facts.checkpoints_dir,
                "--keep-full",
                keep,
                *(("--base", facts.base) if facts.base else ()),
            )
            + (f"  (older steps shrink to ~{human_bytes(unique)} each)" if unique else ""),
            "trainer/ckpt.py:56-69, 202-233 (16e747c)",
        )
    ]


# ------------------------------------------------------------------------------------------ resume, exports
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
    cfg = section_config(facts, "trainer", GEN_16E747C)
    if cfg is None:
        return []
    step = _resume_step(cfg)
    if step is None:
        return []
    lr = cfg.value("trainer.optim.lr")
    s = _step_for(facts, step)
    src = "trainer/ckpt.py:71-79, 164-177; rl/train.py:145-170"
    if s is None or s.initial_lr is None:
        return [
            finding(
                cfg,
                "resume-lr",
                INFO,
                "trainer.optim.lr",
                f"resuming restores the checkpoint's lr and schedule; lr = {lr:g} here is ignored "
                "(no checkpoint of that step found to compare)",
                "ckpt inspect outputs/checkpoints/step_N/trainer  (shows the lr the resume will use)",
                src,
            )
        ]
    if math.isclose(s.initial_lr, lr, rel_tol=1e-9):
        return []
    return [
        finding(
            cfg,
            "resume-lr",
            ERROR,
            "trainer.optim.lr",
            f"resuming from step_{s.step} restores its optimizer and scheduler: it trains at the "
            f"checkpoint's "
            f"lr {s.lr:g} (base {s.initial_lr:g}), not this lr {lr:g}; RL has no skip_scheduler",
            f"{ckpt_command('set-lr', s.path, '--in-place', '--scale', f'{lr / s.initial_lr:.6g}')}  ; or a "
            "fresh-LR restart: "
            + ckpt_command("restart-prep", s.path, "OUT", "--base", facts.base or "BASE", "--lr", f"{lr:g}"),
            src,
        )
    ]


def resume_lr_offload(facts: RunFacts) -> list[Finding]:
    """HEAD: with the optimizer CPU-offloaded (the default) a resume does not restore the lr. A run that
    resumed (`[trainer.resume] step`) already ran at the wrong lr: error. A run whose newest checkpoint
    is short of max_steps would resume at the wrong lr: warning. A finished run: nothing."""
    cfg = section_config(facts, "trainer", GEN_HEAD)
    if cfg is None or not cfg.value("trainer.model.optim_cpu_offload") or facts.fresh_lr is None:
        return []
    step, max_steps = _resume_step(cfg), cfg.value("trainer.max_steps")
    if step is not None:
        s, severity, who = _step_for(facts, step), ERROR, "this run resumed from"
    else:
        s, severity, who = _step_for(facts, None), WARNING, "a resume from"
        if s is not None and max_steps is not None and s.step >= max_steps:
            return []  # finished: its final checkpoint is not resumed from
    if s is None or s.lr is None or math.isclose(s.lr, facts.fresh_lr, rel_tol=1e-6, abs_tol=0.0):
        return []
    kind = cfg.value("trainer.scheduler.type")
    return [
        finding(
            cfg,
            "resume-lr-offload",
            severity,
            "trainer.model.optim_cpu_offload",
            f"with the optimizer CPU-offloaded a resume loads the AdamW state but not the param groups: "
            f"step_{s.step} holds lr {s.lr:g}; {who} it starts at {facts.fresh_lr:g}, the lr the freshly "
            f"built {kind} scheduler sets from optim.lr {cfg.value('trainer.optim.lr'):g}; the logged "
            "metrics do not show it",
            toml_fix("trainer.model.optim_cpu_offload", False) + "  (for the resumed run: the checkpoint's "
            "lr is then restored)",
            "trainer/ckpt.py:104-124 (559b447), trainer/scheduler.py",
        )
    ]


def weights_are_base(facts: RunFacts) -> list[Finding]:
    cfg = facts.config
    out = []
    for w in facts.weights:
        if not w.identical_to_base:
            continue
        ckpt = _step_for(facts, w.step) or _step_for(facts, None)
        src_ckpt = ckpt.path if ckpt else "outputs/checkpoints/step_N/trainer"
        out.append(
            Finding(
                "weights-are-base",
                ERROR,
                "trainer.ckpt.weights",
                "[trainer.ckpt] weights",
                w.path,
                None,
                f"{w.path} is bitwise the base model: prime-rl's weight export drops the LoRA instead of "
                "merging it, so this is not the trained model",
                ckpt_command("merge", w.base or facts.base or "BASE", src_ckpt, f"merged-step{w.step}"),
                "trainer/weights.py:114-140, trainer/lora.py:220-234",
            )
        )
    if out or cfg is None or cfg.generation != GEN_16E747C or "trainer" not in cfg.sections:
        return out
    if (
        cfg.enabled("trainer.model.lora")
        and cfg.enabled("trainer.ckpt")
        and cfg.enabled("trainer.ckpt.weights")
    ):
        out.append(
            finding(
                cfg,
                "weights-are-base",
                WARNING,
                "trainer.ckpt.weights",
                "with LoRA, every save also writes outputs/weights/step_N: ~2 bytes per parameter of base "
                "weights that look like the trained model but are the base (the LoRA is dropped)",
                toml_fix("trainer.ckpt.weights", None) + "  ; for a merged model: ckpt merge BASE "
                "outputs/checkpoints/step_N/trainer OUT",
                "trainer/config.py:379-415, trainer/weights.py:114-140",
                value="on (default)",
                default="on",
                use_config=False,
            )
        )
    return out


def broadcast_modules_to_save(facts: RunFacts) -> list[Finding]:
    """prime-rl HEAD trains `lora.modules_to_save` and its broadcast's adapter_config.json lists them, but
    the broadcast holds none of their tensors: PEFT loads it with the base's untrained modules, silently."""
    bad = [a for a in facts.adapter_configs if a.absent_full]
    if not bad:
        return []
    cfg = facts.config
    head = cfg is not None and cfg.generation == GEN_HEAD
    a = bad[-1]
    step = a.path.rsplit("step_", 1)[-1].split("/", 1)[0] if "step_" in a.path else "N"
    why = (
        f"{len(bad)} adapter_config.json file(s) such as {a.path} list modules_to_save {list(a.absent_full)} "
        f"but "
        "hold none of their tensors: "
        + (
            "this run trains them (lora.modules_to_save), so PEFT loading the "
            "broadcast uses the base's UNTRAINED modules"
            if head
            else "PEFT raises or uses the base's modules"
        )
    )
    ck = f"{facts.checkpoints_dir or 'outputs/checkpoints'}/step_{step}/trainer"
    return [
        Finding(
            "broadcast-modules-to-save",
            ERROR if head else WARNING,
            "trainer.model.lora.modules_to_save",
            "[trainer.model.lora] modules_to_save",
            list(a.absent_full),
            None,
            why,
            f"ckpt fix-adapter {a.path.rsplit('/', 1)[0]} adapter-step{step} --checkpoint {ck}  ; or "
            f"ckpt merge {facts.base or 'BASE'} {ck} merged-step{step}",
            "trainer/lora.py: save_lora_config, transports/weights/filesystem.py (559b447)",
        )
    ]
