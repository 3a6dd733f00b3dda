"""`ckpt inspect`: what a path holds, from metadata alone.

For a DCP checkpoint it reads `.metadata` plus a handful of tiny byte items (step, lr, scheduler
fields: `formats.dcp.summary`) and never a byte of tensor data. It also inspects an
`outputs/checkpoints` dir (lists the steps), an HF model dir and a PEFT adapter dir.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.errors import AlphaError, CkptError, FormatError, MissingPathError, UnsafeInputError, UsageError
from ..core.keys import LoraStats, classify
from ..formats.dcp.layout import METADATA_NAME
from ..formats.dcp.model import TensorEntry
from ..formats.dcp.reader import DcpCheckpoint
from ..formats.dcp.summary import CheckpointSummary, summarize
from ..formats.primerl.alpha import RULE_16E747C, RULE_HEAD, resolve_alpha
from ..formats.primerl.attempt_facts import attempt_facts
from ..formats.primerl.config import GEN_16E747C, GEN_HEAD, config_files, load_run_config
from ..formats.primerl.files import locate_run_configs
from ..formats.primerl.optimizers import optimizer_facts, trained_params
from ..formats.primerl.resume import checkpoint_generation, param_group_fused, resume_instruction, run_name_of
from ..formats.primerl.run_dir import checkpoints_dir_of, run_config_choice
from ..formats.primerl.step_dir import FP8, step_extras
from ..formats.slim.manifest import SLIM_MANIFEST, is_slim
from ..formats.sniff import TORCHTITAN, VERL, sniff, step_number
from ..io.inputs import as_input

__all__ = [
    "InspectOptions",
    "InspectPlan",
    "InspectReport",
    "detect_format",
    "inspect_checkpoints_dir",
    "inspect_dcp",
    "inspect_hf",
    "inspect_path",
    "inspect_peft",
    "list_dcp_keys",
    "plan_inspect",
    "run_inspect",
]


def detect_format(path: Path) -> str:
    p = as_input(path)
    if not p.exists():
        raise MissingPathError(p)
    kind = sniff(p)
    if kind is None:
        raise UsageError(
            "cannot tell what this is: not a DCP checkpoint (.metadata), an outputs/checkpoints "
            "dir (step_N/), an HF model dir (model.safetensors), a PEFT adapter dir "
            "(adapter_config.json), a verl checkpoint (global_step_N/actor/model_world_size_W_rank_R.pt) "
            "or a torchtitan one (step-N/.metadata)",
            path=p,
        )
    return kind


def inspect_dcp(
    path: Path,
    *,
    alpha: float | None = None,
    run_config: str | Path | None = None,
    trust_pickle: bool = False,
) -> dict:
    ckpt = DcpCheckpoint.open(path, trust_pickle=trust_pickle, known_keys_only=False)  # lists unknown keys
    s = summarize(ckpt)
    lora, infos = s.lora, s.infos
    report = _summary_json(s)
    # LoRA runs: the base weights trained whole (prime-rl HEAD lora.modules_to_save), known only by their
    # optimizer state; `extract-adapter` writes them as modules_to_save, `merge` applies them
    trained = trained_params(ckpt)
    report["modules_to_save"] = (
        sorted(
            i.hf_name or i.key.removeprefix("app.model.")
            for i in infos
            if i.group == "base" and i.key.removeprefix("app.model.") in trained
        )
        if lora.modules
        else []
    )
    report.update(run_facts(ckpt.dir, s, infos, ckpt))
    beside = beside_facts(ckpt.dir, bool(lora.modules))
    report["warnings"] += beside.pop("warnings", [])
    report.update(beside)
    report["slim"] = is_slim(ckpt.dir)
    if report["slim"]:
        report["warnings"].append(
            "this is a SLIM checkpoint (frozen base weights removed): prime-rl's strict "
            "loader cannot resume from it; rebuild it with `ckpt rehydrate`"
        )
    if lora.modules:
        report.update(_alpha_facts(ckpt.dir, lora, alpha, run_config, report))
    if report["other_keys"]:
        report["warnings"].append(
            f"{len(report['other_keys'])} key(s) are not part of prime-rl's layout (group 'other')"
        )
    ckpt.close()
    return report


def _summary_json(s: CheckpointSummary) -> dict[str, Any]:
    """What the summary says of a checkpoint, as `inspect --json` lists it (`warnings` to be added to)."""
    lora = s.lora
    return {
        "format": "dcp",
        "path": s.path,
        "keys": s.keys,
        "step": s.step,
        "world_size": s.world_size,
        "lr": s.lr,
        "initial_lr": s.initial_lr,
        "scheduler": s.scheduler,
        "progress": s.progress,
        "groups": {
            g: {"count": st.count, "bytes": st.bytes, "tensor_bytes": st.tensor_bytes}
            for g, st in s.groups.items()
        },
        "frozen_bytes": s.frozen_bytes,
        "unique_bytes": s.unique_bytes,
        "frozen_fraction": s.frozen_fraction,
        "total_bytes": s.frozen_bytes + s.unique_bytes + s.metadata_bytes,
        "data_files": list(s.data_files),
        "lora": {
            "rank": lora.rank,
            "slots": list(lora.slots),
            "modules": lora.modules,
            "targets": list(lora.targets),
            "bytes": lora.bytes,
            "ranks_vary": lora.rank is None and lora.modules > 0,
        },
        "other_keys": [i.key for i in s.infos if i.group == "other"],
        "experts": s.experts,
        "training": "full fine-tune" if s.full_finetune else ("LoRA" if lora.modules else None),
        "warnings": [],
    }


def _alpha_facts(
    ckpt_dir: Path,
    lora: LoraStats,
    alpha: float | None,
    run_config: str | Path | None,
    report: dict[str, Any],
) -> dict[str, Any]:
    """The LoRA's alpha as the run set it (`alpha`: its source and rule, the training scale), or why it is
    not known; its warnings are added to `report`'s."""
    try:
        res = resolve_alpha(alpha=alpha, run_config=run_config, ckpt_dir=ckpt_dir, rank=lora.rank)
    except AlphaError as exc:
        return {"alpha": None, "alpha_unresolved": exc.message}
    except FormatError as exc:
        if isinstance(exc, UnsafeInputError):  # a FIFO, a link out of the tree: refused, not read
            raise
        # a run config that opens but does not parse: the checkpoint is still reported
        report["warnings"].append(f"run config unreadable, alpha not resolved: {exc.render()}")
        return {"alpha": None, "alpha_unresolved": f"the run config is unreadable: {exc.render()}"}
    report["warnings"] += list(res.warnings)
    return {
        "alpha": {
            "alpha": res.alpha,
            "source": res.source,
            "rule": res.rule or report["scale_rule"],
            "training_scale": res.alpha / lora.rank if lora.rank else None,
        }
    }


