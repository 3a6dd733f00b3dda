"""`ckpt restart-prep`: the "fresh-LR restart" of a prime-rl LoRA run in one command.

prime-rl's resume restores the checkpoint's optimizer and scheduler, so a new lr in the config is
ignored. Two ways to restart with lr X (docs/surgery.md says when to prefer which):

- `merge` (default): merge the LoRA into the base (`ckpt merge`, bf16 HF model dir at OUT) and
  write a copy of the user's prime-rl TOML next to OUT with the model name -> OUT, lr -> X and
  the resume settings removed (edited with tomlkit: comments and order survive). The next run
  trains a fresh LoRA on the merged weights from step 0.
- `adapter`: keep the adapter. Extract it (`ckpt extract-adapter`) and build a resumable trainer
  checkpoint with it (`ckpt adapter-to-dcp`): the adapter's A/B, a fresh AdamW, lr X, the step
  kept and the scheduler the run's config describes. The next run resumes at that step.

The TOML keys we touch are a table (`MODEL_NAME_KEYS`, `LR_KEYS`, `RESUME_KEYS`); a config where
no model name or no lr key is found is refused, naming the keys we looked for.
"""
from __future__ import annotations

import difflib
import math
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from ..atomic import check_output_file, pid_alive
from ..errors import FormatError, MissingFileError, OutputExistsError, UsageError
from ..inputs import read_toml

# Dotted key paths in prime-rl configs: `rl` (shared [model], [trainer.*], [orchestrator.*],
# [inference.*]) and the standalone trainer (`[model]`, `[optim]`, `[ckpt]`).
MODEL_NAME_KEYS = ("model.name", "trainer.model.name", "orchestrator.model.name", "inference.model.name")
LR_KEYS = ("optim.lr", "trainer.optim.lr")
RESUME_KEYS = ("ckpt.resume_step", "ckpt.resume_dir", "trainer.ckpt.resume_step", "trainer.ckpt.resume_dir",
               "orchestrator.ckpt.resume_step", "orchestrator.ckpt.resume_dir")
SCHEDULER_TABLES = ("scheduler", "trainer.scheduler")
MAX_STEPS_KEYS = ("max_steps", "trainer.max_steps")
MODES = ("merge", "adapter")


# ============================================================================ TOML (pure)
@dataclass(frozen=True)
class TomlChange:
    key: str
    before: object
    after: object          # None: removed

    def to_json(self) -> dict:
        return {"key": self.key, "before": self.before, "after": self.after}


def _get_parent(doc, dotted: str):
    """(table, last key) of a dotted path when every table on the way exists, else (None, None)."""
    *parents, last = dotted.split(".")
    cur = doc
    for p in parents:
        if not hasattr(cur, "get") or p not in cur:
            return None, None
        cur = cur[p]
    if not hasattr(cur, "get") or last not in cur:
        return None, None
    return cur, last


def _plain(v):
    return v.unwrap() if hasattr(v, "unwrap") else v


