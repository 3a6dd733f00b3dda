"""Plain HTTP(S) for `io.remote`, through fsspec's aiohttp session: a file is stat'ed by HEAD and read by
`Range` requests; a directory is an index page of links (nginx's, Apache's or Caddy's autoindex, Python's
http.server), parsed here.

Identity: a strong ETag is pinned and sent as `If-Match`; without one, the size and `Last-Modified`
(`If-Unmodified-Since`, and both compared on every answer); a server that sends neither gives an object
that `io.remote` lets a command read by one request only. Index pages of stock servers list no dotfiles
(nginx, Apache: `.metadata` is invisible), so a name looked up and not listed is probed by HEAD
(`hides_names`). An index page is a stranger's text: only links that resolve to this directory's own
children are entries (the parent link, sort links and links elsewhere are navigation, left out); such a
child whose name is not one plain segment is passed on for `io.remote` to refuse."""

from __future__ import annotations

import html
import re
from urllib.parse import quote, unquote, urljoin, urlsplit

from .remote_backends import Backend, Identity, Listed, http_status, need, run_sync
from .remote_url import RemoteChanged, RemoteDenied, RemoteMissing, RemoteRetry, RemoteUrl, settings

__all__ = ["HttpBackend", "index_links"]

_HREF = re.compile(r"""<a\s[^>]*?href\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s>"']+))""", re.I | re.S)
MAX_INDEX_BYTES = 64 << 20  # an index page of a million entries is ~100 MB; a checkpoint dir's is KBs


def index_links(page: str, dir_url: str) -> list[tuple[str, bool]]:
    """(name, is_dir) of every link of the index page `page` of `dir_url` (ending in '/') that names an
    entry inside it (percent-decoded; a name that is not one plain segment is kept, for the caller to
    refuse); an identical link twice is one entry."""
    base = urlsplit(dir_url)
    out: dict[tuple[str, bool], None] = {}
    for m in _HREF.finditer(page):
        href = html.unescape(m.group(1) or m.group(2) or m.group(3) or "")
        target = urlsplit(urljoin(dir_url, href))
        if (target.scheme, target.netloc) != (base.scheme, base.netloc) or not target.path.startswith(
            base.path
        ):
            continue  # the parent, another host, an absolute link elsewhere: navigation, not an entry
        rel = target.path[len(base.path) :]
        if not rel or (target.query and not rel):
            continue  # the directory itself (a sort link `?C=N;O=D`)
        is_dir = rel.endswith("/")
        out[(unquote(rel[:-1] if is_dir else rel), is_dir)] = None
    return list(out)


