"""The benchmark table: printed for people, written as JSON rows for tools."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Row:
    name: str
    value: float
    unit: str
    baseline: float
    ratio: float
    target: float
    met: bool


def row(name: str, value: float, unit: str, baseline: float, target: float) -> Row:
    """``ratio`` is value over the baseline measured in the same run; met is ratio >= target."""
    ratio = value / baseline if baseline else 0.0
    return Row(
        name, round(value, 1), unit, round(baseline, 1), round(ratio, 3), target, ratio >= target
    )


def report(bench: str, rows: list[Row]) -> Path:
    table = Table(title=f"bench/{bench}.py")
    for column in ("name", "value", "unit", "baseline", "ratio", "target", "met"):
        table.add_column(column, justify="left" if column in {"name", "unit"} else "right")
    for r in rows:
        table.add_row(
            r.name,
            f"{r.value:,.1f}",
            r.unit,
            f"{r.baseline:,.1f}",
            f"{r.ratio:.3f}",
            f">= {r.target}",
            "yes" if r.met else "NO",
        )
    Console().print(table)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{bench}.json"
    path.write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    return path
