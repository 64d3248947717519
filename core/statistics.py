"""The promotion rule's tests on paired outcomes, and the group-sequential plan that lets it
look at them in chunks.

A candidate and its parent answer the same tasks; a task the candidate alone passes is a win, one
the parent alone passes a loss. ``sign_test_p_value`` tests a gain on the wins and losses,
``non_inferiority_p_value`` tests that a suite did not drop by a margin. A ``SequentialPlan``
runs these tests at several looks, spending the contract's alpha over them (Lan and DeMets):
``nominal_levels`` turns the spending function into the p-value each look must reach, so that the
chance of ever passing a candidate that is no better stays at most alpha.
"""

from __future__ import annotations

import functools
import itertools
import math
from statistics import NormalDist
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

_NORMAL = NormalDist()
MAX_LOOKS = 10


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


def non_inferiority_p_value(wins: int, losses: int, pairs: int, margin: float) -> float:
    """One-sided p-value of H0 "the candidate's pass rate is at most the parent's minus
    ``margin``" from ``pairs`` paired outcomes, ``wins`` of them passed by the candidate only and
    ``losses`` by the parent only: Tango's (1998) score test for paired proportions. The
    variance is taken at the restricted maximum-likelihood estimate of the loss-cell probability
    under H0, so it holds with no discordant pairs at all (where a Wald test cannot be used).
    One minus it is the p-value of the opposite hypothesis: that the suite dropped by more."""
    if min(wins, losses) < 0 or wins + losses > pairs or pairs < 1:
        raise ValueError("need 0 <= wins, losses and wins + losses <= pairs, pairs >= 1")
    if not 0.0 < margin < 1.0:
        raise ValueError("the margin must be in (0, 1)")
    b, c, n, d0 = wins, losses, pairs, -margin
    # The loss-cell probability q maximising the likelihood under H0 (win cell q + d0) is the
    # root of 2n q^2 + B q + C = 0 that keeps both cells in [0, 1].
    big_b = -(b + c) + (2 * n - b + c) * d0
    big_c = -c * d0 * (1 - d0)
    q = (-big_b + math.sqrt(big_b * big_b - 8 * n * big_c)) / (4 * n)
    z = (b - c - n * d0) / math.sqrt(n * (2 * q + d0 - d0 * d0))
    return 0.5 * math.erfc(z / math.sqrt(2))


Spending = Literal["obrien-fleming", "pocock"]


class SequentialPlan(BaseModel):
    """Looks at the changed tasks: ``looks`` are the shares of them run by each look (rising,
    the last 1.0), ``spending`` the alpha-spending function (Lan-DeMets O'Brien-Fleming type,
    which spends little early, or Pocock type, which spends evenly)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    looks: list[float] = Field(min_length=1, max_length=MAX_LOOKS)
    spending: Spending

    @field_validator("looks")
    @classmethod
    def _adds_up(cls, looks: list[float]) -> list[float]:
        if any(not 0.0 < t <= 1.0 for t in looks):
            raise ValueError("each look is a share of the tasks, in (0, 1]")
        if any(later <= earlier for earlier, later in itertools.pairwise(looks)):
            raise ValueError("looks must rise strictly")
        if looks[-1] != 1.0:
            raise ValueError("the last look must run every task (1.0)")
        return looks


ONE_LOOK = SequentialPlan(looks=[1.0], spending="obrien-fleming")
"""A fixed-size test: every task, one look, the whole alpha at once."""


def spent(spending: Spending, alpha: float, fraction: float) -> float:
    """The alpha spent by the time ``fraction`` of the tasks has been seen (``alpha`` at 1)."""
    if spending == "pocock":
        return alpha * math.log(1 + (math.e - 1) * fraction)
    z = _NORMAL.inv_cdf(1 - alpha / 2)
    return 2 - 2 * _NORMAL.cdf(z / math.sqrt(fraction))


_GRID = 400
"""Points per look in the numerical integration of the test statistic's path."""
_TAIL = 8.0
"""Standard deviations below zero where the path's density is cut off."""


@functools.lru_cache(maxsize=1024)
def nominal_levels(
    spending: Spending, alpha: float, fractions: tuple[float, ...]
) -> tuple[float, ...]:
    """The one-sided p-value each look must reach so that, under H0, the chance of crossing at
    look k for the first time is the alpha spent between looks k-1 and k (a standard normal
    statistic on independent increments; Jennison and Turnbull, ch. 19). The path's density on
    the continuing region is integrated numerically from look to look; a later look never
    changes an earlier one's level, so looks at fractions not planned are allowed."""
    if not 0.0 < alpha < 1.0:
        raise ValueError("alpha must be in (0, 1)")
    if any(not 0.0 < t <= 1.0 for t in fractions) or any(
        b <= a for a, b in itertools.pairwise(fractions)
    ):
        raise ValueError("fractions must rise strictly within (0, 1]")
    levels: list[float] = []
    mass: list[tuple[float, float]] = []  # continuing paths at the last look: (value, mass)
    before, used = 0.0, 0.0
    for t in fractions:
        budget = max(spent(spending, alpha, t) - used, 1e-12)  # an early look spends ~nothing
        if not mass:
            levels.append(budget)  # the first look spends its budget alone
            bound = math.sqrt(t) * _NORMAL.inv_cdf(1 - budget)
        else:
            bound = _crossing_bound(mass, math.sqrt(t - before), budget, math.sqrt(t))
            levels.append(1 - _NORMAL.cdf(bound / math.sqrt(t)))
        mass = _continuing(mass, t, t - before, bound)
        before, used = t, used + budget
    return tuple(levels)


def _crossing_bound(
    mass: list[tuple[float, float]], step: float, budget: float, scale: float
) -> float:
    """The bound the path must cross at this look to spend exactly ``budget`` (bisection)."""

    def crossing(bound: float) -> float:
        return sum(m * _NORMAL.cdf((s - bound) / step) for s, m in mass)

    low, high = -_TAIL * scale, (_TAIL + 2) * scale
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if crossing(middle) > budget else (low, middle)
    return (low + high) / 2


def _continuing(
    mass: list[tuple[float, float]], t: float, step: float, bound: float
) -> list[tuple[float, float]]:
    """The mass of paths below ``bound`` at time ``t`` on a grid (trapezoid weights), from the
    continuing mass at the previous look (``step`` later) or from zero at the first."""
    low = -_TAIL * math.sqrt(t)
    width = (bound - low) / (_GRID - 1)
    points = [low + i * width for i in range(_GRID)]
    sources = mass or [(0.0, 1.0)]
    scale = 1 / math.sqrt(2 * math.pi * step)
    out = []
    for i, point in enumerate(points):
        density = scale * sum(m * math.exp(-((point - s) ** 2) / (2 * step)) for s, m in sources)
        weight = width / 2 if i in (0, _GRID - 1) else width
        out.append((point, density * weight))
    return out
