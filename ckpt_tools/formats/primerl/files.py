"""Where a prime-rl run's config files are, and the order prime-rl loads them in.

- 16e747c (Jan 2026): the user's TOML, `uv run rl @ rl.toml [@ more.toml] [--trainer @ t.toml]`;
  files named by a file's top-level `toml_files = [...]` load right after it (paths relative to it)
  and override it (utils/pydantic_config.py:100-177). A run dir holds only the orchestrator's resolved
  copy, `outputs/run_*/configs/orch.toml` (orchestrator.py:79-83).
- HEAD (Aug 2026): the rl entrypoint writes the resolved `<run_dir>/configs/{rl,trainer,orchestrator,
  inference}.json` (entrypoints/rl.py:70-85).

`ckpt_tools.primerl.config` re-exports the public names; use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ...core.errors import FormatError, UsageError
from ...io import inputs
from ...io.inputs import as_input, lexists, real_name, search_top
from .attempts import (
    ATTEMPT_ENV,
    RunAttempts,
    WriterChoice,
    attempt_number,
    checkpoint_step,
    run_attempts,
    writer_of,
)

__all__ = [
    "CONFIG_DIRS",
    "GEN_16E747C",
    "GEN_HEAD",
    "HEAD_JSON",
    "SECTIONS",
    "ConfigFile",
    "RunFiles",
    "config_files",
    "config_run_dir",
    "head_config_files",
    "locate_run_configs",
    "read_json",
    "read_toml",
]

GEN_16E747C = "16e747c"
GEN_HEAD = "head"
SECTIONS = ("trainer", "orchestrator", "inference")
HEAD_JSON = {
    "rl.json": "",
    "trainer.json": "trainer",
    "orchestrator.json": "orchestrator",
    "inference.json": "inference",
}
# Where a run dir holds its resolved JSON configs (entrypoints/rl.py writes configs/ at 559b447; later
# prime-rl writes configs/resolved/, then one configs/attempt_<n>/resolved/ per launch with configs/latest
# pointing at the newest: `attempts`).
CONFIG_DIRS = ("configs", "configs/resolved", "configs/latest/resolved", "configs/attempt_<n>/resolved")
_SEARCH_LEVELS = 5  # trainer -> step_N -> checkpoints -> outputs -> run/launch dir


# ------------------------------------------------------------------------------------------ files
@dataclass(frozen=True)
class ConfigFile:
    path: Path
    section: str  # "" = the rl root; "trainer" | "orchestrator" | "inference" = nested under it
    origin: str  # how it was found: "argument", "toml_files of X", "run dir"

    @property
    def format(self) -> str:
        return "json" if self.path.suffix == ".json" else "toml"


@dataclass(frozen=True)
class RunFiles:
    generation: str
    files: tuple[ConfigFile, ...]  # load order: later files override earlier ones
    run_dir: Path | None = None  # where the configs were found (None: given as arguments)
    ignored_includes: tuple[tuple[Path, str], ...] = ()  # (file, table) whose toml_files prime-rl ignores
    attempts: RunAttempts | None = None  # HEAD: the run's launch attempts (configs/attempt_<n>/ ...)
    writer: WriterChoice | None = None  # the attempt these files are of, and how it was chosen


def read_toml(path: Path) -> dict:
    """Through the read side (`inputs.read_toml`: no FIFO or device, size and depth limits)."""
    if not lexists(path):
        raise UsageError("config file not found", path=path)
    try:
        return inputs.read_toml(path, what="prime-rl config")[0]
    except FormatError as exc:
        if not exc.message.startswith("not valid TOML"):
            raise
        raise FormatError(
            exc.message, path=path, hint="prime-rl cannot read it either; fix the syntax first"
        ) from None


def read_json(path: Path) -> dict:
    """Through the read side (`inputs.read_json`: no FIFO or device, size and depth limits, no NaN)."""
    if not lexists(path):
        raise UsageError("config file not found", path=path)
    data = inputs.read_json(path, what="prime-rl config")
    if not isinstance(data, dict):
        raise FormatError("is not a JSON object", path=path)
    return data


def _nested_toml_files(data: dict, path: Path) -> list[tuple[Path, str]]:
    """`toml_files` inside a table is a field prime-rl never reads: only a file's top-level key loads
    files (pydantic_config.py:136-145)."""
    out = []

    def walk(d, prefix):
        for k, v in d.items():
            if isinstance(v, dict):
                if "toml_files" in v:
                    out.append((path, f"{prefix}{k}"))
                walk(v, f"{prefix}{k}.")

    walk(data, "")
    return out


def config_files(files: list[Path], sections: Mapping[str, Path] | None = None) -> RunFiles:
    """The files `uv run rl @ F1 @ F2 --trainer @ T` would load, in prime-rl's order: each @ file,
    then (depth first) the files its top-level `toml_files` names; section files nested under their
    key. A file already loaded is skipped, as prime-rl does."""
    seen: list[ConfigFile] = []
    ignored: list[tuple[Path, str]] = []

    def add(path: Path, section: str, origin: str) -> None:
        path = as_input(path)
        # realpath, not Path.resolve: a symlink loop is then refused by the read below (one clean
        # line naming it), not a RuntimeError here
        real = real_name(path)
        if any(real_name(c.path) == real and c.section == section for c in seen):
            return
        if path.suffix == ".json":
            if section:
                raise UsageError("a section file must be TOML", path=path)
            seen.append(ConfigFile(path, HEAD_JSON.get(path.name, ""), origin))
            return
        data = read_toml(path)
        seen.append(ConfigFile(path, section, origin))
        ignored.extend(_nested_toml_files(data, path))
        includes = data.get("toml_files")
        if includes is None:
            return
        if section:
            raise UsageError(
                f"`toml_files` in a file given as --{section} @ FILE: prime-rl raises "
                f"NotImplementedError for it (pydantic_config.py:137-138)",
                path=path,
                hint="list the files in the rl config's top-level toml_files instead",
            )
        if not isinstance(includes, list) or not all(isinstance(x, str) for x in includes):
            raise FormatError(f"toml_files is {includes!r}, not a list of paths", path=path, key="toml_files")
        for inc in includes:
            if inc.endswith(".toml"):
                add(path.parent / inc, "", f"toml_files of {path.name}")

    for f in files:
        add(as_input(f), "", "argument")
    for sec, f in (sections or {}).items():
        if sec not in SECTIONS:
            raise UsageError(f"unknown section {sec!r}; one of {', '.join(SECTIONS)}")
        add(as_input(f), sec, "argument")
    gens = {GEN_HEAD if c.format == "json" else GEN_16E747C for c in seen}
    if len(gens) > 1:
        raise UsageError("mixes HEAD JSON configs with 16e747c TOML configs; pass one run's files")
    return RunFiles(gens.pop() if gens else GEN_16E747C, tuple(seen), None, tuple(ignored))


def head_config_files(
    d: Path, target: Path | None = None, *, pinned: bool = False
) -> tuple[list[Path], RunAttempts | None, WriterChoice | None]:
    """The HEAD JSON configs of run dir `d` (`attempts.run_attempts`: the legacy `configs/` and
    `configs/resolved/`, one `configs/attempt_<n>/resolved/` per launch) of the launch attempt that wrote
    `target` (a checkpoint's step or trainer dir; `attempts.writer_of`), else of the newest attempt; the
    attempts and the choice with them. `pinned`: `$PRL_ATTEMPT_CONFIG_DIR` may stand for `d`'s configs."""
    found = run_attempts(d, env=None if pinned else {})
    if found is None:
        return [], None, None
    step, when = checkpoint_step(target) if target is not None else (None, None)
    writer = writer_of(found, step, when)
    chosen = writer.attempt or found.newest
    return (list(chosen.files) if chosen is not None else []), found, writer


def config_run_dir(config: Path) -> Path:
    """The run dir a found config file belongs to: `<run>` for `<run>/configs[/resolved | /latest/resolved |
    /attempt_<n>/resolved]/x.json`, and `<outputs>/run_x` for 16e747c's
    `<outputs>/run_x/configs/orch.toml`."""
    p = as_input(config).resolve()
    parts = p.parent.parts
    if (
        len(parts) > 3
        and parts[-1] == "resolved"
        and parts[-3] == "configs"
        and (parts[-2] == "latest" or attempt_number(parts[-2]) is not None)
    ):
        return p.parents[3]
    if len(parts) > 2 and parts[-1] == "resolved" and parts[-2] == "configs":
        return p.parents[2]
    if len(parts) > 1 and parts[-1] == "configs":
        return p.parents[1]
    return p.parent.parent


def _orch_tomls(d: Path) -> list[Path]:
    if (d / "configs" / "orch.toml").is_file():  # a run_* dir itself
        return [d / "configs" / "orch.toml"]
    return sorted(d.glob("run_*/configs/orch.toml")) + sorted(d.glob("outputs/run_*/configs/orch.toml"))


def _run_below(d: Path) -> RunFiles | None:
    """HEAD's configs of the run under launch dir `d`: `outputs/` itself (the trainer's output_dir) or one
    `outputs/<run.name>/` (the rl entrypoint's run dir); several runs there are refused, naming them."""
    if (d / "configs").is_dir() or not (d / "outputs").is_dir():
        return None
    found = []
    for run in [d / "outputs", *sorted(p for p in (d / "outputs").iterdir() if p.is_dir())]:
        head, attempts, writer = head_config_files(run)
        if head:
            found.append((run, head, attempts, writer))
    if len(found) > 1:
        raise UsageError(
            f"several runs' configs here: {', '.join(str(f[0]) for f in found)}",
            path=d,
            hint="pass the run's dir (outputs/<run.name>) to pick one",
        )
    if not found:
        return None
    run, head, attempts, writer = found[0]
    order = sorted(head, key=lambda f: list(HEAD_JSON).index(f.name))
    files = tuple(ConfigFile(f, HEAD_JSON[f.name], "run dir") for f in order)
    return RunFiles(GEN_HEAD, files, run, attempts=attempts, writer=writer)


def locate_run_configs(path: str | Path) -> RunFiles | None:
    """A run's config files from a config file, a run/outputs dir, or a checkpoint inside one (the
    nearest ancestor that has any). None when there are none; an error when several runs share the
    dir (pass the one you mean)."""
    p = as_input(path)
    if p.is_file():
        return config_files([p])
    d = p.resolve()
    # a URL's shadow tree (io.remote): nothing above its root stands for the run (the local temp dir that
    # holds it could hold anything); the run configs above a URL are `run_dir.find_run_configs`'s
    top = search_top(p)
    below = _run_below(d)  # a launch dir: the run dir(s) prime-rl wrote under its outputs/
    if below is not None:
        return below
    for _ in range(_SEARCH_LEVELS + 1):
        (head, attempts, writer), old = head_config_files(d, p), _orch_tomls(d)
        if head:
            order = sorted(head, key=lambda f: list(HEAD_JSON).index(f.name))  # rl.json first
            files = tuple(ConfigFile(f, HEAD_JSON[f.name], "run dir") for f in order)
            return RunFiles(GEN_HEAD, files, d, attempts=attempts, writer=writer)
        if len(old) > 1:
            raise UsageError(
                f"several runs' configs here: {', '.join(map(str, old))}",
                path=d,
                hint="pass the run's orch.toml (or its run_* dir) to pick one",
            )
        if old:
            return RunFiles(GEN_16E747C, (ConfigFile(old[0], "orchestrator", "run dir"),), d)
        if d.parent == d or (top is not None and d == top):
            break
        d = d.parent
    head, attempts, writer = head_config_files(p.resolve(), p, pinned=True)  # $PRL_ATTEMPT_CONFIG_DIR, last
    if head:
        order = sorted(head, key=lambda f: list(HEAD_JSON).index(f.name))
        files = tuple(ConfigFile(f, HEAD_JSON[f.name], f"${ATTEMPT_ENV}") for f in order)
        return RunFiles(GEN_HEAD, files, None, attempts=attempts, writer=writer)
    return None
