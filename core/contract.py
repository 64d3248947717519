"""The contract: the held-out task suites a candidate is scored on, and the promotion rule.

A contract is data (``learners/contract-v*.yaml``): per specialist a suite of tasks, each with a
checker and a reference answer, plus a ``general`` suite that catches forgetting. ``decide``
applies the rule to paired per-task outcomes of a candidate and its parent, so a decision can be
recomputed from stored outcomes under any contract version. Running the checkers is I/O and lives
in ``learners.evaluation.contract_runner``.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.routing import SpecialistName
from core.statistics import SequentialPlan, non_inferiority_p_value, sign_test_p_value
from core.tasks import Task

GENERAL_SUITE = "general"
"""The suite of easy tasks across all specialists that detects forgetting."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class NonInferiority(_Frozen):
    """The forgetting guard as a test: on every suite but the candidate's own, a paired
    one-sided test of H0 "the candidate passes at least ``margin`` fewer of its tasks than the
    parent", rejected at level ``alpha`` (Tango's score test, ``non_inferiority_p_value``).
    ``margins`` sets the margin of named suites (a small suite cannot show a small margin)."""

    margin: float = Field(gt=0.0, lt=1.0)
    alpha: float = Field(gt=0.0, lt=1.0)
    margins: dict[str, Annotated[float, Field(gt=0.0, lt=1.0)]] = Field(default_factory=dict)

    def margin_for(self, suite: str) -> float:
        return self.margins.get(suite, self.margin)


class PromotionRule(_Frozen):
    """Gains and drops are fractions of a suite's tasks: 0.05 is 5 points on the 0..1 scale.

    The own suite must gain at least ``min_gain`` with the sign test at ``alpha``. Other suites
    are guarded either by ``max_regression`` (contract v1: no suite may drop more than that) or
    by ``non_inferiority`` (contract v2: a test, not a threshold); exactly one is given.
    ``sequential`` (with a non-inferiority guard, every alpha under 0.5) looks at the outcomes
    in chunks and stops once the verdict is known (``core.sequential``); without it the rule
    looks once, at every task."""

    min_gain: float = Field(ge=0.0, le=1.0)
    alpha: float = Field(gt=0.0, le=1.0)
    max_regression: float | None = Field(default=None, ge=0.0, le=1.0)
    non_inferiority: NonInferiority | None = None
    sequential: SequentialPlan | None = None

    @model_validator(mode="after")
    def _one_guard(self) -> PromotionRule:
        if (self.max_regression is None) == (self.non_inferiority is None):
            raise ValueError("the rule needs exactly one of max_regression and non_inferiority")
        if self.sequential is not None:
            if self.non_inferiority is None:
                raise ValueError("a sequential plan needs the non_inferiority guard (a test)")
            if max(self.alpha, self.non_inferiority.alpha) >= 0.5:
                raise ValueError("a sequential plan needs every alpha under 0.5")
        return self


DEFAULT_ANSWER_TOKENS = 256


class RoutingRule(_Frozen):
    """How a router version is judged: on a held-out file of labelled turns (``suite``, next to
    the contract; with ``follow_ups``, a file of messages after a previous turn, routed in
    that context), the candidate's accuracy must be shown non-inferior to its parent's within
    ``margin`` (Tango's paired score test at ``alpha``), and no specialist's recall may drop by
    more than ``max_recall_drop``."""

    suite: str = Field(pattern=r"^[A-Za-z0-9._-]+\.jsonl$")
    follow_ups: str | None = Field(default=None, pattern=r"^[A-Za-z0-9._-]+\.jsonl$")
    margin: float = Field(gt=0.0, lt=1.0)
    alpha: float = Field(gt=0.0, lt=1.0)
    max_recall_drop: float = Field(ge=0.0, le=1.0)


_YAML_FILE = r"^[A-Za-z0-9._-]+\.ya?ml$"


