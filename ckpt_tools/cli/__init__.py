"""The `ckpt` command line. Commands live in ckpt_tools/cli/commands/<name>.py, each a thin click
wrapper (arguments -> one op -> render); this module only wires them up and owns the error edge:
every CkptError is printed as one line naming the file/key and the fix, with its exit code (and
as one JSON object under --json: `render.error_object`).

The layers below, one way: cli -> workflows -> ops -> sources -> formats -> io -> core
(docs/architecture.md)."""
from __future__ import annotations

import importlib
import logging
import os
import sys
import traceback

import click

from .. import __version__
from .. import dist
from ..core.errors import CkptError, UsageError
from ..io import inputs
from ..io.signals import Terminated, install_signal_handlers
from .render import emit_json, error_object

__all__ = ["main", "COMMAND_MODULES"]

# Module names under ckpt_tools.cli.commands; each defines `command` (a click.Command).
COMMAND_MODULES = (
    "inspect", "extract_adapter", "adapter_to_dcp", "fix_adapter", "merge", "export", "diff_vs_base",
    "verify", "slim", "rehydrate", "set_lr", "set_value", "restart_prep", "gc", "doctor",
)
# Commands that split their plan over torchrun's ranks (`ckpt_tools.dist`); any other refuses 2+ ranks
# (N copies of one command would race for the same OUT).
MULTI_RANK_COMMANDS = ("merge", "export", "rehydrate", "adapter-to-dcp", "slim", "diff-vs-base", "verify")


class _Group(click.Group):
    def invoke(self, ctx):
        # the subcommand's arguments (click 8.2+ keeps them in `_protected_args`, older ones in `protected_args`)
        protected = vars(ctx).get("_protected_args", vars(ctx).get("protected_args", []))
        argv = [*protected, *ctx.args]
        verbose = ctx.params.get("verbose") or "-v" in sys.argv[1:]
        as_json = "--json" in argv

        def fail(kind: str, line: str, code: int, exc: CkptError | None = None):
            click.echo(line, err=True)
            if as_json:   # a failure is JSON on stdout too (the one-line message stays on stderr)
                emit_json(error_object(line.split(": ", 1)[-1], code, exc, kind))
            ctx.exit(code)

        try:
            self._check_ranks(protected[0] if protected else None)
            # every path this command reads is recorded as an input (inputs.register): OUT may not
            # be, contain or be inside any of them (io.staging.AtomicOutputDir)
            with inputs.tracking():
                return super().invoke(ctx)
        except CkptError as exc:
            if verbose:
                traceback.print_exc()
            fail(type(exc).__name__, f"error: {exc}", exc.exit_code, exc)
        except KeyboardInterrupt:
            fail("interrupted", "interrupted: nothing was written (temporary files removed)", 130)
        except Terminated as exc:
            fail("terminated", "terminated: nothing was written (temporary files removed)", exc.exit_code)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except BrokenPipeError:  # `ckpt inspect --keys | head`: the reader left, that is fine
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            ctx.exit(0)
        except MemoryError:   # a safety net: every size is checked against the bytes on disk first
            fail("MemoryError", "error: out of memory (an input claims more than this machine holds; run `ckpt "
                                "verify` on it, and report it if it verifies)", 1)
        except RecursionError:   # a safety net: pickles, JSON and TOML are depth-checked when read
            fail("RecursionError", "error: an input is nested too deeply to process (crafted or corrupt; report "
                                   "it if it verifies)", 1)
        except Exception as exc:  # a bug of ours: say so, one line unless -v
            if verbose:
                traceback.print_exc()
            fail("internal", f"internal error: {type(exc).__name__}: {str(exc)[:500]} (rerun with -v for the "
                             "traceback and report it)", 1)


    @staticmethod
    def _check_ranks(name: str | None) -> None:
        """Under torchrun with 2+ ranks: refuse a command that does not split its work; rank 0 alone prints."""
        part = dist.env_part()
        if part.world == 1:
            return
        if name not in MULTI_RANK_COMMANDS:
            raise UsageError(f"`ckpt {name}` runs in one process, not under torchrun ({part.world} ranks)",
                             hint=f"run it without torchrun; multi-rank commands: {', '.join(MULTI_RANK_COMMANDS)}")
        if not part.leader:   # the ranks' reports are the same: the leader's is the one shown (errors stay on stderr)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Log details and show tracebacks on errors.")
@click.option("--follow-symlinks", is_flag=True,
              help="Read through symlinks that leave the checkpoint or model dir they are in (refused by "
                   "default: a downloaded tree must not make us read elsewhere). Only for links you made.")
@click.option("--allow-sparse", is_flag=True,
              help="Read files that are mostly holes (refused by default: a crafted sparse file claims GBs that "
                   "cost nothing on disk). Only for filesystems that report no allocated blocks.")
@click.version_option(version=__version__, prog_name="ckpt")
def main(verbose: bool, follow_symlinks: bool, allow_sparse: bool) -> None:
    """LoRA merge and checkpoint surgery for prime-rl (torch DCP) checkpoints."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    inputs.set_policy(follow_symlinks=follow_symlinks, allow_sparse=allow_sparse)
    install_signal_handlers()  # SIGTERM unwinds like Ctrl-C, so temp outputs are removed


def _register() -> None:
    for name in COMMAND_MODULES:
        main.add_command(importlib.import_module(f"{__package__}.commands.{name}").command)


_register()

if __name__ == "__main__":
    main()
