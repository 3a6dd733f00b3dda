"""OUT at a bucket prefix with the local contract (docs/remote.md, "Writing to a URL"; io/upload_commit.py), on
every store there is a real server for: S3 (moto's), GCS (fake-gcs-server), a Hugging Face bucket (the test Hub,
its uploads through xet-core's local CAS), a Hub repo (the test Hub) and an fsspec filesystem (memory://).

  - `--overwrite` onto a prefix holding a stranger's object, or no marker of ours, is refused with the very
    message a local OUT gets, and nothing is deleted;
  - a 503 injected at each write request of an overwrite (and every retry of it: the client's own retries are
    spent, then it fails) leaves the earlier output verifying OK, or the new one complete: never a mix, no
    multipart upload left open, no staging or backup prefix left, and the error is one line naming the URL and
    the server's code;
  - Ctrl-C during the backup leaves the earlier output; Ctrl-C once the commit began is held until the new one
    is complete;
  - no credential in any object written, nor in any message or --json."""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

pytest.importorskip("fsspec")
pytest.importorskip("moto.server")

from ckpt_tools.io import upload  # noqa: E402
from ckpt_tools.io.owned import OUTPUT_MARKER  # noqa: E402

from .remote_servers import GcsServer, HubServer, S3Server  # noqa: E402
from .test_remote import BASE, REPO, TRAINER, ckpt, digest, fresh_remote_state  # noqa: E402,F401

AWS_SECRET = "ckptTestSecret/0123456789abcdefABCDEF"
GCS_TOKEN = "ya29.ckpt-write-test-token-0123456789"
HF_TOKEN = "hf_ckptWriteTestToken0123456789"
TAG = re.compile(r"ckpt-(tmp|old)-[0-9a-f]+")


def cli(*args):
    """The CLI in this process, its exit code whatever it is."""
    from click.testing import CliRunner

    from ckpt_tools.cli import main
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def norm(request) -> tuple:
    """A write request with the staging tag (random per run) left out: the same step in every run."""
    return tuple(TAG.sub(r"ckpt-\1-X", x) if isinstance(x, str) else x for x in request)


# ------------------------------------------------------------------------------------ the stores
class S3Target:
    name = "s3"

    def __init__(self, srv):
        import boto3

        self.srv = srv
        self.client = boto3.client("s3", endpoint_url=srv.url, aws_access_key_id="k", aws_secret_access_key=AWS_SECRET,
                                   region_name="us-east-1")
        self.client.create_bucket(Bucket="out")

    def env(self, mp):
        mp.setenv("AWS_ENDPOINT_URL", self.srv.url)
        mp.setenv("AWS_ACCESS_KEY_ID", "k")
        mp.setenv("AWS_SECRET_ACCESS_KEY", AWS_SECRET)
        mp.setenv("AWS_DEFAULT_REGION", "us-east-1")
        mp.setenv("AWS_MAX_ATTEMPTS", "2")   # botocore's own retries, fewer: a persistent 503 fails fast

    def url(self, prefix):
        return f"s3://out/{prefix}"

    def keys(self):
        return sorted(o["Key"] for o in self.client.list_objects_v2(Bucket="out").get("Contents", []))

    def get(self, key):
        return self.client.get_object(Bucket="out", Key=key)["Body"].read()

    def put(self, key, data):
        self.client.put_object(Bucket="out", Key=key, Body=data)

    def delete(self, key):
        self.client.delete_object(Bucket="out", Key=key)

    def open_uploads(self):
        return self.client.list_multipart_uploads(Bucket="out").get("Uploads", [])

    def writes(self):
        return self.srv.writes

    def fail(self, pred):
        self.srv.fail_if = pred

    def on_write(self, hook):
        self.srv.on_write = hook


