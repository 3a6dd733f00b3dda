"""URLs as paths (docs/remote.md), against real servers on 127.0.0.1 (tests/remote_servers.py): plain
HTTP with ranges, the Hub's API (HfFileSystem through HF_ENDPOINT) and S3 (moto's standalone server
through s3fs). Each command's output from a URL is byte-identical to the local run on the same genuine
fixture; the bytes the server sent are counted and held to what the command needs; faults (a dropped
connection, 503s, a stalled body, an object rewritten mid-read, a missing key, missing credentials,
Ctrl-C during an upload) are injected for real."""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

from ckpt_tools.cli import main  # noqa: E402
from ckpt_tools.formats.dcp.metadata import load_metadata  # noqa: E402
from ckpt_tools.formats.dcp.reader import DcpCheckpoint  # noqa: E402
from ckpt_tools.io import remote, remote_url, upload  # noqa: E402

from .remote_servers import HttpServer, HubServer, S3Server  # noqa: E402
from .test_json_envelope import SCHEMAS  # noqa: E402

jsonschema = pytest.importorskip("jsonschema")

FX = Path(__file__).parent / "fixtures" / "primerl-tiny"
TRAINER = FX / "outputs/checkpoints/step_3/trainer"
BASE = FX / "base_model"
REPO = Path(__file__).resolve().parents[1]
META = (TRAINER / ".metadata").stat().st_size


def _group_bytes(groups) -> int:
    c = DcpCheckpoint.open(TRAINER, known_keys_only=False)
    from ckpt_tools.core.keys import classify
    total = 0
    for k, e in c.entries.items():
        if classify(k, e.path).group in groups:
            total += e.stored_bytes
    c.close()
    return total


LORA_BYTES = _group_bytes({"lora"})
UNIQUE_BYTES = _group_bytes({"lora", "optimizer_state", "param_groups", "scheduler", "progress"})


@pytest.fixture(autouse=True)
def fresh_remote_state(monkeypatch):
    monkeypatch.setenv("CKPT_REMOTE_BACKOFF", "0.05")
    monkeypatch.setenv("CKPT_REMOTE_TIMEOUT", "5")
    yield
    upload.discard_pending()


def ckpt(*args, code=0):
    r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert r.exit_code == code, (args, r.exit_code, r.output)
    return r


def digest(root: Path) -> dict:
    """Every file of a tree by content; a DCP .metadata by its decoded content (it carries a random save
    id), a slim manifest without its source path (the path the user gave)."""
    out = {}
    for p in sorted(Path(root).rglob("*")):
        if not p.is_file():
            continue
        rel = p.relative_to(root).as_posix()
        data = p.read_bytes()
        if p.name == ".metadata":
            md = load_metadata(data, str(p))
            out[rel] = repr((md.state_dict_metadata, md.storage_data, md.planner_data))
        elif p.name == "ckpt-slim-manifest.json":
            m = json.loads(data)
            m["source"].pop("path")
            out[rel] = m
        else:
            out[rel] = hashlib.sha256(data).hexdigest()
    return out


def inspect_json(target) -> dict:
    doc = json.loads(ckpt("inspect", target, "--json").stdout)
    doc.pop("remote", None)
    doc["result"].pop("path", None)
    return doc


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """The local runs every remote one is compared with, of a copy of the trainer dir on its own (as a URL
    of it is: no run dir around it to find the run config in)."""
    t = tmp_path_factory.mktemp("local")
    trainer = t / "src" / "trainer"
    shutil.copytree(TRAINER, trainer)
    ckpt("extract-adapter", trainer, t / "adapter", "--alpha", "16")
    ckpt("slim", trainer, t / "slim", "--base", BASE)
    ckpt("rehydrate", t / "slim", t / "full", "--base", BASE)
    ckpt("merge", BASE, trainer, t / "merged", "--alpha", "16")
    ckpt("export", trainer, t / "exported", "--alpha", "16", "--config-from", BASE)
    return {"dir": t, "inspect": inspect_json(trainer),
            "verify": json.loads(ckpt("verify", trainer, "--json").stdout)["result"]}


