"""The `ckpt` command line. Commands live in ckpt_tools/cli/commands/<name>.py, each a thin click
wrapper, a client of the library (arguments -> one `ckpt_tools.api` call -> render); this module only
wires them up and owns the error edge: every CkptError is printed as one line naming the file/key and
the fix, with its exit code (and as the failure envelope under --json: `render.emit_failure`).

Commands are imported when they run, not before: `ckpt --help`, `--version` and the metadata
commands (`inspect`, `verify`) never import torch (measured: `ckpt --version` 3.3-4.7 s -> ~0.15 s on
2 cores; bench/startup.py). Nor does `ckpt <command> --help`: a command module imports only
`ckpt_tools.api`, which imports an op (torch, for most) when it is called (`ckpt merge --help` 2.3 s ->
0.18 s, median of 5 on 2 cores).
The group's listing takes each command's one-line help from `COMMANDS` (a test checks it equals the
command's own).

The layers below, one way: cli -> api -> workflows -> ops -> sources -> formats -> io -> core
(docs/architecture.md)."""

from __future__ import annotations

import importlib
import logging
import os
import sys
import traceback

import click

from .. import dist
from ..core.errors import CkptError, UsageError
from ..io import inputs, owned, staging
from ..io.files import stdout_to_devnull
from ..io.owned import TOOL
from ..io.remote_display import display
from ..io.remote_url import redact
from ..io.signals import Terminated, install_signal_handlers
from .render import STATE, clear_progress, emit_failure, escaped_streams, one_line

__all__ = ["COMMANDS", "COMMAND_MODULES", "GLOBAL_FLAGS", "hoist_global_flags", "main"]

# name -> (module under ckpt_tools.cli.commands defining `command`, the one-line help `ckpt --help` lists)
COMMANDS = {
    "inspect": ("inspect", "Describe a checkpoint, HF model dir or PEFT adapter from metadata alone."),
    "extract-adapter": ("extract_adapter", "Export a prime-rl DCP checkpoint's LoRA as a PEFT adapter dir."),
    "adapter-to-dcp": (
        "adapter_to_dcp",
        "Build a prime-rl trainer checkpoint from a PEFT adapter and the HF base.",
    ),
    "fix-adapter": (
        "fix_adapter",
        "Repair a prime-rl adapter export into a PEFT adapter that really applies.",
    ),
    "average": (
        "average",
        "Average LoRA steps of one run in delta space; write a PEFT adapter (or, with --merge, the merged "
        "model).",
    ),
    "resize-adapter": (
        "resize_adapter",
        "Bring each LoRA module of an adapter to its best lower rank; write a PEFT adapter.",
    ),
    "merge": ("merge", "Merge a LoRA into base weights; write an HF model directory (sharded safetensors)."),
    "export": (
        "export",
        "Export a prime-rl DCP checkpoint as an HF model directory: the trained weights of a full fine-tune, "
        "or the merged model of a LoRA run (= merge --base-from-checkpoint).",
    ),
    "diff-vs-base": ("diff_vs_base", "Tell whether WEIGHTS differ from BASE, tensor by tensor."),
    "verify": ("verify", "Check a checkpoint's integrity before you trust or ship it."),
    "slim": ("slim", "Drop the frozen base weights of a checkpoint, keeping everything unique."),
    "rehydrate": (
        "rehydrate",
        "Rebuild the full checkpoint prime-rl resumes from, from a slim one and the base.",
    ),
    "set-lr": ("set_lr", "Change the learning rate of a checkpoint, keeping the Adam moments."),
    "set": (
        "set_value",
        "Set scalar byte items (progress, scheduler fields, ...) of a checkpoint by surgery.",
    ),
    "restart-prep": ("restart_prep", "Prepare a fresh-LR restart of a prime-rl LoRA run."),
    "gc": ("gc", "Keep every checkpoint of a run: the newest N whole, every older one slim, in place."),
    "doctor": ("doctor", "Find a prime-rl run's config and disk traps."),
    "report": ("report", "See what a run changed, and its learning rate, as a picture."),
}
COMMAND_MODULES = tuple(m for m, _ in COMMANDS.values())

# flags of the group that may stand anywhere on the line (`ckpt merge A B C -v` as well as `ckpt -v merge
# ...`)
GLOBAL_FLAGS = ("-v", "--verbose", "-q", "--quiet")


