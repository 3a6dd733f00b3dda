"""Outputs to a Hugging Face bucket, `hf://buckets/NS/NAME/PATH`, through huggingface_hub's bucket API
(`HfApi.batch_bucket_files`: the Xet upload, then a batch of adds, copies and deletes).

A bucket has no commits, and a batch is not a transaction (the Hub applies each operation on its own and
lists the ones that failed). So an output is put in place in steps that a reader can never catch half
done:

  1. the contents: every file uploaded (through Xet) and added under a private staging prefix of the
     bucket, `.ckpt-upload/<random>/`; nothing under PATH yet. Ctrl-C or a failure here deletes what was
     staged.
  2. the commit, with Ctrl-C held: server-side copies by Xet hash (no byte is sent again) from the staging
     prefix into PATH, the data files first, checked there, then the files that name them (the DCP
     `.metadata`, index, manifest, configs: `upload.COMMIT_LAST`) in a last batch: a reader that finds a
     `.metadata` finds every file it names. `--overwrite` deletes the old output's marker files before
     the copies and its files the new output does not replace after them.
  3. the staging prefix deleted.

A failure during the commit (an operation the Hub refused) deletes what it had put under PATH, and with
`--overwrite` the old output too, since it was partly replaced: never half an output there.
"""

from __future__ import annotations

import os
import secrets

from ..core.errors import CkptError, OutputExistsError, UsageError
from .signals import signals_deferred

__all__ = ["STAGING_ROOT", "HfBucketWriter"]

STAGING_ROOT = ".ckpt-upload"  # in the bucket: one folder per upload in flight, removed when it ends
_REFUSED = "set HF_TOKEN (or run `hf auth login`) with a token that can write to this bucket"


class HfBucketWriter:
    committed = False  # set once the output is in place (an interrupt held through the commit says so)

    def __init__(self):
        from huggingface_hub import HfApi

        self.api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None)

    def upload(self, url, files, *, overwrite: bool):
        from .upload import COMMIT_LAST, Uploaded, fetched_locally, fetched_note

        parts = url.path.split("/")
        if len(parts) < 4 or not parts[1] or not parts[2] or not "/".join(parts[3:]).strip("/"):
            raise UsageError(
                "name a folder inside the bucket (hf://buckets/NAMESPACE/NAME/PATH)", path=url.text
            )
        bucket_id, prefix = f"{parts[1]}/{parts[2]}", "/".join(parts[3:]).strip("/")
        with _hub_errors(url.text, bucket_id), _quiet_progress():
            self.api.bucket_info(bucket_id)
            old = [
                f.path
                for f in self.api.list_bucket_tree(bucket_id, prefix=prefix, recursive=True)
                if getattr(f, "type", "file") == "file"
                and (f.path == prefix or f.path.startswith(prefix + "/"))
            ]
            if old and not overwrite:
                raise OutputExistsError(
                    "already exists in the bucket",
                    path=url.text,
                    hint="pass --overwrite to replace it, or another output path",
                )
            files, fetched = fetched_locally(files)  # a remote input's unchanged object (set-lr's data files)
            staging = f"{STAGING_ROOT}/{secrets.token_hex(8)}"
            dest = {rel: f"{prefix}/{rel}" if rel else prefix for rel, _, _ in files}
            staged = {rel: f"{staging}/{rel}" if rel else f"{staging}/{url.name}" for rel, _, _ in files}
            try:
                self.api.batch_bucket_files(bucket_id, add=[(str(p), staged[rel]) for rel, p, _ in files])
                hashes = self._hashes(bucket_id, {staged[rel]: size for rel, _, size in files})
                with signals_deferred():
                    try:
                        self._commit(
                            bucket_id,
                            files,
                            dest,
                            {rel: hashes[staged[rel]] for rel in staged},
                            old if overwrite else [],
                            COMMIT_LAST,
                        )
                    except Exception as exc:
                        cleared = self._delete(
                            bucket_id, sorted({*dest.values(), *(old if overwrite else [])})
                        )
                        hint = (
                            "nothing is left there"
                            + (
                                " (the earlier output, partly replaced, was removed too)"
                                if old and overwrite
                                else ""
                            )
                            + "; rerun"
                            if cleared
                            else "removing what had been put there failed too: delete it in the bucket, then "
                            "rerun"
                        )
                        raise CkptError(
                            f"uploading to {url.text} failed while putting it in place: {_describe(exc)}",
                            hint=hint,
                        ) from None
                    self.committed = True
                    self._delete(bucket_id, list(staged.values()))
            except BaseException:
                if not self.committed:  # nothing is under PATH; the staged files go too
                    with signals_deferred():
                        self._delete(bucket_id, list(staged.values()))
                raise
        return Uploaded(
            url.text,
            len(files),
            sum(s for _, _, s in files),
            "hf bucket: uploaded to a staging prefix, then copied into place by Xet hash"
            + fetched_note(fetched),
        )

    def _commit(self, bucket_id, files, dest, hashes, old_to_replace, commit_last):
        """Copies into place: the data files, checked, then the marker files; the old output's markers
        deleted first and its other files after (with --overwrite)."""

        def is_marker(rel):
            return rel.rsplit("/", 1)[-1] in commit_last

        old_markers = [p for p in old_to_replace if is_marker(p)]
        if old_markers:
            self.api.batch_bucket_files(bucket_id, delete=old_markers)
        data = [rel for rel, _, _ in files if not is_marker(rel)]
        markers = [rel for rel, _, _ in files if is_marker(rel)]
        sizes = {rel: size for rel, _, size in files}
        for group in (data, markers):
            if not group:
                continue
            self.api.batch_bucket_files(
                bucket_id, copy=[("bucket", bucket_id, hashes[rel], dest[rel]) for rel in group]
            )
            got = self._hashes(bucket_id, {dest[rel]: sizes[rel] for rel in group})
            wrong = [dest[rel] for rel in group if got[dest[rel]] != hashes[rel]]
            if wrong:
                raise CkptError(f"the bucket holds other contents at {wrong[0]} than were copied there")
        stale = [p for p in old_to_replace if p not in set(dest.values()) and not is_marker(p)]
        if stale:
            self.api.batch_bucket_files(bucket_id, delete=stale)

    def _hashes(self, bucket_id, want: dict[str, int]) -> dict[str, str]:
        """Each path's Xet hash, as the bucket lists it; each must be there with its size."""
        got = {f.path: f for f in self.api.get_bucket_paths_info(bucket_id, list(want))}
        for path, size in want.items():
            f = got.get(path)
            if f is None or int(f.size) != size:
                raise CkptError(
                    f"the bucket does not hold {path} as uploaded "
                    f"({'missing' if f is None else f'{f.size} bytes, not {size}'})"
                )
        return {path: got[path].xet_hash for path in want}

    def _delete(self, bucket_id, paths) -> bool:
        """Best effort (whether it worked): a cleanup that fails (the server gone) leaves files under the
        staging prefix, or under PATH files that the error then says to delete."""
        if paths:
            try:
                self.api.batch_bucket_files(bucket_id, delete=list(paths))
            except Exception:
                return False
        return True


