"""A demo's outputs: ``demo.json``, the ``demo.png`` chart and the tables printed as it runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

from matplotlib.figure import Figure
from rich.table import Table

from macaron.demo.records import DemoReport, GenerationRecord


def write_outputs(report: DemoReport, out_dir: Path) -> tuple[Path, Path]:
    """``demo.json`` (every record) and ``demo.png`` (contract score per suite per generation)."""
    data, chart = out_dir / "demo.json", out_dir / "demo.png"
    data.write_text(json.dumps(report.as_json(), indent=2) + "\n", encoding="utf-8")
    plot_scores(report, chart)
    return data, chart


def plot_scores(report: DemoReport, path: Path) -> None:
    """One line per contract suite; the x axis names the runs each generation promoted."""
    figure = Figure(figsize=(8, 4.8), dpi=120, layout="constrained")
    axes = figure.add_subplot()
    generations = [g.generation for g in report.generations]
    suites = sorted({suite for g in report.generations for suite in g.scores})
    for suite in suites:
        scores = [g.scores.get(suite, math.nan) for g in report.generations]
        axes.plot(generations, scores, marker="o", label=suite)
    labels = []
    for g in report.generations:
        promoted = [run.specialist for run in g.runs if run.outcome == "promoted"]
        labels.append(f"{g.generation}" + (f"\n+{', '.join(promoted)}" if promoted else ""))
    axes.set_xticks(generations, labels)
    axes.set_ylim(-0.03, 1.03)
    axes.set_xlabel("generation (and the specialists it promoted)")
    axes.set_ylabel("contract score (share of tasks passed)")
    axes.set_title(f"Contract score of the active release per suite ({report.contract_version})")
    axes.grid(alpha=0.3)
    if suites:
        axes.legend(loc="best")
    figure.savefig(path, format="png")


def _scores_text(scores: dict[str, float]) -> str:
    return " · ".join(f"{suite} {score:.2f}" for suite, score in sorted(scores.items())) or "-"


def generation_table(record: GenerationRecord) -> Table:
    """One generation: its runs and the contract score of the release it leaves active."""
    caption = f"active release {record.release_id}; contract: {_scores_text(record.scores)}"
    if record.turns:
        caption += (
            f"\n{record.turns} simulated turns, oracle pass rate: "
            f"{_scores_text(record.simulated_pass_rate)}"
        )
    table = Table(title=f"generation {record.generation}", caption=caption)
    for column in ("run", "specialist", "training s", "outcome", "candidate", "parent"):
        table.add_column(column)
    for run in record.runs:
        seconds = "-" if run.training_seconds is None else f"{run.training_seconds:.0f}"
        outcome = run.outcome if not run.reasons else f"{run.outcome}: {'; '.join(run.reasons)}"
        table.add_row(
            run.run_id,
            run.specialist,
            seconds,
            outcome,
            _scores_text(run.candidate),
            _scores_text(run.parent),
        )
    return table


def demo_table(report: DemoReport) -> Table:
    """Every generation's contract score per suite, and what its runs became."""
    suites = sorted({suite for g in report.generations for suite in g.scores})
    table = Table(title=f"learning loop under contract {report.contract_version}")
    for column in ("generation", "release", "runs", *suites):
        table.add_column(column, justify="right" if column in suites else "left")
    for g in report.generations:
        runs = ", ".join(f"{run.specialist} {run.outcome}" for run in g.runs) or "-"
        scores = (f"{g.scores[s]:.2f}" if s in g.scores else "-" for s in suites)
        table.add_row(str(g.generation), g.release_id, runs, *scores)
    return table
