"""`--download` (docs/remote.md): a hub id missing from the local HF cache is fetched into it, only the
files the command needs, from a local Hub endpoint (tests/remote_servers.HubServer, HF_ENDPOINT) that
counts every file it serves. The repo is the genuine primerl-tiny base split into two safetensors shards
with an index, plus weights in other formats and a subfolder that no command may fetch."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from ckpt_tools.cli import main
from ckpt_tools.io import hub_fetch, remote

from .remote_servers import HubServer
from .test_json_envelope import SCHEMAS
from .test_remote import BASE, TRAINER, digest

jsonschema = pytest.importorskip("jsonschema")

NON_WEIGHTS = sorted(p.name for p in BASE.iterdir() if not p.name.endswith(".safetensors"))
SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
DECOYS = ["pytorch_model.bin", "original/consolidated.00.pth", "original/params.json"]


def ckpt(*args, code=0):
    r = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    assert r.exit_code == code, (args, r.exit_code, r.output)
    return r


def sharded_base(dst: Path) -> Path:
    """The fixture's base as a two-shard model dir with its index (as transformers writes a big one)."""
    dst.mkdir(parents=True)
    for name in NON_WEIGHTS:
        shutil.copy(BASE / name, dst / name)
    tensors = load_file(BASE / "model.safetensors")
    names = sorted(tensors)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for shard, part in zip(SHARDS, halves):
        save_file({n: tensors[n] for n in part}, dst / shard, metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=2))
    return dst


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    t = tmp_path_factory.mktemp("dl")
    local = sharded_base(t / "local-base")
    repo = t / "repo"
    shutil.copytree(local, repo)
    (repo / "pytorch_model.bin").write_bytes(b"\0" * 4096)   # never fetched: not safetensors
    (repo / "original").mkdir()
    (repo / "original" / "consolidated.00.pth").write_bytes(b"\0" * 4096)
    (repo / "original" / "params.json").write_text("{}")
    srv = HubServer({"org/base": repo})
    srv.local_base = local
    yield srv
    srv.close()


@pytest.fixture()
def env(hub, monkeypatch, tmp_path):
    from huggingface_hub import constants
    cache = tmp_path / "hf-home" / "hub"
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))   # read at import; the cache starts empty
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    hub.counter.reset()
    hub.unknown.clear()
    hub.cache = cache
    yield hub
    hub_fetch.reset_log()


def served(hub) -> list[str]:
    """The repo files whose bodies the Hub sent (GETs of the resolve endpoint)."""
    return sorted({p.split("/resolve/", 1)[1].split("/", 1)[1] for m, p, n in hub.counter.requests
                   if m == "GET" and "/resolve/" in p})


def test_merge_with_download_into_an_empty_cache_equals_the_local_merge(env, tmp_path):
    ckpt("merge", env.local_base, TRAINER, tmp_path / "local", "--alpha", "16")
    r = ckpt("merge", "org/base", TRAINER, tmp_path / "hub", "--alpha", "16", "--download", "--json")
    assert digest(tmp_path / "hub") == digest(tmp_path / "local")
    assert served(env) == sorted(NON_WEIGHTS + ["model.safetensors.index.json"] + SHARDS)
    assert env.unknown == []
    doc = json.loads(r.stdout)
    jsonschema.validate(doc, SCHEMAS["envelope"], cls=jsonschema.Draft202012Validator)
    (got,) = doc["downloaded"]
    sha = env.repos["org/base"]["sha"]
    assert (got["repo"], got["revision"], got["commit"]) == ("org/base", "main", sha)
    assert sorted(got["files"]) == served(env)
    assert got["bytes"] == sum((env.local_base / f).stat().st_size for f in got["files"])
    folder = env.cache / "models--org--base"
    assert (folder / "refs" / "main").read_text() == sha
    assert not any((folder / "snapshots" / sha / d).exists() for d in DECOYS)

    env.counter.reset()   # now cached: no request at all, with or without --download
    ckpt("merge", "org/base", TRAINER, tmp_path / "again", "--alpha", "16", "--download")
    ckpt("merge", "org/base", TRAINER, tmp_path / "offline", "--alpha", "16")
    assert env.counter.requests == []
    assert digest(tmp_path / "again") == digest(tmp_path / "offline") == digest(tmp_path / "local")


