"""ckpt-tools: LoRA merge and checkpoint surgery for prime-rl DCP checkpoints.

The operations are functions of this package (docs/api.md), one per command: `ckpt_tools.merge(...)`,
`.inspect`, `.open`, `.extract_adapter`, `.export`, `.diff_vs_base`, `.verify`, `.slim`, `.rehydrate`,
`.set_lr`, `.set_values`, `.adapter_to_dcp`, `.fix_adapter`, `.restart_prep`, `.gc`, `.doctor`, `.average`,
`.resize_adapter`, `.report`, each returning its typed report (with `to_json()`). They are loaded on first
use (`ckpt_tools.api`), so `import ckpt_tools` and `ckpt --version` stay instant (no torch). `__version__`
is the installed package's (pyproject.toml's, read from its metadata).
"""

__all__ = [
    "__version__",
    "adapter_to_dcp",
    "average",
    "diff_vs_base",
    "doctor",
    "export",
    "extract_adapter",
    "fix_adapter",
    "gc",
    "inspect",
    "merge",
    "open",
    "rehydrate",
    "report",
    "resize_adapter",
    "restart_prep",
    "set_lr",
    "set_values",
    "slim",
    "verify",
]

_API = frozenset(__all__) - {"__version__"}


def _hold_signals_for_main():
    """`python -m ckpt_tools` imports this package first: Ctrl-C and SIGTERM are held from here (a
    Ctrl-C in the first instants printed a traceback), for `__main__` and `entry.main` to release once
    the CLI is imported (entry.py). Only then: while runpy locates `ckpt_tools` itself (`sys.argv[0]` is
    `-m` during that); any other import of the package changes nothing. The mask found before, or None."""
    import sys

    argv = getattr(sys, "orig_argv", [])
    if sys.argv[:1] != ["-m"] or "-m" not in argv or argv[argv.index("-m") + 1 :][:1] != ["ckpt_tools"]:
        return None
    import _signal

    return _signal.pthread_sigmask(_signal.SIG_BLOCK, {_signal.SIGINT, _signal.SIGTERM})


startup_signal_mask = _hold_signals_for_main()


def __getattr__(name: str):
    if name == "__version__":
        from .io.owned import tool_version

        return tool_version()
    # lazy: the operations import torch (2-3 s); `ckpt --version` and the metadata commands import this
    # package and must not pay for it
    if name in _API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'ckpt_tools' has no attribute {name!r}")
