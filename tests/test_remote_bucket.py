"""OUT to a Hugging Face bucket, `hf://buckets/NS/NAME/PATH` (docs/remote.md, io/upload_bucket.py), against
the test Hub (tests/remote_servers.HubServer) with a real Xet CAS behind it: huggingface_hub's
`batch_bucket_files` asks the Hub for a xet write token, whose `casUrl: local://DIR` makes hf_xet upload into
xet-core's own local CAS; the Hub's batch endpoint then reconstructs each file from the CAS by its Xet hash.

Each output uploaded this way equals the local run's, byte for byte as the CAS gives it back; a slim in a
bucket rehydrates to the local round trip's checkpoint; the files appear under PATH only after every file
was uploaded, the data files before the marker files; Ctrl-C during the upload leaves nothing (and no
staged file), Ctrl-C once the commit has begun is held until the output is complete; a commit the Hub
refuses leaves nothing under PATH; `gc --slim-to hf://buckets/...` uploads each slim before freeing."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

pytest.importorskip("hf_xet")
pytest.importorskip("fsspec")

from ckpt_tools.cli import main  # noqa: E402
from ckpt_tools.io import remote, upload  # noqa: E402
from ckpt_tools.io.owned import OUTPUT_MARKER  # noqa: E402
from ckpt_tools.io.upload import COMMIT_LAST  # noqa: E402

from .remote_servers import HubServer  # noqa: E402
from .test_remote import BASE, REPO, TRAINER, assert_one_interrupt_line, ckpt, digest, local  # noqa: E402,F401

BUCKET = "org/out"


@pytest.fixture(scope="module")
def bucket_hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("bucket")
    srv = HubServer({}, buckets={BUCKET: root})
    srv.root = root
    yield srv
    srv.close()


@pytest.fixture()
def hub(bucket_hub, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", bucket_hub.url)
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    monkeypatch.setenv("CKPT_REMOTE_BACKOFF", "0.05")
    bucket_hub.batches.clear()
    yield bucket_hub
    bucket_hub.on_xet_token = bucket_hub.on_batch = bucket_hub.fail_batch_op = None
    upload.discard_pending()


def files_under(root: Path, prefix: str) -> list[str]:
    base = root / prefix
    return sorted(p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file()) if base.exists() else []


def same_bytes(a: Path, b: Path) -> None:
    names = files_under(a, "")
    assert names == files_under(b, ""), (names, files_under(b, ""))
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n


def leftovers(root: Path) -> list[str]:
    """Staging and backup files left in the bucket (`.NAME.ckpt-tmp-*/`, `.NAME.ckpt-old-*/`)."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if ".ckpt-tmp-" in str(p) or ".ckpt-old-" in str(p))


def assert_staged_then_placed(batches: list[list[dict]], prefix: str) -> None:
    """The order a reader relies on: every file added under the staging prefix beside PATH first (nothing
    under PATH), then the ownership marker, then the files copied into PATH, every data file before any
    marker file, the ownership marker last; the staging prefix deleted last."""
    staging = f".{prefix}.ckpt-tmp-"
    assert {op["type"] for op in batches[0]} == {"addFile"} and all(op["path"].startswith(staging) for op in batches[0])
    assert [(op["type"], op["path"]) for op in batches[1]] == [("addFile", f"{prefix}/{OUTPUT_MARKER}")]
    copies = [op["path"] for b in batches for op in b if op["type"] == "copyFile"]
    assert copies and all(p.startswith(prefix + "/") for p in copies)
    assert copies[-1] == f"{prefix}/{OUTPUT_MARKER}"
    first_marker = next(i for i, p in enumerate(copies) if p.rsplit("/", 1)[-1] in COMMIT_LAST)
    assert all(p.rsplit("/", 1)[-1] in (*COMMIT_LAST, OUTPUT_MARKER) for p in copies[first_marker:]), copies
    last = batches[-1]
    assert {op["type"] for op in last} == {"deleteFile"} and all(op["path"].startswith(staging) for op in last)
    assert len(last) == len(batches[0])


def test_slim_to_a_bucket_then_rehydrate_from_it_equals_the_local_round_trip(hub, local, tmp_path):
    ckpt("slim", TRAINER, f"hf://buckets/{BUCKET}/slim-3", "--base", BASE)
    assert digest(hub.root / "slim-3") == digest(local["dir"] / "slim")
    assert leftovers(hub.root) == []
    assert_staged_then_placed(hub.batches, "slim-3")
    ckpt("rehydrate", f"hf://buckets/{BUCKET}/slim-3", tmp_path / "full", "--base", BASE)
    assert digest(tmp_path / "full") == digest(local["dir"] / "full")

    r = ckpt("slim", TRAINER, f"hf://buckets/{BUCKET}/slim-3", "--base", BASE, code=1)
    assert "already exists" in r.output and "--overwrite" in r.output, r.output
    assert digest(hub.root / "slim-3") == digest(local["dir"] / "slim")