class Contract(_Frozen):
    """Suites are named by specialist, plus ``general`` whose tasks may name any specialist.

    ``answer_tokens`` caps the new tokens of an answer per specialist (``DEFAULT_ANSWER_TOKENS``
    for one not named): a task is served with the budget of the specialist it names, in any
    suite, and candidate and parent get the same budget.

    ``development`` (contract v5 on) names the contract file, next to this one, whose suites
    are this contract's development split: what recipes, thresholds and features are chosen
    on, and what benches report. This contract's own suites are then its sealed test split,
    written apart from the development split, on which promotions are decided and the
    project's numbers are reported (``docs/learning.md``, "Development and test splits").
    """

    version: str = Field(min_length=1, max_length=100)
    rule: PromotionRule
    answer_tokens: dict[SpecialistName, Annotated[int, Field(ge=1, le=4096)]] = Field(
        default_factory=dict
    )
    suites: dict[SpecialistName, list[Task]]
    routing: RoutingRule | None = None
    development: str | None = Field(default=None, pattern=_YAML_FILE)

    def answer_budget(self, specialist: str) -> int:
        return self.answer_tokens.get(specialist, DEFAULT_ANSWER_TOKENS)

    @model_validator(mode="before")
    @classmethod
    def _added(cls, data: Any) -> Any:
        """A contract that ``extends`` another may list ``adds``: per suite, tasks after the
        other contract's."""
        if isinstance(data, dict) and "adds" in data:
            data = dict(data)
            added, suites = data.pop("adds"), data.get("suites")
            if not (
                isinstance(added, dict)
                and isinstance(suites, dict)
                and all(isinstance(tasks, list) for tasks in added.values())
            ):
                raise ValueError("adds lists, per suite, tasks added to an extended contract's")
            data["suites"] = {
                name: [*suites.get(name, []), *added.get(name, [])] for name in suites | added
            }
        return data

    @model_validator(mode="after")
    def _consistent(self) -> Contract:
        seen: set[str] = set()
        for suite, tasks in self.suites.items():
            if not tasks:
                raise ValueError(f"suite {suite!r} has no tasks")
            for task in tasks:
                if task.id in seen:
                    raise ValueError(f"task id {task.id!r} is used more than once")
                seen.add(task.id)
                if suite != GENERAL_SUITE and task.specialist != suite:
                    raise ValueError(
                        f"task {task.id!r} names specialist {task.specialist!r} "
                        f"but is in suite {suite!r}"
                    )
        return self

    def task_keys(self) -> dict[str, list[str]]:
        """Each suite's tasks by content (``Task.key``), in suite order."""
        return {suite: [task.key() for task in tasks] for suite, tasks in self.suites.items()}

    def specialists(self) -> list[str]:
        """Every specialist a task names: running the contract needs an adapter for each."""
        return sorted({task.specialist for tasks in self.suites.values() for task in tasks})


class Decision(_Frozen):
    """The rule applied to one candidate: ``reasons`` names every condition that failed.

    ``regressions`` maps each guarded suite (every other suite; every suite when no gain is
    needed) to the parent's score minus the candidate's (negative when the candidate is better
    there); ``guard_p_values`` each guarded suite's non-inferiority p-value (empty under a
    ``max_regression`` rule).
    """

    passed: bool
    gain: float
    p_value: float
    regressions: dict[str, float]
    reasons: list[str]
    guard_p_values: dict[str, float] = Field(default_factory=dict)


def decide(
    candidate: dict[str, list[bool]],
    parent: dict[str, list[bool]],
    specialist: str,
    rule: PromotionRule,
    *,
    needs_gain: bool = True,
) -> Decision:
    """Whether ``candidate`` may replace ``parent`` as ``specialist``'s adapter.

    Outcomes are per task and paired: both runs list the same suites, tasks in the same order.
    Scores are differences of pass counts divided by the suite size, so a gain of exactly 1 in
    10 compares equal to a ``min_gain`` of 0.1. A candidate that ``needs_gain=False`` (one
    that unlearns a forgotten tenant, judged against the release it would fall back to) must
    only hold every suite, its own included, by the guard.
    """
    _check_paired(candidate, parent, specialist)
    own_candidate, own_parent = candidate[specialist], parent[specialist]
    gain = _difference(own_candidate, own_parent)
    wins = sum(c and not p for c, p in zip(own_candidate, own_parent, strict=True))
    losses = sum(p and not c for c, p in zip(own_candidate, own_parent, strict=True))
    p_value = sign_test_p_value(wins, losses)

    reasons: list[str] = []
    if needs_gain and gain < rule.min_gain:
        reasons.append(
            f"gain on {specialist} is {_points(gain)} points; "
            f"at least {_points(rule.min_gain)} are required"
        )
    if needs_gain and p_value > rule.alpha:
        reasons.append(
            f"gain on {specialist} is not significant: sign test p = {p_value:.4f} "
            f"({wins} wins, {losses} losses) > alpha = {rule.alpha}"
        )
    regressions: dict[str, float] = {}
    guard_p_values: dict[str, float] = {}
    for suite in sorted(candidate):
        if suite == specialist and needs_gain:
            continue
        drop = _difference(parent[suite], candidate[suite])
        regressions[suite] = drop
        if rule.non_inferiority is not None:
            guard = _non_inferior(suite, candidate[suite], parent[suite], rule.non_inferiority)
            guard_p_values[suite], reason = guard
            if reason:
                reasons.append(reason)
        elif rule.max_regression is not None and drop > rule.max_regression:
            reasons.append(
                f"{suite} drops by {_points(drop)} points; "
                f"at most {_points(rule.max_regression)} are allowed"
            )
    return Decision(
        passed=not reasons,
        gain=gain,
        p_value=p_value,
        regressions=regressions,
        reasons=reasons,
        guard_p_values=guard_p_values,
    )


