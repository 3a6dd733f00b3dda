"""A stock web server: nginx from Debian's package (`apt-get install nginx`; .ci/run installs it), serving
the fixture with `autoindex on`. Its index pages list no dotfiles, so a checkpoint's `.metadata` is found
by asking for it by name; it sends ETags (or, with `etag off`, Last-Modified only, which then pins each
object). `inspect`, `extract-adapter`, `merge` and `slim` over it are byte-identical to the local runs,
within their byte budgets (docs/remote.md). Skipped, saying why, where nginx is not installed."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

from .test_remote import (  # noqa: E402,F401
    BASE, LORA_BYTES, META, TRAINER, check_commands, ckpt, digest, fresh_remote_state, local)

NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.path.exists(p)), None)
pytestmark = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (apt-get install -y nginx)")

CONF = """
daemon off;
master_process off;
worker_processes 1;
error_log {tmp}/error.log;
pid {tmp}/nginx.pid;
events {{ worker_connections 64; }}
http {{
    access_log {tmp}/access.log;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    default_type application/octet-stream;
    server {{
        listen 127.0.0.1:{port};
        root {root};
        autoindex on;
        {extra}
    }}
}}
"""


class Nginx:
    """nginx as Debian ships it, one process (`master_process off`: it runs as this user, reads the
    test's files), on a free port of 127.0.0.1."""

    def __init__(self, root: Path, tmp: Path, extra: str = ""):
        tmp.mkdir(parents=True, exist_ok=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        conf = tmp / "nginx.conf"
        conf.write_text(CONF.format(tmp=tmp, port=port, root=root, extra=extra))
        self.tmp = tmp
        self.proc = subprocess.Popen([NGINX, "-c", str(conf), "-p", str(tmp), "-e", str(tmp / "error.log")],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                urllib.request.urlopen(self.url + "/", timeout=1).read()
                break
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(self.proc.stdout.read().decode()) from None
                time.sleep(0.1)

    def gets(self) -> list[tuple[str, int]]:
        """(path, body bytes) of every GET it answered 200 or 206 (its access log)."""
        out = []
        for line in (self.tmp / "access.log").read_text().splitlines():
            request, status, size = line.split('"')[1], *line.split('"')[2].split()[:2]
            if request.startswith("GET ") and status in ("200", "206"):
                out.append((request.split()[1], int(size)))
        return out

    def close(self):
        self.proc.terminate()
        self.proc.wait(timeout=30)


class AccessLog:
    """The counter `check_commands` reads: the bytes of file bodies nginx sent (index pages are not a
    file's bytes, as the tests' own HTTP server does not count them)."""

    def __init__(self, srv: Nginx):
        self.srv, self.start = srv, 0

    def reset(self):
        time.sleep(0.2)   # nginx writes a request's log line once it is answered
        self.start = len(self.srv.gets())

    @property
    def bytes(self) -> int:
        time.sleep(0.2)
        return sum(n for path, n in self.srv.gets()[self.start:] if not path.endswith("/"))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("nginx-root")
    shutil.copytree(TRAINER, root / "trainer")
    shutil.copytree(BASE, root / "base_model")
    return root


def test_nginx_autoindex_hides_the_dotfiles(served, tmp_path):
    srv = Nginx(served, tmp_path / "nginx")
    try:
        page = urllib.request.urlopen(srv.url + "/trainer/").read().decode()
    finally:
        srv.close()
    assert "__0_0.distcp" in page and ".metadata" not in page   # what makes `.metadata` invisible


@pytest.mark.parametrize("etag", ["on", "off"])
def test_nginx_serves_inspect_extract_merge_and_slim_equal_to_local(served, local, tmp_path, etag):
    srv = Nginx(served, tmp_path / "nginx", extra=f"etag {etag};")
    try:
        url = f"{srv.url}/trainer"
        check_commands(url, AccessLog(srv), local, tmp_path)
        counter = AccessLog(srv)
        counter.reset()
        r = ckpt("extract-adapter", url, tmp_path / "adapter-base", "--alpha", "16", "--base", f"{srv.url}/base_model")
        assert "internal error" not in r.output
        assert counter.bytes <= (LORA_BYTES + META) * 1.02 + (BASE / "model.safetensors").stat().st_size
    finally:
        srv.close()