def run_facts(ckpt_dir: Path, s, infos, ckpt) -> dict:
    """The prime-rl generation that wrote the checkpoint, its LoRA scale rule, EP from the run's config,
    and whether its progress lags (HEAD's interval checkpoints are saved before the step's totals)."""
    choice = run_config_choice(ckpt_dir)
    configs = list(choice.configs)
    fused = param_group_fused(ckpt, infos)
    opt = optimizer_facts(infos, fused)
    gen, why = checkpoint_generation(ckpt_dir, infos, fused=fused, experts=bool(s.experts))
    out = {
        "generation": gen,
        "generation_from": why,
        "scale_rule": RULE_HEAD if gen == GEN_HEAD else RULE_16E747C,
        "ep": None,
        "interval_checkpoint": None,
        "optimizer": opt.describe(),
        "optimizer_state": {"fields": list(opt.state_fields), "absent": opt.absent},
        **_attempts(choice),
    }
    if configs and gen == GEN_HEAD:
        try:
            cfg = load_run_config(config_files(configs))
            out["ep"] = cfg.value("trainer.model.ep") if "trainer" in cfg.sections else None
            max_steps = cfg.value("trainer.max_steps") if "trainer" in cfg.sections else None
            if isinstance(max_steps, int) and isinstance(s.step, int) and s.step < max_steps:
                out["interval_checkpoint"] = (
                    f"step {s.step} < max_steps {max_steps}: an interval checkpoint, saved before step "
                    f"{s.step}'s "
                    f"totals were added (progress total_tokens/total_samples count steps 1..{s.step - 1}); "
                    f"the "
                    "final checkpoint is complete"
                )
        except CkptError:
            pass
    return out


def beside_facts(ckpt_dir: Path, lora: bool) -> dict:
    """What the step dir holds beside trainer/ (`formats.primerl.step_dir`): each weights dir with the
    command that proves whether it is this step's weights, and a warning for an incomplete one."""
    if ckpt_dir.name != "trainer" or step_number(ckpt_dir.parent) is None:
        return {}
    extras = step_extras(ckpt_dir.parent)
    if not extras:
        return {}
    out = []
    for e in extras:
        d = e.to_json()
        if e.kind == FP8:  # block FP8: against this step's own FP8 export (the same quantization)
            d["check"] = f"ckpt export {ckpt_dir} FP8_OUT --dtype fp8; ckpt diff-vs-base {e.path} FP8_OUT"
        elif e.is_weights:  # a full fine-tune's export is the checkpoint rounded; a LoRA run's, base + s*B@A
            d["check"] = (
                f"ckpt diff-vs-base {e.path} BASE --adapter {ckpt_dir}"
                if lora
                else f"ckpt diff-vs-base {e.path} {ckpt_dir}"
            )
        out.append(d)
    warnings = [
        f"{e.path}: incomplete {e.kind} ({e.problem})" for e in extras if e.is_weights and not e.complete
    ]
    if lora and any(e.is_weights for e in extras):
        warnings.append(
            "weights beside a LoRA checkpoint: prime-rl's converters export full fine-tunes only "
            "(they refuse LoRA); check what it holds against the base with the command shown"
        )
    return {"beside": out, "warnings": warnings}


