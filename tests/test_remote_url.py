"""io.remote_url: a URL parsed once, shown without its credentials, and credentials removed from free text."""

from __future__ import annotations

import pytest

from ckpt_tools.core.errors import UsageError
from ckpt_tools.io.remote_url import parse_url, redact, refuse_url_lookalike


@pytest.mark.parametrize(
    ("given", "scheme", "path", "shown"),
    [
        (
            "s3://runs/exp7/step_95/trainer/",
            "s3",
            "runs/exp7/step_95/trainer",
            "s3://runs/exp7/step_95/trainer",
        ),
        (
            "http://user:PASS@host:8080/ck/trainer",
            "http",
            "host:8080/ck/trainer",
            "http://host:8080/ck/trainer",
        ),
        (
            "https://host/x.safetensors?X-Amz-Signature=abc&X-Amz-Credential=k",
            "https",
            "host/x.safetensors",
            "https://host/x.safetensors",
        ),
        ("https://host/ck#frag", "https", "host/ck", "https://host/ck"),
        ("hf://org/name@main/ckpt", "hf", "org/name@main/ckpt", "hf://org/name@main/ckpt"),
        ("HTTP://Host/x", "http", "Host/x", "HTTP://Host/x"),
    ],
)
def test_a_url_is_shown_without_its_credentials(given, scheme, path, shown):
    url = parse_url(given)
    assert (url.scheme, url.path, url.shown, str(url)) == (scheme, path, shown, shown)
    assert "PASS" not in repr(url) and "Signature" not in repr(url)


def test_the_credentials_are_kept_for_the_requests_and_for_children():
    url = parse_url("http://user:PASS@host/ck?token=t1")
    assert url.text == "http://user:PASS@host/ck?token=t1"
    child = url.child("trainer/.metadata")
    assert child.text == "http://user:PASS@host/ck/trainer/.metadata?token=t1"
    assert child.shown == "http://host/ck/trainer/.metadata"


@pytest.mark.parametrize("local", ["ckpt", "./s3:/x", "file:///tmp/x", "c:/x", "/abs/path", "a:b"])
def test_local_paths_are_not_urls(local):
    assert parse_url(local) is None


def test_redact_removes_userinfo_and_queries_from_any_text():
    text = (
        "error: http://user:PASS@host/a?sig=S3CR3T failed; see https://h2/b?X-Amz-Signature=Z, "
        "hf://org/name@rev/x stays"
    )
    out = redact(text)
    assert "PASS" not in out and "S3CR3T" not in out and "X-Amz" not in out
    assert out == "error: http://host/a failed; see https://h2/b hf://org/name@rev/x stays"
    assert redact({"a": ["s3://k:s@b/x"], "n": 3}) == {"a": ["s3://b/x"], "n": 3}


def test_a_lookalike_is_refused_without_its_credentials():
    with pytest.raises(UsageError) as exc:
        refuse_url_lookalike("https:/user:PASS@host/x")
    assert "looks like a URL" in str(exc.value) and "PASS" not in str(exc.value)
    assert "write https://host/x," in str(exc.value)
