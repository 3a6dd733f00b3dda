from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

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