def decide_routing(
    candidate: dict[str, list[bool]], parent: dict[str, list[bool]], rule: RoutingRule
) -> Decision:
    """Whether a router version may replace its parent: ``candidate`` and ``parent`` hold, per
    specialist, whether each held-out turn labelled with it was routed to it (paired, in the
    same order). ``gain`` is the accuracy difference over all turns, ``regressions`` each
    specialist's recall drop."""
    if candidate.keys() != parent.keys() or any(
        len(candidate[s]) != len(parent[s]) for s in candidate
    ):
        raise ValueError("candidate and parent outcomes are not paired")
    both = [(c, p) for s in sorted(candidate) for c, p in zip(candidate[s], parent[s], strict=True)]
    if not both:
        raise ValueError("a routing suite needs turns")
    wins = sum(c and not p for c, p in both)
    losses = sum(p and not c for c, p in both)
    p_value = non_inferiority_p_value(wins, losses, len(both), rule.margin)
    reasons = []
    if p_value > rule.alpha:
        reasons.append(
            f"routing accuracy is not shown within {_points(rule.margin)} points of the parent: "
            f"non-inferiority p = {p_value:.4f} > alpha = {rule.alpha} ({wins} wins, {losses} "
            f"losses of {len(both)} turns)"
        )
    regressions = {s: _difference(parent[s], candidate[s]) for s in sorted(candidate)}
    for specialist, drop in regressions.items():
        if drop > rule.max_recall_drop:
            reasons.append(
                f"{specialist} recall drops by {_points(drop)} points; at most "
                f"{_points(rule.max_recall_drop)} are allowed"
            )
    return Decision(
        passed=not reasons,
        gain=(wins - losses) / len(both),
        p_value=p_value,
        regressions=regressions,
        reasons=reasons,
    )


def _non_inferior(
    suite: str, candidate: list[bool], parent: list[bool], guard: NonInferiority
) -> tuple[float, str]:
    """The guard's p-value on one suite, and why it failed (empty when it passed)."""
    wins = sum(c and not p for c, p in zip(candidate, parent, strict=True))
    losses = sum(p and not c for c, p in zip(candidate, parent, strict=True))
    margin = guard.margin_for(suite)
    p_value = non_inferiority_p_value(wins, losses, len(candidate), margin)
    if p_value <= guard.alpha:
        return p_value, ""
    return p_value, (
        f"{suite} is not shown within {_points(margin)} points of the parent: non-inferiority "
        f"p = {p_value:.4f} > alpha = {guard.alpha} ({wins} wins, {losses} losses "
        f"of {len(candidate)} tasks)"
    )


def _check_paired(
    candidate: dict[str, list[bool]], parent: dict[str, list[bool]], specialist: str
) -> None:
    if candidate.keys() != parent.keys():
        raise ValueError(
            f"candidate suites {sorted(candidate)} differ from parent suites {sorted(parent)}"
        )
    if specialist not in candidate:
        raise ValueError(f"no suite for specialist {specialist!r}")
    if not candidate[specialist]:
        raise ValueError(f"suite {specialist!r} has no outcomes")
    for suite, outcomes in candidate.items():
        if len(outcomes) != len(parent[suite]):
            raise ValueError(
                f"suite {suite!r} has {len(outcomes)} candidate outcomes "
                f"but {len(parent[suite])} parent outcomes"
            )


def _difference(first: list[bool], second: list[bool]) -> float:
    """``mean(first) - mean(second)`` of paired outcomes, rounded once (0 for an empty suite)."""
    if not first:
        return 0.0
    return (sum(first) - sum(second)) / len(first)


def _points(fraction: float) -> str:
    return f"{fraction * 100:.1f}"