class GcsTarget:
    name = "gs"

    def __init__(self, srv, adc: Path):
        self.srv, self.adc = srv, adc
        srv.create_bucket("out")

    def env(self, mp):
        mp.setenv("STORAGE_EMULATOR_HOST", self.srv.url)
        mp.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(self.adc))
        mp.setenv("GOOGLE_CLOUD_PROJECT", "ckpt-test")
        mp.setenv("NO_GCE_CHECK", "true")
        self.srv.faults.clear()
        self.srv.faults["require_token"] = GCS_TOKEN

    def url(self, prefix):
        return f"gs://out/{prefix}"

    def keys(self):
        return self.srv.names("out")

    def get(self, key):
        return self.srv.get("out", key)

    def put(self, key, data):
        self.srv.put("out", key, data)

    def delete(self, key):
        import urllib.parse
        self.srv.request("DELETE", f"/storage/v1/b/out/o/{urllib.parse.quote(key, safe='')}")

    def open_uploads(self):
        return []

    def writes(self):
        return self.srv.writes

    def fail(self, pred):
        if pred is None:
            self.srv.faults.pop("fail_if", None)
        else:
            self.srv.faults["fail_if"] = pred

    def on_write(self, hook):
        self.srv.faults["on_write"] = hook


class BucketTarget:
    name = "hf-bucket"

    def __init__(self, hub, root: Path):
        self.hub, self.root = hub, root

    def env(self, mp):
        mp.setenv("HF_ENDPOINT", self.hub.url)
        mp.setenv("HF_TOKEN", HF_TOKEN)
        mp.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")

    def url(self, prefix):
        return f"hf://buckets/org/out/{prefix}"

    def keys(self):
        return sorted(p.relative_to(self.root).as_posix() for p in self.root.rglob("*") if p.is_file())

    def get(self, key):
        return (self.root / key).read_bytes()

    def put(self, key, data):   # through the Hub's own API: the Xet CAS must hold what a copy names
        from huggingface_hub import HfApi
        HfApi(endpoint=self.hub.url, token=HF_TOKEN).batch_bucket_files("org/out", add=[(data, key)])

    def delete(self, key):
        (self.root / key).unlink()

    def open_uploads(self):
        return []

    def writes(self):   # one batch request is one step: its operations, in order
        return [tuple((op["type"], op["path"]) for op in b) for b in self.hub.batches]

    def fail(self, pred):
        self.hub.fail_batch = None if pred is None else (lambda ops: pred(tuple((o["type"], o["path"]) for o in ops)))

    def on_write(self, hook):
        def arm(ops):
            hook(tuple((o["type"], o["path"]) for o in ops))
            self.hub.on_batch = arm
        self.hub.on_batch = None if hook is None else arm


class MemoryTarget:
    """fsspec's memory:// (one store per process: the CLI runs in this one), its faults as a failing method."""
    name = "memory"

    def __init__(self):
        import fsspec
        self.fs = fsspec.filesystem("memory")
        self.log: list[tuple] = []
        self.pred = None
        self.hook = None

    def env(self, mp):
        from fsspec.implementations.memory import MemoryFileSystem
        for meth in ("cp_file", "rm_file", "pipe_file", "put_file"):
            real = getattr(MemoryFileSystem, meth)

            def wrapped(fs, *args, _real=real, _meth=meth, **kw):
                req = (_meth, *[str(a) for a in args if isinstance(a, str)][-2:])
                if _meth == "put_file":
                    req = (_meth, str(args[1]))
                self.log.append(req)
                if self.hook is not None:
                    self.hook(req)
                if self.pred is not None and self.pred(req):
                    raise OSError(503, "Service Unavailable")
                return _real(fs, *args, **kw)
            mp.setattr(MemoryFileSystem, meth, wrapped)

    def url(self, prefix):
        return f"memory://out/{prefix}"

    def keys(self):
        return sorted(p[len("/out/"):] for p in self.fs.find("/out"))

    def get(self, key):
        return self.fs.cat_file(f"/out/{key}")

    def put(self, key, data):
        self.fs.pipe_file(f"/out/{key}", data)

    def delete(self, key):
        self.fs.rm_file(f"/out/{key}")

    def open_uploads(self):
        return []

    def writes(self):
        return self.log

    def fail(self, pred):
        self.pred = pred

    def on_write(self, hook):
        self.hook = hook


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    base = tmp_path_factory.mktemp("write-stores")
    (base / "bucket").mkdir()
    (base / "repo").mkdir()
    s3, gcs = S3Server(), GcsServer()
    hub = HubServer({"org/repo": base / "repo"}, buckets={"org/out": base / "bucket"})
    adc = base / "adc.json"
    adc.write_text(json.dumps({"type": "authorized_user", "client_id": "ckpt-test", "client_secret": "s",
                               "refresh_token": "r", "token": GCS_TOKEN, "expiry": "2099-01-01T00:00:00Z"}))
    targets = {"s3": S3Target(s3), "gs": GcsTarget(gcs, adc), "hf-bucket": BucketTarget(hub, base / "bucket"),
               "memory": MemoryTarget()}
    yield targets, hub, base
    s3.close()
    gcs.close()
    hub.close()