class _hub_errors:
    """Hub errors of a bucket upload as one line naming the URL: a missing bucket, refused credentials,
    anything else ('nothing was committed'). CkptErrors and interrupts pass through."""

    def __init__(self, where: str, bucket_id: str):
        self.where, self.bucket_id = where, bucket_id

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is None or isinstance(exc, CkptError) or not isinstance(exc, Exception):
            return False
        status = getattr(getattr(exc, "response", None), "status_code", None)
        if status in (401, 403):
            raise UsageError(f"the Hub refused access to {self.where}: {_REFUSED}") from None
        if type(exc).__name__ == "BucketNotFoundError" or status == 404:
            raise UsageError(
                "the bucket does not exist",
                path=self.where,
                hint=f"create it first: hf buckets create {self.bucket_id}",
            ) from None
        raise CkptError(
            f"uploading to {self.where} failed: {_describe(exc)}",
            hint="nothing was committed there; check the endpoint and credentials, then rerun",
        ) from None


class _quiet_progress:
    """huggingface_hub's progress bars off while ckpt uploads (ckpt has its own line)."""

    def __enter__(self):
        from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars

        self.was_on = not are_progress_bars_disabled()
        if self.was_on:
            disable_progress_bars()
        return self

    def __exit__(self, *exc):
        if self.was_on:
            from huggingface_hub.utils import enable_progress_bars

            enable_progress_bars()
        return False


def _describe(exc: BaseException) -> str:
    """One line: a batch's refused operations (the Hub lists each with its reason), else the exception's
    first line."""
    failures = getattr(exc, "failures", None)
    if failures:
        shown = "; ".join(f"{f.get('path')}: {f.get('error')}" for f in failures[:3])
        more = f"; and {len(failures) - 3} more" if len(failures) > 3 else ""
        return f"the Hub refused {len(failures)} operation(s) ({shown}{more})"
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"
