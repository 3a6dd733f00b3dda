"""How a URL's local stand-ins are shown: every message and report names the URL, never the shadow tree
or staging dir that stands for it locally (`io.remote` mounts inputs, `io.upload` stages outputs)."""

from __future__ import annotations

import os

__all__ = ["add_display", "clear_display", "display"]

_DISPLAY: dict[str, str] = {}  # a local stand-in path -> the URL shown for it


def add_display(local, url_text: str) -> None:
    """Show `local` (a shadow tree, a staged output) as `url_text` in messages and reports."""
    _DISPLAY[str(local)] = url_text
    real = os.path.realpath(local)
    if real != str(local):
        _DISPLAY[real] = url_text


def display(text):
    """`text` (a string, or a JSON-able structure of them) with every local stand-in path shown as the
    URL it stands for (errors, reports)."""
    if not _DISPLAY:
        return text
    if isinstance(text, dict):
        return {k: display(v) for k, v in text.items()}
    if isinstance(text, (list, tuple)):
        return type(text)(display(v) for v in text)
    if not isinstance(text, str):
        return text
    for local in sorted(_DISPLAY, key=len, reverse=True):
        if local in text:
            text = text.replace(local, _DISPLAY[local])
    return text


def clear_display() -> None:
    """Forget every stand-in (`io.remote.reset`)."""
    _DISPLAY.clear()
