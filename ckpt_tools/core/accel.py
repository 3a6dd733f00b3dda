"""Whether the optional C fast paths may load.

Both compiled parts (`io/pickle_scan_c.c`, `sources/delta_stats_c.c`) are fast paths of a Python (or
torch) reference that gives the same verdicts and figures. `CKPT_TOOLS_PURE_PYTHON=1` loads neither:
for a machine where a built extension is suspect, and for CI, which runs the suite a second time that
way so the fallbacks stay tested.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

__all__ = ["PURE_PYTHON_ENV", "load_accelerator", "pure_python"]

PURE_PYTHON_ENV = "CKPT_TOOLS_PURE_PYTHON"


def pure_python() -> bool:
    """True when the user asked for the Python paths alone (any value but empty or "0")."""
    return os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0")


def load_accelerator(module: str) -> ModuleType | None:
    """The compiled module `module` (absolute name), or None: not built (installed without a C
    compiler) or turned off by CKPT_TOOLS_PURE_PYTHON."""
    if pure_python():
        return None
    try:
        return importlib.import_module(module)
    except ImportError:
        return None
