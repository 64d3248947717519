"""What a demo records: each generation's contract scores and what became of its runs; and
the error that stops a demo."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from core.errors import MacaronError
from learners.rollouts.job import RolloutSummary


class DemoFailed(MacaronError):
    """A part of the loop stopped, or a generation could not finish; the message says which."""

    code = "demo_failed"


@dataclass(frozen=True)
class RunRecord:
    """One training run and what became of it. ``outcome`` is ``promoted``, ``rejected`` (by the
    contract), ``promotion refused`` (by the server's canary), or ``training failed``,
    ``evaluation failed``, ``promotion failed`` (the worker's task raised). ``half`` is the half
    of the release the run changes: ``adapter`` (trained) or ``harness`` (proposed; ``recipe``
    names the change). ``p_value`` is the gain test's and ``guard_p_values`` each guarded
    suite's non-inferiority p-value, as the evaluation recorded them (``None`` and empty
    before an evaluation)."""

    run_id: str
    specialist: str
    half: str
    recipe: str
    outcome: str
    passed: bool
    training_seconds: float | None
    candidate: dict[str, float]
    parent: dict[str, float]
    reasons: list[str]
    candidate_formats: dict[str, float] = field(default_factory=dict)
    parent_formats: dict[str, float] = field(default_factory=dict)
    p_value: float | None = None
    guard_p_values: dict[str, float] = field(default_factory=dict)
    candidate_calls: dict[str, float] = field(default_factory=dict)
    parent_calls: dict[str, float] = field(default_factory=dict)
    """Tool calls right and no call where none is asked (``ContractRun.call_rates``)."""


@dataclass(frozen=True)
class GenerationRecord:
    """``scores`` are the contract scores per suite of ``release_id`` (served with
    ``harness_version``), active after the generation; ``formats`` the share of well-formed
    answers per suite that asks for a form; ``calls`` the share of tool-call tasks called
    right and of no-call tasks answered without a call (``ContractRun.call_rates``). The
    traffic was simulated users (``mode`` oracle: ``turns``, and ``simulated_pass_rate`` the
    oracle's verdict on them) or rollouts (``self``: ``rollouts`` per specialist,
    ``learners.rollouts.job.RolloutSummary`` summed, with pass@1 and pass@K; ``hints`` how
    unsolved groups were resampled: ``tools`` a sweep, ``checker`` only in the ablation).
    ``phase_seconds``: traffic until a run was queued; adapter runs until every one was decided
    (trained, evaluated, promoted or not); harness proposals (queued by those decisions) until
    every one was decided; measure. ``outside``: the release's no-call rate on the outside
    measure (BFCL's requests no tool serves, ``learners.evaluation.contract_runner.OUTSIDE``;
    ``None``: not measured)."""

    generation: int
    release_id: str
    harness_version: str
    scores: dict[str, float]
    formats: dict[str, float] = field(default_factory=dict)
    calls: dict[str, float] = field(default_factory=dict)
    mode: str = "oracle"
    hints: str = "none"
    turns: int = 0
    simulated_pass_rate: dict[str, float] = field(default_factory=dict)
    rollouts: dict[str, dict[str, float]] = field(default_factory=dict)
    runs: list[RunRecord] = field(default_factory=list)
    phase_seconds: dict[str, float] = field(default_factory=dict)
    outside: float | None = None


@dataclass(frozen=True)
class DemoReport:
    contract_version: str
    generations: list[GenerationRecord]
    split: str = "test"
    """Which split the scores come from: ``test`` for a contract that names its development
    split (its own suites are the sealed test split), ``single`` for one that names none."""

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def phase_seconds(
    started: datetime,
    runs: list[RunRecord],
    times: dict[str, tuple[datetime, datetime]],
    measuring: datetime,
    ended: datetime,
) -> dict[str, float]:
    """A generation's phases on its timeline, bounded by what the registry recorded:
    ``traffic`` until its first run was queued, ``adapter runs`` until the last adapter run
    was decided, ``harness proposals`` until the last harness run was, ``measure`` from then to
    ``ended`` (``times``: each run's queued and decided time, ``run_times``); they add up to
    the generation. A run decided while the traffic still rolled out counts from its queueing,
    not from when the demo looked; with no run, the traffic lasts until ``measuring``."""
    queued = max(started, min((times[r.run_id][0] for r in runs), default=measuring))

    def decided(half: str, since: datetime) -> datetime:
        return max([since, *(times[r.run_id][1] for r in runs if r.half == half)])

    adapters = decided("adapter", queued)
    harness = decided("harness", adapters)
    return {
        "traffic": (queued - started).total_seconds(),
        "adapter runs": (adapters - queued).total_seconds(),
        "harness proposals": (harness - adapters).total_seconds(),
        "measure": (ended - harness).total_seconds(),
    }


def rollout_stats(
    specialists: Sequence[str], summaries: Sequence[RolloutSummary]
) -> dict[str, dict[str, float]]:
    """Per specialist: groups and samples rolled out, samples passed, pass@1 and pass@K, the
    groups with signal and their share, the groups sampled again for want of signal (their
    samples, passes, and those with signal), the tasks written, kept and solved, the hinted
    groups, their samples and their passes,
    samples the verifier failed on, and seconds."""
    stats: dict[str, dict[str, float]] = {}
    for specialist, summary in zip(specialists, summaries, strict=True):
        into = stats.setdefault(specialist, dict.fromkeys(_SUMMED, 0.0) | {"solved": 0.0})
        for name in _SUMMED:
            into[name] += float(getattr(summary, name))
        into["solved"] += summary.pass_at_k * summary.groups
    for into in stats.values():
        into["pass_at_1"] = into["passed"] / into["samples"] if into["samples"] else 0.0
        into["pass_at_k"] = into.pop("solved") / into["groups"] if into["groups"] else 0.0
        into["signal_share"] = into["signal_groups"] / into["groups"] if into["groups"] else 0.0
    return stats


_SUMMED = (
    "groups",
    "samples",
    "passed",
    "failed",
    "signal_groups",
    "resampled_groups",
    "resampled_samples",
    "resampled_passed",
    "resampled_signal",
    "written",
    "written_kept",
    "written_solved",
    "hinted_groups",
    "hinted_samples",
    "hinted_passed",
    "seconds",
)
