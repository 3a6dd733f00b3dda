"""A dry run's report: the op's report (its plan, no result) and what writing OUT would do."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["DryRunReport", "PlannedReport"]


class PlannedReport(Protocol):
    """What every op's report offers: its plan, its result (None in a dry run) and the JSON of both."""

    @property
    def plan(self) -> Any: ...

    def to_json(self) -> dict: ...


@dataclass(frozen=True)
class DryRunReport:
    """A dry run's `report` with what writing OUT would do (`io.staging.describe_output`, which refuses
    the OUTs the real run refuses): its JSON plan gains `output` = {"out", "exists", "replaces"}. `.plan`
    is the report's plan; `.result` is None (nothing ran)."""

    report: PlannedReport
    output: dict | None

    @property
    def plan(self) -> Any:
        return self.report.plan

    @property
    def result(self) -> None:
        return None

    def to_json(self) -> dict:
        d = self.report.to_json()
        if self.output is None:
            return d
        if isinstance(d.get("plan"), dict):
            return {**d, "plan": {**d["plan"], "output": self.output}}
        return {**d, "output": self.output}