def check_commands(url: str, counter, local, tmp: Path, *, slim_to: str | None = None):
    """inspect, verify, extract-adapter, slim, merge, export of `url` (the trainer dir) equal the local runs,
    within their byte budgets as counted by the server."""
    counter.reset()
    assert inspect_json(url) == local["inspect"]
    assert counter.bytes <= META + 64 * 1024, counter.bytes

    verified = json.loads(ckpt("verify", url, "--json").stdout)
    assert verified["result"]["ok"] is True and verified["result"]["problems"] == local["verify"]["problems"]

    counter.reset()
    r = json.loads(ckpt("extract-adapter", url, tmp / "adapter", "--alpha", "16", "--json").stdout)
    assert digest(tmp / "adapter") == digest(local["dir"] / "adapter")
    assert counter.bytes <= (LORA_BYTES + META) * 1.02, (counter.bytes, LORA_BYTES, META)
    assert r["remote"]["bytes_fetched"] == counter.bytes and r["remote"]["input_bytes"] > counter.bytes
    jsonschema.validate(r, SCHEMAS["envelope"], cls=jsonschema.Draft202012Validator)

    counter.reset()
    ckpt("slim", url, tmp / "slim", "--base", BASE)
    assert digest(tmp / "slim") == digest(local["dir"] / "slim")
    assert counter.bytes <= (UNIQUE_BYTES + META) * 1.02, (counter.bytes, UNIQUE_BYTES, META)

    ckpt("merge", BASE, url, tmp / "merged", "--alpha", "16")
    assert digest(tmp / "merged") == digest(local["dir"] / "merged")
    ckpt("export", url, tmp / "exported", "--alpha", "16", "--config-from", BASE)
    assert digest(tmp / "exported") == digest(local["dir"] / "exported")


