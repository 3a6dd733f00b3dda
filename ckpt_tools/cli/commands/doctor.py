"""`ckpt doctor`: arguments -> `api.doctor` -> findings (text or JSON), exit 3 when any."""

from __future__ import annotations

from pathlib import Path

import click

from ... import api
from ...api import DOCTOR_DEFAULT_DECODE_RATE as DEFAULT_DECODE_RATE
from ...api import DOCTOR_ERROR as ERROR
from ...api import DOCTOR_INFO as INFO
from ...api import DOCTOR_WARNING as WARNING
from ...api import doctor_toml_value as toml_value
from ...core.errors import UsageError
from ..flow import shown
from ..options import InputPath, input_arg, json_option, trust_option
from ..render import emit, json_errors, warn_trust

__all__ = ["command", "render"]

_SECTION_FILE = InputPath(dir_okay=False)


@click.command("doctor")
@click.argument("run_or_config", metavar="RUN_OR_CONFIG...", nargs=-1, required=True, type=InputPath())
@click.option(
    "--trainer", "trainer_file", type=_SECTION_FILE, help="A trainer TOML, read as `--trainer @ FILE`."
)
@click.option(
    "--orchestrator",
    "orch_file",
    type=_SECTION_FILE,
    help="An orchestrator TOML, read as `--orchestrator @ FILE`.",
)
@click.option(
    "--inference",
    "inference_file",
    type=_SECTION_FILE,
    help="An inference TOML, read as `--inference @ FILE`.",
)
@click.option(
    "--outputs",
    type=InputPath(file_okay=False),
    help="The run's outputs dir (default: the config's output_dir, or the run dir's).",
)
@click.option("--base", help="The bf16 HF base model (default: the config's model name, if it is here).")
@click.option(
    "--decode-rate",
    type=click.FloatRange(min=0, min_open=True),
    default=DEFAULT_DECODE_RATE,
    show_default=True,
    help="Tokens/s per sequence a loaded inference server sustains (judges the client timeout).",
)
@click.option(
    "--no-weights-check",
    is_flag=True,
    help="Do not compare outputs/weights/step_N with the base (that reads both once).",
)
@json_option
@trust_option
@click.pass_context
def command(
    ctx: click.Context,
    run_or_config: tuple[Path, ...],
    trainer_file,
    orch_file,
    inference_file,
    outputs,
    base,
    decode_rate: float,
    no_weights_check: bool,
    as_json: bool,
    trust_pickle: bool,
) -> None:
    """Find a prime-rl run's config and disk traps: timeouts, retention, LR on resume, LoRA alpha, ...

    RUN_OR_CONFIG: a run dir, outputs dir or checkpoint (16e747c: outputs/run_*/configs/orch.toml;
    HEAD: configs/*.json), or config files in the order `rl @ A.toml @ B.toml` takes them (each
    file's toml_files follow it). Each finding names the key as you write it in TOML, its value and
    default, why it bites, and the exact fix (a TOML line or a ckpt command). Unknown keys are
    reported, never guessed at.

    Exit status: 0 no problem found; 3 an error or warning was found; 1 the run could not be read.

    \b
    Example:
      ckpt doctor rl.toml --outputs outputs
    """
    warn_trust(trust_pickle)
    sections = {
        k: v
        for k, v in (("trainer", trainer_file), ("orchestrator", orch_file), ("inference", inference_file))
        if v is not None
    }
    dirs = [p for p in run_or_config if p.is_dir()]
    with json_errors(as_json):
        if dirs and (len(run_or_config) > 1 or sections):
            raise UsageError(
                "pass either one run dir, or config files (with --trainer/--orchestrator/--inference)",
                hint="use --outputs DIR to point config files at the run's outputs",
            )
        kw = dict(
            outputs=outputs,
            base=input_arg(base),
            decode_rate=decode_rate,
            compare_weights=not no_weights_check,
            trust_pickle=trust_pickle,
        )
        if dirs:
            report = api.doctor(dirs[0], **kw)
        else:
            report = api.doctor(None, files=list(run_or_config), sections=sections, **kw)
    if as_json:
        emit(report, exit_code=report.exit_code)
    else:
        render(report, echo=lambda text, **kw: click.secho(shown(text), **kw))  # a URL shown as itself
    ctx.exit(report.exit_code)


_LABEL = {ERROR: ("ERROR", "red"), WARNING: ("WARNING", "yellow"), INFO: ("info", None)}


def _value(v) -> str:
    return "unset" if v is None else toml_value(v)


def render(r, echo=click.secho) -> None:
    files = (
        ", ".join(
            f"{c['path']}" + (f" (as [{c['section']}])" if c["section"] not in ("(rl)", "") else "")
            for c in r.config_files
        )
        or "none"
    )
    echo(f"doctor: prime-rl {r.generation or '?'} run; configs: {files}")
    if r.outputs:
        full = sum(1 for c in r.checkpoints if c["complete"] and not c["slim"])
        echo(f"  outputs: {r.outputs} ({len(r.checkpoints)} checkpoint(s), {full} full)")
    for f in r.findings:
        label, color = _LABEL[f.severity]
        dflt = "not a key there" if f.trap == "unknown-key" else f"default {_value(f.default)}"
        echo(
            f"{label:<8}{f.trap}: {f.toml} = {_value(f.value)} ({dflt})"
            + (f"  [{f.file}]" if f.file else ""),
            fg=color,
        )
        echo(f"        why: {f.why}")
        fix = f.fix.replace("\n", "\n             ")
        echo(f"        fix: {fix}")
        if f.source:
            echo(f"        prime-rl: {f.source}")
    for n in r.notes:
        echo(f"note: {n}")
    errors = sum(1 for f in r.findings if f.severity == ERROR)
    warnings = sum(1 for f in r.findings if f.severity == WARNING)
    echo("no problem found" if not r.problems else f"{errors} error(s), {warnings} warning(s)")
