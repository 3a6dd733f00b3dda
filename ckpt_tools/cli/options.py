"""Click options shared by commands (one definition each, so every command words them alike)."""

from __future__ import annotations

import os
from pathlib import Path

import click

from ..core.errors import MissingPathError
from ..formats.hf_dir.hub import is_hub_id
from ..io import remote_url

__all__ = [
    "InputPath",
    "ModelPath",
    "OutputPath",
    "alpha_options",
    "download_option",
    "dry_run_option",
    "input_arg",
    "json_option",
    "output_beside",
    "overwrite_option",
    "trust_option",
]


class InputPath(click.Path):
    """An input path: a missing one is `no such file or directory: P` (exit 2) from every command and
    argument, the same words the library uses (`MissingPathError`), not click's own per-argument text."""

    def __init__(self, **kw):
        kw.setdefault("path_type", Path)
        super().__init__(exists=True, **kw)

    def convert(self, value, param, ctx):
        if remote_url.parse_url(value):  # a URL: a path of it, read in place (io.remote)
            return existing_url(value)
        remote_url.refuse_url_lookalike(value)
        if not os.path.lexists(os.fspath(value)):
            raise MissingPathError(value)
        return super().convert(value, param, ctx)


def existing_url(value):
    """The URL `value` as a path of it (`io.remote.as_input`), once something is there (`no such file or
    directory: URL` otherwise, as for a local path: `io.inputs.existing_urls`, the api's check too)."""
    from ..io.inputs import as_input, existing_urls

    existing_urls(value)
    return as_input(value)


def input_arg(value):
    """An input given as a plain string (an option naming a model dir or hub id, a path the op resolves):
    a URL look-alike is refused, anything else (a URL too: read in place, io.remote) is unchanged."""
    if value is None:
        return None
    if remote_url.parse_url(value):
        return existing_url(value)
    remote_url.refuse_url_lookalike(value)
    return value


class OutputPath(click.ParamType):
    """OUT: a local path, or a URL (s3://, hf://, gs://, ...) the output is uploaded to once complete
    (written locally first, then committed in one step: `io.upload`). A URL look-alike (`s3:/x`) is
    refused rather than created as a local dir named `s3:`."""

    name = "out"

    def __init__(self, path_type=Path):
        self.path_type = path_type

    def convert(self, value, param, ctx):
        if remote_url.parse_url(
            value
        ):  # the api puts the output there (io.upload.output_at): passed as given
            from ..io.upload import check_writable  # lazy: only a URL imports the remote packages

            check_writable(value)
            return str(value)
        remote_url.refuse_url_lookalike(value)
        return self.path_type(value)


def output_beside(out, suffix: str):
    """For an OUT at a URL, a second output at that URL + `suffix` (restart-prep's patched config beside its
    merged model), put there after OUT; None for a local OUT (the command's own default)."""
    if out is None or not remote_url.parse_url(str(out)):
        return None
    return str(out) + suffix


class ModelPath(click.ParamType):
    """A checkpoint, model or adapter: an existing path, else a hub id (`org/name[@revision]`) found in the
    local HF cache (offline; fetched into it under `--download`); anything else is `no such file or
    directory: P`."""

    name = "path_or_hub_id"

    def convert(self, value, param, ctx):
        if isinstance(value, Path) or os.path.lexists(os.fspath(value)):
            return Path(value)
        if remote_url.parse_url(value):  # read in place (io.remote)
            return existing_url(value)
        remote_url.refuse_url_lookalike(value)
        if is_hub_id(str(value)):
            # lazy: resolving a hub id imports huggingface_hub (~0.2 s); a local path never does
            from ..formats.hf_dir.hub import resolve_model_dir

            return resolve_model_dir(str(value))
        raise MissingPathError(value)


def _download_on(ctx, _param, value):
    """--download: hub ids missing from the HF cache are fetched into it for this command (io.hub_fetch)."""
    if value:
        from ..io import hub_fetch

        cm = hub_fetch.allowing(True)
        cm.__enter__()

        def done():
            cm.__exit__(None, None, None)
            for f in hub_fetch.fetched():
                click.echo(
                    f"downloaded {len(f.files)} file(s), {f.bytes:,} bytes, of {f.repo}@{f.revision} "
                    f"({f.commit[:12]}) into the HF cache",
                    err=True,
                )
            hub_fetch.reset_log()

        ctx.call_on_close(done)
    return value


# eager: on before any argument naming a hub id is converted; not a parameter of the command
download_option = click.option(
    "--download",
    is_flag=True,
    is_eager=True,
    expose_value=False,
    callback=_download_on,
    help="Fetch a hub id (org/name[@rev]) missing from the local HF cache into it first: only the files this "
    "command needs (config and tokenizer files; the safetensors index and shards where it reads weights).",
)
json_option = click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON envelope on stdout instead of text (docs/json.md).",
)
trust_option = click.option(
    "--trust-remote-pickle",
    "trust_pickle",
    is_flag=True,
    help="DANGEROUS: unpickle checkpoint metadata/items beyond the allow-list. Only for files you made.",
)
dry_run_option = click.option("--dry-run", is_flag=True, help="Print the plan and write nothing.")
overwrite_option = click.option(
    "--overwrite",
    is_flag=True,
    help="Replace OUT if it is an earlier output of ckpt-tools (it carries the "
    ".ckpt-tools-output marker); anything else there is refused, named. The new "
    "one is renamed in only when complete.",
)


def alpha_options(f):
    f = click.option(
        "--run-config",
        type=InputPath(dir_okay=False),
        help="prime-rl orchestrator config (outputs/run_*/configs/orch.toml) whose "
        "[model.lora] alpha set the training scale.",
    )(f)
    f = click.option("--alpha", type=float, help="LoRA alpha training used (scale = alpha / rank).")(f)
    return f