def test_extract_adapter_and_merge_to_a_bucket_equal_the_local_outputs_byte_for_byte(hub, local, tmp_path):
    r = json.loads(ckpt("extract-adapter", TRAINER, f"hf://buckets/{BUCKET}/adapter", "--alpha", "16",
                        "--json").stdout)
    up = r["remote"]["uploaded"]
    assert up and up[0]["url"] == f"hf://buckets/{BUCKET}/adapter", r
    ckpt("merge", BASE, TRAINER, f"hf://buckets/{BUCKET}/merged", "--alpha", "16")
    local_adapter, local_merged = tmp_path / "adapter", tmp_path / "merged"
    ckpt("extract-adapter", TRAINER, local_adapter, "--alpha", "16")
    ckpt("merge", BASE, TRAINER, local_merged, "--alpha", "16")
    same_bytes(hub.root / "adapter", local_adapter)
    same_bytes(hub.root / "merged", local_merged)
    # and what the Hub serves back for it, read as a remote input, merges the same
    ckpt("merge", BASE, f"hf://buckets/{BUCKET}/adapter", tmp_path / "from-bucket")
    ckpt("merge", BASE, local_adapter, tmp_path / "from-local")
    same_bytes(tmp_path / "from-bucket", tmp_path / "from-local")


def test_overwrite_replaces_the_output_markers_removed_first_and_stale_files_after(hub, tmp_path):
    ckpt("extract-adapter", TRAINER, f"hf://buckets/{BUCKET}/over", "--alpha", "16")
    assert "adapter_config.json" in files_under(hub.root, "over")
    hub.batches.clear()
    ckpt("slim", TRAINER, f"hf://buckets/{BUCKET}/over", "--base", BASE, "--overwrite")
    ckpt("slim", TRAINER, tmp_path / "slim", "--base", BASE)
    assert digest(hub.root / "over") == digest(tmp_path / "slim")  # no file of the adapter is left
    assert leftovers(hub.root) == []
    ops = [(op["type"], op["path"]) for b in hub.batches for op in b]
    into = [i for i, (t, p) in enumerate(ops) if t == "copyFile" and p.startswith("over/")]
    # the old marker files were backed up, then deleted before anything was copied into place
    backed = [i for i, (t, p) in enumerate(ops) if t == "copyFile" and p.startswith(".over.ckpt-old-")]
    assert any(ops[i][1].endswith("/adapter_config.json") for i in backed)
    gone = ops.index(("deleteFile", "over/adapter_config.json"))
    assert max(backed) < gone < into[0]
    # then the old files the new output does not hold, before anything of it was put in place
    stale = ops.index(("deleteFile", "over/adapter_model.safetensors"))
    assert gone < stale < into[0]


def _run_cli_interrupted(hub, out_url: str, when: str):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "ckpt_tools", "slim", str(TRAINER), out_url, "--base", str(BASE)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def interrupt(*_):
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)   # the answer arrives after the interrupt
    if when == "upload":
        hub.on_xet_token = interrupt
    else:   # the first batch that copies into place: the commit has begun
        hub.on_batch = None

        def arm(ops):
            if any(op["type"] == "copyFile" for op in ops):
                interrupt()
            else:
                hub.on_batch = arm
        hub.on_batch = arm
    out, _ = proc.communicate(timeout=180)
    return proc.returncode, out


def test_ctrl_c_during_the_upload_commits_nothing(hub):
    rc, out = _run_cli_interrupted(hub, f"hf://buckets/{BUCKET}/int-upload", "upload")
    assert rc == 130, out
    assert hub.on_xet_token is None   # it was interrupted there
    assert_one_interrupt_line(out)
    assert files_under(hub.root, "int-upload") == [] and leftovers(hub.root) == []
    assert not any(op["type"] == "copyFile" for b in hub.batches for op in b)


def test_ctrl_c_once_the_commit_began_is_held_until_the_output_is_complete(hub, tmp_path):
    rc, out = _run_cli_interrupted(hub, f"hf://buckets/{BUCKET}/int-commit", "commit")
    assert rc == 130, out
    lines = [x for x in out.strip().splitlines() if x.strip()]
    assert lines == [f"interrupted: hf://buckets/{BUCKET}/int-commit had been uploaded and committed, complete, "
                     "when the interrupt arrived"], out
    ckpt("slim", TRAINER, tmp_path / "slim", "--base", BASE)
    assert digest(hub.root / "int-commit") == digest(tmp_path / "slim")
    assert leftovers(hub.root) == []