def test_config_from_downloads_no_weights_and_a_partial_cache_is_completed(env, tmp_path):
    ckpt("export", TRAINER, tmp_path / "exported", "--alpha", "16", "--config-from", "org/base", "--download")
    assert served(env) == NON_WEIGHTS   # config, tokenizer, chat template: no index, no shard
    ckpt("export", TRAINER, tmp_path / "local", "--alpha", "16", "--config-from", env.local_base)
    assert digest(tmp_path / "exported") == digest(tmp_path / "local")

    env.counter.reset()   # the cache holds the config only: a command reading weights fetches the rest
    r = ckpt("slim", TRAINER, tmp_path / "slim", "--base", "org/base", "--download")
    assert served(env) == sorted(["model.safetensors.index.json"] + SHARDS), r.output
    assert "downloaded 3 file(s)" in r.output


def test_without_download_a_missing_id_is_the_usual_error_naming_download(env, tmp_path):
    r = ckpt("merge", "org/base", TRAINER, tmp_path / "m", "--alpha", "16", code=1)
    assert "not in the local HF cache" in r.output and "--download" in r.output, r.output
    assert env.counter.requests == [] and not (tmp_path / "m").exists()


def test_download_of_a_repo_the_hub_does_not_have(env, tmp_path):
    r = ckpt("inspect", "org/nothing", "--download", code=1)
    assert "no such model repo" in r.output and "Traceback" not in r.output, r.output


def test_download_under_hf_hub_offline_is_one_line(env, tmp_path):
    import os
    import subprocess
    import sys
    repo_root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "ckpt_tools", "inspect", "org/base", "--download"], cwd=repo_root,
                       env=dict(os.environ, PYTHONPATH=str(repo_root), HF_HUB_OFFLINE="1"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: --download cannot fetch org/base: HF_HUB_OFFLINE is set (unset HF_HUB_OFFLINE, or download it "
        "elsewhere with `hf download`)"], r.stderr
    assert env.counter.requests == []


def test_the_api_takes_download(env, tmp_path):
    import ckpt_tools
    with pytest.raises(ckpt_tools.core.errors.CkptError, match="--download"):
        ckpt_tools.inspect("org/base")
    rep = ckpt_tools.inspect("org/base", download=True)
    assert rep.data["format"] == "hf" and rep.data["tensors"] == len(load_file(BASE / "model.safetensors"))
    assert served(env) == sorted(NON_WEIGHTS + ["model.safetensors.index.json"] + SHARDS)


@pytest.fixture(scope="module")
def a_slim(tmp_path_factory):
    out = tmp_path_factory.mktemp("slim") / "slim"
    ckpt("slim", TRAINER, out, "--base", BASE)
    return out


@pytest.mark.parametrize("command", ["inspect", "verify", "diff-vs-base", "extract-adapter", "rehydrate"])
def test_every_command_taking_a_model_honours_download(env, tmp_path, a_slim, command):
    args = {"inspect": ["inspect", "org/base"], "verify": ["verify", "org/base"],
            "diff-vs-base": ["diff-vs-base", "org/base", BASE],
            "extract-adapter": ["extract-adapter", TRAINER, tmp_path / "a", "--alpha", "16", "--base", "org/base"],
            "rehydrate": ["rehydrate", a_slim, tmp_path / "full", "--base", "org/base"]}[command]
    code = 3 if command == "diff-vs-base" else 0   # diff-vs-base: the same weights as the base (exit 3)
    if command == "extract-adapter":   # not cached: a warning (the shapes go unchecked), the adapter written
        assert "not found locally" in ckpt(*args).output
        shutil.rmtree(tmp_path / "a")
    else:
        ckpt(*args, code=1)   # not cached: the usual error
    r = ckpt(*args, "--download", code=code)
    assert served(env) == sorted(NON_WEIGHTS + ["model.safetensors.index.json"] + SHARDS), r.output
    assert f"downloaded {len(served(env))} file(s)" in r.output
