"""A prime-rl run directory on disk: where its outputs, checkpoints, exports and base model are.

Layouts (shared/docs/primerl-config-traps.md §9, primerl-head-format.md §3):

- 16e747c: `<launch>/outputs/{checkpoints/step_N/trainer, weights/step_N, run_default/{configs/orch.toml,
  broadcasts/step_N}}`; the orchestrator's `output_dir` (`outputs/run_default`) is relative to the
  launch directory, and so is a relative `model.name` (trainer/model.py:207-213).
- HEAD: `<run_dir>/configs/*.json` and the trainer's `output_dir` (relative to the launch directory)
  with `checkpoints/step_N/trainer` and `broadcasts/step_N`.

Reads directory listings and small JSON files only.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ...io import inputs
from ...core.errors import CkptError, UsageError
from ..hf_dir.hub import locate_model, resolve_model_dir
from ..safetensors.header import read_header
from .alpha import find_run_configs, orch_model_name
from .config import GEN_HEAD, RunConfig, config_files, load_run_config
from .files import config_run_dir

__all__ = ["step_number", "step_dirs", "checkpoints_dir_of", "launch_dir", "launch_dir_of", "run_base_of",
    "outputs_dir", "model_name",
    "BaseModel", "resolve_base", "adapter_config_files", "read_adapter_config", "absent_modules_to_save",
    "weights_exports",
    "dir_bytes"]

_STEP = re.compile(r"^step_(\d+)$")


def step_number(p: Path) -> int | None:
    m = _STEP.match(p.name)
    return int(m.group(1)) if m else None


def step_dirs(checkpoints: Path) -> list[tuple[int, Path]]:
    """`step_N` directories (not links) of a checkpoints dir, by step."""
    out = []
    for c in Path(checkpoints).iterdir():
        n = step_number(c)
        if n is not None and c.is_dir() and not c.is_symlink():
            out.append((n, c))
    return sorted(out)


def checkpoints_dir_of(path: str | Path) -> Path:
    """The `checkpoints/` dir for a path that is one, or an outputs dir that holds one."""
    p = Path(path)
    if not p.is_dir():
        raise UsageError("not a directory", path=p, hint="pass a run's outputs/checkpoints directory")
    if any(step_number(c) is not None for c in p.iterdir()):
        return p
    if (p / "checkpoints").is_dir():
        return p / "checkpoints"
    if (p / "outputs" / "checkpoints").is_dir():
        return p / "outputs" / "checkpoints"
    raise UsageError("holds no step_N checkpoints", path=p,
                     hint="pass prime-rl's outputs/checkpoints directory (it holds step_N/trainer)")


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
    """THE run-dir rule (every command's): where a run config found in a run dir says prime-rl was
    launched from, i.e. where its relative `model.name` and `output_dir` point.

    - HEAD `<run>/configs[/resolved | /latest/resolved]/trainer.json`: `<run>`, or the dir above it when
      the trainer's relative `output_dir` lies there (`rl` runs write `<output_dir>/<run.name>/configs`);
    - 16e747c `<launch>/<orchestrator.output_dir>/configs/orch.toml` (default `outputs/run_default`)."""
    run = config_run_dir(config)
    if Path(config).suffix == ".json":
        for cand in (run, run.parent):
            if output_dir and (cand / str(output_dir)).is_dir():
                return cand
        return run
    out = Path(str(output_dir or "outputs/run_default"))
    if not out.is_absolute() and run.parts[-len(out.parts):] == out.parts:
        return Path(*run.parts[:-len(out.parts)])
    return run.parent.parent


def run_base_of(artifact: str | Path) -> BaseModel | None:
    """The base model of the run that wrote `artifact` (a checkpoint, step or broadcast dir), from the one
    run config prime-rl wrote for it (`alpha.find_run_configs`), found as prime-rl resolved it: relative to
    the launch dir (`launch_dir_of`), else a local dir or hub id in the local HF cache. None when the run
    has no (or several) configs or names no model; `dir` None when the model is not on this machine."""
    configs = find_run_configs(Path(artifact))
    if len(configs) != 1:
        return None
    cfg_path = configs[0]
    name = orch_model_name(cfg_path)
    if name is None:
        return None
    try:
        cfg = load_run_config(config_files([cfg_path]))
        key = "trainer.output_dir" if cfg_path.suffix == ".json" else "orchestrator.output_dir"
        out = cfg.value(key) if key.split(".")[0] in cfg.sections else None
    except CkptError:
        out = None
    launch = launch_dir_of(cfg_path, out)
    found, why = locate_model(name, run_root=launch)
    how = f"the run config {cfg_path}'s model.name {name!r}" + (f" (relative to {launch})" if found is not None
                                                                 and found == launch / name else "")
    return BaseModel(name, found, how, why)


def outputs_dir(cfg: RunConfig | None, target: Path | None) -> Path | None:
    """The run's outputs dir (the trainer's output_dir), if it exists."""
    cands = []
    if target is not None and target.is_dir():
        t = target.resolve()
        cands += [t, t / "outputs"] + list(t.parents)[:3]   # a checkpoints, step or trainer dir: its outputs
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
    name: str            # as given or as the config says
    dir: Path | None     # where it is on this machine (None: not found)
    how: str             # "--base" | "config model.name (relative to the launch dir)" | ...
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
            return BaseModel(name, c, f"the config's model.name {name!r}" + (f" (relative to {ld})" if c != Path(name)
                                                                          else ""))
    try:
        return BaseModel(name, resolve_model_dir(name), f"the config's model.name {name!r} (local HF cache)")
    except CkptError as exc:
        return BaseModel(name, None, f"the config's model.name {name!r}", exc.message)


def adapter_config_files(outputs: Path) -> list[Path]:
    """adapter_config.json files prime-rl wrote: broadcasts (both layouts) and weight exports."""
    pats = ("run_*/broadcasts/step_*/adapter_config.json", "broadcasts/step_*/adapter_config.json",
            "weights/step_*/lora_adapters/adapter_config.json")
    return sorted(f for pat in pats for f in Path(outputs).glob(pat))


def read_adapter_config(path: Path) -> tuple[int, float] | None:
    """(r, lora_alpha) of an adapter_config.json, None when it does not have them."""
    try:   # through the read side: a FIFO or a 100,000-deep file is a None here, not a hang or a crash
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
        weights = Path(path).parent / "adapter_model.safetensors"
        if not listed or not isinstance(listed, list) or not weights.is_file():
            return ()
        names = [k.removeprefix("base_model.model.") for k in read_header(weights).tensors]
    except (CkptError, AttributeError, TypeError, ValueError):
        return ()
    held = [n.rsplit(".", 1)[0] for n in names if "lora_" not in n]
    return tuple(t for t in listed if isinstance(t, str) and not any(h == t or h.endswith("." + t) for h in held))


def weights_exports(outputs: Path) -> list[tuple[int, Path]]:
    """16e747c's `outputs/weights/step_N` HF exports, by step."""
    w = Path(outputs) / "weights"
    if not w.is_dir():
        return []
    return [(n, d) for n, d in step_dirs(w)
            if (d / "model.safetensors").is_file() or (d / "model.safetensors.index.json").is_file()]


def dir_bytes(path: Path) -> int:
    """Apparent size of the regular files under `path` (links not followed)."""
    total = 0
    for p in Path(path).rglob("*"):
        if p.is_file() and not p.is_symlink():
            total += p.lstat().st_size
    return total