def _attempts(choice) -> dict:
    """A run launched more than once: each launch's alpha, lr and optimizer, and which one wrote this."""
    if choice.attempts is None or len(choice.attempts.attempts) < 2:
        return {}
    writer = choice.writer
    return {
        "attempts": [f.to_json() for f in attempt_facts(choice.attempts)],
        "written_by": {
            "attempt": writer.attempt.label if writer is not None and writer.attempt is not None else None,
            "how": writer.how if writer is not None else None,
        },
    }


def inspect_checkpoints_dir(path: Path) -> dict:
    """A run's checkpoints dir, from it, its outputs dir or the run dir (`run_dir.checkpoints_dir_of`): each
    step's state, and the run's config files (found as doctor and report find them)."""
    root = checkpoints_dir_of(path)
    steps = []
    numbered = [(n, c) for c in root.iterdir() if (n := step_number(c)) is not None]
    numbered.sort(key=lambda t: t[0])  # (stable: equal numbers keep the listing's order)
    for n, c in numbered:
        trainer = c / "trainer"
        complete = (trainer / METADATA_NAME).is_file()
        slim = complete and (trainer / SLIM_MANIFEST).is_file()  # `ckpt gc` / `ckpt slim` wrote it
        size = sum(f.stat().st_size for f in trainer.iterdir() if f.is_file()) if trainer.is_dir() else 0
        state = "slim" if slim else "full" if complete else "incomplete"
        steps.append(
            {
                "step": n,
                "path": str(c),
                "complete": complete,
                "slim": slim,
                "state": state,
                "bytes": size,
                "beside": [
                    {k: e.to_json()[k] for k in ("name", "kind", "bytes", "complete")} for e in step_extras(c)
                ],
                "resumes_at_step": n if state == "full" else None,
                "to_resume": f"ckpt rehydrate {trainer} OUT --base BASE, then resume from OUT"
                if slim
                else None,
            }
        )
    try:
        found = locate_run_configs(root)
        configs, problem = ([str(c.path) for c in found.files] if found is not None else []), None
    except CkptError as exc:  # several runs' configs: said, the steps still listed
        configs, problem = [], exc.message
    return {
        "format": "checkpoints",
        "path": str(root),
        "steps": steps,
        "run_config": configs,
        **({"run_config_problem": problem} if problem else {}),
        "note": f"prime-rl resumes from a full step_N at step N ({_resume_form(steps)}); a slim step "
        "must be rehydrated first (`ckpt rehydrate`)",
    }


def _resume_form(steps: list[dict]) -> str:
    """How the run resumes at its newest full step, in its generation's form (the run's config files say
    which; where none is found, both forms)."""
    full = [s for s in steps if s["state"] == "full"]
    step = full[-1]["step"] if full else "N"
    configs = run_config_choice(as_input(full[-1]["path"]) / "trainer").configs if full else ()
    if configs:
        gen = GEN_HEAD if configs[0].suffix == ".json" else GEN_16E747C
        name = run_name_of(as_input(full[-1]["path"]) / "trainer") if gen == GEN_HEAD else None
        return resume_instruction(gen, step, run_name=name) if isinstance(step, int) else ""
    return (
        f"prime-rl after Aug 2026: --resume.step {step} with the run's --run.name; 16e747c: "
        f"ckpt.resume_step = {step}"
    )


def inspect_hf(path: Path) -> dict:
    from ..formats.hf_dir.model_dir import HFModelDir  # here: a DCP inspect need not import it (#13's 0.5 s)

    d = HFModelDir.open(path)
    dtypes: dict[str, int] = {}
    for k in d.keys():
        info = d.info(k)
        dtypes[info.dtype] = dtypes.get(info.dtype, 0) + 1
    cfg = d.config or {}
    return {
        "format": "hf",
        "path": str(path),
        "tensors": len(d.keys()),
        "total_bytes": d.total_bytes,
        "dtypes": dtypes,
        "shards": sorted({str(d.info(k).path.name) for k in d.keys()}),
        "architecture": (cfg.get("architectures") or [None])[0],
        "config_dtype": cfg.get("torch_dtype") or cfg.get("dtype"),
        "tie_word_embeddings": cfg.get("tie_word_embeddings"),
        "lora_keys": sum(1 for k in d.keys() if "lora_" in k),
        **_fp8(d),
    }


