"""Sequential decisions: run a candidate's tasks in chunks and stop once the verdict is known.

A contract whose rule has a ``sequential`` plan looks at the candidate's outcomes after each
chunk (``schedule``). At each look every test still open (the gain on the own suite, the
non-inferiority of each other suite) is run at the nominal level its alpha-spending function
allows at the share of its tasks known by then (``core.statistics.nominal_levels``, one-sided):

- the gain test passes when the sign test reaches the level and the gain so far is at least
  ``min_gain``; it fails when the loss is as significant the other way, or when winning every
  task left could not reach ``min_gain``;
- a guard passes when its non-inferiority test reaches the level, and fails when the test of the
  opposite hypothesis (the suite dropped by more than the margin) does;
- at a test's last look (all its tasks known) it passes or fails.

A failed test rejects the candidate at once; when every test has passed it is promoted. The
stops for failure never promote, so the chance of promoting a candidate that is no better stays
within each test's alpha (non-binding futility). Task order within a suite is a hash of the
contract version and the task id: fixed for a contract, unrelated to how its file lists tasks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict

from core.canonical import sha256_hex
from core.contract import Contract, Decision, NonInferiority, PromotionRule, decide
from core.statistics import (
    ONE_LOOK,
    SequentialPlan,
    nominal_levels,
    non_inferiority_p_value,
    sign_test_p_value,
)

Key = tuple[str, int]
"""A task by suite and place in it."""
Known = Mapping[str, Sequence[bool | None]]
"""Per suite, per task: the candidate's outcome, or ``None`` while it has not run."""


def plan_of(rule: PromotionRule) -> SequentialPlan:
    return rule.sequential or ONE_LOOK


def schedule(contract: Contract, changed: frozenset[str] | None) -> list[list[Key]]:
    """The tasks to run before each look: those of the ``changed`` specialists (every task
    for ``None``), each suite's in hash order, each look adding its share of every suite."""
    chunks: list[list[Key]] = [[] for _ in plan_of(contract.rule).looks]
    for suite, tasks in contract.suites.items():
        order = sorted(
            (i for i, task in enumerate(tasks) if changed is None or task.specialist in changed),
            key=lambda i: sha256_hex(f"{contract.version}/{tasks[i].id}".encode()),
        )
        start = 0
        for chunk, share in zip(chunks, plan_of(contract.rule).looks, strict=True):
            end = math.ceil(share * len(order) - 1e-9)
            chunk += [(suite, i) for i in order[start:end]]
            start = end
    return chunks


