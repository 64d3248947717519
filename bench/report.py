"""The benchmark table: printed for people, written as JSON rows for tools.

Each row is ``{name, value, unit, baseline, ratio, target, met}``: ``ratio`` is value over the
baseline measured in the same run; ``target`` is written as the issue names it:
``">= 3x"`` bounds the ratio, ``">= 90 %"`` or ``"<= 15 ms"`` bound the value itself, and
``"report"`` has no bound (``met`` is null).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

RESULTS = Path(__file__).resolve().parent / "results"
_TARGET = re.compile(r"^(>=|<=) ([0-9.]+)(x| .+)$")


@dataclass(frozen=True)
class Row:
    name: str
    value: float
    unit: str
    baseline: float
    ratio: float
    target: str
    met: bool | None


def row(name: str, value: float, unit: str, baseline: float, target: str) -> Row:
    ratio = value / baseline if baseline else 0.0
    met: bool | None = None
    if target != "report":
        match = _TARGET.match(target)
        if match is None:
            raise ValueError(f"target {target!r} is not '>= Nx', '>= N unit', '<= N unit'")
        bound = float(match[2])
        measured = ratio if match[3] == "x" else value
        met = measured >= bound if match[1] == ">=" else measured <= bound
    return Row(name, round(value, 2), unit, round(baseline, 2), round(ratio, 3), target, met)


def report(bench: str, rows: list[Row], results: Path = RESULTS) -> Path:
    table = Table(title=f"bench/{bench}.py")
    for column in ("name", "value", "unit", "baseline", "ratio", "target", "met"):
        table.add_column(column, justify="left" if column in {"name", "unit"} else "right")
    for r in rows:
        met = "-" if r.met is None else ("yes" if r.met else "NO")
        table.add_row(
            r.name, f"{r.value:,.2f}", r.unit, f"{r.baseline:,.2f}", f"{r.ratio:.3f}", r.target, met
        )
    Console(width=140).print(table)
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{bench}.json"
    path.write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    return path
