"""Contract v1: the held-out task suites a candidate adapter is scored on, and the promotion rule.

A contract is data (``learners/contract-v1.yaml``): per specialist a suite of tasks, each with a
checker and a reference answer, plus a ``general`` suite that catches forgetting. ``decide``
applies the rule to paired per-task outcomes of a candidate and its parent, so a decision can be
recomputed from stored outcomes under any contract version. Running the checkers is I/O and lives
in ``learners.contract``.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator, model_validator

from core.routing import SpecialistName

GENERAL_SUITE = "general"
"""The suite of easy tasks across all specialists that detects forgetting."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ExactChecker(_Frozen):
    """Passes when the output equals ``expected``, both stripped of surrounding whitespace."""

    kind: Literal["exact"]
    expected: str


class RegexChecker(_Frozen):
    """Passes when ``pattern`` matches anywhere in the output (``re.search``, ``DOTALL``)."""

    kind: Literal["regex"]
    pattern: str = Field(min_length=1)

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"not a regular expression: {exc}") from exc
        return pattern


class GenUIChecker(_Frozen):
    """Passes when the output is a valid GenUI tree whose text contains each of ``must_contain``."""

    kind: Literal["genui"]
    must_contain: list[str] = Field(default_factory=list)


class ToolCallChecker(_Frozen):
    """Passes when the output is a valid call of ``tool`` whose arguments include ``args``."""

    kind: Literal["tool_call"]
    tool: str = Field(min_length=1)
    args: dict[str, JsonValue] = Field(default_factory=dict)


class PythonTestsChecker(_Frozen):
    """Passes when the answer's code followed by ``tests`` runs without error in a sandbox."""

    kind: Literal["python_tests"]
    tests: str = Field(min_length=1)


Checker = Annotated[
    ExactChecker | RegexChecker | GenUIChecker | ToolCallChecker | PythonTestsChecker,
    Field(discriminator="kind"),
]


class Task(_Frozen):
    """One prompt, served by ``specialist``, and how to tell a correct answer.

    ``reference`` is a correct answer: the simulator's oracle uses it as the user's edit, so it
    becomes training data for bank tasks (never for contract tasks, which are held out).
    """

    id: str = Field(pattern=r"^[a-z0-9-]+$", max_length=100)
    specialist: SpecialistName
    prompt: str = Field(min_length=1)
    checker: Checker
    reference: str = Field(min_length=1)


class PromotionRule(_Frozen):
    """Gains and drops are fractions of a suite's tasks: 0.05 is 5 points on the 0..1 scale."""

    min_gain: float = Field(ge=0.0, le=1.0)
    alpha: float = Field(gt=0.0, le=1.0)
    max_regression: float = Field(ge=0.0, le=1.0)


DEFAULT_ANSWER_TOKENS = 256


class Contract(_Frozen):
    """Suites are named by specialist, plus ``general`` whose tasks may name any specialist.

    ``answer_tokens`` caps the new tokens of an answer per specialist (``DEFAULT_ANSWER_TOKENS``
    for one not named): a task is served with the budget of the specialist it names, in any
    suite, and candidate and parent get the same budget.
    """

    version: str = Field(min_length=1, max_length=100)
    rule: PromotionRule
    answer_tokens: dict[SpecialistName, Annotated[int, Field(ge=1, le=4096)]] = Field(
        default_factory=dict
    )
    suites: dict[SpecialistName, list[Task]]

    def answer_budget(self, specialist: str) -> int:
        return self.answer_tokens.get(specialist, DEFAULT_ANSWER_TOKENS)

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

    def specialists(self) -> list[str]:
        """Every specialist a task names: running the contract needs an adapter for each."""
        return sorted({task.specialist for tasks in self.suites.values() for task in tasks})


class Decision(_Frozen):
    """The rule applied to one candidate: ``reasons`` names every condition that failed.

    ``regressions`` maps each other suite to the parent's score minus the candidate's (negative
    when the candidate is better there).
    """

    passed: bool
    gain: float
    p_value: float
    regressions: dict[str, float]
    reasons: list[str]


def sign_test_p_value(wins: int, losses: int) -> float:
    """One-sided exact sign test on discordant pairs (McNemar's exact test).

    ``P(X >= wins)`` for ``X ~ Bin(wins + losses, 1/2)``: how likely the candidate wins at least
    this often if it were no better than its parent. Exact integer arithmetic; 1 without pairs.
    """
    if wins < 0 or losses < 0:
        raise ValueError("wins and losses must not be negative")
    pairs = wins + losses
    if pairs == 0:
        return 1.0
    return sum(math.comb(pairs, k) for k in range(wins, pairs + 1)) / (1 << pairs)


def decide(
    candidate: dict[str, list[bool]],
    parent: dict[str, list[bool]],
    specialist: str,
    rule: PromotionRule,
) -> Decision:
    """Whether ``candidate`` may replace ``parent`` as ``specialist``'s adapter.

    Outcomes are per task and paired: both runs list the same suites, tasks in the same order.
    Scores are differences of pass counts divided by the suite size, so a gain of exactly 1 in
    10 compares equal to a ``min_gain`` of 0.1.
    """
    _check_paired(candidate, parent, specialist)
    own_candidate, own_parent = candidate[specialist], parent[specialist]
    gain = _difference(own_candidate, own_parent)
    wins = sum(c and not p for c, p in zip(own_candidate, own_parent, strict=True))
    losses = sum(p and not c for c, p in zip(own_candidate, own_parent, strict=True))
    p_value = sign_test_p_value(wins, losses)

    reasons: list[str] = []
    if gain < rule.min_gain:
        reasons.append(
            f"gain on {specialist} is {_points(gain)} points; "
            f"at least {_points(rule.min_gain)} are required"
        )
    if p_value > rule.alpha:
        reasons.append(
            f"gain on {specialist} is not significant: sign test p = {p_value:.4f} "
            f"({wins} wins, {losses} losses) > alpha = {rule.alpha}"
        )
    regressions: dict[str, float] = {}
    for suite in sorted(candidate):
        if suite == specialist:
            continue
        drop = _difference(parent[suite], candidate[suite])
        regressions[suite] = drop
        if drop > rule.max_regression:
            reasons.append(
                f"{suite} drops by {_points(drop)} points; "
                f"at most {_points(rule.max_regression)} are allowed"
            )
    return Decision(
        passed=not reasons, gain=gain, p_value=p_value, regressions=regressions, reasons=reasons
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
