"""`import ckpt_tools` exposes the operations with typed results; docs/api.md's examples run as written."""
from __future__ import annotations

import re
import subprocess
import sys

import ckpt_tools

from .conftest import REPO


def test_the_package_exports_every_operation_and_importing_it_needs_no_torch():
    assert set(ckpt_tools.__all__) == {"__version__", "open", "inspect", "extract_adapter", "merge", "diff_vs_base",
                                       "verify", "slim", "rehydrate", "set_lr", "report"}
    from ckpt_tools import api
    assert set(ckpt_tools.__all__) - {"__version__"} <= set(api.__all__)
    for name in set(ckpt_tools.__all__) - {"__version__"}:
        fn = getattr(ckpt_tools, name)
        assert callable(fn) and fn.__doc__ and "return" in fn.__annotations__, name
    r = subprocess.run([sys.executable, "-c", "import sys, ckpt_tools; ckpt_tools.__version__; "
                        "assert 'torch' not in sys.modules"], cwd=REPO, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_docs_api_examples_run_as_written():
    text = (REPO / "docs" / "api.md").read_text()
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
    assert len(blocks) >= 4
    r = subprocess.run([sys.executable, "-c", "\n".join(blocks)], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    out = r.stdout.splitlines()
    assert out[0] == "3 0.01 8 16.0" and out[1] == "(8, 64) torch.float32"
    assert out[2] == "21 16.0" and out[3].startswith("21 {'merge': 21, 'copy': 15")
    assert out[4] == "True"
    assert out[5] == "1 already exists pass --overwrite to replace it, or another output path"