def patch_config_text(text: str, *, model_name: str | None, lr: float | None, resume_step: int | None = None,
                      remove_resume: bool = False, rebase_from: Path | None = None,
                      where: str | Path = "config") -> tuple[str, list[TomlChange]]:
    """Return the edited TOML text and the list of changes. `model_name` / `lr` set every key of
    `MODEL_NAME_KEYS` / `LR_KEYS` present (at least one must be); `remove_resume` deletes every
    `RESUME_KEYS` present; `resume_step` sets `ckpt.resume_step` (in every ckpt table present, or a
    new top-level `[ckpt]`); `rebase_from` (the source config's directory, when the copy is written
    elsewhere) makes relative `toml_files` entries absolute, since prime-rl resolves them relative
    to the file that names them. Nothing else changes: tomlkit keeps comments, order, formatting."""
    import tomlkit
    from tomlkit.exceptions import TOMLKitError

    try:
        doc = tomlkit.parse(text)
    except TOMLKitError as exc:
        raise FormatError(f"not valid TOML: {exc}", path=where) from None
    except RecursionError:
        raise FormatError("not valid TOML: nested too deeply", path=where) from None
    changes: list[TomlChange] = []

    def set_all(keys, value, what):
        found = 0
        for dotted in keys:
            table, last = _get_parent(doc, dotted)
            if table is None:
                continue
            found += 1
            before = _plain(table[last])
            if before != value:
                table[last] = value
                changes.append(TomlChange(dotted, before, value))
        if not found:
            raise FormatError(f"no {what} key found: looked for {', '.join(keys)}", path=where,
                              hint=f"add it to the config (e.g. [{keys[0].rsplit('.', 1)[0]}] "
                                   f"{keys[0].rsplit('.', 1)[1]} = ...) and rerun")

    inherits = doc.get("toml_files")
    if rebase_from is not None and isinstance(_plain(inherits), list):
        old = [str(x) for x in _plain(inherits)]
        new = [x if os.path.isabs(x) else str((Path(rebase_from) / x).resolve()) for x in old]
        if new != old:
            doc["toml_files"] = new
            changes.append(TomlChange("toml_files", old, new))
    if model_name is not None:
        set_all(MODEL_NAME_KEYS, model_name, "model name")
    if lr is not None:
        set_all(LR_KEYS, float(lr), "learning rate")
    if remove_resume:
        for dotted in RESUME_KEYS:
            table, last = _get_parent(doc, dotted)
            if table is not None:
                changes.append(TomlChange(dotted, _plain(table[last]), None))
                del table[last]
    if resume_step is not None:
        tables = [t for t in ("ckpt", "trainer.ckpt") if _get_parent(doc, t)[0] is not None]
        if not tables:
            doc.add("ckpt", tomlkit.table())
            tables = ["ckpt"]
        for t in tables:
            table, last = _get_parent(doc, t)
            tab = table[last]
            before = _plain(tab.get("resume_step"))
            if before != resume_step:
                tab["resume_step"] = resume_step
                changes.append(TomlChange(f"{t}.resume_step", before, resume_step))
    return tomlkit.dumps(doc), changes


def config_kind(text: str) -> str:
    """`rl` for a combined prime-rl config (trainer/orchestrator/inference tables), else `trainer`."""
    import tomllib
    doc = tomllib.loads(text)
    return "rl" if any(k in doc for k in ("trainer", "orchestrator", "inference")) else "trainer"


def scheduler_from_config(text: str, where: str | Path = "config"):
    """prime-rl's `[scheduler]` (or `[trainer.scheduler]`) of a config as a SchedulerSpec
    (constant when the config has none, as prime-rl defaults)."""
    import tomllib

    from ..primerl_state import SchedulerSpec

    doc = tomllib.loads(text)

    def dig(dotted):
        cur = doc
        for p in dotted.split("."):
            if not isinstance(cur, dict) or p not in cur:
                return None
            cur = cur[p]
        return cur

    sched = next((dig(t) for t in SCHEDULER_TABLES if isinstance(dig(t), dict)), None) or {}
    max_steps = next((dig(k) for k in MAX_STEPS_KEYS if isinstance(dig(k), int)), None)
    try:
        return SchedulerSpec(sched.get("type", "constant"), warmup_steps=int(sched.get("warmup_steps", 0)),
                             decay_steps=int(sched.get("decay_steps", 0)), max_steps=max_steps,
                             min_lr=float(sched.get("min_lr", 0.0)))
    except (ValueError, TypeError) as exc:
        raise FormatError(f"cannot use its [scheduler] table: {exc}", path=where) from None


def unified_diff(old: str, new: str, name: str) -> str:
    return "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), f"a/{name}", f"b/{name}"))


# ============================================================================ locating the checkpoint
_STEP = re.compile(r"^step_(\d+)$")


