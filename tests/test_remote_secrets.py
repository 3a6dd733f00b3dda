"""A URL's credentials are for its requests only (docs/remote.md, "Credentials"): the password of
`http://user:PASS@host/...` and a query string's token never appear in a message, `--json`, a progress line,
a report page or any byte of any file written; `base_model_name_or_path` and a slim's manifest get the URL
without them. Against the tests' HTTP server requiring the password (Basic) on every request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

from .remote_servers import HttpServer  # noqa: E402
from .test_remote import BASE, REPO, TRAINER, ckpt, digest, fresh_remote_state, local  # noqa: E402,F401

PASSWORD, TOKEN = "S3CRETpass", "T0KENsig"
SECRETS = (PASSWORD.encode(), TOKEN.encode())


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    (root / "trainer").symlink_to(TRAINER.resolve())
    (root / "base_model").symlink_to(BASE.resolve())
    srv = HttpServer(root)
    srv.faults["require_basic"] = f"user:{PASSWORD}"
    yield srv
    srv.close()


def secret_url(srv, rel: str) -> str:
    return f"http://user:{PASSWORD}@{srv.url.split('://', 1)[1]}/{rel}?token={TOKEN}"


def clean_url(srv, rel: str) -> str:
    return f"{srv.url}/{rel}"


def no_secret_in(text: str | bytes, what) -> None:
    data = text.encode() if isinstance(text, str) else text
    for s in SECRETS:
        assert s not in data, (what, s)


def no_secret_in_tree(root: Path) -> int:
    """Every byte of every file under `root`; returns how many files were read."""
    n = 0
    for p in sorted(root.rglob("*")):
        if p.is_file():
            no_secret_in(p.read_bytes(), p)
            n += 1
    return n


def test_no_credential_in_any_output_message_or_file(guarded, local, tmp_path):
    url, base = secret_url(guarded, "trainer"), secret_url(guarded, "base_model")
    out = tmp_path / "out"
    runs = [
        ("inspect", url, "--json"),
        ("verify", url, "--json"),
        ("extract-adapter", url, out / "adapter", "--alpha", "16", "--base", base, "--json"),
        ("slim", url, out / "slim", "--base", BASE, "--json"),
        ("merge", base, url, out / "merged", "--alpha", "16"),
        ("report", url, "-o", out / "page.html", "--alpha", "16", "--json"),
    ]
    for argv in runs:
        r = ckpt(*argv)
        no_secret_in(r.output, argv[0])
        if "--json" in argv:
            doc = json.loads(r.stdout)
            assert doc["remote"]["bytes_fetched"] > 0, argv[0]
    failing = ckpt("extract-adapter", secret_url(guarded, "nothing/here"), out / "never", "--alpha", "16", code=2)
    no_secret_in(failing.output, "a failing command")
    assert clean_url(guarded, "nothing/here") in failing.output
    guarded.faults["require_basic"] = "user:another"   # the password is refused: one line, still not printed
    try:
        refused = ckpt("inspect", url, code=2)
    finally:
        guarded.faults["require_basic"] = f"user:{PASSWORD}"
    no_secret_in(refused.output, "a refused password")
    assert "refused access (401)" in refused.output and clean_url(guarded, "trainer") in refused.output

    assert no_secret_in_tree(out) >= 15
    cfg = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == clean_url(guarded, "base_model")
    manifest = json.loads((out / "slim" / "ckpt-slim-manifest.json").read_text())
    assert manifest["source"]["path"] == clean_url(guarded, "trainer")
    assert digest(out / "slim") == digest(local["dir"] / "slim")


def test_no_credential_in_the_progress_line(guarded, tmp_path):
    """On a terminal (a pty), the progress line of a command reading a credentialed URL."""
    import pty

    leader, follower = pty.openpty()
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="300")
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_tools", "verify", secret_url(guarded, "trainer"), "--deep"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=follower, env=env)
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    stdout = proc.stdout.read()
    proc.wait(timeout=60)
    os.close(leader)
    assert proc.returncode == 0, seen
    assert b"fetched" in seen and clean_url(guarded, "trainer").encode() in stdout
    no_secret_in(seen + stdout, "the terminal")
