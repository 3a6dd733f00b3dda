#!/usr/bin/env python3
"""Merge a LoRA adapter into a base model and write an HF model directory.

The standalone form of `ckpt merge`, runnable from a checkout without installing the package: it runs
that command (the same flags, output and exit codes), which parses the arguments and makes one call of
the library, `ckpt_tools.api.merge` (= `ckpt_tools.merge`; docs/api.md), so the script is a client of
the api as the CLI is. A script of your own calls `ckpt_tools.merge(base, adapter, out, ...)` directly.

    python scripts/merge_lora.py BASE ADAPTER OUT [--alpha A | --run-config ORCH_TOML] [--slot i]
        [--dtype bf16|fp16|fp32] [--max-shard-size 5GB] [--threads N] [--dry-run] [--json]
    python scripts/merge_lora.py --base-from-checkpoint CHECKPOINT OUT --config-from DIR

BASE: an HF model dir or a hub id in the local HF cache. ADAPTER: a PEFT adapter dir or a prime-rl
DCP checkpoint (outputs/checkpoints/step_N/trainer). `--help` lists every flag. -v shows tracebacks.

Example: python scripts/merge_lora.py Qwen/Qwen3-8B outputs/checkpoints/step_95/trainer merged-step95
"""
from __future__ import annotations

import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # a checkout works without `pip install`


def main(argv: list[str] | None = None) -> int:
    import logging

    import click

    from ckpt_tools.core.errors import CkptError
    from ckpt_tools.io import inputs
    from ckpt_tools.cli.commands.merge import command

    args = list(sys.argv[1:] if argv is None else argv)
    verbose = any(a in ("-v", "--verbose") for a in args)
    args = [a for a in args if a not in ("-v", "--verbose")]
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        with inputs.tracking():   # every path read is an input OUT may not overlap, as under `ckpt`
            command.main(args=args, prog_name="merge_lora.py", standalone_mode=False)
    except CkptError as exc:              # the same one-line edge as `ckpt`
        if verbose:
            traceback.print_exc()
        click.echo(f"error: {exc}", err=True)
        return exc.exit_code
    except click.exceptions.Exit as exc:  # --help
        return exc.exit_code
    except click.ClickException as exc:   # bad flags
        exc.show()
        return exc.exit_code
    except (KeyboardInterrupt, click.exceptions.Abort):
        click.echo("interrupted: nothing was written (temporary files removed)", err=True)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
