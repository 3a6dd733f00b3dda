"""Shared by the bench scripts: write a results block into docs/benchmarks.md between markers."""
from __future__ import annotations

from pathlib import Path


def record_section(doc: Path, body: str, begin: str, end: str, heading: str) -> None:
    """Replace the text between `begin` and `end` in `doc`; append a new `heading` section with the
    markers when they are absent."""
    text = doc.read_text() if doc.exists() else "# Benchmarks\n"
    block = f"{begin}\n{body}\n{end}"
    if begin in text and end in text:
        pre, rest = text.split(begin, 1)
        text = pre + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + f"\n\n## {heading}\n\n" + block + "\n"
    doc.write_text(text)
