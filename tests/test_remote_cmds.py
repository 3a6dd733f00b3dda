"""URLs as paths for the commands the first stage of issue 21 left local (adapter-to-dcp, fix-adapter,
set-lr, set, restart-prep, doctor, average, resize-adapter, report), against the real servers of
tests/remote_servers.py on 127.0.0.1: each command's remote run equals its local run on the same genuine
fixture (outputs compared file by file, a DCP `.metadata` by its decoded content), within the bytes it
needs as the server counts them; its OUT uploaded to S3 or a Hub repo equals the local output; set-lr /
set within one S3 store copy the data files server-side (UploadPartCopy), fetching and sending O(KB);
a missing URL is the usual missing-path error and a URL look-alike OUT is refused, nothing created."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

from ckpt_tools.core.keys import classify  # noqa: E402
from ckpt_tools.formats.dcp.reader import DcpCheckpoint  # noqa: E402
from ckpt_tools.io import remote, upload  # noqa: E402

from .remote_servers import HttpServer, HubServer, S3Server  # noqa: E402
from .test_remote import REPO, assert_one_interrupt_line, ckpt, digest  # noqa: E402
# fixtures: the same servers and settings (hub_env takes this module's own `hub`, which holds an adapter too)
from .test_remote import fresh_remote_state, hub_env, s3, s3_env  # noqa: E402,F401

FIXTURES = Path(__file__).parent / "fixtures"
TINY = FIXTURES / "primerl-tiny"
TRAINER = TINY / "outputs/checkpoints/step_3/trainer"
BASE = TINY / "base_model"
ADAPTER = TINY / "reference_peft_adapter"
BROADCAST = TINY / "outputs/run_default/broadcasts/step_3"
ORCH = TINY / "outputs/run_default/configs/orch.toml"
E = FIXTURES / "primerl-head" / "E_head_dense"
E_CKPT = E / "outputs" / "checkpoints"
SCALARS = {"param_groups", "scheduler", "progress"}


def size_of(*paths: Path) -> int:
    return sum(f.stat().st_size for p in paths for f in ([p] if p.is_file() else p.rglob("*")) if f.is_file())


def group_bytes(trainer: Path, groups: set[str]) -> int:
    """The stored bytes of a checkpoint's items in `groups` (core.keys' groups), plus its `.metadata`."""
    with DcpCheckpoint.open(trainer, known_keys_only=False) as c:
        items = sum(e.stored_bytes for k, e in c.entries.items() if classify(k, e.path).group in groups)
    return items + (trainer / ".metadata").stat().st_size


def run(*args, code=0):
    """A command, then its staged outputs forgotten (each command lists its inputs afresh, as a new
    process would: the remote session is the command's)."""
    try:
        return ckpt(*args, code=code)
    finally:
        upload.discard_pending()


def standalone(p: Path, tmp: Path) -> Path:
    """A copy of the input `p` with only what a URL of it shows: nothing around it, but for a checkpoint in
    prime-rl's layout (`<outputs>/checkpoints/step_N/trainer`) the run configs where prime-rl writes them,
    which are looked up above a URL too (`configs/` of the outputs or the run dir, `run_default/configs/`);
    never the base model beside them (a URL's run says no launch dir here)."""
    root = tmp / "standalone"
    root.mkdir(exist_ok=True)
    top = root / str(len(list(root.iterdir())))
    in_layout = p.name == "trainer" and p.parent.name.startswith("step_") and p.parent.parent.name == "checkpoints"
    if in_layout:
        outputs = p.parents[2]
        for rel in ("configs", "../configs", "run_default/configs"):
            if (outputs / rel).is_dir():
                shutil.copytree(outputs / rel, top / "run" / "outputs" / rel)
        dest = top / "run" / "outputs" / p.relative_to(outputs)
    else:
        dest = top / p.name
    dest.parent.mkdir(parents=True, exist_ok=True)
    if p.is_dir():
        shutil.copytree(p, dest)
    else:
        shutil.copy(p, dest)
    return dest


def same_text(remote_text: str, local_text: str, pairs) -> None:
    for url, local in pairs:
        remote_text = remote_text.replace(url, str(local))
    assert remote_text == local_text


# ------------------------------------------------------------------------------------ servers
@pytest.fixture(scope="module")
def http():
    srv = HttpServer(FIXTURES)
    yield srv
    srv.close()


def url_of(srv, p: Path) -> str:
    return f"{srv.url}/{p.relative_to(FIXTURES).as_posix()}"


def s3_tree(s3, prefix: str, dest: Path) -> Path:
    """The objects under `prefix` downloaded into `dest` (to compare them with a local output)."""
    for o in s3.client.list_objects_v2(Bucket="runs", Prefix=prefix + "/").get("Contents", []):
        p = dest / o["Key"][len(prefix) + 1:]
        p.parent.mkdir(parents=True, exist_ok=True)
        s3.client.download_file("runs", o["Key"], str(p))
    return dest


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    repo = tmp_path_factory.mktemp("hub") / "run"
    shutil.copytree(TRAINER, repo / "step_3" / "trainer")
    shutil.copytree(ADAPTER, repo / "adapter")
    out = tmp_path_factory.mktemp("hub-out")
    srv = HubServer({"org/run": repo, "org/out": out})
    yield srv
    srv.close()


# ------------------------------------------------------------------------------------ remote runs = local runs
def _lora_etc(trainer: Path) -> int:
    return group_bytes(trainer, {"lora"} | SCALARS)


# command -> (argv with `at(path)` for each input and OUT for the output, what it may fetch: bytes). The
# local run is of a `standalone` copy: what a URL of the input shows (docs/remote.md).
CASES = {
    # a local OUT of a remote checkpoint holds its data files: they are fetched (O(KB) only into a store)
    "set-lr": (lambda at, out: ["set-lr", at(TRAINER), out, "--scale", "0.5"],
               lambda: size_of(TRAINER) * 1.02),
    "set": (lambda at, out: ["set", at(TRAINER), out, "progress.step=5"],
            lambda: size_of(TRAINER) * 1.02),
    # the adapter, the base (its fp32 masters are written from it) and the carried optimizer state
    "adapter-to-dcp": (lambda at, out: ["adapter-to-dcp", at(ADAPTER), out, "--base", at(BASE), "--lr", "1e-3",
                                        "--optimizer-from", at(TRAINER)],
                       lambda: (size_of(ADAPTER, BASE / "model.safetensors", BASE / "config.json")
                                + group_bytes(TRAINER, {"optimizer_state"} | SCALARS)) * 1.02),
    # the export (a base at a URL is read by its header: test_a_base_at_a_url_is_named_by_its_url)
    "fix-adapter": (lambda at, out: ["fix-adapter", at(BROADCAST), out, "--base", BASE, "--alpha", "16"],
                    lambda: size_of(BROADCAST) * 1.02),
    # the factors twice: once to choose each module's rank, once to write it (one module in memory)
    "resize-adapter": (lambda at, out: ["resize-adapter", at(ADAPTER), out, "--rank", "4"],
                       lambda: (2 * size_of(ADAPTER / "adapter_model.safetensors")
                                + size_of(ADAPTER / "adapter_config.json")) * 1.02),
    # each step's LoRA factors and scalars
    "average": (lambda at, out: ["average", at(E_CKPT / "step_2/trainer"), at(E_CKPT / "step_3/trainer"), out,
                                 "--ema", "0.5", "--alpha", "16"],
                lambda: sum(_lora_etc(E_CKPT / f"step_{n}/trainer") for n in (2, 3)) * 1.02),
    # merge mode: the LoRA, the masters of the merged modules (checked against the base) and the scalars
    "restart-prep": (lambda at, out: ["restart-prep", at(TRAINER), out, "--base", BASE, "--lr", "5e-3", "--alpha", "16"],
                     lambda: group_bytes(TRAINER, {"lora", "base"} | SCALARS) * 1.02),
    "restart-prep --mode adapter": (
        lambda at, out: ["restart-prep", at(TRAINER), out, "--base", BASE, "--lr", "5e-3", "--alpha", "16",
                         "--mode", "adapter"],
        lambda: _lora_etc(TRAINER) * 1.02),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_command_from_urls_equals_its_local_run_within_what_it_needs(http, name, tmp_path):
    argv, budget = CASES[name]
    local = run(*argv(lambda p: standalone(p, tmp_path), tmp_path / "local"))
    http.counter.reset()
    remote_run = run(*argv(lambda p: url_of(http, p), tmp_path / "remote"))
    assert digest(tmp_path / "remote") == digest(tmp_path / "local")
    assert 0 < http.counter.bytes <= budget(), (http.counter.bytes, budget())
    assert "fetched" in remote_run.stdout.splitlines()[-1]
    assert local.exit_code == remote_run.exit_code == 0


def test_a_base_at_a_url_is_read_by_its_header_and_named_by_its_url(http, tmp_path):
    """fix-adapter's --base: the shapes of its modules from the safetensors header; the adapter_config.json
    it writes names the base as the user gave it, the URL (never its local stand-in)."""
    http.counter.reset()
    run("fix-adapter", BROADCAST, tmp_path / "fixed", "--base", url_of(http, BASE), "--alpha", "16")
    cfg = json.loads((tmp_path / "fixed" / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == url_of(http, BASE)
    header = 8 + int.from_bytes((BASE / "model.safetensors").read_bytes()[:8], "little")
    assert http.counter.bytes <= header + size_of(BASE / "config.json") + 4096, (http.counter.bytes, header)


def test_set_lr_to_a_local_out_says_the_data_files_were_fetched(http, tmp_path):
    r = run("set-lr", url_of(http, TRAINER), tmp_path / "lr", "--scale", "0.5")
    assert "4 data file(s) were fetched from the URL: a local OUT holds the whole checkpoint" in r.stderr


def test_report_of_a_run_at_a_url_equals_the_local_page_and_pictures(http, tmp_path):
    at = lambda p: url_of(http, p)   # noqa: E731
    argv = lambda at, d: ["report", at(E_CKPT), "--run-config", at(E / "configs/trainer.json"),  # noqa: E731
                          "-o", d / "report.html", "--png", d / "png", "--json"]
    (tmp_path / "l").mkdir()
    (tmp_path / "r").mkdir()
    local = json.loads(run(*argv(lambda p: p, tmp_path / "l")).stdout)
    http.counter.reset()
    got = json.loads(run(*argv(at, tmp_path / "r")).stdout)
    pairs = [(at(E), E), (str(tmp_path / "r"), tmp_path / "l")]
    same_text((tmp_path / "r/report.html").read_text(), (tmp_path / "l/report.html").read_text(), pairs)
    assert digest(tmp_path / "r/png") == digest(tmp_path / "l/png")
    for doc in (local, got):
        doc["result"].pop("seconds")
    same_text(json.dumps(got["result"]), json.dumps(local["result"]), pairs)
    # per step its LoRA, Adam moments and scalars; ||W|| of the targeted weights from the first step's masters
    need = sum(group_bytes(E_CKPT / f"step_{n}/trainer", {"lora", "optimizer_state"} | SCALARS) for n in (2, 3))
    need += group_bytes(E_CKPT / "step_2/trainer", {"base"})
    assert got["remote"]["bytes_fetched"] == http.counter.bytes <= need * 1.02, (http.counter.bytes, need)


@pytest.mark.parametrize("target", ["run", "config"])
def test_doctor_of_a_run_or_config_at_a_url_finds_what_the_local_one_finds(http, target, tmp_path):
    path = TINY if target == "run" else ORCH
    local = json.loads(run("doctor", path, "--json", code=3).stdout)
    http.counter.reset()
    got = json.loads(run("doctor", url_of(http, path), "--json", code=3).stdout)
    same_text(json.dumps(got["result"]), json.dumps(local["result"]), [(url_of(http, TINY), TINY)])
    if target == "config":   # the config only (read twice, as locally: its toml_files followed, then loaded)
        assert http.counter.bytes <= 2 * size_of(ORCH)
    else:   # .metadata and the scalars; the weights export and the base, compared (weights-are-base)
        assert http.counter.bytes <= (group_bytes(TRAINER, SCALARS) + size_of(TINY / "outputs/weights/step_3")
                                      + size_of(BASE)) * 1.02
    text = run("doctor", url_of(http, TINY), "--no-weights-check", code=3).stdout
    assert f"outputs: {url_of(http, TINY / 'outputs')} " in text and "/ckpt-remote-" not in text


def test_a_run_at_a_url_finds_its_config_where_prime_rl_writes_it_and_never_in_the_local_temp_dir(
        http, tmp_path, monkeypatch):
    """A run root's URL: its checkpoint's alpha from the run config inside it. A checkpoints dir's URL: the
    run config above it, at the URL where prime-rl writes it (HEAD: the run dir's configs/trainer.json),
    never in a local temp dir (reading a URL makes none; a stray configs/trainer.json in TMPDIR once set
    the scale). A checkpoint's URL outside prime-rl's layout: no config is looked for around it."""
    r = run("restart-prep", url_of(http, TINY), tmp_path / "o", "--base", BASE, "--lr", "5e-3")
    assert f"alpha 16, from run config {url_of(http, ORCH)}" in r.stdout
    stray = tmp_path / "tmp"
    (stray / "configs").mkdir(parents=True)
    shutil.copy(E / "configs" / "trainer.json", stray / "configs" / "trainer.json")
    monkeypatch.setattr("tempfile.tempdir", str(stray))
    http.counter.reset()
    r = run("report", url_of(http, E_CKPT), "--json")
    assert json.loads(r.stdout)["ok"] is True and str(stray) not in r.stdout
    assert "/E_head_dense/configs/trainer.json" in " ".join(p for _m, p, _n in http.counter.requests)
    alone = standalone(E_CKPT / "step_3" / "trainer", tmp_path)   # in the layout, with its configs ...
    shutil.rmtree(alone.parents[3] / "configs")                     # ... taken away: nothing where they go
    srv = HttpServer(tmp_path / "standalone")
    try:
        r = run("report", f"{srv.url}/{alone.relative_to(tmp_path / 'standalone').as_posix()}", "--json", code=1)
    finally:
        srv.close()
    assert "LoRA alpha is not stored in a DCP checkpoint" in r.stdout and str(stray) not in r.stdout
    r = run("report", url_of(http, E_CKPT), "--run-config", stray / "configs" / "trainer.json", "--json")
    assert json.loads(r.stdout)["ok"] is True


def test_a_checkpoints_url_in_prime_rls_layout_finds_its_run_config_as_locally(http, tmp_path):
    """`extract-adapter URL-of-.../checkpoints/step_N/trainer` with no --alpha: the run config is found at
    the URL where prime-rl wrote it (16e747c: outputs/run_default/configs/orch.toml; HEAD: the run dir's
    configs/trainer.json), read by range, and the adapter is the local run's, byte for byte."""
    for trainer, cfg in ((TRAINER, ORCH), (E_CKPT / "step_3" / "trainer", E / "configs" / "trainer.json")):
        local = json.loads(run("extract-adapter", trainer, tmp_path / f"local-{cfg.name}", "--json").stdout)
        http.counter.reset()
        got = json.loads(run("extract-adapter", url_of(http, trainer), tmp_path / f"url-{cfg.name}", "--json").stdout)
        assert digest(tmp_path / f"url-{cfg.name}") == digest(tmp_path / f"local-{cfg.name}")
        assert url_of(http, cfg) in json.dumps(got), got
        assert local["result"]["alpha"] == got["result"]["alpha"]
        # the config file read (twice: for the alpha and for the base's name), and beside it only what
        # extract-adapter reads of any checkpoint (the LoRA items and .metadata, group_bytes counts them)
        assert cfg.name in " ".join(p for _m, p, _n in http.counter.requests)
        assert http.counter.bytes <= _lora_etc(trainer) * 1.02 + 2 * cfg.stat().st_size, http.counter.bytes


# ------------------------------------------------------------------------------------ set-lr / set into a store
def test_set_lr_within_one_s3_store_copies_the_data_files_server_side(s3_env, tmp_path):
    run("set-lr", TRAINER, tmp_path / "local", "--scale", "0.5")
    s3_env.counter.reset()
    doc = json.loads(run("set-lr", "s3://runs/step_3/trainer", "s3://runs/lr/step_3", "--scale", "0.5", "--json").stdout)
    fetched = s3_env.counter.bytes
    assert digest(s3_tree(s3_env, "lr/step_3", tmp_path / "got")) == digest(tmp_path / "local")
    data = size_of(*TRAINER.glob("*.distcp"))
    (up,) = doc["remote"]["uploaded"]
    assert up["copied_bytes"] == data and "4 file(s) copied server-side (UploadPartCopy)" in up["method"]
    assert s3_env.part_copies == 4
    # fetched: .metadata and the items patched; sent: the patch file, the new .metadata and the marker
    assert fetched == doc["remote"]["bytes_fetched"] <= META_TINY + 64 * 1024
    sent = size_of(tmp_path / "local" / "__patch_0.distcp", tmp_path / "local" / ".metadata",
                   tmp_path / "local" / ".ckpt-tools-output")
    assert up["bytes"] == sent and s3_env.put_bytes <= sent + 1024, (s3_env.put_bytes, sent)
    assert doc["result"]["linked"] == {"remote": 4}


META_TINY = (TRAINER / ".metadata").stat().st_size


def test_free_space_is_asked_for_the_data_files_only_where_they_are_written(s3_env, tmp_path):
    """A remote checkpoint's data files cost no local disk when OUT is bound for a URL (stand-ins), and
    their whole size when OUT is local (fetched): the free-space check of set-lr / set counts them so."""
    from ckpt_tools.io.copy import link_writes_bytes
    shadow = remote.as_input("s3://runs/step_3/trainer")
    staged = upload.stage_output("s3://runs/elsewhere")
    assert link_writes_bytes(shadow, staged.parent) is False
    assert link_writes_bytes(shadow, tmp_path) is True
    assert link_writes_bytes(TRAINER, tmp_path) is (os.stat(TRAINER).st_dev != os.stat(tmp_path).st_dev)


def test_staging_on_another_filesystem_still_copies_server_side(s3_env, tmp_path, monkeypatch):
    """CKPT_UPLOAD_STAGING on another filesystem than the shadow tree: no hard link of a placeholder there,
    a new placeholder stands in for the object instead (registered, then forgotten with the staging dir)."""
    other = Path("/dev/shm")
    if not other.is_dir() or os.stat(other).st_dev == os.stat(tempfile.gettempdir()).st_dev:
        pytest.skip("no second filesystem (/dev/shm) here")
    staging = Path(tempfile.mkdtemp(dir=other, prefix="ckpt-test-"))
    monkeypatch.setenv("CKPT_UPLOAD_STAGING", str(staging))
    try:
        run("set-lr", TRAINER, tmp_path / "local", "--scale", "0.25")
        doc = json.loads(run("set-lr", "s3://runs/step_3/trainer", "s3://runs/lr-shm", "--scale", "0.25",
                             "--json").stdout)
        assert doc["remote"]["uploaded"][0]["copied_bytes"] == size_of(*TRAINER.glob("*.distcp"))
        assert digest(s3_tree(s3_env, "lr-shm", tmp_path / "got")) == digest(tmp_path / "local")
        assert list(staging.iterdir()) == []
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def test_set_from_another_store_into_s3_streams_the_data_files(s3_env, http, tmp_path):
    run("set", TRAINER, tmp_path / "local", "progress.step=5")
    doc = json.loads(run("set", url_of(http, TRAINER), "s3://runs/set/step_3", "progress.step=5", "--json").stdout)
    assert digest(s3_tree(s3_env, "set/step_3", tmp_path / "got")) == digest(tmp_path / "local")
    (up,) = doc["remote"]["uploaded"]
    assert up["copied_bytes"] == 0 and s3_env.part_copies == 0 and up["bytes"] == size_of(tmp_path / "local")


def test_a_store_without_upload_part_copy_has_the_files_streamed(s3_env, tmp_path):
    run("set-lr", TRAINER, tmp_path / "local", "--lr", "1e-3")
    s3_env.refuse_part_copy = True
    try:
        doc = json.loads(run("set-lr", "s3://runs/step_3/trainer", "s3://runs/lr-streamed", "--lr", "1e-3",
                             "--json").stdout)
    finally:
        s3_env.refuse_part_copy = False
    assert digest(s3_tree(s3_env, "lr-streamed", tmp_path / "got")) == digest(tmp_path / "local")
    (up,) = doc["remote"]["uploaded"]
    assert up["copied_bytes"] == 0 and up["bytes"] == size_of(tmp_path / "local")
    assert s3_env.part_copies == 1   # the first one refused, then every file streamed


def test_a_source_rewritten_during_the_server_side_copy_commits_nothing(s3_env):
    key = "step_3/trainer/__1_0.distcp"
    original = (TRAINER / "__1_0.distcp").read_bytes()
    # the first part uploaded (the output's marker file) is the moment: the data files' copies come after
    s3_env.on_upload_part = lambda: s3_env.client.put_object(Bucket="runs", Key=key,
                                                            Body=original[:-1] + bytes([original[-1] ^ 1]))
    try:
        r = run("set-lr", "s3://runs/step_3/trainer", "s3://runs/lr-changed", "--scale", "0.5", code=1)
    finally:
        s3_env.on_upload_part = None
        s3_env.client.put_object(Bucket="runs", Key=key, Body=original)
    line = r.output.strip().splitlines()[-1]
    assert "changed while it was being copied" in line and f"s3://runs/{key}" in line, r.output
    assert s3_env.client.list_objects_v2(Bucket="runs", Prefix="lr-changed").get("KeyCount", 0) == 0
    assert not s3_env.client.list_multipart_uploads(Bucket="runs").get("Uploads")


def test_an_out_that_is_or_holds_the_input_url_is_refused_the_input_untouched(s3_env):
    before = {o["Key"]: o["ETag"] for o in s3_env.client.list_objects_v2(Bucket="runs", Prefix="step_3/")["Contents"]}
    for out in ("s3://runs/step_3/trainer", "s3://runs/step_3"):
        r = run("set-lr", "s3://runs/step_3/trainer", out, "--scale", "0.5", "--overwrite", code=2)
        assert "OUT is an input of this command, or holds or lies inside one (s3://runs/step_3/trainer" in r.output
    after = {o["Key"]: o["ETag"] for o in s3_env.client.list_objects_v2(Bucket="runs", Prefix="step_3/")["Contents"]}
    assert after == before and not s3_env.client.list_multipart_uploads(Bucket="runs").get("Uploads")


def test_ctrl_c_during_an_upload_within_one_store_commits_nothing(s3_env):
    env = dict(os.environ, PYTHONPATH=str(REPO), CKPT_REMOTE_BACKOFF="0.05")
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_tools", "set-lr", "s3://runs/step_3/trainer",
                             "s3://runs/lr-interrupted", "--scale", "0.5"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)

    def interrupt():
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)   # the part arrives after the interrupt; the copies would come next
    s3_env.on_upload_part = interrupt
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert_one_interrupt_line(out)
    assert s3_env.client.list_objects_v2(Bucket="runs", Prefix="lr-interrupted").get("KeyCount", 0) == 0
    assert not s3_env.client.list_multipart_uploads(Bucket="runs").get("Uploads")


def test_set_lr_in_place_on_a_url_is_refused(s3_env):
    r = run("set-lr", "s3://runs/step_3/trainer", "--in-place", "--scale", "0.5", code=2)
    assert "--in-place patches a local checkpoint, and this one is at a URL" in r.output
    assert "s3://runs/step_3/trainer" in r.output and "/ckpt-remote-" not in r.output


def test_set_lr_from_a_hub_repo_into_a_hub_repo_is_one_commit(hub_env, tmp_path):
    run("set-lr", TRAINER, tmp_path / "local", "--scale", "0.5")
    commits = len(hub_env.commits)
    doc = json.loads(run("set-lr", "hf://org/run/step_3/trainer", "hf://org/out/lr-3", "--scale", "0.5",
                         "--json").stdout)
    assert len(hub_env.commits) == commits + 1
    assert digest(Path(hub_env.repos["org/out"]["dir"]) / "lr-3") == digest(tmp_path / "local")
    (up,) = doc["remote"]["uploaded"]   # the Hub copies no file across repos: fetched, then committed
    assert "fetched from the inputs first" in up["method"] and up["copied_bytes"] == 0
    assert hub_env.unknown == []


# ------------------------------------------------------------------------------------ OUT at a URL
def test_outputs_uploaded_to_s3_equal_the_local_outputs(s3_env, http, tmp_path):
    at = lambda p: url_of(http, p)   # noqa: E731
    for name, prefix in (("adapter-to-dcp", "a2d"), ("average", "avg"), ("restart-prep --mode adapter", "rp-adapter")):
        argv, _ = CASES[name]
        run(*argv(lambda p: standalone(p, tmp_path), tmp_path / f"{prefix}-local"))
        run(*argv(at, f"s3://runs/{prefix}"))
        assert digest(s3_tree(s3_env, prefix, tmp_path / prefix)) == digest(tmp_path / f"{prefix}-local"), name
    page = ["report", E_CKPT, "--run-config", E / "configs/trainer.json"]
    run(*page, "-o", tmp_path / "report.html", "--png", tmp_path / "png")
    run(*page, "-o", "s3://runs/report/index.html", "--png", "s3://runs/report/png")
    got = s3_env.client.get_object(Bucket="runs", Key="report/index.html")["Body"].read()
    assert got == (tmp_path / "report.html").read_bytes()
    assert digest(s3_tree(s3_env, "report/png", tmp_path / "got-png")) == digest(tmp_path / "png")


def test_outputs_committed_to_a_hub_repo_equal_the_local_outputs(hub_env, tmp_path):
    for name, argv in (("resize-adapter", lambda src, out: ["resize-adapter", src, out, "--rank", "4"]),
                       ("fix-adapter", lambda src, out: ["fix-adapter", BROADCAST, out, "--base", BASE, "--alpha", "16"])):
        commits = len(hub_env.commits)
        run(*argv(ADAPTER, tmp_path / name))
        run(*argv("hf://org/run/adapter", f"hf://org/out/{name}"))
        assert len(hub_env.commits) == commits + 1
        assert digest(Path(hub_env.repos["org/out"]["dir"]) / name) == digest(tmp_path / name), name
    assert hub_env.unknown == []


def test_restart_prep_to_a_url_puts_the_patched_config_beside_it_naming_the_url(s3_env, tmp_path):
    cfg = tmp_path / "rl.toml"
    shutil.copy(ORCH, cfg)
    r = run("restart-prep", TRAINER, "s3://runs/merged-3", "--base", BASE, "--lr", "5e-3", "--alpha", "16",
            "--config", cfg)
    text = s3_env.client.get_object(Bucket="runs", Key="merged-3.rl.toml")["Body"].read().decode()
    assert 'name = "s3://runs/merged-3"' in text and "lr = 0.005" in text.replace("5e-3", "0.005")
    assert "uv run trainer @ s3://runs/merged-3.rl.toml" in r.stdout and "download OUT" in r.stdout
    run("restart-prep", TRAINER, tmp_path / "merged-3", "--base", BASE, "--lr", "5e-3", "--alpha", "16",
        "--config", cfg, "--config-out", tmp_path / "local.toml")
    assert digest(s3_tree(s3_env, "merged-3", tmp_path / "got")) == digest(tmp_path / "merged-3")


def test_restart_prep_with_a_config_at_a_url_asks_where_the_patched_one_goes(http, tmp_path):
    r = run("restart-prep", TRAINER, tmp_path / "o", "--base", BASE, "--lr", "5e-3", "--alpha", "16",
            "--mode", "adapter", "--config", url_of(http, ORCH), code=2)
    assert "beside --config by default, and that is at a URL" in r.output and "--config-out" in r.output
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------ the usual errors
MISSING = {   # command -> argv with the missing URL M as its input
    "adapter-to-dcp": lambda m, t: ["adapter-to-dcp", m, t / "o", "--base", BASE, "--lr", "1"],
    "adapter-to-dcp (--base)": lambda m, t: ["adapter-to-dcp", ADAPTER, t / "o", "--base", m, "--lr", "1"],
    "adapter-to-dcp (--optimizer-from)": lambda m, t: ["adapter-to-dcp", ADAPTER, t / "o", "--base", BASE,
                                                       "--optimizer-from", m],
    "fix-adapter": lambda m, t: ["fix-adapter", m, t / "o"],
    "fix-adapter (--base)": lambda m, t: ["fix-adapter", BROADCAST, t / "o", "--base", m],
    "set-lr": lambda m, t: ["set-lr", m, t / "o", "--lr", "1"],
    "set": lambda m, t: ["set", m, t / "o", "progress.step=1"],
    "restart-prep": lambda m, t: ["restart-prep", m, t / "o", "--base", BASE, "--lr", "1"],
    "restart-prep (--base)": lambda m, t: ["restart-prep", TRAINER, t / "o", "--base", m, "--lr", "1", "--alpha", "16"],
    "restart-prep (--config)": lambda m, t: ["restart-prep", TRAINER, t / "o", "--base", BASE, "--lr", "1",
                                             "--config", m],
    "doctor": lambda m, t: ["doctor", m],
    "doctor (--base)": lambda m, t: ["doctor", TINY, "--base", m],
    "average": lambda m, t: ["average", TRAINER, m, t / "o"],
    "average (--merge)": lambda m, t: ["average", TRAINER, ADAPTER, t / "o", "--merge", m],
    "resize-adapter": lambda m, t: ["resize-adapter", m, t / "o", "--rank", "2"],
    "report": lambda m, t: ["report", m],
    "report (--base)": lambda m, t: ["report", TRAINER, "--base", m],
}


@pytest.mark.parametrize("name", list(MISSING))
def test_a_missing_url_is_the_usual_missing_path_error(http, s3_env, name, tmp_path):
    for missing in (f"{http.url}/nothing/here", "s3://runs/step_9/trainer"):
        r = run(*MISSING[name](missing, tmp_path), code=2)
        assert r.output.strip().splitlines()[-1].startswith(f"error: no such file or directory: {missing}"), \
            (name, r.output)
        assert not (tmp_path / "o").exists()


LOOKALIKE = {   # command -> argv with the URL look-alike L as an output
    "adapter-to-dcp": lambda lk: ["adapter-to-dcp", ADAPTER, lk, "--base", BASE, "--lr", "1"],
    "fix-adapter": lambda lk: ["fix-adapter", BROADCAST, lk],
    "set-lr": lambda lk: ["set-lr", TRAINER, lk, "--lr", "1"],
    "set": lambda lk: ["set", TRAINER, lk, "progress.step=1"],
    "restart-prep": lambda lk: ["restart-prep", TRAINER, lk, "--base", BASE, "--lr", "1"],
    "restart-prep (--config-out)": lambda lk: ["restart-prep", TRAINER, "o", "--base", BASE, "--lr", "1",
                                               "--config", ORCH, "--config-out", lk],
    "average": lambda lk: ["average", TRAINER, ADAPTER, lk],
    "resize-adapter": lambda lk: ["resize-adapter", ADAPTER, lk, "--rank", "2"],
    "report (-o)": lambda lk: ["report", TRAINER, "-o", lk],
    "report (--png)": lambda lk: ["report", TRAINER, "--png", lk],
}


@pytest.mark.parametrize("name", list(LOOKALIKE))
def test_a_url_lookalike_out_is_refused_and_nothing_created(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for bad in ("s3:/bucket/x", "hf:org/name", "gs:/b/x"):
        r = run(*LOOKALIKE[name](bad), code=2)
        assert "looks like a URL but is not one" in r.output, (name, r.output)
    assert list(tmp_path.iterdir()) == []
