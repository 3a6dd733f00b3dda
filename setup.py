"""The one compiled part: the pickle bounds scan's fast path (ckpt_tools/io/pickle_scan_c.c).

Everything else is in pyproject.toml. The extension is optional: where no C compiler is at hand the
install still succeeds and `io.pickle_scan` runs its Python reference scan alone (same verdicts,
slower on big `.metadata` files; tests/test_pickle_scan.py says which one ran).
"""
from setuptools import Extension, setup

setup(ext_modules=[Extension("ckpt_tools.io.pickle_scan_c", ["ckpt_tools/io/pickle_scan_c.c"], optional=True)])