class HttpBackend(Backend):
    scheme = "http"
    hides_names = True
    stat_first = True

    def __init__(self, url: RemoteUrl, root: str):
        http = need("fsspec.implementations.http", url.scheme)
        self.fs = http.HTTPFileSystem(skip_instance_cache=True)
        auth = url.userinfo + "@" if url.userinfo else ""
        self.base = f"{url.scheme}://{auth}{root}"  # with the credentials: requests only
        self.shown_base = f"{url.scheme}://{root}"
        self.query = url.query

    def url(self, parts, *, is_dir: bool = False, shown: bool = False) -> str:
        path = "/".join(quote(p, safe="!$&'()*+,;=:@~") for p in parts)
        tail = ("/" + path if path else "") + ("/" if is_dir else "")
        return (self.shown_base + tail) if shown else (self.base + tail + self.query)

    def _call(self, method: str, url: str, shown: str, timeout_s: float, headers=None, read_max: int = 0):
        """(status, headers, final URL, body up to read_max bytes) of one request."""
        import aiohttp

        async def go():
            session = await self.fs.set_session()
            timeout = aiohttp.ClientTimeout(sock_connect=timeout_s, sock_read=timeout_s)
            hdrs = {"Accept-Encoding": "identity", **(headers or {})}
            async with session.request(method, url, headers=hdrs, timeout=timeout, allow_redirects=True) as r:
                body = await r.content.read(read_max + 1) if read_max else b""
                return r.status, r.headers, str(r.url), body

        try:
            return run_sync(self.fs.loop, go(), timeout_s * 4 + 5)
        except RemoteRetry:
            raise
        except Exception as exc:
            raise RemoteRetry(f"{type(exc).__name__}: {exc}") from None

    def _listed(self, parts, status, headers, final_url, shown) -> Listed | None:
        if status == 404 or status == 410:
            return None
        http_status(status, shown)
        name = parts[-1] if parts else ""
        if status >= 300:
            raise RemoteRetry(f"HTTP {status}")
        if final_url.split("?", 1)[0].endswith("/") or headers.get("Content-Type", "").startswith(
            "text/html"
        ):
            return Listed(name, True)
        size = headers.get("Content-Length")
        return Listed(
            name, False, int(size) if size and size.isdigit() else None, _identity(headers), self.url(parts)
        )

    def stat(self, parts, shown):
        status, headers, final, _ = self._call("HEAD", self.url(parts), shown, settings()["timeout_s"])
        return self._listed(parts, status, headers, final, shown)

    def list_dir(self, parts, shown):
        status, headers, _final, body = self._call(
            "GET", self.url(parts, is_dir=True), shown, settings()["timeout_s"], read_max=MAX_INDEX_BYTES
        )
        if status in (404, 410):
            raise RemoteMissing(shown)
        http_status(status, shown)
        if not headers.get("Content-Type", "").startswith("text/html"):
            raise RemoteMissing(shown)  # a file, not an index page
        if len(body) > MAX_INDEX_BYTES:
            raise RemoteRetry(f"the index page is over {MAX_INDEX_BYTES:,} bytes")
        page = body.decode("utf-8", "replace")
        dir_url = self.url(parts, is_dir=True, shown=True)
        return [Listed(name, is_dir) for name, is_dir in index_links(page, dir_url)]

    def fetch(self, obj, start, end, sink, timeout_s, deadline_s):
        import aiohttp

        ident = obj.identity
        headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
        if ident.kind == "etag" and not ident.value.startswith("W/"):
            headers["If-Match"] = ident.value
        elif ident.kind == "mtime":
            headers["If-Unmodified-Since"] = ident.value

        async def get():
            session = await self.fs.set_session()
            timeout = aiohttp.ClientTimeout(sock_connect=timeout_s, sock_read=timeout_s)
            async with session.get(obj.ref, headers=headers, timeout=timeout) as r:
                if r.status == 416:  # the object is shorter than it was
                    raise RemoteChanged("another size")
                http_status(r.status, obj.url, r.headers.get("ETag"))
                _same(obj, r.status, r.headers, start, end)
                async for chunk in r.content.iter_chunked(1 << 20):
                    sink(chunk)

        try:
            run_sync(self.fs.loop, get(), deadline_s)
        except (RemoteRetry, RemoteChanged, RemoteMissing, RemoteDenied):
            raise
        except Exception as exc:
            raise RemoteRetry(f"{type(exc).__name__}: {exc}") from None

    def identity_now(self, obj):
        try:
            status, headers, _final, _ = self._call("HEAD", obj.ref, obj.url, settings()["timeout_s"])
        except Exception:
            return None
        if status in (404, 410):
            return Identity("gone", None)
        if status >= 300:
            return None
        size = headers.get("Content-Length")
        if size and size.isdigit() and int(size) != obj.size:
            return Identity("size", size)
        return _identity(headers)


def _identity(headers) -> Identity:
    if headers.get("ETag"):
        return Identity("etag", headers["ETag"])
    if headers.get("Last-Modified"):
        return Identity("mtime", headers["Last-Modified"])
    return Identity("none", None)


def _same(obj, status: int, headers, start: int, end: int) -> None:
    """The answer is the pinned object's: its ETag or Last-Modified as pinned, its total size as listed, the
    range asked for (a server that ignores If-Match or If-Unmodified-Since is caught here)."""
    ident = obj.identity
    if ident.kind == "etag" and headers.get("ETag") and headers["ETag"] != ident.value:
        raise RemoteChanged(headers["ETag"])
    if ident.kind == "mtime" and headers.get("Last-Modified") and headers["Last-Modified"] != ident.value:
        raise RemoteChanged(headers["Last-Modified"])
    if status == 206:
        m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", headers.get("Content-Range", "").strip())
        if m is None or int(m.group(1)) != start or int(m.group(2)) != end - 1:
            raise RemoteRetry(
                f"the server answered bytes [{start}, {end}) with {headers.get('Content-Range')!r}"
            )
        if m.group(3) != "*" and int(m.group(3)) != obj.size:
            raise RemoteChanged(f"{m.group(3)} bytes")
    elif status == 200:
        if not (start == 0 and end == obj.size):
            raise RemoteDeniedRange(obj.url)
        size = headers.get("Content-Length")
        if size and size.isdigit() and int(size) != obj.size:
            raise RemoteChanged(f"{size} bytes")
    else:
        raise RemoteRetry(f"HTTP {status} to a byte-range request")


class RemoteDeniedRange(RemoteDenied):
    """The server answers a byte-range request with the whole object (200): it serves no ranges."""

    def __init__(self, where: str):
        super().__init__(
            f"the server answered a byte-range request of {where} with 200 and the whole object, "
            "not 206: it must serve HTTP Range requests"
        )
