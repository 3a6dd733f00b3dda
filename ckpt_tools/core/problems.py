"""Problems found in a file, listed rather than raised (pure): one `Problem(file, key, message)` per
problem, warnings alike, and what was checked. `ckpt verify` reports them; the checks themselves live
with their formats (`formats.dcp.checks`, ...), which fill a `VerifyReport`; nothing there raises on a
malformed input: a problem it cannot even describe is reported as "cannot check: ..."."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = [
    "PROBLEM",
    "UNSUPPORTED",
    "WARNING",
    "Finding",
    "Problem",
    "VerifyReport",
    "first_fatal",
    "group_problems",
]

PROBLEM, WARNING, UNSUPPORTED = (
    "problem",
    "warning",
    "unsupported",
)  # unsupported: readable by torch, not by us


@dataclass(frozen=True)
class Finding:
    """One broken rule of a format, found by the format's one check of it (`formats.dcp.model.parse_metadata`,
    `formats.hf_dir.checks.check_index`): `ckpt verify` lists every finding, the format's open raises the
    first fatal one (`first_fatal`). `file` is as the format names it (DCP: a data file relative to the
    checkpoint, None for `.metadata`; HF: the file's path). `error`: the exact error an open raises for it,
    where the format keeps one (the reader's own, or a one-line refusal grouping a rule's findings)."""

    file: str | None
    key: str | None
    message: str
    severity: str = PROBLEM
    hint: str | None = None
    error: BaseException | None = field(default=None, compare=False, repr=False)


def first_fatal(findings) -> Finding | None:
    """The first finding that makes the input unreadable here (warnings are not)."""
    return next((f for f in findings if f.severity in (PROBLEM, UNSUPPORTED)), None)


@dataclass(frozen=True)
class Problem:
    file: str
    key: str | None
    message: str

    def render(self) -> str:
        where = self.file + (f", key {self.key!r}" if self.key else "")
        return f"{where}: {self.message}"


@dataclass
class VerifyReport:
    path: str
    format: str
    deep: bool
    problems: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)
    checked: dict = field(default_factory=dict)
    # what the checks prove about the bytes: {"proven": bool, "by": [digest sources] or None, "statement"}
    integrity: dict | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def problem(self, file, key: str | None, message: str) -> None:
        self.problems.append(Problem(str(file), key, message))

    def warn(self, file, key: str | None, message: str) -> None:
        self.warnings.append(Problem(str(file), key, message))

    def to_json(self) -> dict:
        return {
            "path": self.path,
            "format": self.format,
            "deep": self.deep,
            "ok": self.ok,
            "problems": [asdict(p) for p in self.problems],
            "warnings": [asdict(w) for w in self.warnings],
            "checked": self.checked,
            "integrity": self.integrity,
        }


def group_problems(problems, min_group: int = 4, examples: int = 3) -> list[str]:
    """Problems as lines for people: the same message about many keys of one file is one line
    ("42 keys: key maps to no LoRA module ... (e.g. 'a', 'b', 'c')"), in first-seen order; the
    JSON report keeps every problem."""
    groups: dict[tuple[str, str], list] = {}
    for p in problems:
        groups.setdefault((p.file, p.message), []).append(p)
    lines = []
    for (file, message), ps in groups.items():
        keys = [p.key for p in ps if p.key]
        if len(keys) >= min_group:
            shown = ", ".join(repr(k) for k in keys[:examples])
            lines.append(f"{file}: {len(keys)} keys: {message} (e.g. {shown}; --json lists all)")
        else:
            lines += [p.render() for p in ps]
    return lines
