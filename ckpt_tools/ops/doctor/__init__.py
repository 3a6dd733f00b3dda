"""`ckpt doctor`: a prime-rl run's config and disk traps, found before they cost hours. `run` gathers
the facts (`facts`) and runs the traps (`traps`, one small function per trap in `traps_config` and
`traps_run`, over plain facts).

`run` is imported on first use of one of its names, not with the package: `facts` and `traps` are
torch-free, so `ckpt doctor --help` (whose --decode-rate default is `facts.DEFAULT_DECODE_RATE`) never
imports torch (tests/test_startup.py)."""

from __future__ import annotations

import importlib

__all__ = [
    "EXIT_CLEAN",
    "EXIT_PROBLEMS",
    "DoctorOptions",
    "DoctorPlan",
    "DoctorReport",
    "doctor",
    "plan_doctor",
    "run_doctor",
]


def __getattr__(name: str):
    if name in __all__:
        return getattr(importlib.import_module(f"{__name__}.run"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
