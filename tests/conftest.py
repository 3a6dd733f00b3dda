from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest

# A suite started in the background by a non-interactive shell (`make test &`) inherits SIGINT ignored,
# and so would every ckpt process it starts (an ignored signal stays ignored across exec): the Ctrl-C
# tests need the terminal's default. A Python handler here is reset to the default in each child.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

REPO = Path(__file__).resolve().parents[1]
# Genuine prime-rl fixtures live in the repository (tests/fixtures/README.md says what wrote them):
# a fresh clone with nothing beside it runs the whole suite.
FIXTURES = REPO / "tests" / "fixtures"
FIXTURE = FIXTURES / "primerl-tiny"
HEAD_FIXTURES = FIXTURES / "primerl-head"
TRAINER = FIXTURE / "outputs" / "checkpoints" / "step_3" / "trainer"
BASE = FIXTURE / "base_model"

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def fixture_copy(tmp_path: Path) -> Path:
    """A writable copy of the genuine fixture's tree (for corruption tests)."""
    dst = tmp_path / "primerl-tiny"
    shutil.copytree(FIXTURE, dst)
    for p in dst.rglob("*"):
        os.chmod(p, 0o755 if p.is_dir() else 0o644)
    return dst


def json_payload(text: str):
    """The report a command printed under --json: the envelope's result, or its plan in a dry run
    (docs/json.md). The envelope itself is checked against its schema in tests/test_json_envelope.py."""
    import json
    doc = json.loads(text)
    assert doc["schema"] == "ckpt/1", doc
    return doc["result"] if doc["result"] is not None else doc["plan"]


def pytest_report_header(config):
    """Which path the run tests: the C fast paths, or the Python/torch ones alone (CKPT_TOOLS_PURE_PYTHON=1)."""
    from ckpt_tools.io import pickle_scan
    from ckpt_tools.sources import compare
    state = {True: "loaded", False: "not loaded"}
    return (f"ckpt_tools C fast paths: pickle_scan_c {state[pickle_scan.accelerator is not None]}, "
            f"delta_stats_c {state[compare.accelerator is not None]}")


def write_sharded_base(d: Path) -> Path:
    """The tiny base model in 3 shards + index at the new dir `d`, written by huggingface_hub's sharded
    writer (a pristine sharded HF dir for the verify and HF-check tests to damage)."""
    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import load_file

    d.mkdir()
    save_torch_state_dict(load_file(str(BASE / "model.safetensors")), str(d), max_shard_size="200KB")
    shutil.copy(BASE / "config.json", d / "config.json")
    return d
