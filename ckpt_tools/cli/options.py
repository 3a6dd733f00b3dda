"""Click options shared by commands."""
from __future__ import annotations

from pathlib import Path

import click

__all__ = ["json_option", "trust_option", "dry_run_option", "alpha_options"]

json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")
trust_option = click.option(
    "--trust-remote-pickle", "trust_pickle", is_flag=True,
    help="DANGEROUS: unpickle checkpoint metadata/items beyond the allow-list. Only for files you made.")
dry_run_option = click.option("--dry-run", is_flag=True, help="Print the plan and write nothing.")


def alpha_options(f):
    f = click.option("--run-config", type=click.Path(exists=True, dir_okay=False, path_type=Path),
                     help="prime-rl orchestrator config (outputs/run_*/configs/orch.toml) whose "
                          "[model.lora] alpha set the training scale.")(f)
    f = click.option("--alpha", type=float, help="LoRA alpha training used (scale = alpha / rank).")(f)
    return f