@pytest.fixture(params=["s3", "gs", "hf-bucket", "memory"])
def store(request, servers, monkeypatch):
    targets, _hub, _base = servers
    t = targets[request.param]
    t.env(monkeypatch)
    _fast_client_retries(monkeypatch)
    t.fail(None)
    t.on_write(None)
    yield t
    t.fail(None)
    t.on_write(None)
    upload.discard_pending()


def _fast_client_retries(monkeypatch):
    """gcsfs and huggingface_hub wait out their own backoff (up to ~30 s a request) before a persistent 503
    fails: their sleeps made short here, their retries left as they are."""
    import asyncio

    import gcsfs.retry
    import huggingface_hub.utils._http as hf_http

    async def short(_s, *a, **k):
        await asyncio.sleep(0.01)
    monkeypatch.setattr(gcsfs.retry, "asyncio", types.SimpleNamespace(**{**vars(asyncio), "sleep": short}))
    monkeypatch.setattr(hf_http, "time", types.SimpleNamespace(**{**vars(time), "sleep": lambda s: None}))


def objects(t, prefix: str) -> dict[str, bytes]:
    return {k[len(prefix) + 1:]: t.get(k) for k in t.keys() if k.startswith(prefix + "/")}


def leftovers(t) -> list[str]:
    return [k for k in t.keys() if TAG.search(k)]


def reset(t, prefix: str, files: dict[str, bytes]) -> None:
    """The prefix made to hold exactly `files`, and no staging or backup prefix left anywhere."""
    for k in t.keys():
        if k.startswith(prefix + "/") or TAG.search(k):
            t.delete(k)
    for rel, data in sorted(files.items()):
        t.put(f"{prefix}/{rel}", data)


def tree(files: dict[str, bytes], dest: Path) -> Path:
    for rel, data in files.items():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).write_bytes(data)
    return dest


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """The local runs: the earlier output (an adapter) and the new one (a slim)."""
    d = tmp_path_factory.mktemp("write-local")
    ckpt("extract-adapter", TRAINER, d / "adapter", "--alpha", "16")
    ckpt("slim", TRAINER, d / "slim", "--base", BASE)
    return d


def without_marker(files: dict) -> dict:
    return {k: v for k, v in files.items() if k != OUTPUT_MARKER}


def is_the_slim(files: dict[str, bytes], outputs: Path, tmp: Path) -> bool:
    """`files` (the marker aside) are the local slim's, as `digest` compares them."""
    return digest(tree(without_marker(files), tmp)) == without_marker(digest(outputs / "slim"))


# ------------------------------------------------------------------------------------ ownership
def test_overwrite_onto_a_strangers_prefix_is_refused_as_locally_and_nothing_is_deleted(store, tmp_path):
    stranger = {"notes.txt": b"mine", "sub/data.bin": b"\x00" * 100}
    reset(store, "theirs", stranger)
    local = tree(stranger, tmp_path / "theirs")
    r = ckpt("slim", TRAINER, store.url("theirs"), "--base", BASE, "--overwrite", code=1)
    mine = ckpt("slim", TRAINER, local, "--base", BASE, "--overwrite", code=1)
    assert r.output.replace(store.url("theirs"), "OUT") == mine.output.replace(str(local), "OUT"), r.output
    assert "is not an output of ckpt-tools" in r.output and "notes.txt, sub" in r.output
    assert objects(store, "theirs") == stranger and leftovers(store) == []


def test_overwrite_onto_an_earlier_output_with_a_strangers_object_in_it_is_refused(store, tmp_path):
    reset(store, "mixed", {})
    ckpt("extract-adapter", TRAINER, store.url("mixed"), "--alpha", "16")
    store.put("mixed/notes.txt", b"mine")
    store.put("mixed/sub/data.bin", b"x")
    before = objects(store, "mixed")
    r = ckpt("slim", TRAINER, store.url("mixed"), "--base", BASE, "--overwrite", code=1)
    lines = r.output.strip().splitlines()
    assert lines == [f"error: {store.url('mixed')}: is an earlier output of `ckpt extract-adapter`, but holds "
                     "entries it did not write: notes.txt, sub; --overwrite would delete them; refusing (move those "
                     "entries out first, or pass another output path)"], r.output
    assert objects(store, "mixed") == before and leftovers(store) == []
    # without --overwrite: the local words too, and nothing written
    r = ckpt("slim", TRAINER, store.url("mixed"), "--base", BASE, code=1)
    assert r.output.strip() == f"error: {store.url('mixed')}: already exists (pass --overwrite to replace it, or " \
                               "another output path)"
    assert objects(store, "mixed") == before


