"""How an output bound for a URL is shown: every message and report names the URL, never the local
staging dir that stands for it until it is put there (`io.upload`). Inputs need none of this: a URL
input is a `RemotePath`, whose str is the URL without its credentials."""

from __future__ import annotations

import os

__all__ = ["add_display", "display"]

_DISPLAY: dict[str, str] = {}  # a local staging path -> the URL shown for it


def add_display(local, url_text: str) -> None:
    """Show `local` (a staged output) as `url_text` in messages and reports."""
    _DISPLAY[str(local)] = url_text
    real = os.path.realpath(local)
    if real != str(local):
        _DISPLAY[real] = url_text


def display(text):
    """`text` (a string, or a JSON-able structure of them) with every staged output's local path shown
    as the URL it is bound for (errors, reports)."""
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