def test_a_commit_the_hub_refuses_leaves_nothing_under_the_path(hub):
    hub.fail_batch_op = lambda op: ("storage quota exceeded" if op["type"] == "copyFile"
                                    and op["path"].endswith("/.metadata") else None)
    r = ckpt("slim", TRAINER, f"hf://buckets/{BUCKET}/refused", "--base", BASE, code=1)
    lines = r.output.strip().splitlines()
    assert lines == [f"error: uploading to hf://buckets/{BUCKET}/refused failed: the Hub answered storage quota "
                     "exceeded to copy refused/.metadata; nothing is left there (rerun when the store answers)"], r.output
    assert files_under(hub.root, "refused") == [] and leftovers(hub.root) == []
    # the data files had been copied before the marker failed: they were removed, not left as half an output
    assert any(op["type"] == "copyFile" and op["path"].endswith(".distcp") for b in hub.batches for op in b)


def test_a_missing_bucket_no_path_inside_or_a_refused_token_is_one_line_and_nothing_is_uploaded(hub):
    r = ckpt("slim", TRAINER, "hf://buckets/org/nothing/slim", "--base", BASE, code=2)
    assert "the bucket does not exist" in r.output and "hf buckets create org/nothing" in r.output, r.output
    r = ckpt("slim", TRAINER, f"hf://buckets/{BUCKET}", "--base", BASE, code=2)
    assert "name a folder inside the bucket" in r.output, r.output
    hub.faults["require_token"] = "hf_right"   # HF_TOKEN is another one
    try:
        r = ckpt("slim", TRAINER, f"hf://buckets/{BUCKET}/denied", "--base", BASE, code=2)
    finally:
        hub.faults.clear()
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "refused access" in lines[0] and "HF_TOKEN" in lines[0], r.output
    assert hub.batches == [] and files_under(hub.root, "denied") == []


def test_gc_slim_to_a_bucket_uploads_each_slim_and_it_rehydrates_bit_exactly(hub, tmp_path):
    from .test_gc import make_run
    from .test_slim_rehydrate import assert_bit_equal_checkpoints
    ck = make_run(tmp_path / "run", steps=(1, 2, 3))
    originals = tmp_path / "originals"
    shutil.copytree(ck, originals)
    r = CliRunner().invoke(main, ["gc", str(ck), "--keep-full", "1", "--slim-to", f"hf://buckets/{BUCKET}/gc-run",
                                  "--json"])
    upload.discard_pending()
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["result"]["slimmed"] == [1, 2]
    for n in (1, 2):
        step = next(s for s in doc["result"]["steps"] if s["step"] == n)
        assert step["uploaded"]["url"] == f"hf://buckets/{BUCKET}/gc-run/step_{n}/trainer", step
        same_bytes(hub.root / "gc-run" / f"step_{n}" / "trainer", ck / f"step_{n}" / "trainer")
        out = tmp_path / "rehydrated" / f"step_{n}"
        ckpt("rehydrate", f"hf://buckets/{BUCKET}/gc-run/step_{n}/trainer", out, "--base",
             tmp_path / "run" / "base_model")
        assert_bit_equal_checkpoints(originals / f"step_{n}" / "trainer", out)
    assert files_under(hub.root, "gc-run/step_3") == [] and leftovers(hub.root) == []


def test_signals_deferred_holds_a_ctrl_c_that_another_thread_receives():
    """A signal sent to the process while the main thread holds it may be taken by a thread that does not
    block it (hf_xet's and HTTP clients' workers): it is still held until the block ends."""
    code = textwrap.dedent("""
        import os, signal, threading, time
        from ckpt_tools.io.signals import signals_deferred
        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()   # a thread that does not block SIGINT
        try:
            with signals_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                t = time.time()
                while time.time() - t < 0.5:
                    sum(range(100))
                print("held")
        except KeyboardInterrupt:
            print("delivered after")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.stdout.split() == ["held", "delivered", "after"], (out.stdout, out.stderr)


def test_set_lr_from_a_bucket_into_a_bucket_copies_the_data_files_by_xet_hash(hub, tmp_path):
    """set-lr keeps the input's data files unchanged: from one bucket into another (or the same) the Hub copies
    them by Xet hash, server-side; nothing of them is fetched or sent, and the files equal a local set-lr's."""
    ckpt("set-lr", TRAINER, tmp_path / "lr1", "--scale", "0.5")
    ckpt("set-lr", tmp_path / "lr1", tmp_path / "lr2", "--scale", "0.5")
    ckpt("set-lr", TRAINER, f"hf://buckets/{BUCKET}/lr1", "--scale", "0.5")
    r = ckpt("set-lr", f"hf://buckets/{BUCKET}/lr1", f"hf://buckets/{BUCKET}/lr2", "--scale", "0.5", "--json")
    assert digest(hub.root / "lr2") == digest(tmp_path / "lr2")
    (up,) = json.loads(r.stdout)["remote"]["uploaded"]
    data = sum(p.stat().st_size for p in TRAINER.glob("*.distcp"))
    assert "4 file(s) copied server-side (by Xet hash)" in up["method"] and up["copied_bytes"] == data, up
    assert up["bytes"] < data / 10, up
