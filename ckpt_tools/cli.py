"""The `ckpt` command line. Commands live in ckpt_tools/commands/<name>.py, each a thin click
wrapper over one library operation; this module only wires them up and owns the error edge:
every CkptError is printed as one line naming the file/key and the fix, with its exit code."""
from __future__ import annotations

import importlib
import logging
import sys
import traceback

import click

from .atomic import Terminated, install_signal_handlers
from . import __version__
from .errors import CkptError

# Module names under ckpt_tools.commands; each defines `command` (a click.Command).
COMMAND_MODULES = (
    "inspect", "extract_adapter", "adapter_to_dcp", "fix_adapter", "merge", "diff_vs_base",
    "verify", "slim", "rehydrate", "set_lr", "set_value", "restart_prep", "gc", "doctor",
)


class _Group(click.Group):
    def invoke(self, ctx):
        verbose = ctx.params.get("verbose") or "-v" in sys.argv[1:]
        try:
            return super().invoke(ctx)
        except CkptError as exc:
            if verbose:
                traceback.print_exc()
            click.echo(f"error: {exc}", err=True)
            ctx.exit(exc.exit_code)
        except KeyboardInterrupt:
            click.echo("interrupted: nothing was written (temporary files removed)", err=True)
            ctx.exit(130)
        except Terminated as exc:
            click.echo("terminated: nothing was written (temporary files removed)", err=True)
            ctx.exit(exc.exit_code)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except BrokenPipeError:  # `ckpt inspect --keys | head`: the reader left, that is fine
            import os
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            ctx.exit(0)
        except Exception as exc:  # a bug of ours: say so, one line unless -v
            if verbose:
                traceback.print_exc()
            click.echo(f"internal error: {type(exc).__name__}: {exc} (rerun with -v for the traceback "
                       "and report it)", err=True)
            ctx.exit(1)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Log details and show tracebacks on errors.")
@click.version_option(version=__version__, prog_name="ckpt")
def main(verbose: bool) -> None:
    """LoRA merge and checkpoint surgery for prime-rl (torch DCP) checkpoints."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    install_signal_handlers()  # SIGTERM unwinds like Ctrl-C, so temp outputs are removed


def _register() -> None:
    for name in COMMAND_MODULES:
        modname = f"{__package__}.commands.{name}"
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as exc:
            if exc.name == modname:
                continue  # not built yet
            raise
        main.add_command(mod.command)


_register()

if __name__ == "__main__":
    main()
