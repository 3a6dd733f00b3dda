"""The compiled parts, each an optional fast path of a Python (or torch) reference:

- `ckpt_tools/io/pickle_scan_c.c`: the pickle bounds scan's fast path;
- `ckpt_tools/sources/delta_stats_c.c`: one chunk's statistics of W - W0 in one pass, GIL released
  (`sources/compare.py: chunk_stats`). IEEE semantics are part of its answer: no -ffast-math, and
  -ffp-contract=off so that no compiler or -march fuses b*b + acc into an FMA (the sums' bits must
  not depend on how it was built);
- `ckpt_tools/core/fp8_error_c.c`: an FP8 row block's quantization error in one pass, GIL released
  (`core/fp8.py: error_sq`; the codes themselves are always torch's cast), built with the same flags.

Everything else is in pyproject.toml. The extensions are optional: where no C compiler is at hand
the install still succeeds and `io.pickle_scan` runs its Python reference scan alone, `sources.compare`
its torch statistics, `core.fp8` its torch and numpy error figure (same verdicts and figures, slower;
tests/test_pickle_scan.py, tests/test_delta_stats_c.py and tests/test_fp8_error_c.py say which one ran).
"""
from setuptools import Extension, setup

setup(ext_modules=[
    Extension("ckpt_tools.io.pickle_scan_c", ["ckpt_tools/io/pickle_scan_c.c"], optional=True),
    Extension("ckpt_tools.sources.delta_stats_c", ["ckpt_tools/sources/delta_stats_c.c"], optional=True,
              extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math"]),
    Extension("ckpt_tools.core.fp8_error_c", ["ckpt_tools/core/fp8_error_c.c"], optional=True,
              extra_compile_args=["-O3", "-ffp-contract=off", "-fno-fast-math"]),
])
