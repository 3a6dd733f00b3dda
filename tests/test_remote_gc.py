"""`ckpt gc --slim-to URL` (docs/remote.md) against moto's S3 server (tests/remote_servers.S3Server): each
old step's slim is uploaded to URL/step_N/trainer and committed before the local full copy is deleted;
the uploaded slim rehydrates bit-exactly to the original step; a failing upload (503s, the server
gone) leaves the local step full and untouched and nothing at the URL."""
from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from ckpt_tools.cli import main
from ckpt_tools.io import remote, upload

from . import hardening_util as hu
from .test_gc import make_run
from .test_remote import s3, s3_env  # noqa: F401  (fixtures)
from .test_slim_rehydrate import assert_bit_equal_checkpoints

pytest.importorskip("s3fs")


def gc(*args):
    r = CliRunner().invoke(main, ["gc", *map(str, args)])
    upload.discard_pending()
    return r


def keys(s3, prefix):
    return sorted(o["Key"] for o in s3.client.list_objects_v2(Bucket="runs", Prefix=prefix).get("Contents", []))


def test_gc_slim_to_s3_uploads_each_slim_before_freeing_and_it_rehydrates_bit_exactly(s3_env, tmp_path):
    ck = make_run(tmp_path / "run")
    for bad, why in (("backups/run", "not a URL"), ("https://host/run", "plain HTTP has no upload")):
        r = gc(ck, "--keep-full", "2", "--slim-to", bad)
        assert r.exit_code == 2 and why in r.output and "s3://" in r.output, r.output
    originals = tmp_path / "originals"
    shutil.copytree(ck, originals)
    r = gc(ck, "--keep-full", "2", "--slim-to", "s3://runs/gc-run", "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["plan"]["slim_to"] == "s3://runs/gc-run" and doc["result"]["slimmed"] == [1, 2]
    for n in (1, 2):
        step = next(s for s in doc["result"]["steps"] if s["step"] == n)
        assert step["uploaded"]["url"] == f"s3://runs/gc-run/step_{n}/trainer", step
        local = sorted(p.name for p in (ck / f"step_{n}" / "trainer").iterdir())
        assert keys(s3_env, f"gc-run/step_{n}/") == [f"gc-run/step_{n}/trainer/{x}" for x in local]
        for x in local:   # the uploaded slim is the local one, byte for byte
            body = s3_env.client.get_object(Bucket="runs", Key=f"gc-run/step_{n}/trainer/{x}")["Body"].read()
            assert body == (ck / f"step_{n}" / "trainer" / x).read_bytes(), x
        out = tmp_path / "rehydrated" / f"step_{n}"
        rr = CliRunner().invoke(main, ["rehydrate", f"s3://runs/gc-run/step_{n}/trainer", str(out),
                                       "--base", str(tmp_path / "run" / "base_model")])
        assert rr.exit_code == 0, rr.output
        assert_bit_equal_checkpoints(originals / f"step_{n}" / "trainer", out)
    assert keys(s3_env, "gc-run/step_3") == [] and keys(s3_env, "gc-run/step_4") == []
    jsonschema = pytest.importorskip("jsonschema")
    from .test_json_envelope import SCHEMAS
    for name in ("envelope", "gc"):
        jsonschema.validate(doc, SCHEMAS[name], cls=jsonschema.Draft202012Validator)

    other = make_run(tmp_path / "other", steps=(1, 2))   # a step already at the URL is refused, not replaced
    kept = {k: s3_env.client.head_object(Bucket="runs", Key=k)["ETag"] for k in keys(s3_env, "gc-run/step_1/")}
    r = gc(other, "--keep-full", "1", "--slim-to", "s3://runs/gc-run")
    assert r.exit_code == 1 and "already exists" in r.output and "the step stays full" in r.output, r.output
    assert {k: s3_env.client.head_object(Bucket="runs", Key=k)["ETag"] for k in keys(s3_env, "gc-run/step_1/")} == kept
    assert sorted(p.name for p in (other / "step_1").iterdir()) == ["trainer"]
    assert not (other / "step_1" / "trainer" / "ckpt-slim-manifest.json").exists()


@pytest.mark.parametrize("fault", ["503", "server gone"])
def test_a_failing_upload_leaves_the_step_full_and_untouched(s3_env, tmp_path, monkeypatch, fault):
    ck = make_run(tmp_path / "run", steps=(1, 2))
    before = hu.snapshot(ck)
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "2")
    if fault == "503":
        s3_env.fail_puts = 10 ** 6
    else:
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")   # nothing listens there
    try:
        r = gc(ck, "--keep-full", "1", "--slim-to", "s3://runs/gc-fail")
    finally:
        s3_env.fail_puts = 0
    assert r.exit_code == 1, r.output
    assert "step_1: skipped" in r.output or "step_1" in r.output
    line = [x for x in r.output.splitlines() if "uploading to s3://runs/gc-fail/step_1/trainer failed" in x]
    assert line and "the step stays full" in line[0], r.output
    assert "Traceback" not in r.output
    assert hu.diff_snapshots(before, hu.snapshot(ck)) == []   # nothing changed, nothing left beside it
    assert keys(s3_env, "gc-fail") == []
    if fault == "503":
        assert getattr(s3_env, "puts_failed", 0) > 0
        assert not s3_env.client.list_multipart_uploads(Bucket="runs").get("Uploads")