def hoist_global_flags(args: list[str]) -> list[str]:
    """Move -v/-q (and their long forms) found after the command name to before it, so click's group
    parses them wherever the user typed them. Nothing after a `--` is touched (a literal argument)."""
    if "--" in args:
        cut = args.index("--")
        head, tail = args[:cut], args[cut:]
    else:
        head, tail = args, []
    flags = [a for a in head if a in GLOBAL_FLAGS]
    rest = [a for a in head if a not in GLOBAL_FLAGS]
    return flags + rest + tail


# Commands that split their plan over torchrun's ranks (`ckpt_tools.dist`); any other refuses 2+ ranks
# (N copies of one command would race for the same OUT).
MULTI_RANK_COMMANDS = ("merge", "export", "rehydrate", "adapter-to-dcp", "slim", "diff-vs-base", "verify")


_NOTHING_WRITTEN = "nothing was written (temporary files removed)"


def _what_was_done(exc: BaseException) -> str:
    """What an interrupted command leaves: its own summary (gc's steps), the outputs it had committed
    (complete: the interruption came after), or nothing."""
    from ..io import upload  # an OUT bound for a URL is committed when its upload is (its own `summary`)

    done = [out for out in staging.committed_outputs() if not upload.bound_for_url(out)]
    if getattr(exc, "summary", None) or not done:
        return getattr(exc, "summary", None) or _NOTHING_WRITTEN
    return (
        f"{', '.join(done)}: written and complete (the interruption came after it was committed); "
        "what the command had left to do (its report) was not done"
    )


def _failure(exc: BaseException) -> tuple[str, str, int, bool]:
    """(kind, the line, exit code, whether -v shows the traceback) of the error a command ended with."""
    if isinstance(exc, CkptError):
        return type(exc).__name__, f"error: {exc}", exc.exit_code, True
    if isinstance(exc, KeyboardInterrupt):  # `summary`: a command that had written something says what
        # (or the outputs it had committed: `_what_was_done`)
        return "interrupted", f"interrupted: {_what_was_done(exc)}", 130, False
    if isinstance(exc, Terminated):
        return ("terminated", f"terminated: {_what_was_done(exc)}", exc.exit_code, False)
    if isinstance(exc, MemoryError):  # a safety net: every size is checked against the bytes on disk first
        return (
            "MemoryError",
            "error: out of memory (an input claims more than this machine holds; run `ckpt "
            "verify` on it, and report it if it verifies)",
            1,
            False,
        )
    if isinstance(exc, RecursionError):  # a safety net: pickles, JSON and TOML are depth-checked when read
        return (
            "RecursionError",
            "error: an input is nested too deeply to process (crafted or corrupt; report it if it verifies)",
            1,
            False,
        )
    # a bug of ours: say so, one line unless -v
    return (
        "internal",
        f"internal error: {type(exc).__name__}: {str(exc)[:500]} (rerun with -v for the "
        "traceback and report it)",
        1,
        True,
    )