def test_overwrite_replaces_an_earlier_output_whole(store, outputs, tmp_path):
    reset(store, "whole", {})
    ckpt("extract-adapter", TRAINER, store.url("whole"), "--alpha", "16")
    ckpt("slim", TRAINER, store.url("whole"), "--base", BASE, "--overwrite")
    got = objects(store, "whole")
    assert is_the_slim(got, outputs, tmp_path / "got")
    marker = json.loads(got[OUTPUT_MARKER])
    assert marker["command"] == "slim" and "committing" not in marker
    assert leftovers(store) == [] and store.open_uploads() == []


def test_overwrite_onto_a_hub_repo_dir_applies_the_same_rule(servers, monkeypatch, outputs, tmp_path):
    _targets, hub, base = servers
    BucketTarget(hub, base).env(monkeypatch)
    out = base / "repo" / "dir"
    out.mkdir(parents=True, exist_ok=True)
    (out / "notes.txt").write_bytes(b"mine")
    r = ckpt("slim", TRAINER, "hf://org/repo/dir", "--base", BASE, "--overwrite", code=1)
    assert "is not an output of ckpt-tools" in r.output and "notes.txt" in r.output, r.output
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    (out / "notes.txt").unlink()
    commits = len(hub.commits)
    ckpt("extract-adapter", TRAINER, "hf://org/repo/dir", "--alpha", "16")
    ckpt("slim", TRAINER, "hf://org/repo/dir", "--base", BASE, "--overwrite")
    assert len(hub.commits) == commits + 2   # one commit each, the adapter's files deleted in the second
    got = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert is_the_slim(got, outputs, tmp_path / "got")
    upload.discard_pending()


# ------------------------------------------------------------------------------------ a 503 at each step
def _state(store, outputs, earlier: dict, tmp: Path) -> str:
    """"old" (the earlier output, every byte) or "new" (the new output complete), else what is there."""
    got = objects(store, "step")
    if got == earlier:
        return "old"
    if is_the_slim(got, outputs, tmp):
        return "new"
    return f"a mix: {sorted(got)}"


def test_a_503_at_each_write_of_an_overwrite_leaves_the_earlier_output_or_the_new_one(store, outputs, tmp_path):
    reset(store, "step", {})
    ckpt("extract-adapter", TRAINER, store.url("step"), "--alpha", "16")
    earlier = objects(store, "step")
    start = len(store.writes())
    ckpt("slim", TRAINER, store.url("step"), "--base", BASE, "--overwrite")   # the requests of one overwrite
    steps = list(dict.fromkeys(norm(w) for w in store.writes()[start:]))
    assert len(steps) >= 8, steps
    seen = {"old": 0, "new": 0}
    for i, step in enumerate(steps):
        reset(store, "step", earlier)
        store.fail(lambda req, step=step: norm(req) == step)
        r = cli("slim", TRAINER, store.url("step"), "--base", BASE, "--overwrite")
        store.fail(None)
        state = _state(store, outputs, earlier, tmp_path / f"got-{i}")
        assert state in ("old", "new"), (step, state, r.output)
        seen[state] += 1
        assert store.open_uploads() == [], step
        if r.exit_code:
            lines = r.output.strip().splitlines()
            assert len(lines) == 1 and store.url("step") in lines[0] and "503" in lines[0], (step, r.output)
            said = ("nothing was written there", "put back as it was") if state == "old" else ("complete",)
            assert any(x in lines[0] for x in said), (step, lines)
        if state == "old":
            assert r.exit_code == 1, (step, r.output)
            ckpt("verify", store.url("step"))
        if leftovers(store):   # only a cleanup that failed leaves them, and says so
            assert r.exit_code == 0 and state == "new", (step, r.output)
            assert "the cleanup could not remove" in r.output and "503" in r.output, (step, r.output)
    assert seen["old"] and seen["new"], seen


