"""verl and torchtitan checkpoints at a URL (docs/remote.md), against the real servers of tests/test_remote.py
(tests/remote_servers.py: plain HTTP with ranges, the Hub's API through HF_ENDPOINT, moto's S3 server): each
command's output from a URL is byte-identical to the local run on the same genuine fixture, and what the server
sent is held to what the command needs (the rank files are read where they lie, by range)."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

from ckpt_tools.formats.verl.reader import VerlCheckpoint  # noqa: E402

from .conftest import FIXTURES  # noqa: E402
from .remote_servers import HttpServer, HubServer, S3Server  # noqa: E402
# the same CLI runner and settings as the DCP tests (hub_env takes this module's own `hub`)
from .test_remote import ckpt, fresh_remote_state, hub_env  # noqa: E402,F401

VERL = FIXTURES / "verl-fsdp2-lora"
VERL_BASE = VERL / "base"
RUN = VERL / "checkpoints"   # the run dir (trainer.default_local_dir): latest_checkpointed_iteration.txt
ACTOR = RUN / "global_step_2" / "actor"
TITAN = FIXTURES / "torchtitan-llama3-debug"
STEP = TITAN / "checkpoint" / "step-3"
HF_ASSETS = TITAN / "hf_assets"


def _file_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.iterdir() if p.is_file())


def digest(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(root).rglob("*")) if p.is_file()}


def report(cmd: str, target, *args, root=None) -> dict:
    """The --json envelope's result, the checkpoint's location (`root`: what the user gave) written as ROOT."""
    r = ckpt(cmd, target, *args, "--json")
    text = r.stdout
    if root is not None:
        text = text.replace(str(root).rstrip("/"), "ROOT")
    return json.loads(text)["result"]


# The local runs (the fixtures in place), each once
@pytest.fixture(scope="module")
def local(tmp_path_factory):
    t = tmp_path_factory.mktemp("local")
    ckpt("extract-adapter", RUN, t / "verl-adapter")
    ckpt("merge", VERL_BASE, RUN, t / "verl-merged")
    ckpt("export", RUN, t / "verl-exported")
    ckpt("export", TITAN, t / "titan-exported", "--config-from", HF_ASSETS)
    return {
        "dir": t,
        "verl-inspect": report("inspect", RUN, root=RUN),
        "verl-verify": report("verify", RUN, "--deep", root=RUN),
        "titan-inspect": report("inspect", TITAN, root=TITAN),
        "titan-verify": report("verify", TITAN, "--deep", root=TITAN),
    }


def check_verl(url: str, counter, local, tmp: Path):
    """inspect, verify --deep, extract-adapter, merge and export of the verl run dir at `url` equal the local
    runs; inspect fetches the rank files' zip directories, data.pkl and record headers only, verify --deep
    every record once."""
    counter.reset()
    assert report("inspect", url, root=url) == local["verl-inspect"]
    assert counter.bytes < 0.2 * _file_bytes(ACTOR), counter.bytes
    counter.reset()
    verified = report("verify", url, "--deep", root=url)
    assert verified == local["verl-verify"] and verified["ok"] is True
    assert counter.bytes < 1.15 * _file_bytes(ACTOR), counter.bytes   # every record once, its header once
    counter.reset()
    ckpt("extract-adapter", url, tmp / "adapter")
    assert digest(tmp / "adapter") == digest(local["dir"] / "verl-adapter")
    with VerlCheckpoint.open(ACTOR) as c:   # the LoRA factors' stored bytes, over both ranks
        lora = sum(e.stored_bytes for k, e in c.entries.items() if ".lora_" in k)
    assert counter.bytes < lora + 0.2 * _file_bytes(ACTOR), (counter.bytes, lora)
    ckpt("merge", VERL_BASE, url, tmp / "merged")
    assert digest(tmp / "merged") == digest(local["dir"] / "verl-merged")
    ckpt("export", url, tmp / "exported")
    assert digest(tmp / "exported") == digest(local["dir"] / "verl-exported")


def check_titan(url: str, counter, local, tmp: Path):
    """inspect, verify --deep and export of the torchtitan dump folder at `url` equal the local runs; inspect
    fetches little beyond the .metadata."""
    counter.reset()
    assert report("inspect", url, root=url) == local["titan-inspect"]
    assert counter.bytes < (STEP / ".metadata").stat().st_size + 64 * 1024, counter.bytes
    verified = report("verify", url, "--deep", root=url)
    assert verified == local["titan-verify"] and verified["ok"] is True
    ckpt("export", url, tmp / "exported", "--config-from", HF_ASSETS)
    assert digest(tmp / "exported") == digest(local["dir"] / "titan-exported")


# ------------------------------------------------------------------------------------ HTTP
@pytest.fixture(scope="module")
def http_server():
    srv = HttpServer(FIXTURES)
    yield srv
    srv.close()


def test_http_verl_equals_the_local_runs(http_server, local, tmp_path):
    check_verl(f"{http_server.url}/{VERL.name}/checkpoints", http_server.counter, local, tmp_path)


def test_http_torchtitan_equals_the_local_runs(http_server, local, tmp_path):
    check_titan(f"{http_server.url}/{TITAN.name}", http_server.counter, local, tmp_path)


def test_http_verl_set_lr_is_refused_before_anything_is_read(http_server, tmp_path):
    r = ckpt("set-lr", f"{http_server.url}/{VERL.name}/checkpoints/global_step_2", tmp_path / "o", "--scale", "2",
             code=2)
    assert "local verl checkpoint" in r.output and not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------ the Hub
@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    shutil.copytree(RUN, root / "verl-run")
    shutil.copytree(TITAN / "checkpoint", root / "titan" / "checkpoint")
    srv = HubServer({"org/verl-run": root / "verl-run", "org/titan": root / "titan"})
    yield srv
    srv.close()


def test_hub_verl_and_torchtitan_equal_the_local_runs(hub_env, local, tmp_path):
    check_verl("hf://org/verl-run", hub_env.counter, local, tmp_path / "verl")
    check_titan("hf://org/titan", hub_env.counter, local, tmp_path / "titan")
    assert hub_env.unknown == []


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
    for top, prefix in ((RUN, "verl/checkpoints"), (TITAN / "checkpoint", "titan/checkpoint")):
        for p in sorted(top.rglob("*")):
            if p.is_file():
                c.upload_file(str(p), "runs", f"{prefix}/{p.relative_to(top).as_posix()}")
    yield srv
    srv.close()


def test_s3_verl_and_torchtitan_equal_the_local_runs(s3, local, tmp_path, monkeypatch):
    for k, v in (("AWS_ENDPOINT_URL", s3.url), ("AWS_ACCESS_KEY_ID", "k"), ("AWS_SECRET_ACCESS_KEY", "s"),
                 ("AWS_DEFAULT_REGION", "us-east-1")):
        monkeypatch.setenv(k, v)
    check_verl("s3://runs/verl/checkpoints", s3.counter, local, tmp_path / "verl")
    check_titan("s3://runs/titan", s3.counter, local, tmp_path / "titan")