def find_checkpoint(path: str | Path) -> Path:
    """A trainer dir, a step dir, an outputs/checkpoints dir, an outputs dir or a run root: the
    latest complete checkpoint under it."""
    from ..dcp.reader import METADATA_NAME, resolve_checkpoint_dir

    p = Path(path)
    if not p.exists():
        raise MissingFileError("no such file or directory", path=p)
    if (p / METADATA_NAME).is_file() or (p / "trainer" / METADATA_NAME).is_file():
        return resolve_checkpoint_dir(p)
    for root in (p, p / "checkpoints", p / "outputs" / "checkpoints"):
        if not root.is_dir():
            continue
        steps = sorted((int(m.group(1)), c) for c in root.iterdir()
                       if (m := _STEP.match(c.name)) and (c / "trainer" / METADATA_NAME).is_file())
        if steps:
            return steps[-1][1] / "trainer"
    raise UsageError("no prime-rl checkpoint found (looked for .metadata, trainer/.metadata, and "
                     "step_N/trainer/.metadata under checkpoints/ and outputs/checkpoints/)", path=p,
                     hint="pass outputs/checkpoints/step_N/trainer")


def default_config_out(mode: str, out: Path, config: Path, step: int | None = None) -> Path:
    """merge: beside OUT (`OUT.<config name>`); adapter: beside the source config
    (`<stem>.restart<suffix>`), because OUT is a checkpoint dir prime-rl scans by name."""
    if mode == "merge":
        return out.parent / f"{out.name}.{config.name}"
    return config.parent / f"{config.stem}.restart{config.suffix}"


# ============================================================================ the command
def restart_prep(run_or_ckpt: str | Path, out: str | Path, *, base: str | None, lr: float | None, config: str | Path | None = None,
                 mode: str = "merge", alpha: float | None = None, run_config: str | Path | None = None,
                 dtype: str | None = None, max_shard_size: str = "5GB", world_size: int | None = None,
                 scheduler_step: int = 0, config_out: str | Path | None = None, dry_run: bool = False,
                 trust_pickle: bool = False, progress=None) -> dict:
    """Library entry point. Returns a JSON-able report with "next" (what to run next)."""
    from ..dcp.reader import DcpCheckpoint

    if mode not in MODES:
        raise UsageError(f"--mode {mode!r}: choose one of {', '.join(MODES)}")
    out = Path(out)
    ckpt_dir = find_checkpoint(run_or_ckpt)
    DcpCheckpoint.open(ckpt_dir, trust_pickle=trust_pickle).close()   # the input is checked first
    if base is None:
        raise UsageError("--base is required: the HF base model the run trained on")
    if lr is None or not (lr > 0 and math.isfinite(lr)):
        raise UsageError(f"--lr is required and must be a positive finite number (got {lr})")
    cfg_text = cfg_out = None
    if config is not None:
        config = Path(config)
        _doc, cfg_text = read_toml(config, what="prime-rl config")
        cfg_out = Path(config_out) if config_out is not None else default_config_out(mode, out, config)
        if cfg_out.resolve() == config.resolve():
            raise UsageError("the patched config would overwrite the source config", path=cfg_out,
                             hint="pass another --config-out")
        # checked now, before anything is written: its dir exists, nothing is there, and it is not
        # (inside) an input (the checkpoint, the config, the base dir, the run config) or inside OUT
        local_base = [base] if base is not None and Path(base).is_dir() else []
        cfg_out = check_output_file(cfg_out, [ckpt_dir, config, *local_base, *([run_config] if run_config else [])],
                                    what="patched config (--config-out)")
        if cfg_out.parent.resolve() == out.resolve() or out.resolve() in cfg_out.parents:
            raise UsageError("the patched config would be written inside OUT", path=cfg_out,
                             hint="pass a --config-out outside OUT")
    if mode == "merge":
        return _merge_mode(ckpt_dir, out, base=base, lr=lr, cfg_text=cfg_text, config=config, cfg_out=cfg_out,
                           alpha=alpha, run_config=run_config, dtype=dtype, max_shard_size=max_shard_size,
                           dry_run=dry_run, trust_pickle=trust_pickle, progress=progress)
    return _adapter_mode(ckpt_dir, out, base=base, lr=lr, cfg_text=cfg_text, config=config, cfg_out=cfg_out,
                         alpha=alpha, run_config=run_config, world_size=world_size, scheduler_step=scheduler_step,
                         dry_run=dry_run, trust_pickle=trust_pickle)