# ------------------------------------------------------------------------------------ URL parsing
def test_a_url_lookalike_is_refused_not_created(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for bad in ("s3:/bucket/x", "hf:org/name", "https:/host/x"):
        r = ckpt("slim", TRAINER, bad, code=2)
        assert "looks like a URL" in r.output and "://" in r.output
    assert list(tmp_path.iterdir()) == []
    remote_url.refuse_url_lookalike("step:3")   # a local name with a colon is not a URL look-alike
    assert remote_url.parse_url("C:/x") is None and remote_url.parse_url("./s3://x") is None
    u = remote_url.parse_url("hf://org/name@main/step_3/trainer/")
    assert (u.scheme, u.path, u.name) == ("hf", "org/name@main/step_3/trainer", "trainer")


def test_the_remote_packages_are_not_imported_for_local_paths():
    code = ("import sys; from ckpt_tools.cli import main; from click.testing import CliRunner; "
            f"CliRunner().invoke(main, ['inspect', {str(TRAINER)!r}]); "
            "print(sorted(m for m in ('fsspec', 's3fs', 'aiohttp', 'botocore') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=str(REPO)), check=True).stdout
    assert out.strip() == "[]"


# ------------------------------------------------------------------------------------ HTTP
@pytest.fixture(scope="module")
def http_server():
    srv = HttpServer(FX / "outputs/checkpoints/step_3")
    yield srv
    srv.close()


def test_http_commands_equal_the_local_runs(http_server, local, tmp_path):
    check_commands(f"{http_server.url}/trainer", http_server.counter, local, tmp_path)


def test_http_merge_reads_a_peft_adapter_from_a_url(local, tmp_path):
    srv = HttpServer(local["dir"])
    try:
        ckpt("merge", BASE, f"{srv.url}/adapter", tmp_path / "merged")
        ckpt("merge", BASE, local["dir"] / "adapter", tmp_path / "merged-local")
    finally:
        srv.close()
    assert digest(tmp_path / "merged") == digest(tmp_path / "merged-local")


def test_http_dropped_connection_mid_body_resumes(http_server, local, tmp_path):
    http_server.faults.update(drop_after=100, drops=5)
    try:
        ckpt("extract-adapter", f"{http_server.url}/trainer", tmp_path / "a", "--alpha", "16")
    finally:
        http_server.faults.clear()
    assert digest(tmp_path / "a") == digest(local["dir"] / "adapter")


def test_http_503s_and_stalls_are_retried(http_server, local, tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_REMOTE_TIMEOUT", "0.5")
    http_server.faults.update(status_503=3, stall_s=2.0, stalls=2)
    try:
        ckpt("extract-adapter", f"{http_server.url}/trainer", tmp_path / "a", "--alpha", "16")
    finally:
        http_server.faults.clear()
    assert digest(tmp_path / "a") == digest(local["dir"] / "adapter")


def test_http_503s_forever_end_in_a_clear_error(http_server, tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_REMOTE_RETRIES", "2")
    url = f"{http_server.url}/trainer"
    ckpt("inspect", url)   # listed fine; then the server fails every request
    r = None
    try:
        http_server.faults.update(after_get=lambda path: http_server.faults.update(status_503=10 ** 6))
        r = ckpt("extract-adapter", url, tmp_path / "a", "--alpha", "16", code=1)
    finally:
        http_server.faults.clear()
    line = r.output.strip().splitlines()[-1]
    assert line.startswith("error: ") and "HTTP 503" in line and "times in a row" in line and url in line
    assert not (tmp_path / "a").exists()


def test_http_object_rewritten_mid_read_is_an_error_naming_it(tmp_path):
    root = tmp_path / "served"
    shutil.copytree(TRAINER, root / "trainer")
    srv = HttpServer(root)
    victim = root / "trainer" / "__2_0.distcp"

    def rewrite(path):
        if path.endswith("__0_0.distcp") and victim.exists():
            data = victim.read_bytes()
            victim.unlink()
            victim.write_bytes(data)   # the same bytes, a new object (a new ETag): a rewrite
            srv.faults.pop("after_get")
    try:
        srv.faults["after_get"] = rewrite
        r = ckpt("extract-adapter", f"{srv.url}/trainer", tmp_path / "a", "--alpha", "16", code=1)
    finally:
        srv.close()
    assert "changed while it was being read" in r.output and f"{srv.url}/trainer/__2_0.distcp" in r.output
    assert not (tmp_path / "a").exists()


def test_http_missing_path_is_the_usual_error(http_server, tmp_path):
    r = ckpt("inspect", f"{http_server.url}/nothing-here", code=2)
    assert f"no such file or directory: {http_server.url}/nothing-here" in r.output


# ------------------------------------------------------------------------------------ the Hub
@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    repo = tmp_path_factory.mktemp("hub") / "run"
    shutil.copytree(TRAINER, repo / "step_3" / "trainer")
    (tmp_path_factory.getbasetemp() / "out-repo").mkdir()
    srv = HubServer({"org/run": repo, "org/out": tmp_path_factory.getbasetemp() / "out-repo",
                     "datasets/org/runs": repo}, buckets={"org/ckpts": repo})
    yield srv
    srv.close()


@pytest.fixture()
def hub_env(hub, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    return hub


def test_hub_commands_equal_the_local_runs(hub_env, local, tmp_path):
    check_commands("hf://org/run/step_3/trainer", hub_env.counter, local, tmp_path)
    assert hub_env.unknown == []


def test_hub_bucket_commands_equal_the_local_runs(hub_env, local, tmp_path):
    check_commands("hf://buckets/org/ckpts/step_3/trainer", hub_env.counter, local, tmp_path)
    assert hub_env.unknown == []
    r = ckpt("inspect", "hf://buckets/org/ckpts/step_9", code=2)
    assert "no such file or directory: hf://buckets/org/ckpts/step_9" in r.output
    r = ckpt("inspect", "hf://buckets/org/nothing/step_3", code=2)
    assert "no such file or directory: hf://buckets/org/nothing/step_3" in r.output


def test_hub_bucket_file_replaced_mid_read_is_an_error_naming_it(hub_env, tmp_path):
    root = tmp_path / "bucket"
    shutil.copytree(TRAINER, root / "trainer")
    hub_env.buckets["org/scratch"] = root
    victim = root / "trainer" / "__2_0.distcp"
    original = victim.read_bytes()

    def rewrite(path):
        if path.endswith("__0_0.distcp"):
            hub_env.faults.pop("after_get")
            victim.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))   # another content: another Xet hash
    hub_env.faults["after_get"] = rewrite
    try:
        r = ckpt("extract-adapter", "hf://buckets/org/scratch/trainer", tmp_path / "a", "--alpha", "16", code=1)
    finally:
        hub_env.faults.pop("after_get", None)
        del hub_env.buckets["org/scratch"]
    assert "changed while" in r.output and "hf://buckets/org/scratch/trainer/__2_0.distcp" in r.output, r.output
    assert not (tmp_path / "a").exists()


def test_hub_dataset_repos_and_pinned_revisions_read_as_the_local_run(hub_env, local, tmp_path):
    sha = hub_env.repos["org/run"]["sha"]
    for url in ("hf://datasets/org/runs/step_3/trainer", f"hf://org/run@{sha}/step_3/trainer",
                "hf://org/run@main/step_3/trainer"):
        assert inspect_json(url) == local["inspect"], url
    ckpt("extract-adapter", "hf://datasets/org/runs/step_3/trainer", tmp_path / "a", "--alpha", "16")
    assert digest(tmp_path / "a") == digest(local["dir"] / "adapter")
    r = ckpt("inspect", "hf://org/run@" + "0" * 40 + "/step_3/trainer", "--json", code=2)
    err = json.dumps(json.loads(r.stdout)["error"])
    assert "0" * 40 in err and "no such revision" in err, err
    err = json.dumps(json.loads(ckpt("inspect", "hf://org/nope/step_3/trainer", "--json", code=2).stdout)["error"])
    assert "no such repo" in err, err


def test_progress_over_a_url_shows_the_bytes_fetched_rate_and_eta(http_server, tmp_path):
    """On a terminal (a pty here) the progress line of a command reading a URL carries the bytes fetched."""
    import pty
    leader, follower = pty.openpty()
    env = dict(os.environ, PYTHONPATH=str(REPO), COLUMNS="200")
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_tools", "verify", f"{http_server.url}/trainer", "--deep"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=follower, env=env)
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:   # EIO: the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    proc.wait(timeout=60)
    os.close(leader)
    assert proc.returncode == 0, seen
    lines = [ln for ln in seen.decode(errors="replace").replace("\x1b[K", "").split("\r") if "fetched" in ln]
    assert lines, seen[-2000:]
    assert re.search(r"/s  ETA \d+:\d\d  fetched [\d.]+ (B|KiB|MiB)", lines[-1]), lines[-1]


def test_hub_refused_token_names_the_variable(hub_env, tmp_path):
    hub_env.faults["require_token"] = "hf_right"
    try:
        wrong = ckpt("inspect", "hf://org/run/step_3/trainer", code=2).output.strip().splitlines()
        os.environ.pop("HF_TOKEN")
        none = ckpt("inspect", "hf://org/run/step_3/trainer", code=2).output.strip().splitlines()
    finally:
        hub_env.faults.clear()
    for lines in (wrong, none):
        assert len(lines) == 1 and "HF_TOKEN" in lines[0], lines


def test_hub_slim_is_one_commit(hub_env, local, tmp_path):
    ckpt("slim", "hf://org/run/step_3/trainer", "hf://org/out/slim-3", "--base", BASE)
    assert len(hub_env.commits) == 1
    out = Path(hub_env.repos["org/out"]["dir"]) / "slim-3"
    assert digest(out) == digest(local["dir"] / "slim")


# ------------------------------------------------------------------------------------ S3
@pytest.fixture(scope="module")
def s3():
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    srv = S3Server()
    import boto3
    c = boto3.client("s3", endpoint_url=srv.url, aws_access_key_id="k", aws_secret_access_key="s",
                     region_name="us-east-1")
    c.create_bucket(Bucket="runs")
    for p in sorted(TRAINER.iterdir()):
        c.upload_file(str(p), "runs", f"step_3/trainer/{p.name}")
    srv.client = c
    yield srv
    srv.close()


@pytest.fixture()
def s3_env(s3, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    s3.counter.reset()   # each test counts its own requests
    s3.put_bytes = s3.part_copies = 0
    return s3


def test_s3_commands_equal_the_local_runs(s3_env, local, tmp_path):
    check_commands("s3://runs/step_3/trainer", s3_env.counter, local, tmp_path)


def test_s3_slim_to_a_bucket_then_rehydrate_from_it(s3_env, local, tmp_path):
    ckpt("slim", "s3://runs/step_3/trainer", "s3://runs/slim/step_3", "--base", BASE)
    keys = {o["Key"] for o in s3_env.client.list_objects_v2(Bucket="runs", Prefix="slim/")["Contents"]}
    assert keys == {f"slim/step_3/{p.name}" for p in (local["dir"] / "slim").iterdir()}
    r = ckpt("slim", "s3://runs/step_3/trainer", "s3://runs/slim/step_3", "--base", BASE, code=1)
    assert "already exists" in r.output
    ckpt("rehydrate", "s3://runs/slim/step_3", tmp_path / "full", "--base", BASE)
    assert digest(tmp_path / "full") == digest(local["dir"] / "full")


def test_s3_object_rewritten_mid_read_is_an_error_naming_it(s3_env, tmp_path):
    key = "step_3/trainer/__2_0.distcp"
    original = (TRAINER / "__2_0.distcp").read_bytes()

    def rewrite(path):
        if path.endswith("__0_0.distcp"):
            s3_env.after_get = None
            s3_env.client.put_object(Bucket="runs", Key=key, Body=original[:-1] + bytes([original[-1] ^ 1]))
    s3_env.after_get = rewrite
    try:
        r = ckpt("extract-adapter", "s3://runs/step_3/trainer", tmp_path / "a", "--alpha", "16", code=1)
    finally:
        s3_env.after_get = None
        s3_env.client.put_object(Bucket="runs", Key=key, Body=original)
    assert "changed while it was being read" in r.output and f"s3://runs/{key}" in r.output, r.output
    assert not (tmp_path / "a").exists()


def test_s3_missing_key_is_the_usual_error(s3_env):
    r = ckpt("inspect", "s3://runs/step_9/trainer", code=2)
    assert "no such file or directory: s3://runs/step_9/trainer" in r.output


def test_s3_without_credentials_names_the_variable(s3_env, monkeypatch, tmp_path):
    for v in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    r = ckpt("inspect", "s3://runs/step_3/trainer", code=2)
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "AWS_PROFILE" in lines[0], r.output


def test_s3_ctrl_c_during_upload_commits_nothing(s3_env, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), CKPT_REMOTE_BACKOFF="0.05")
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_tools", "slim", str(TRAINER), "s3://runs/interrupted",
                             "--base", str(BASE)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)

    def interrupt():
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)   # the part arrives after the interrupt
    s3_env.on_upload_part = interrupt
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert_one_interrupt_line(out)
    assert s3_env.client.list_objects_v2(Bucket="runs", Prefix="interrupted").get("KeyCount", 0) == 0
    assert not s3_env.client.list_multipart_uploads(Bucket="runs").get("Uploads")


def local_slim(tmp: Path) -> Path:
    ckpt("slim", TRAINER, tmp / "local-slim", "--base", BASE)
    return tmp / "local-slim"


def assert_one_interrupt_line(out: str) -> None:
    """The CLI's interrupt message, as for every other interrupt: one line, no traceback."""
    lines = [x for x in out.strip().splitlines() if x.strip()]
    assert lines == ["interrupted: nothing was written (temporary files removed)"], out


@pytest.mark.parametrize("when", ["upload", "commit"])
def test_hub_ctrl_c_during_upload_commits_nothing(hub_env, tmp_path, when):
    """Ctrl-C while the contents go up: nothing is committed. Ctrl-C once the commit request is out: it is
    held until the commit is made, and the message says the output is there, complete."""
    env = dict(os.environ, PYTHONPATH=str(REPO), CKPT_REMOTE_BACKOFF="0.05", HF_HUB_DISABLE_PROGRESS_BARS="1")
    out_dir = Path(hub_env.repos["org/out"]["dir"])
    before, sha = sorted(p.relative_to(out_dir) for p in out_dir.rglob("*")), hub_env.repos["org/out"]["sha"]
    commits = len(hub_env.commits)
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_tools", "slim", str(TRAINER), f"hf://org/out/int-{when}",
                             "--base", str(BASE)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)

    def interrupt():
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)   # the answer arrives after the interrupt
    setattr(hub_env, f"on_{'preupload' if when == 'upload' else 'commit'}", interrupt)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert hub_env.on_preupload is None and hub_env.on_commit is None   # it was interrupted there
    if when == "commit":
        lines = [x for x in out.strip().splitlines() if x.strip()]
        assert lines == ["interrupted: hf://org/out/int-commit had been uploaded and committed, complete, when "
                         "the interrupt arrived"], out
        assert len(hub_env.commits) == commits + 1
        assert digest(out_dir / "int-commit") == digest(local_slim(tmp_path))
        return
    assert_one_interrupt_line(out)
    assert len(hub_env.commits) == commits and hub_env.repos["org/out"]["sha"] == sha
    assert sorted(p.relative_to(out_dir) for p in out_dir.rglob("*")) == before
