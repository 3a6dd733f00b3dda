"""A prime-rl run directory on disk: where its outputs, checkpoints, exports, configs and base model are.

Layouts (shared/docs/primerl-config-traps.md §9, primerl-head-format.md §3):

- 16e747c: `<launch>/outputs/{checkpoints/step_N/trainer, weights/step_N, run_default/{configs/orch.toml,
  broadcasts/step_N}}`; the orchestrator's `output_dir` (`outputs/run_default`) is relative to the
  launch directory, and so is a relative `model.name` (trainer/model.py:207-213).
- HEAD: `<run_dir>/configs/*.json` (or `configs/resolved/`, `configs/latest/resolved/`) and the trainer's
  `output_dir` (relative to the launch directory) with `checkpoints/step_N/trainer` and `broadcasts/step_N`;
  the `rl` entrypoint's named run is `outputs/<run.name>/{configs, checkpoints, broadcasts}`.

THE rule, for every command: `resolve_run(path)` (a trainer, step, checkpoints, outputs or launch dir, a
broadcast or a weights export; optionally the run config the user named) -> `RunRoot`: the outputs dir it
lies in (`run_outputs_dir`: only where prime-rl writes, never a climb), the run configs prime-rl wrote for
it (`find_run_configs`), the launch dir that config says (`launch_of_config`), the base model name; and
`run_base(run)` finds that base as prime-rl resolved it.

Reads directory listings and small JSON files only.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ...core.errors import CkptError, UsageError
from ...core.keys import step_of
from ...io import inputs
from ...io.inputs import as_input, read_toml
from ..hf_dir.hub import locate_model, resolve_model_dir
from ..safetensors.header import read_header
from .attempts import Attempt, RunAttempts, WriterChoice, checkpoint_step, run_attempts, writer_of
from .config import GEN_HEAD, RunConfig, config_files, load_run_config
from .files import config_run_dir

__all__ = [
    "BaseModel",
    "RunRoot",
    "absent_modules_to_save",
    "adapter_config_files",
    "checkpoints_dir_of",
    "dir_bytes",
    "find_run_configs",
    "launch_dir",
    "launch_dir_of",
    "launch_of_config",
    "model_name",
    "orch_model_name",
    "outputs_dir",
    "read_adapter_config",
    "resolve_base",
    "resolve_run",
    "run_base",
    "run_base_of",
    "run_outputs_dir",
    "step_dirs",
    "weights_exports",
]


def step_dirs(checkpoints: Path) -> list[tuple[int, Path]]:
    """`step_N` directories (not links) of a checkpoints dir, by step."""
    out = []
    for c in as_input(checkpoints).iterdir():
        n = step_of(c.name)
        if n is not None and c.is_dir() and not c.is_symlink():
            out.append((n, c))
    return sorted(out)


def checkpoints_dir_of(path: str | Path) -> Path:
    """The `checkpoints/` dir for a path that is one, or an outputs dir that holds one."""
    p = as_input(path)
    if not p.is_dir():
        raise UsageError("not a directory", path=p, hint="pass a run's outputs/checkpoints directory")
    if any(step_of(c.name) is not None for c in p.iterdir()):
        return p
    if (p / "checkpoints").is_dir():
        return p / "checkpoints"
    if (p / "outputs" / "checkpoints").is_dir():
        return p / "outputs" / "checkpoints"
    raise UsageError(
        "holds no step_N checkpoints",
        path=p,
        hint="pass prime-rl's outputs/checkpoints directory (it holds step_N/trainer)",
    )


# ------------------------------------------------------------------------------------ the one resolver
def run_outputs_dir(path: str | Path) -> Path | None:
    """The prime-rl trainer `output_dir` that `path` was written into, recognised only by where
    prime-rl writes (docs/format.md §2): `<outputs>/checkpoints/step_N/trainer` (or its step dir),
    `<outputs>/weights/step_N[/lora_adapters]`, `<outputs>/run_*/broadcasts/step_N` (16e747c),
    `<outputs>/broadcasts/step_N` (HEAD).
    None anywhere else: we never climb further to look for configs (an unrelated sibling's
    `run_*/configs/orch.toml` two levels up once set the scale), nor above a URL (`_within`: what lies
    around a URL is not the user's input; only its run configs are looked for there, `find_run_configs`)."""
    return _within(_outputs_by_layout(as_input(path).resolve()), path)


def _outputs_by_layout(p: Path) -> Path | None:
    parents = p.parents
    if p.name == "trainer" and step_of(p.parent.name) is not None and p.parent.parent.name == "checkpoints":
        return parents[2]
    if p.name == "lora_adapters" and step_of(p.parent.name) is not None and p.parent.parent.name == "weights":
        return parents[2]
    if step_of(p.name) is not None and p.parent.name in ("checkpoints", "weights") and len(parents) > 1:
        return parents[1]
    if step_of(p.name) is not None and p.parent.name == "broadcasts" and len(parents) > 2:
        # 16e747c: <outputs>/run_*/broadcasts/step_N (the orchestrator's output_dir); HEAD:
        # <outputs>/broadcasts
        return parents[2] if p.parent.parent.name.startswith("run_") else parents[1]
    return None


@dataclass(frozen=True)
class ConfigChoice:
    """The run configs prime-rl wrote for an artifact, by the one rule (`run_config_choice`)."""

    configs: tuple[
        Path, ...
    ]  # HEAD: the trainer.json (else rl.json) of the launch that wrote it; 16e747c: orch.toml(s)
    attempts: RunAttempts | None = None  # the run's launch attempts (HEAD), when its configs were found there
    writer: WriterChoice | None = None  # which attempt wrote the artifact, and how that was decided

    @property
    def undecided(self) -> tuple[Attempt, ...]:
        """The attempts that may have written it when that cannot be told (configs then holds the newest)."""
        if self.writer is None or self.writer.attempt is not None or self.attempts is None:
            return ()
        return self.writer.candidates if len(self.attempts.attempts) > 1 else ()


def _head_choice(
    run: Path, target: Path | None, *, pinned: bool = False, at: tuple[int | None, float | None] | None = None
) -> ConfigChoice | None:
    """The attempt of `run` that wrote `target` (a checkpoint's step or trainer dir; None: the newest).
    `pinned`: `$PRL_ATTEMPT_CONFIG_DIR` may stand for `run`'s configs (the last place looked)."""
    found = run_attempts(run, env=None if pinned else {})
    if found is None:
        return None
    step, when = at if at is not None else checkpoint_step(target) if target is not None else (None, None)
    writer = writer_of(found, step, when)
    chosen = writer.attempt or found.newest
    files = chosen.trainer_first if chosen is not None else ()
    return ConfigChoice(files[:1], found, writer) if files else None


def _head_configs(outputs: Path, target: Path | None) -> ConfigChoice | None:
    """HEAD's configs of the run that owns `outputs`: in the outputs dir or the run dir just above it
    (the rl entrypoint writes `<run_dir>/configs/`), one dir only."""
    for d in (outputs, outputs.parent):
        found = _head_choice(d, target)
        if found is not None:
            return found
    return None


def _configs_at(outputs: Path, target: Path | None) -> ConfigChoice:
    """HEAD's configs, else 16e747c's orch.toml(s), else those `$PRL_ATTEMPT_CONFIG_DIR` names."""
    head = _head_configs(outputs, target)
    if head is not None:
        return head
    old = tuple(sorted(outputs.glob("run_*/configs/orch.toml")))
    if old:
        return ConfigChoice(old)
    return _head_choice(outputs, target, pinned=True) or ConfigChoice(())


def run_config_choice(ckpt_dir: str | Path) -> ConfigChoice:
    """The run configs of the run(s) that wrote `ckpt_dir`, where prime-rl writes them for the `<outputs>`
    of `run_outputs_dir`: HEAD's trainer.json (else rl.json) of the launch attempt that wrote it
    (`attempts.writer_of`), else 16e747c's `<outputs>/run_*/configs/orch.toml` (one per run); none
    elsewhere. Above a URL too, by the layout of the URL's own path: each dir is listed only when the one
    before holds nothing, only the config files are read, and no file time is asked (a launch dir such a
    config names is on the machine that trained: `resolve_run`)."""
    target = as_input(ckpt_dir)
    outputs = _outputs_by_layout(target.resolve())
    return ConfigChoice(()) if outputs is None else _configs_at(outputs, target)


def find_run_configs(ckpt_dir: Path) -> list[Path]:
    """`run_config_choice(ckpt_dir).configs`, as a list."""
    return list(run_config_choice(ckpt_dir).configs)


def _configs_of(outputs: Path, target: Path | None) -> list[Path]:
    return list(_configs_at(outputs, target).configs)


def orch_model_name(path: Path | None) -> str | None:
    """The `[model] name` of an orchestrator config (None when it has none or cannot be read: it is
    only a default, for base_model_name_or_path and for the base a slim records)."""
    if path is None:
        return None
    if as_input(path).suffix == ".json":  # HEAD: the trainer's model.name
        try:
            cfg = load_run_config(config_files([as_input(path)]))
            name = cfg.value("trainer.model.name") if "trainer" in cfg.sections else None
        except CkptError:
            return None
        return name if isinstance(name, str) and name else None
    try:
        data, _ = read_toml(
            path, root=run_outputs_dir(path) if run_outputs_dir(path) else None, what="orchestrator config"
        )
        name = (data.get("model") or {}).get("name") if isinstance(data.get("model"), dict) else None
    except CkptError:
        return None
    return name if isinstance(name, str) and name else None


def _within(found: Path | None, path) -> Path | None:
    """`found` (a dir found around the input `path`), or None where `path` is a URL and `found` lies above
    it (`inputs.bounded`): a launch dir or model root above a URL is on the machine that trained."""
    return inputs.bounded(found, path)


def _outputs_of_run_dir(p: Path) -> Path | None:
    """The outputs dir of a run dir given whole: a `checkpoints` dir's parent, an outputs dir (it holds
    `checkpoints/`), a launch dir with prime-rl's default `output_dir` (`outputs/checkpoints`)."""
    p = p.resolve()
    if p.name == "checkpoints" and p.is_dir():
        return _within(p.parent, p)
    if (p / "checkpoints").is_dir():
        return p
    if (p / "outputs" / "checkpoints").is_dir():
        return p / "outputs"
    return None


@dataclass(frozen=True)
class RunRoot:
    """Where the run of an artifact is, by the one rule (`resolve_run`)."""

    path: Path  # what was given
    outputs: Path | None  # the trainer output_dir it lies in (or is)
    configs: tuple[Path, ...]  # the run configs prime-rl wrote for it, or the one the user named
    named: bool  # the config was named (--run-config), not found
    launch: Path | None  # where that config says prime-rl was launched from (None without one)
    base_name: str | None  # the one config's model.name

    @property
    def config(self) -> Path | None:
        return self.configs[0] if len(self.configs) == 1 else None

    @property
    def model_root(self) -> Path | None:
        """Where a relative model name is looked up: the launch dir; without a run config, the parent of
        the outputs dir (prime-rl's default `output_dir` is `outputs` in the launch dir), else of the
        nearest dir named `outputs` above the path (an export whose run wrote no config)."""
        if self.launch is not None:
            return _within(self.launch, self.path)
        if self.outputs is not None:
            return _within(self.outputs.parent, self.path)
        for p in self.path.resolve().parents:
            if p.name == "outputs":
                return _within(p.parent, self.path)
        return None


def resolve_run(path: str | Path, *, config: str | Path | None = None) -> RunRoot:
    """The run `path` belongs to (see the module docstring). `config`: the run config the user named
    (--run-config), which then says the launch dir and the model name."""
    p = as_input(path)
    outputs = run_outputs_dir(p)
    if outputs is None and p.is_dir():
        outputs = _outputs_of_run_dir(p)
    if config is not None:
        configs: tuple = (as_input(config),)
    else:
        configs = tuple(_configs_of(outputs, p) if outputs is not None else run_config_choice(p).configs)
    one = configs[0] if len(configs) == 1 else None
    # a config found above a URL says no launch dir here: its relative paths are on the machine that trained
    launch = None if one is None or (outputs is None and config is None) else launch_of_config(one)
    return RunRoot(
        p, outputs, configs, config is not None, launch, None if one is None else orch_model_name(one)
    )


def launch_of_config(cfg_path: str | Path) -> Path:
    """The launch dir a run config says (`launch_dir_of` with the config's own output_dir)."""
    cfg_path = as_input(cfg_path)
    try:
        cfg = load_run_config(config_files([cfg_path]))
        key = "trainer.output_dir" if cfg_path.suffix == ".json" else "orchestrator.output_dir"
        out = cfg.value(key) if key.split(".")[0] in cfg.sections else None
    except CkptError:
        out = None
    return launch_dir_of(cfg_path, out)


def run_base(run: RunRoot) -> BaseModel | None:
    """The base model of `run`, found as prime-rl resolved it: relative to the launch dir, else a local dir
    or hub id in the local HF cache. None when the run has no (or several) configs or names no model;
    `dir` None when the model is not on this machine."""
    name = run.base_name
    if name is None:
        return None
    found, why = locate_model(name, run_root=run.launch)
    if run.named:
        return BaseModel(name, found, "--run-config", why)
    how = f"the run config {run.config}'s model.name {name!r}" + (
        f" (relative to {run.launch})"
        if found is not None and run.launch is not None and found == run.launch / name
        else ""
    )
    return BaseModel(name, found, how, why)


def launch_dir(cfg: RunConfig) -> Path | None:
    """The directory prime-rl was launched from, where relative paths of the config point."""
    files = cfg.files
    if files.run_dir is None:
        return Path.cwd()
    f = files.files[0].path
    if cfg.generation == GEN_HEAD:
        return launch_dir_of(f, cfg.value("trainer.output_dir"))
    return launch_dir_of(f, cfg.value("orchestrator.output_dir"))


def launch_dir_of(config: Path, output_dir: object = None) -> Path:
    """The launch-dir rule: where a run config found in a run dir says prime-rl was launched from, i.e.
    where its relative `model.name` and `output_dir` point.

    - HEAD `<run>/configs[/resolved | /latest/resolved]/trainer.json`: `<run>`, or the nearest dir above it
      that holds the trainer's relative `output_dir` (`rl` runs write `outputs/<run.name>/configs` with the
      trainer's `output_dir` = `outputs/<run.name>`);
    - 16e747c `<launch>/<orchestrator.output_dir>/configs/orch.toml` (default `outputs/run_default`)."""
    run = config_run_dir(config)
    if as_input(config).suffix == ".json":
        depth = len(Path(str(output_dir)).parts) if output_dir else 0
        for cand in [run, *list(run.parents)[: depth + 1]]:
            if output_dir and not Path(str(output_dir)).is_absolute() and (cand / str(output_dir)).is_dir():
                return cand
        return run
    out = Path(str(output_dir or "outputs/run_default"))
    if not out.is_absolute() and run.parts[-len(out.parts) :] == out.parts:
        return run.parents[len(out.parts) - 1]
    return run.parent.parent


def run_base_of(artifact: str | Path) -> BaseModel | None:
    """The base model of the run that wrote `artifact` (a checkpoint, step or broadcast dir):
    `run_base(resolve_run(artifact))`."""
    return run_base(resolve_run(artifact))


def outputs_dir(cfg: RunConfig | None, target: Path | None) -> Path | None:
    """The run's outputs dir (the trainer's output_dir), if it exists."""
    cands = []
    if target is not None and target.is_dir():
        t = target.resolve()
        cands += [t, t / "outputs"] + list(t.parents)[:3]  # a checkpoints, step or trainer dir: its outputs
    if cfg is not None:
        base = launch_dir(cfg)
        out = cfg.value("trainer.output_dir") if "trainer" in cfg.sections else None
        if out is None and cfg.value("orchestrator.output_dir"):
            out = Path(str(cfg.value("orchestrator.output_dir"))).parent
        if out is not None and base is not None:
            cands.append(base / str(out) if not Path(str(out)).is_absolute() else Path(str(out)))
    for c in cands:
        if (c / "checkpoints").is_dir() or (c / "weights").is_dir() or list(c.glob("run_*/configs")):
            return c
    return None


def model_name(cfg: RunConfig | None) -> str | None:
    if cfg is None:
        return None
    for path in ("trainer.model.name", "orchestrator.model.name"):
        section = path.split(".")[0]
        if section in cfg.sections:
            v = cfg.value(path)
            if v:
                return str(v)
    return None


@dataclass(frozen=True)
class BaseModel:
    name: str  # as given or as the config says
    dir: Path | None  # where it is on this machine (None: not found)
    how: str  # "--base" | "config model.name (relative to the launch dir)" | ...
    problem: str | None = None


def resolve_base(base: str | Path | None, cfg: RunConfig | None) -> BaseModel | None:
    """The run's bf16 HF base model: `base` if given, else the config's model name, found as a
    directory (relative names against the launch directory) or in the local HF cache."""
    if base is not None:
        return BaseModel(str(base), resolve_model_dir(base), "--base")
    name = model_name(cfg)
    if name is None:
        return None
    cands = [Path(name)]
    ld = launch_dir(cfg) if cfg is not None else None
    if ld is not None and not Path(name).is_absolute():
        cands.insert(0, ld / name)
    for c in cands:
        if c.is_dir() and ((c / "config.json").is_file() or list(c.glob("*.safetensors*"))):
            return BaseModel(
                name,
                c,
                f"the config's model.name {name!r}" + (f" (relative to {ld})" if c != Path(name) else ""),
            )
    try:
        return BaseModel(name, resolve_model_dir(name), f"the config's model.name {name!r} (local HF cache)")
    except CkptError as exc:
        return BaseModel(name, None, f"the config's model.name {name!r}", exc.message)


def adapter_config_files(outputs: Path) -> list[Path]:
    """adapter_config.json files prime-rl wrote: broadcasts (both layouts) and weight exports."""
    pats = (
        "run_*/broadcasts/step_*/adapter_config.json",
        "broadcasts/step_*/adapter_config.json",
        "weights/step_*/lora_adapters/adapter_config.json",
    )
    return sorted(f for pat in pats for f in as_input(outputs).glob(pat))


def read_adapter_config(path: Path) -> tuple[int, float] | None:
    """(r, lora_alpha) of an adapter_config.json, None when it does not have them."""
    try:  # through the read side: a FIFO or a 100,000-deep file is a None here, not a hang or a crash
        cfg = inputs.read_json(path, what="adapter_config.json")
        return int(cfg["r"]), float(cfg["lora_alpha"])
    except (CkptError, ValueError, KeyError, TypeError, OverflowError):
        return None


def absent_modules_to_save(path: Path) -> tuple[str, ...]:
    """The `modules_to_save` an adapter_config.json lists whose tensors its adapter_model.safetensors does
    not hold (prime-rl HEAD's broadcast lists them and saves none: PEFT then loads the base's modules);
    () when it lists none, or the files cannot be read (other checks report those)."""
    try:
        cfg = inputs.read_json(path, what="adapter_config.json")
        listed = cfg.get("modules_to_save") or []
        weights = as_input(path).parent / "adapter_model.safetensors"
        if not listed or not isinstance(listed, list) or not weights.is_file():
            return ()
        names = [k.removeprefix("base_model.model.") for k in read_header(weights).tensors]
    except (CkptError, AttributeError, TypeError, ValueError):
        return ()
    held = [n.rsplit(".", 1)[0] for n in names if "lora_" not in n]
    return tuple(
        t for t in listed if isinstance(t, str) and not any(h == t or h.endswith("." + t) for h in held)
    )


def weights_exports(outputs: Path) -> list[tuple[int, Path]]:
    """HF weight exports, by step: 16e747c's `outputs/weights/step_N` (the trainer wrote them; for a LoRA run
    the base, not the merge) and the `checkpoints/step_N/weights` prime-rl's converters write after August
    2026 (`step_dir`; bf16 only: an FP8 dir is not bitwise comparable with a base)."""
    found = []
    for sub, inner in (("weights", ""), ("checkpoints", "weights")):
        d = as_input(outputs) / sub
        if not d.is_dir():
            continue
        for n, step in step_dirs(d):
            w = step / inner if inner else step
            if (w / "model.safetensors").is_file() or (w / "model.safetensors.index.json").is_file():
                found.append((n, w))
    return sorted(found)


def dir_bytes(path: Path) -> int:
    """Apparent size of the regular files under `path` (links not followed)."""
    total = 0
    for p in as_input(path).rglob("*"):
        if p.is_file() and not p.is_symlink():
            total += p.lstat().st_size
    return total