def _rebase(config: Path, cfg_out: Path) -> Path | None:
    src, dst = config.resolve().parent, cfg_out.resolve().parent
    return None if src == dst else src


def _write_config(cfg_out: Path, text: str) -> None:
    from ..atomic import atomic_write_text
    if cfg_out.exists():
        raise OutputExistsError("appeared while we worked", path=cfg_out)
    atomic_write_text(cfg_out, text)


def _merge_mode(ckpt_dir, out, *, base, lr, cfg_text, config, cfg_out, alpha, run_config, dtype, max_shard_size,
                dry_run, trust_pickle, progress) -> dict:
    from .merge import check_output, execute_merge, prepare_merge

    report: dict = {"mode": "merge", "checkpoint": str(ckpt_dir), "out": str(out), "lr": lr, "dry_run": dry_run}
    new_text = None
    if cfg_text is not None:   # validate the config before the (long) merge
        new_text, changes = patch_config_text(cfg_text, model_name=str(out.resolve()), lr=lr, remove_resume=True,
                                              rebase_from=_rebase(config, cfg_out), where=config)
        report["config"] = {"source": str(config), "out": str(cfg_out), "changes": [c.to_json() for c in changes],
                            "diff": unified_diff(cfg_text, new_text, config.name)}
    plan = prepare_merge(base, ckpt_dir, alpha=alpha, run_config=run_config, dtype=dtype,
                         max_shard_size=max_shard_size, trust_pickle=trust_pickle)
    ad = plan.adapter or {}
    report["merge_plan"] = {"merged_modules": plan.merged_modules, "alpha": ad.get("alpha"),
                            "alpha_source": ad.get("alpha_source"), "scale": ad.get("scale"),
                            "out_dtype": plan.out_dtype, "write_bytes": plan.write_bytes,
                            "warnings": list(plan.warnings)}
    if dry_run:
        check_output(plan, out)
    else:
        res = execute_merge(plan, out, progress=progress)
        report["merge"] = {"seconds": res.seconds, "tensors": res.tensors, "merged_modules": res.merged_modules,
                           "bytes_written": res.bytes_written, "files": list(res.files)}
        if new_text is not None:
            _write_config(cfg_out, new_text)
    if cfg_text is not None:
        cmd = "rl" if config_kind(cfg_text) == "rl" else "trainer"
        report["next"] = [f"uv run {cmd} @ {cfg_out}"]
        report["notes"] = ["the restart trains a NEW LoRA on the merged weights from step 0, with the config's "
                           "scheduler (warmup included); use a fresh output_dir so old checkpoints are not mixed in"]
    else:
        report["next"] = [f"set [model] name = \"{out.resolve()}\" and [trainer.optim] lr = {lr!r} (or [optim] lr for a "
                          "trainer config), remove ckpt.resume_step, then start the run as before"]
        report["notes"] = ["pass --config YOUR.toml to have these edits written for you"]
    return report


