"""Common mistakes on the command line, caught from what each path is before any work starts.

`check_roles("merge", {"BASE": (base, ("hf",)), "ADAPTER": (adapter, ("peft", "dcp"))})` refuses two
arguments that each look like what the other should be: "BASE looks like a DCP checkpoint and ADAPTER
like an HF model dir: swapped?". A path that is not there, or that is neither (a hub id, say), is left
to the command's own checks, which name it.
"""
from __future__ import annotations

from pathlib import Path

from ..core.errors import UsageError
from ..formats.sniff import CHECKPOINTS, DCP, HF, PEFT, sniff

__all__ = ["KIND_NAMES", "check_roles"]

KIND_NAMES = {DCP: "a DCP checkpoint", HF: "an HF model dir", PEFT: "a PEFT adapter dir",
              CHECKPOINTS: "a prime-rl checkpoints dir"}


def _kind(path) -> str | None:
    if path is None:
        return None
    p = Path(path)
    try:
        return sniff(p) if p.exists() else None
    except OSError:
        return None


def check_roles(command: str, roles: dict[str, tuple[object, tuple[str, ...]]]) -> None:
    """Raise a UsageError when two arguments are swapped (each is what the other one expects)."""
    kinds = {label: _kind(path) for label, (path, _) in roles.items()}
    labels = list(roles)
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            ka, kb = kinds[a], kinds[b]
            if ka is None or kb is None:
                continue
            want_a, want_b = roles[a][1], roles[b][1]
            if ka not in want_a and kb not in want_b and ka in want_b and kb in want_a:
                order = " ".join(labels)
                raise UsageError(f"{a} looks like {KIND_NAMES[ka]} and {b} like {KIND_NAMES[kb]}: swapped?",
                                 hint=f"`ckpt {command}` takes {order}, {a} being "
                                      f"{' or '.join(KIND_NAMES[k] for k in want_a)}")
