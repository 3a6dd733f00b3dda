"""A URL given where a path is expected: what it is, how it is shown, and the remote failures' kinds.

Pure (no network, no fsspec): every module that reads or writes a URL parses it here (`parse_url`), and
shows it by `RemoteUrl.shown` (or `str(url)`): the URL as the user wrote it minus its credentials, the
userinfo (`http://user:PASS@host`) and the query string and fragment (a presigned URL's signature, a
`?token=`). `RemoteUrl.text` keeps them for the requests alone. `redact(text)` removes the same from a
free text (a client library's message), the last line of defence at the CLI's edge.

The settings every remote read and write share come from the environment (`settings()`):
CKPT_REMOTE_CONCURRENCY (requests in flight), CKPT_REMOTE_RETRIES (failures in a row without progress),
CKPT_REMOTE_TIMEOUT (seconds a request may stall without a byte), CKPT_REMOTE_BACKOFF (the first retry's
wait, doubling), CKPT_REMOTE_MIN_RATE (bytes/s a read must average, after CKPT_REMOTE_TIMEOUT seconds of
grace: a server that drips a byte a minute never stalls long enough for the timeout, and is ended by this).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..core.errors import UsageError

__all__ = [
    "LOCAL_SCHEMES",
    "RemoteChanged",
    "RemoteDenied",
    "RemoteMissing",
    "RemoteRetry",
    "RemoteUrl",
    "parse_url",
    "redact",
    "refuse_url_lookalike",
    "settings",
]

CONCURRENCY = 8
RETRIES = 5
MIN_RATE = 64 << 10  # bytes/s: a 64 KiB/s link is slow; a server below it for a whole read is stalled
_URL_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+)://(.*)$", re.S)
_LOOKALIKE_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):(/{0,1}[^/].*|/{3,}.*|)$", re.S)
LOCAL_SCHEMES = ("file", "local")
# schemes whose look-alikes (`s3:/x`) are refused; any other `name:rest` is a local name with a colon
_URL_SCHEMES = frozenset(
    (
        "hf",
        "s3",
        "s3a",
        "gs",
        "gcs",
        "http",
        "https",
        "az",
        "abfs",
        "abfss",
        "adl",
        "oss",
        "r2",
        "ftp",
        "sftp",
        "ssh",
        "hdfs",
        "webhdfs",
        "dbfs",
        "lakefs",
        "github",
        "memory",
    )
)
# userinfo of any URL in a text, and the query string / fragment of any URL in a text
_USERINFO_RE = re.compile(r"(?<![A-Za-z0-9+.-])(?!hf://)([A-Za-z][A-Za-z0-9+.-]+://)[^/\s@\"'<>]*@")
_QUERY_RE = re.compile(r"((?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]+://[^\s?#\"'<>]*)[?#][^\s\"'<>]*")


def settings() -> dict:
    """concurrency, retries, timeout_s, backoff_s, min_rate (bytes/s) from the environment."""

    def num(name, default, kind=float):
        try:
            return kind(os.environ.get(name, default))
        except ValueError:
            raise UsageError(f"{name}={os.environ[name]!r} is not a number", hint=f"unset {name}") from None

    return {
        "concurrency": max(1, num("CKPT_REMOTE_CONCURRENCY", CONCURRENCY, int)),
        "retries": max(0, num("CKPT_REMOTE_RETRIES", RETRIES, int)),
        "timeout_s": max(0.1, num("CKPT_REMOTE_TIMEOUT", 60.0)),
        "backoff_s": max(0.0, num("CKPT_REMOTE_BACKOFF", 0.5)),
        "min_rate": max(0.0, num("CKPT_REMOTE_MIN_RATE", MIN_RATE)),
    }


# ------------------------------------------------------------------------------------ URLs
@dataclass(frozen=True)
class RemoteUrl:
    """A URL: `text` as the user wrote it (trailing slashes dropped; credentials kept, for requests
    only), `scheme` in lower case, `path` what follows `scheme://` (userinfo, query and fragment
    removed), `netloc_auth` the userinfo (`user:pass`, '' without), `query` (with its `?`, '' without)."""

    text: str
    scheme: str
    path: str
    userinfo: str = ""
    query: str = ""

    @property
    def shown(self) -> str:
        """The URL as every message, report and written file names it: no userinfo, no query."""
        return f"{self.scheme_as_given}://{self.path}"

    @property
    def scheme_as_given(self) -> str:
        return self.text.split("://", 1)[0]

    @property
    def name(self) -> str:
        """The last path component, as a safe local file name (a staged output's directory name)."""
        tail = self.path.rstrip("/").rsplit("/", 1)[-1]
        tail = tail.split("@", 1)[0] if self.scheme == "hf" and "/" not in self.path.rstrip("/") else tail
        return re.sub(r"[^A-Za-z0-9._@-]", "_", tail) or self.scheme

    def __str__(self) -> str:
        return self.shown

    def __repr__(self) -> str:
        return f"RemoteUrl({self.shown!r})"

    def child(self, rel: str) -> RemoteUrl:
        """The URL of `rel` (a relative path, already checked) below this one, with its credentials."""
        path = self.path.rstrip("/") + "/" + rel if rel else self.path
        auth = self.userinfo + "@" if self.userinfo else ""
        first, _, rest = path.partition("/")
        text = f"{self.scheme_as_given}://{auth}{first}" + (f"/{rest}" if rest else "") + self.query
        return RemoteUrl(text, self.scheme, path, self.userinfo, self.query)


def parse_url(value) -> RemoteUrl | None:
    """A URL (`scheme://...`, scheme of 2+ characters, not file://), else None (a local path)."""
    if isinstance(value, RemoteUrl):
        return value
    if not isinstance(value, str):
        value = os.fspath(value) if isinstance(value, os.PathLike) else None
        if not isinstance(value, str):
            return None
    m = _URL_RE.match(value)
    if not m or m.group(1).lower() in LOCAL_SCHEMES:
        return None
    rest = m.group(2)
    query = ""
    cut = min((i for i in (rest.find("?"), rest.find("#")) if i >= 0), default=-1)
    if cut >= 0:
        rest, query = rest[:cut], rest[cut:]
    userinfo = ""
    host, slash, tail = rest.partition("/")
    if "@" in host and m.group(1).lower() != "hf":  # hf://org/name@rev: a revision, not a user
        userinfo, _, host = host.rpartition("@")
    path = (host + slash + tail).rstrip("/")
    text = value if not value.endswith("/") or query else value.rstrip("/")
    if not path and value.rstrip("/") == f"{m.group(1)}:":
        text = value
    return RemoteUrl(text, m.group(1).lower(), path, userinfo, query)


def refuse_url_lookalike(value) -> None:
    """A path that is not a URL but looks like one (`s3:/bucket/x`, `hf:org/name`, `https:/host`) and
    does not exist is refused: writing it would create a local dir named `s3:`."""
    text = os.fspath(value) if isinstance(value, os.PathLike) else value
    if not isinstance(text, str) or parse_url(text) or os.path.lexists(text):
        return
    m = _LOOKALIKE_RE.match(text)
    if m and m.group(1).lower() in _URL_SCHEMES:
        scheme, rest = m.group(1).lower(), m.group(2)
        meant = redact(f"{m.group(1)}://{rest.lstrip('/')}")  # what it would be, without credentials
        shown = f"{m.group(1)}:{'/' * (len(rest) - len(rest.lstrip('/')))}{meant.split('://', 1)[1]}"
        raise UsageError(
            f"{shown!r} looks like a URL but is not one (a URL is `{scheme}://...`, two slashes); "
            "refusing to treat it as a local path",
            path=shown,
            hint=f"write {meant}, or ./{shown} for a local path",
        )


def redact(text):
    """`text` (a string, or a JSON-able structure of them) with the userinfo, query string and fragment
    of every URL in it removed (`http://u:p@h/x?sig=1` -> `http://h/x`)."""
    if isinstance(text, dict):
        return {k: redact(v) for k, v in text.items()}
    if isinstance(text, (list, tuple)):
        return type(text)(redact(v) for v in text)
    if not isinstance(text, str) or "://" not in text:
        return text
    return _QUERY_RE.sub(r"\1", _USERINFO_RE.sub(r"\1", text))


# ------------------------------------------------------------------------------------ failures
class RemoteChanged(Exception):
    """The object's identity is not the one pinned at open (412, another ETag, generation or size)."""


class RemoteMissing(Exception):
    """No such object (404)."""


class RemoteDenied(Exception):
    """Credentials missing or refused (401/403); the message names what to set."""


class RemoteRetry(Exception):
    """A transient failure (connection dropped, timeout, 5xx, 429): retried with backoff."""