# ------------------------------------------------------------------------------------ Ctrl-C
def _interrupted(store, monkeypatch, when: str):
    """`slim --overwrite` in a child process, sent SIGINT at the first backup copy or the first deletion at
    the prefix (the commit has begun)."""
    from huggingface_hub.utils._xet import abort_xet_session
    abort_xet_session()   # this process's Xet session let go of the test CAS, which the child's must open
    gc.collect()           # (and whatever a failed upload's traceback kept of it)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_tools", "slim", str(TRAINER), store.url("int"), "--base",
                             str(BASE), "--overwrite"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    fired = []

    def hook(req):
        text = " ".join(str(x) for x in req)
        backup = "ckpt-old-" in text and not any(k in text for k in ("DELETE", "deleteFile"))
        commit = any(k in text for k in ("DELETE", "deleteFile")) and "int/" in text and "ckpt-" not in text
        if not fired and (backup if when == "backup" else commit):
            fired.append(text)
            proc.send_signal(signal.SIGINT)
            time.sleep(0.5)   # the answer arrives after the interrupt
    store.on_write(hook)
    out, _ = proc.communicate(timeout=180)
    store.on_write(None)
    return proc.returncode, out, fired


@pytest.mark.parametrize("when", ["backup", "commit"])
def test_ctrl_c_leaves_the_earlier_output_or_the_new_one_complete(store, outputs, tmp_path, monkeypatch, when):
    if store.name == "memory":
        pytest.skip("memory:// lives in one process")
    reset(store, "int", {})
    ckpt("extract-adapter", TRAINER, store.url("int"), "--alpha", "16")
    earlier = objects(store, "int")
    rc, out, fired = _interrupted(store, monkeypatch, when)
    assert fired and rc == 130, (fired, out)
    lines = [x for x in out.strip().splitlines() if x.strip()]
    got = objects(store, "int")
    if when == "backup":
        assert lines == ["interrupted: nothing was written (temporary files removed)"], out
        assert got == earlier
    else:
        assert lines == [f"interrupted: {store.url('int')} had been uploaded and committed, complete, when the "
                         "interrupt arrived"], out
        assert is_the_slim(got, outputs, tmp_path / "got")
    assert leftovers(store) == [] and store.open_uploads() == []


# ------------------------------------------------------------------------------------ credentials
def test_no_credential_in_any_object_written_nor_in_any_message(store, servers, outputs, tmp_path):
    secrets = [AWS_SECRET, GCS_TOKEN, HF_TOKEN]
    reset(store, "cred", {})
    said = [ckpt("extract-adapter", TRAINER, store.url("cred"), "--alpha", "16", "--json").output]
    said.append(ckpt("slim", TRAINER, store.url("cred"), "--base", BASE, "--overwrite", "--json").output)
    said.append(ckpt("slim", TRAINER, store.url("cred"), "--base", BASE, code=1).output)
    store.fail(lambda req: True)   # every write refused: the error message
    said.append(cli("slim", TRAINER, store.url("cred2"), "--base", BASE, "--json").output)
    store.fail(None)
    written = b"".join(store.get(k) for k in store.keys())
    assert written and said
    for s in secrets:
        assert s.encode() not in written, s
        assert not any(s in x for x in said), s


def test_set_lr_from_s3_into_gcs_streams_the_data_files_into_the_upload(servers, monkeypatch, outputs, tmp_path):
    """No server-side copy across stores: the data files are read by range and written through gcsfs, no local
    copy; the output equals a local set-lr's."""
    targets, _hub, _base = servers
    s3, gs = targets["s3"], targets["gs"]
    s3.env(monkeypatch)
    gs.env(monkeypatch)
    for p in sorted(TRAINER.iterdir()):
        s3.put(f"src/trainer/{p.name}", p.read_bytes())
    ckpt("set-lr", TRAINER, tmp_path / "lr", "--scale", "0.5")
    reset(gs, "lr", {})
    doc = json.loads(ckpt("set-lr", "s3://out/src/trainer", gs.url("lr"), "--scale", "0.5", "--json").stdout)
    (up,) = doc["remote"]["uploaded"]
    data = sum(p.stat().st_size for p in TRAINER.glob("*.distcp"))
    assert up["copied_bytes"] == 0 and up["bytes"] > data and "fetched from the inputs first" in up["method"], up
    assert digest(tree(objects(gs, "lr"), tmp_path / "got")) == digest(tmp_path / "lr")
    upload.discard_pending()


