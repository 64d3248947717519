"""A demo's outputs: ``demo.json``, the ``demo.png`` chart and the tables printed as it runs."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path

from matplotlib.figure import Figure
from rich.table import Table

from learners.evaluation.contract_runner import CALL_RATES
from macaron.demo.records import DemoReport, GenerationRecord, RunRecord


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
        promoted = [_changed(run) for run in g.runs if run.outcome == "promoted"]
        labels.append(f"{g.generation}" + (f"\n+{', '.join(promoted)}" if promoted else ""))
    axes.set_xticks(generations, labels)
    axes.set_ylim(-0.03, 1.03)
    axes.set_xlabel("generation (and what it promoted: a specialist's adapter, or its harness)")
    axes.set_ylabel("contract score (share of tasks passed)")
    axes.set_title(
        f"Contract score of the active release per suite "
        f"({report.contract_version}, {report.split} split)"
    )
    axes.grid(alpha=0.3)
    if suites:
        axes.legend(loc="best")
    figure.savefig(path, format="png")


def _changed(run: RunRecord) -> str:
    """What a run changes: ``genui`` (its adapter) or ``genui harness:grammar``."""
    if run.half == "harness":
        return f"{run.specialist} harness:{run.recipe.rsplit('.', 1)[-1]}"
    return run.specialist


def _scores_text(scores: dict[str, float]) -> str:
    return " · ".join(f"{suite} {score:.2f}" for suite, score in sorted(scores.items())) or "-"


def _calls_text(calls: dict[str, float]) -> str:
    """The call accuracy beside the no-call rate (``ContractRun.call_rates``), or nothing."""
    return "; ".join(
        f"{CALL_RATES[name]} {calls[name]:.2f}" for name in CALL_RATES if name in calls
    )


def generation_table(record: GenerationRecord) -> Table:
    """One generation: its runs and the contract score of the release it leaves active."""
    caption = (
        f"active release {record.release_id} ({record.harness_version}); "
        f"contract: {_scores_text(record.scores)}; well-formed: {_scores_text(record.formats)}"
    )
    if record.calls:
        caption += f"; {_calls_text(record.calls)}"
    if record.outside is not None:
        caption += f"; outside measure (BFCL, no call where no tool serves) {record.outside:.2f}"
    if record.turns:
        caption += (
            f"\n{record.turns} simulated turns, oracle pass rate: "
            f"{_scores_text(record.simulated_pass_rate)}"
        )
    for specialist, r in sorted(record.rollouts.items()):
        caption += (
            f"\n{specialist} rollouts: {r['groups']:.0f} prompts, {r['samples']:.0f} samples"
            f", pass@1 {r['pass_at_1']:.2f}, pass@K {r['pass_at_k']:.2f}, groups with signal "
            f"{r['signal_groups']:.0f} ({r['signal_share']:.0%}), {_resampled_text(r)}, "
            f"{_written_text(r)}, hinted "
            f"{r['hinted_groups']:.0f} groups, {r['hinted_samples']:.0f} samples "
            f"({r['hinted_passed']:.0f} passed), verifier failures "
            f"{r['failed']:.0f}, {r['seconds']:.0f} s"
        )
    if record.phase_seconds:
        caption += "\nseconds: " + " · ".join(
            f"{phase} {seconds:.0f}" for phase, seconds in record.phase_seconds.items()
        )
    table = Table(title=f"generation {record.generation}", caption=caption)
    columns = ("run", "changes", "training s", "outcome", "candidate", "parent")
    for column in columns:
        table.add_column(column)
    for run in record.runs:
        seconds = "-" if run.training_seconds is None else f"{run.training_seconds:.0f}"
        outcome = run.outcome if not run.reasons else f"{run.outcome}: {'; '.join(run.reasons)}"
        if run.p_value is not None:
            outcome += f"\ngain p = {run.p_value:.4f}" + "".join(
                f"; {suite} non-inferior p = {p:.4f}"
                for suite, p in sorted(run.guard_p_values.items())
            )
        table.add_row(
            run.run_id,
            _changed(run),
            seconds,
            outcome,
            _side(run.candidate, run.candidate_formats, run.candidate_calls),
            _side(run.parent, run.parent_formats, run.parent_calls),
        )
    return table


def _side(scores: dict[str, float], formats: dict[str, float], calls: dict[str, float]) -> str:
    text = f"{_scores_text(scores)}\nwell-formed: {_scores_text(formats)}"
    return f"{text}\n{_calls_text(calls)}" if calls else text


def demo_table(report: DemoReport) -> Table:
    """Every generation's contract score per suite, and what its runs became."""
    suites = sorted({suite for g in report.generations for suite in g.scores})
    table = Table(
        title=f"learning loop under contract {report.contract_version} ({report.split} split)"
    )
    table.caption = "score (share of tasks passed) / well-formed (share in the asked form)"
    calls = [name for name in CALL_RATES if any(name in g.calls for g in report.generations)]
    if calls:
        table.caption += "; " + "; ".join(
            f"{name.replace('_', ' ')}: {CALL_RATES[name]}" for name in calls
        )
        table.caption += " (over every suite)"
    for column in ("generation", "release", "harness", "runs", *suites):
        table.add_column(column, justify="right" if column in suites else "left")
    for name in calls:
        table.add_column(name.replace("_", " "), justify="right")
    outside = any(g.outside is not None for g in report.generations)
    if outside:
        table.add_column("outside", justify="right")
        table.caption += "; outside: no call on BFCL's requests no tool serves"
    for g in report.generations:
        runs = ", ".join(f"{_changed(run)} {run.outcome}" for run in g.runs) or "-"
        scores = (_score_cell(g, s) for s in suites)
        rates = [f"{g.calls[name]:.2f}" if name in g.calls else "-" for name in calls]
        if outside:
            rates.append("-" if g.outside is None else f"{g.outside:.2f}")
        table.add_row(str(g.generation), g.release_id, g.harness_version, runs, *scores, *rates)
    return table


def _score_cell(g: GenerationRecord, suite: str) -> str:
    score = f"{g.scores[suite]:.2f}" if suite in g.scores else "-"
    return f"{score} / {g.formats[suite]:.2f}" if suite in g.formats else score


def _resampled_text(rollouts: Mapping[str, float]) -> str:
    """The flat groups sampled again (none in a record from before adaptive sampling)."""
    r = {name: rollouts.get(f"resampled_{name}", 0.0) for name in ("groups", "samples", "passed")}
    signal = rollouts.get("resampled_signal", 0.0)
    return (
        f"resampled {r['groups']:.0f} flat groups, {r['samples']:.0f} samples "
        f"({r['passed']:.0f} passed, {signal:.0f} with signal)"
    )


def _written_text(rollouts: Mapping[str, float]) -> str:
    """The tasks the loop wrote (none in a record from before it wrote any)."""
    written, kept, solved = (
        rollouts.get(n, 0.0) for n in ("written", "written_kept", "written_solved")
    )
    return f"tasks written {written:.0f}, kept {kept:.0f}, solved {solved:.0f}"