class Stop(BaseModel):
    """Where a sequential decision stopped: at look ``look`` (from 1) of ``looks``, and why."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    look: int
    looks: int
    why: str


@dataclass
class _Test:
    """One test of the rule across looks: its fractions so far and its verdict once known."""

    alpha: float
    fractions: list[float] = field(default_factory=list)
    verdict: bool | None = None
    p_value: float = 1.0
    reason: str = ""

    def level(self, fraction: float, plan: SequentialPlan) -> float | None:
        """The nominal level at this look, or ``None`` when the test is decided or has nothing
        new to look at."""
        if self.verdict is not None or fraction <= (self.fractions or [0.0])[-1]:
            return None
        self.fractions.append(fraction)
        return nominal_levels(plan.spending, self.alpha, tuple(self.fractions))[-1]


@dataclass(frozen=True)
class _Tally:
    """A suite at one look, over its changed tasks (``changed`` of ``size``; the inherited ones
    are ties by construction): wins and losses among the ``known`` ones, and how many of those
    still to run the parent failed (the candidate could still win them)."""

    wins: int
    losses: int
    known: int
    changed: int
    size: int
    winnable: int

    @property
    def fraction(self) -> float:
        return self.known / self.changed if self.changed else 1.0

    def projected(self) -> float:
        """The suite's gain (candidate minus parent, over all its tasks) if the changed tasks
        still to run went as those known so far."""
        return (
            (self.wins - self.losses) / self.known * self.changed / self.size if self.known else 0.0
        )


def _tally(
    candidate: Sequence[bool | None], parent: Sequence[bool], inherited: Sequence[bool]
) -> _Tally:
    changed = [(c, p) for c, p, i in zip(candidate, parent, inherited, strict=True) if not i]
    pairs = [(c, p) for c, p in changed if c is not None]
    return _Tally(
        wins=sum(c and not p for c, p in pairs),
        losses=sum(p and not c for c, p in pairs),
        known=len(pairs),
        changed=len(changed),
        size=len(parent),
        winnable=sum(c is None and not p for c, p in changed),
    )


def decide_at_look(
    looks: Sequence[Known],
    parent: Mapping[str, Sequence[bool]],
    specialist: str,
    rule: PromotionRule,
    inherited: Mapping[str, Sequence[bool]] | None = None,
    *,
    needs_gain: bool = True,
) -> tuple[Decision, Stop] | None:
    """The decision once the candidate's outcomes known after each look so far (``looks``, in
    order, each including the earlier ones) settle it, with where it stopped; ``None`` while
    the verdict is open. ``inherited`` marks the tasks whose outcome is the parent's (none when
    not given): the tests count only the others, so a suite's few changed tasks are not
    diluted by its inherited ties while they run. At the plan's last look every task is known
    and the verdict is. A rule without a plan looks once, at every task
    (``core.contract.decide``). ``needs_gain=False`` guards the own suite like the others, with
    no gain test (``core.contract.decide``)."""
    if rule.sequential is None:
        if len(looks) != 1:
            raise ValueError("a rule without a sequential plan looks once")
        paired = {suite: list(outcomes) for suite, outcomes in parent.items()}
        decision = decide(_complete(looks[0]), paired, specialist, rule, needs_gain=needs_gain)
        return decision, Stop(look=1, looks=1, why="one look at every task")
    if specialist not in parent:
        raise ValueError(f"no suite for specialist {specialist!r}")
    plan, guard = rule.sequential, rule.non_inferiority
    assert guard is not None  # PromotionRule: a plan needs the non-inferiority guard
    marks = inherited or {suite: [False] * len(done) for suite, done in parent.items()}
    gain = _Test(rule.alpha) if needs_gain else None
    guards = {s: _Test(guard.alpha) for s in sorted(parent) if s != specialist or not needs_gain}
    for number, known in enumerate(looks, start=1):
        if known.keys() != parent.keys() or marks.keys() != parent.keys():
            raise ValueError("candidate and parent outcomes list different suites")
        tallies = {suite: _tally(known[suite], parent[suite], marks[suite]) for suite in parent}
        if gain is not None:
            _look_gain(gain, tallies[specialist], rule, plan, specialist)
        for suite, test in guards.items():
            _look_guard(test, tallies[suite], guard, plan, suite)
        tests = [t for t in (gain, *guards.values()) if t is not None]
        failed = [t.reason for t in tests if t.verdict is False]
        if failed or all(t.verdict for t in tests):
            decision = Decision(
                passed=not failed,
                gain=tallies[specialist].projected(),
                p_value=gain.p_value if gain else _sign_p(tallies[specialist]),
                regressions={suite: -tallies[suite].projected() for suite in guards},
                reasons=failed,
                guard_p_values={suite: t.p_value for suite, t in guards.items() if t.fractions},
            )
            shown = "the gain and every guard are shown" if gain else "every guard is shown"
            why = "; ".join(failed) if failed else shown
            return decision, Stop(look=number, looks=len(plan.looks), why=why)
    if len(looks) >= len(plan.looks):
        raise ValueError("the last look leaves tasks unknown")
    return None


def _sign_p(tally: _Tally) -> float:
    """The own suite's sign-test p-value, reported (not tested) when no gain is needed, as
    ``core.contract.decide`` reports it."""
    return sign_test_p_value(tally.wins, tally.losses)


def _complete(known: Known) -> dict[str, list[bool]]:
    if any(outcome is None for outcomes in known.values() for outcome in outcomes):
        raise ValueError("a single look needs every outcome")
    return {suite: [bool(o) for o in outcomes] for suite, outcomes in known.items()}


def _look_gain(
    test: _Test, tally: _Tally, rule: PromotionRule, plan: SequentialPlan, specialist: str
) -> None:
    """The sign test needs only the wins and losses; ``min_gain`` is over the whole suite, on
    the gain projected from the changed tasks known so far."""
    level = test.level(tally.fraction, plan)
    if level is None:
        return
    wins, losses = tally.wins, tally.losses
    test.p_value = sign_test_p_value(wins, losses)
    gain = tally.projected()
    best = (wins - losses + tally.winnable) / tally.size
    counts = f"{wins} wins, {losses} losses of {tally.known} of {tally.changed} changed tasks"
    if test.p_value <= level and gain >= rule.min_gain:
        test.verdict = True
    elif best < rule.min_gain:
        test.verdict = False
        test.reason = (
            f"gain on {specialist} cannot reach {_points(rule.min_gain)} points ({counts})"
        )
    elif tally.fraction >= 1.0 or sign_test_p_value(losses, wins) <= level:
        test.verdict = False
        test.reason = (
            f"gain on {specialist} is not shown: sign test p = {test.p_value:.4f} at level "
            f"{level:.4f}, gain {_points(gain)} points (at least {_points(rule.min_gain)}; "
            f"{counts})"
        )


def _look_guard(
    test: _Test, tally: _Tally, guard: NonInferiority, plan: SequentialPlan, suite: str
) -> None:
    """The margin is over the whole suite; over its changed tasks alone it is ``size / changed``
    times larger (the inherited ones are ties). A suite whose changed tasks could not lose that
    much even all together is shown at once."""
    margin = guard.margin_for(suite)
    scaled = margin * tally.size / tally.changed if tally.changed else 1.0
    if scaled >= 1.0:
        if test.verdict is None:
            test.verdict, test.p_value, test.fractions = True, 0.0, [1.0]
        return
    level = test.level(tally.fraction, plan)
    if level is None:
        return
    test.p_value = non_inferiority_p_value(tally.wins, tally.losses, tally.known, scaled)
    if test.p_value <= level:
        test.verdict = True
    elif tally.fraction >= 1.0 or 1 - test.p_value <= level:
        test.verdict = False
        test.reason = (
            f"{suite} is not shown within {_points(margin)} points of the parent: "
            f"non-inferiority p = {test.p_value:.4f} at level {level:.4f} ({tally.wins} wins, "
            f"{tally.losses} losses of {tally.known} of {tally.changed} changed tasks, of "
            f"{tally.size})"
        )


def _points(fraction: float) -> str:
    return f"{fraction * 100:.1f}"