def _fp8(d) -> dict:
    """A block-FP8 dir's scheme and counts (`formats.hf_dir.fp8.describe_fp8`); {} for any other dir."""
    from ..formats.hf_dir.fp8 import describe_fp8

    if d.fp8 is None:
        return {}
    return {"fp8": describe_fp8(d.fp8, {k: (d.info(k).dtype_name, tuple(d.info(k).shape)) for k in d.keys()})}


def inspect_peft(path: Path) -> dict:
    from ..formats.peft.adapter import open_peft_adapter  # here: a DCP inspect need not import it

    a = open_peft_adapter(path, strict=False)
    rep = {"format": "peft", **a.describe(), "warnings": []}
    if a.unrecognized:
        rep["warnings"].append(
            f"{len(a.unrecognized)} key(s) do not follow PEFT's layout (e.g. {a.unrecognized[0]!r}): PEFT "
            f"loads "
            "this without an error and applies NOTHING for them, vLLM rejects or ignores them; repair with "
            "`ckpt fix-adapter`"
        )
    if not a.modules:
        rep["warnings"].append("zero LoRA modules match: a model loaded with this adapter equals the base")
    if a.full_tensors:
        rep["warnings"].append(
            f"modules_to_save tensors {sorted(a.full_tensors)}: vLLM rejects adapters with "
            "modules_to_save embed_tokens/lm_head"
        )
    return rep


def inspect_path(path: Path) -> dict:
    fmt = detect_format(path)
    if fmt == "dcp":
        return inspect_dcp(path)
    if fmt == "checkpoints":
        return inspect_checkpoints_dir(path)
    if fmt == "hf":
        return inspect_hf(path)
    return inspect_peft(path)


@dataclass(frozen=True)
class InspectOptions:
    alpha: float | None = None
    run_config: str | None = None
    keys: bool = False  # list every key (DCP only)
    trust_pickle: bool = False


@dataclass(frozen=True)
class InspectPlan:
    path: str
    kind: str  # dcp | checkpoints | hf | peft | verl | torchtitan
    options: InspectOptions

    def to_json(self) -> dict:
        return {"path": self.path, "format": self.kind}


@dataclass(frozen=True)
class InspectReport:
    plan: InspectPlan
    data: object  # the description (a dict), or the key rows with `keys`

    def to_json(self):
        return self.data


def plan_inspect(path: str | Path, options: InspectOptions) -> InspectPlan:
    return InspectPlan(str(path), detect_format(as_input(path)), options)


def _inspect_trainer(plan: InspectPlan) -> object:
    """verl and torchtitan checkpoints: their format's own description (or key rows)."""
    p, o = as_input(plan.path), plan.options
    if plan.kind == VERL:
        from ..formats.verl.summary import describe_verl, list_verl_keys

        return list_verl_keys(p) if o.keys else describe_verl(p, alpha=o.alpha)
    from ..formats.torchtitan.summary import describe_torchtitan, list_torchtitan_keys

    return list_torchtitan_keys(p) if o.keys else describe_torchtitan(p)


def run_inspect(plan: InspectPlan, progress=None) -> InspectReport:
    """Metadata only; `progress` is accepted for the one contract and never called (nothing takes long)."""
    p, o = as_input(plan.path), plan.options
    if plan.kind in (VERL, TORCHTITAN):
        return InspectReport(plan, _inspect_trainer(plan))
    if plan.kind == "dcp" and o.keys:
        return InspectReport(plan, list_dcp_keys(p, trust_pickle=o.trust_pickle))
    if plan.kind == "dcp":
        return InspectReport(
            plan, inspect_dcp(p, alpha=o.alpha, run_config=o.run_config, trust_pickle=o.trust_pickle)
        )
    return InspectReport(plan, inspect_path(p))


def list_dcp_keys(path: Path, *, trust_pickle: bool = False) -> list[dict]:
    """Every key with its group and layout (metadata only)."""
    with DcpCheckpoint.open(path, trust_pickle=trust_pickle, known_keys_only=False) as ckpt:
        rows = []
        for k, e in ckpt.entries.items():
            tensor = isinstance(e, TensorEntry)
            rows.append(
                {
                    "key": k,
                    "group": classify(k, e.path).group,
                    "dtype": e.dtype if tensor else None,
                    "shape": list(e.shape) if tensor else None,
                    "chunks": len(e.chunks) if tensor else 1,
                    "stored_bytes": e.stored_bytes,
                }
            )
        return rows