# ------------------------------------------------------------------------------------ the library
FX = TRAINER.parents[3]
PEFT = FX / "reference_peft_adapter"
BROADCAST = FX / "outputs/run_default/broadcasts/step_3"
VOLATILE = {"seconds", "free_bytes", "elapsed_s", "bytes_read"}  # the CLI sniffs its arguments first (check_roles)


def _api_cases(outputs: Path) -> dict:
    """Each api function that writes an OUT: (the call, the command's arguments, OUT where "OUT" stands)."""
    import ckpt_tools as ct
    return {
        "extract-adapter": (lambda o: ct.extract_adapter(TRAINER, o, alpha=16),
                            ("extract-adapter", TRAINER, "OUT", "--alpha", "16")),
        "slim": (lambda o: ct.slim(TRAINER, o, base=BASE), ("slim", TRAINER, "OUT", "--base", BASE)),
        "rehydrate": (lambda o: ct.rehydrate(outputs / "slim", o, base=BASE),
                      ("rehydrate", outputs / "slim", "OUT", "--base", BASE)),
        "merge": (lambda o: ct.merge(BASE, TRAINER, o, alpha=16), ("merge", BASE, TRAINER, "OUT", "--alpha", "16")),
        "export": (lambda o: ct.export(TRAINER, o, alpha=16, config_from=BASE),
                   ("export", TRAINER, "OUT", "--alpha", "16", "--config-from", BASE)),
        "set-lr": (lambda o: ct.set_lr(TRAINER, o, scale=0.5), ("set-lr", TRAINER, "OUT", "--scale", "0.5")),
        "set": (lambda o: ct.set_values(TRAINER, o, ["progress.step=7"]), ("set", TRAINER, "OUT", "progress.step=7")),
        "adapter-to-dcp": (lambda o: ct.adapter_to_dcp(PEFT, o, base=BASE, lr=1e-3, step=3),
                           ("adapter-to-dcp", PEFT, "OUT", "--base", BASE, "--lr", "1e-3", "--step", "3")),
        "fix-adapter": (lambda o: ct.fix_adapter(BROADCAST, o), ("fix-adapter", BROADCAST, "OUT")),
        "average": (lambda o: ct.average([PEFT, outputs / "adapter"], o), ("average", PEFT, outputs / "adapter", "OUT")),
        "resize-adapter": (lambda o: ct.resize_adapter(PEFT, o, rank=4), ("resize-adapter", PEFT, "OUT", "--rank", "4")),
        "restart-prep": (lambda o: ct.restart_prep(TRAINER, o, base=str(BASE), lr=5e-3),
                         ("restart-prep", TRAINER, "OUT", "--base", BASE, "--lr", "5e-3")),
    }


def _plain(doc, api: str, cli: str):
    """A JSON document with the CLI's OUT named as the api's and the timings left out."""
    if isinstance(doc, dict):
        return {k: _plain(v, api, cli) for k, v in doc.items() if k not in VOLATILE}
    if isinstance(doc, list):
        return [_plain(v, api, cli) for v in doc]
    return doc.replace(cli, api) if isinstance(doc, str) else doc


def test_every_api_function_puts_its_out_at_a_url_as_the_command_does(servers, monkeypatch, outputs, tmp_path):
    """`ckpt_tools.slim(ckpt, "s3://...")` and the rest: the objects the command's run puts there, and the
    report the command prints (its paths naming the URL); an existing OUT refused up front, as the command."""
    from ckpt_tools.cli.render import envelope
    targets, _hub, _base = servers
    s3 = targets["s3"]
    s3.env(monkeypatch)
    for name, (call, args) in _api_cases(outputs).items():
        api, cli = s3.url(f"api/{name}"), s3.url(f"cli/{name}")
        report = call(api)
        doc = json.loads(ckpt(*[cli if a == "OUT" else a for a in args], "--json").stdout)
        got, want = objects(s3, f"api/{name}"), objects(s3, f"cli/{name}")
        assert got and digest(tree(got, tmp_path / name / "api")) == digest(tree(want, tmp_path / name / "cli")), name
        mine = envelope(doc["command"], report.to_json())
        for part in ("plan", "result"):
            assert _plain(mine[part], api, cli) == _plain(doc[part], api, cli), (name, part)
        assert api in json.dumps(mine) and "ckpt-upload-" not in json.dumps(mine), name
    with pytest.raises(Exception, match="already exists"):
        _api_cases(outputs)["slim"][0](s3.url("api/slim"))
    upload.take_uploaded()