def _adapter_mode(ckpt_dir, out, *, base, lr, cfg_text, config, cfg_out, alpha, run_config, world_size,
                  scheduler_step, dry_run, trust_pickle) -> dict:
    from ..dcp.reader import DcpCheckpoint
    from ..keys import world_size_from_chunks
    from ..lora_source import open_lora_source
    from ..primerl_state import SchedulerSpec
    from .adapter_to_dcp import close_all, plan_adapter_to_dcp, run_adapter_to_dcp
    from .extract_adapter import plan_extract, run_extract

    with DcpCheckpoint.open(ckpt_dir, trust_pickle=trust_pickle) as ck:
        step = ck.read_object("app.progress.step") if "app.progress.step" in ck.entries else None
        sharded = [len(e.chunks) for e in ck.tensor_entries() if e.shape and e.shape[0] > 1]
        orig_world = world_size_from_chunks(sharded) or 1
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise FormatError(f"progress.step is {step!r}, not an int >= 0", path=ckpt_dir, key="app.progress.step")
    world_size = world_size or orig_world
    spec = scheduler_from_config(cfg_text, config) if cfg_text is not None else SchedulerSpec("constant")
    report: dict = {"mode": "adapter", "checkpoint": str(ckpt_dir), "out": str(out), "lr": lr, "step": step,
                    "world_size": world_size, "scheduler": spec.describe(), "scheduler_step": scheduler_step,
                    "dry_run": dry_run, "warnings": []}
    if cfg_text is None:
        report["warnings"].append("no --config: the checkpoint gets prime-rl's constant scheduler; the resuming run "
                                  "must use [scheduler] type = \"constant\" (pass --config to take the run's)")
    new_text = None
    if cfg_text is not None:
        new_text, changes = patch_config_text(cfg_text, model_name=None, lr=lr, resume_step=step,
                                              rebase_from=_rebase(config, cfg_out), where=config)
        report["config"] = {"source": str(config), "out": str(cfg_out), "changes": [c.to_json() for c in changes],
                            "diff": unified_diff(cfg_text, new_text, config.name)}

    src = open_lora_source(ckpt_dir, alpha=alpha, run_config=run_config, trust_pickle=trust_pickle)
    _clean_stale_staging(out)
    tmp_adapter = out.parent / f".{out.name}.adapter-{os.getpid()}"
    try:
        xplan = plan_extract(src, tmp_adapter, base=str(base))
        report["adapter"] = {"modules": xplan.modules, "rank": xplan.rank, "alpha": xplan.alpha,
                             "alpha_source": xplan.alpha_source, "scale": xplan.scale}
        report["warnings"] += list(xplan.warnings)
        if dry_run:
            return report
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.exists():
            raise OutputExistsError("already exists", path=out, hint="pass a new output path")
        run_extract(xplan, src)
    finally:
        src.close()
    hf = src_ck = None
    try:
        plan, ad, hf, src_ck = plan_adapter_to_dcp(tmp_adapter, base, out, lr=lr, step=step, world_size=world_size,
                                                   scheduler=spec, scheduler_step=scheduler_step,
                                                   trust_pickle=trust_pickle)
        t0 = time.perf_counter()
        rep = run_adapter_to_dcp(plan, ad, hf, src_ck)
        report["checkpoint_out"] = {"keys": rep["keys"], "bytes_written": rep["bytes_written"],
                                    "seconds": round(time.perf_counter() - t0, 3), "lr_now": rep["lr_now"],
                                    "lr_next": rep["lr_next"], "notes": rep["notes"]}
        report["warnings"] += list(rep["warnings"])
    finally:
        close_all(hf, src_ck)
        shutil.rmtree(tmp_adapter, ignore_errors=True)
    if new_text is not None:
        _write_config(cfg_out, new_text)
    where = f"<output_dir>/checkpoints/step_{step}/trainer"
    if out.name != "trainer" or out.parent.name != f"step_{step}":
        report["warnings"].append(f"prime-rl looks for the checkpoint at {where}: move OUT there (a fresh "
                                  "output_dir keeps the old checkpoints apart)")
    run_cmd = "rl" if cfg_text is not None and config_kind(cfg_text) == "rl" else "trainer"
    report["next"] = ([f"uv run {run_cmd} @ {cfg_out}"] if cfg_out is not None else
                      [f"resume with ckpt.resume_step = {step} and lr {lr!r} in your config"])
    return report


def _clean_stale_staging(out: Path) -> None:
    """Remove what a killed adapter-mode run left beside OUT: its staging adapter
    `.OUT.adapter-<pid>` and that adapter's own temp dir and lock (`..OUT.adapter-<pid>.*`),
    for pids that are no longer alive (a live run's staging is left alone)."""
    parent = out.parent
    if not parent.is_dir():
        return
    rx = re.compile(rf"^\.{{1,2}}{re.escape(out.name)}\.adapter-(\d+)(\..*)?$")
    for entry in parent.iterdir():
        m = rx.match(entry.name)
        if m and not pid_alive(int(m.group(1))):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