class _Group(click.Group):
    def list_commands(self, ctx):
        return list(COMMANDS)

    def get_command(self, ctx, name):
        entry = COMMANDS.get(name)
        if entry is None:
            return None
        return importlib.import_module(f"{__package__}.commands.{entry[0]}").command

    def format_commands(self, ctx, formatter):
        # the listing from COMMANDS: importing every command (torch among them) to print one line each
        # took seconds
        rows = [(name, help_) for name, (_, help_) in COMMANDS.items()]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def main(self, *args, **kwargs):
        with escaped_streams():  # control characters in names never reach the terminal raw (render.py)
            return super().main(*args, **kwargs)

    def parse_args(self, ctx, args):
        return super().parse_args(ctx, hoist_global_flags(list(args)))

    def invoke(self, ctx):
        # the subcommand's arguments (click 8.2+ keeps them in `_protected_args`, older ones in
        # `protected_args`)
        protected = vars(ctx).get("_protected_args", vars(ctx).get("protected_args", []))
        argv = [*protected, *ctx.args]
        verbose = ctx.params.get("verbose")
        as_json = "--json" in argv
        STATE.reset()
        staging.reset_committed()
        if (upload := sys.modules.get("ckpt_tools.io.upload")) is not None:
            upload.take_uploaded()  # what a library call put at a URL earlier in this process is not ours
        STATE.verbose, STATE.quiet, STATE.as_json = verbose, ctx.params.get("quiet"), as_json
        command = protected[0] if protected else None

        def fail(kind: str, line: str, code: int, exc: CkptError | None = None):
            clear_progress()  # Ctrl-C mid-run: the message on its own line, not after the bar
            line = one_line(redact(display(line)))  # a staged OUT shown as its URL; no URL's credentials
            click.echo(line, err=True)
            if as_json and not STATE.emitted:  # the failure envelope on stdout (the line stays on stderr)
                emit_failure(line.split(": ", 1)[-1], code, exc, kind, command=command)
            ctx.exit(code)

        try:
            self._check_ranks(protected[0] if protected else None)
            # every path this command reads is recorded as an input (inputs.register): OUT may not
            # be, contain or be inside any of them (io.staging.AtomicOutputDir)
            with inputs.tracking():
                owned.set_command(command)  # named in the marker of every OUT written (--overwrite's proof)
                return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort):
            raise
        except click.ClickException as exc:
            if as_json and not STATE.emitted:  # a usage error of the command's own arguments
                exc.show()
                emit_failure(exc.format_message(), exc.exit_code, None, "UsageError", command=command)
                ctx.exit(exc.exit_code)
            raise
        except BrokenPipeError:  # `ckpt inspect --keys | head`: the reader left, that is fine
            stdout_to_devnull()
            ctx.exit(0)
        except (Exception, KeyboardInterrupt, Terminated) as exc:
            kind, line, code, trace = _failure(exc)
            if verbose and trace:
                traceback.print_exc()
            fail(kind, line, code, exc if isinstance(exc, CkptError) else None)

    @staticmethod
    def _check_ranks(name: str | None) -> None:
        """Under torchrun with 2+ ranks: refuse a command that cannot split its work; rank 0 alone prints."""
        part = dist.launched_part()
        if part.world == 1:
            return
        if name not in MULTI_RANK_COMMANDS:
            raise UsageError(
                f"`ckpt {name}` runs in one process, not under torchrun ({part.world} ranks)",
                hint=f"run it without torchrun; multi-rank commands: {', '.join(MULTI_RANK_COMMANDS)}",
            )
        dist.check_env()
        if dist.idle_rank():  # a node's ranks past its working ones (dist.working_per_node): nothing to do
            raise SystemExit(0)
        if (
            not dist.env_part().leader
        ):  # the ranks' reports are the same: the leader's is shown (errors on stderr)
            stdout_to_devnull()


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option(
    "-v", "--verbose", is_flag=True, help="Log details and show tracebacks on errors (anywhere on the line)."
)
@click.option(
    "-q",
    "--quiet",
    is_flag=True,
    help="No progress bar, only warnings and errors in the log (anywhere on "
    "the line). The command's own output is kept.",
)
@click.option(
    "--follow-symlinks",
    is_flag=True,
    help="Read through symlinks that leave the checkpoint or model dir they are in (refused by "
    "default: a downloaded tree must not make us read elsewhere). Only for links you made.",
)
@click.option(
    "--allow-sparse",
    is_flag=True,
    help="Read files that are mostly holes (refused by default: a crafted sparse file claims GBs that "
    "cost nothing on disk). Only for filesystems that report no allocated blocks.",
)
@click.version_option(package_name=TOOL, prog_name="ckpt")  # read from the package metadata on --version
@click.pass_context
def main(ctx: click.Context, verbose: bool, quiet: bool, follow_symlinks: bool, allow_sparse: bool) -> None:
    """LoRA merge and checkpoint surgery for prime-rl (torch DCP) checkpoints.

    Every command takes --json (one JSON envelope on stdout: docs/json.md). NO_COLOR=1 turns
    colour off; progress is drawn on a terminal only, never under -q or --json.

    \b
    Shell completion (bash; zsh_source or fish_source for those shells):
      eval "$(_CKPT_COMPLETE=bash_source ckpt)"
    """
    if verbose and quiet:
        raise click.UsageError("-v/--verbose and -q/--quiet contradict each other: pick one")
    if os.environ.get("NO_COLOR"):
        ctx.color = False
    logging.basicConfig(
        level=logging.INFO if verbose else (logging.ERROR if quiet else logging.WARNING),
        format="%(levelname)s %(name)s: %(message)s",
    )
    inputs.set_policy(follow_symlinks=follow_symlinks, allow_sparse=allow_sparse)
    install_signal_handlers()  # SIGTERM unwinds like Ctrl-C, so temp outputs are removed


if __name__ == "__main__":
    main()