def test_an_out_at_a_url_is_checked_before_anything_is_computed_and_a_dry_run_describes_it(store, monkeypatch):
    reset(store, "early", {})
    ckpt("extract-adapter", TRAINER, store.url("early"), "--alpha", "16")
    import ckpt_tools.ops.slim as slim_op

    def never(*a, **k):
        raise AssertionError("the slim ran")
    monkeypatch.setattr(slim_op, "run_slim", never)
    r = ckpt("slim", TRAINER, store.url("early"), "--base", BASE, code=1)
    assert "already exists" in r.output
    store.put("early/notes.txt", b"mine")
    r = ckpt("slim", TRAINER, store.url("early"), "--base", BASE, "--overwrite", code=1)
    assert "holds entries it did not write: notes.txt" in r.output
    store.delete("early/notes.txt")
    doc = json.loads(ckpt("slim", TRAINER, store.url("early"), "--base", BASE, "--overwrite", "--dry-run",
                          "--json").stdout)
    out = doc["plan"]["output"]
    assert out["out"] == store.url("early") and out["exists"] is True, out
    assert out["replaces"]["command"] == "extract-adapter" and out["replaces"]["entries"] >= 2, out
    assert doc["plan"]["out"] == store.url("early"), doc["plan"]
    assert leftovers(store) == []


def test_a_503_at_the_hub_commit_leaves_the_earlier_output_in_the_repo(servers, monkeypatch, tmp_path):
    """A Hub repo takes the output in one commit: refused (503, after huggingface_hub's retries), nothing of
    it is there, the earlier output is as it was, and the error is one line naming the URL and the code."""
    _targets, hub, base = servers
    BucketTarget(hub, base).env(monkeypatch)
    _fast_client_retries(monkeypatch)
    out = base / "repo" / "r503"
    ckpt("extract-adapter", TRAINER, "hf://org/repo/r503", "--alpha", "16")
    before = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    commits = len(hub.commits)
    hub.on_preupload = lambda: hub.faults.update(status_503=100)   # the commit request and its retries
    try:
        r = cli("slim", TRAINER, "hf://org/repo/r503", "--base", BASE, "--overwrite")
    finally:
        hub.faults.clear()
        hub.on_preupload = None
    lines = r.output.strip().splitlines()
    assert r.exit_code == 1 and len(lines) == 1, r.output
    assert lines[0].startswith("error: uploading to hf://org/repo/r503 failed: the Hub answered 503 Service "
                               "Unavailable; nothing was committed there"), lines
    assert len(hub.commits) == commits
    assert {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    upload.discard_pending()


def test_no_temp_dir_is_left_by_a_command_writing_to_a_url(servers, monkeypatch, tmp_path):
    """In a process of its own with a private TMPDIR: an output put at s3://, one refused (OUT exists) and
    one whose every write is refused (503) leave nothing there (the staging dir goes, whatever happens)."""
    targets, _hub, _base = servers
    s3 = targets["s3"]
    s3.env(monkeypatch)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO), TMPDIR=str(tmp))
    reset(s3, "tmpdir", {})
    reset(s3, "tmpdir-503", {})

    def run(*argv, code):
        r = subprocess.run([sys.executable, "-m", "ckpt_tools", *map(str, argv)], env=env, capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == code, (argv, r.stdout + r.stderr)
        assert list(tmp.iterdir()) == [], (argv, list(tmp.iterdir()))
        return r

    run("extract-adapter", TRAINER, s3.url("tmpdir"), "--alpha", "16", code=0)
    assert "already exists" in run("extract-adapter", TRAINER, s3.url("tmpdir"), "--alpha", "16", code=1).stderr
    s3.fail(lambda req: True)
    try:
        r = run("extract-adapter", TRAINER, s3.url("tmpdir-503"), "--alpha", "16", code=1)
    finally:
        s3.fail(None)
    assert "503" in r.stderr and objects(s3, "tmpdir-503") == {} and s3.open_uploads() == []
