"""What simulated users played: each turn, the tally per specialist, and the table of it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from uuid import UUID

from rich.table import Table


@dataclass(frozen=True)
class PlayedTurn:
    """One task asked once. ``error`` is the code of the error frame that ended the turn (or
    its feedback); ``rate_limited`` counts the times it was told to wait first."""

    index: int
    task_id: str
    specialist: str
    turn_id: UUID | None = None
    answer: str | None = None
    passed: bool = False
    feedback: Literal["up", "edit"] | None = None
    latency_ms: float | None = None
    error: str | None = None
    rate_limited: int = 0


@dataclass
class SpecialistStats:
    """Turns of one specialist: ``answered`` completed, ``passed`` of those were right."""

    turns: int = 0
    answered: int = 0
    passed: int = 0
    ups: int = 0
    edits: int = 0
    errors: int = 0
    latency_ms_total: float = 0.0

    def add(self, turn: PlayedTurn) -> None:
        self.turns += 1
        self.errors += turn.error is not None
        self.ups += turn.feedback == "up"
        self.edits += turn.feedback == "edit"
        if turn.latency_ms is not None and turn.answer is not None:
            self.answered += 1
            self.passed += turn.passed
            self.latency_ms_total += turn.latency_ms

    @property
    def pass_rate(self) -> float:
        return self.passed / self.answered if self.answered else 0.0

    @property
    def mean_latency_ms(self) -> float:
        return self.latency_ms_total / self.answered if self.answered else 0.0


@dataclass(frozen=True)
class SimulationReport:
    turns: list[PlayedTurn]
    seconds: float

    def by_specialist(self) -> dict[str, SpecialistStats]:
        stats: dict[str, SpecialistStats] = {}
        for turn in self.turns:
            stats.setdefault(turn.specialist, SpecialistStats()).add(turn)
        return dict(sorted(stats.items()))

    def total(self) -> SpecialistStats:
        stats = SpecialistStats()
        for turn in self.turns:
            stats.add(turn)
        return stats

    @property
    def rate_limited(self) -> int:
        return sum(turn.rate_limited for turn in self.turns)


def report_table(report: SimulationReport, title: str = "simulated users") -> Table:
    table = Table(
        title=title,
        caption=f"{len(report.turns)} turns in {report.seconds:.1f} s; "
        f"told to wait {report.rate_limited} times (rate_limited)",
    )
    for column in ("specialist", "turns", "pass rate", "ups", "edits", "errors", "mean latency"):
        table.add_column(column, justify="left" if column == "specialist" else "right")
    rows = list(report.by_specialist().items())
    if len(rows) > 1:
        rows.append(("all", report.total()))
    for name, s in rows:
        table.add_row(
            name,
            str(s.turns),
            f"{s.pass_rate:.1%}",
            str(s.ups),
            str(s.edits),
            str(s.errors),
            f"{s.mean_latency_ms:.0f} ms",
        )
    return table
