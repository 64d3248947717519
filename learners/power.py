"""What the promotion rule can tell at a contract's suite sizes, by simulating paired outcomes.

Model: on each task the parent passes with probability ``base``; a share ``noise`` of the tasks
flips by chance (half to a win for the candidate, half to a loss), and a true change ``delta``
adds wins (a gain) or losses (a drop) on top, so the candidate's pass rate is the parent's plus
``delta``. For each suite size and change, the share of simulated candidates the rule passes:
on its own suite (gain at least ``min_gain``, sign test at ``alpha``) and on a guarded suite
(contract v1's threshold, or v2's non-inferiority test). Deterministic (seeded).

Usage: python -m learners.power [--sims N] [--noise R]
"""

from __future__ import annotations

import argparse
import functools
import random
from collections.abc import Callable, Sequence

from core.contract import (
    Contract,
    PromotionRule,
    non_inferiority_p_value,
    sign_test_p_value,
)
from learners.contract_runner import CONTRACT_V1, CONTRACT_V2, load_contract

BASE = 0.5
NOISE = 0.10
SIMS = 4000
GAINS = (0.0, 0.05, 0.10, 0.15, 0.20, 0.30)
DROPS = (0.05, 0.0, -0.02, -0.05, -0.10)

Verdict = Callable[[int, int, int], bool]
"""Whether the rule passes a suite of ``n`` tasks with ``wins`` and ``losses`` (n, wins, losses)."""


def pass_rate(
    n: int, delta: float, verdict: Verdict, *, noise: float, sims: int, seed: int
) -> float:
    """The share of ``sims`` simulated suites of ``n`` tasks that ``verdict`` passes."""
    win = noise / 2 + max(delta, 0.0)
    loss = noise / 2 + max(-delta, 0.0)
    rng = random.Random(seed)  # noqa: S311 (a simulation, not a secret)
    passed = 0
    for _ in range(sims):
        draws = rng.choices((0, 1, 2), weights=(1 - win - loss, win, loss), k=n)
        passed += verdict(n, draws.count(1), draws.count(2))
    return passed / sims


def own_suite(rule: PromotionRule) -> Verdict:
    @functools.cache
    def verdict(n: int, wins: int, losses: int) -> bool:
        return (wins - losses) / n >= rule.min_gain and sign_test_p_value(
            wins, losses
        ) <= rule.alpha

    return verdict


def guarded_suite(rule: PromotionRule, suite: str) -> Verdict:
    @functools.cache
    def verdict(n: int, wins: int, losses: int) -> bool:
        if rule.non_inferiority is not None:
            guard = rule.non_inferiority
            margin = guard.margin_for(suite)
            return non_inferiority_p_value(wins, losses, n, margin) <= guard.alpha
        assert rule.max_regression is not None
        return (losses - wins) / n <= rule.max_regression

    return verdict


def _suite_size(contract: Contract, suite: str) -> int:
    return len(contract.suites[suite])


def tables(contracts: Sequence[Contract], *, noise: float, sims: int) -> str:
    """The power tables as markdown: own-suite gains, then guarded-suite changes."""
    lines = [
        f"Own suite: share of candidates passed at a true gain (noise {noise:.0%} of tasks "
        f"flipping by chance, {sims} simulations each).",
        "",
        "| contract | suite (tasks) | " + " | ".join(f"+{g * 100:.0f} pts" for g in GAINS) + " |",
        "|---|---|" + "---|" * len(GAINS),
    ]
    for contract in contracts:
        suite = "genui"
        n = _suite_size(contract, suite)
        rates = [
            pass_rate(n, g, own_suite(contract.rule), noise=noise, sims=sims, seed=1) for g in GAINS
        ]
        lines.append(
            f"| {contract.version} | {suite} ({n}) | "
            + " | ".join(f"{r:.0%}" for r in rates)
            + " |"
        )
    lines += [
        "",
        "Guarded suites: share of candidates the guard lets through at a true change.",
        "",
        "| contract | suite (tasks) | guard | "
        + " | ".join(f"{d * 100:+.0f} pts" for d in DROPS)
        + " |",
        "|---|---|---|" + "---|" * len(DROPS),
    ]
    for contract in contracts:
        for suite in ("general", "chat"):
            n = _suite_size(contract, suite)
            rule = contract.rule
            guard = _guard_text(rule, suite)
            verdict = guarded_suite(rule, suite)
            rates = [pass_rate(n, d, verdict, noise=noise, sims=sims, seed=2) for d in DROPS]
            lines.append(
                f"| {contract.version} | {suite} ({n}) | {guard} | "
                + " | ".join(f"{r:.0%}" for r in rates)
                + " |"
            )
    return "\n".join(lines)


def _guard_text(rule: PromotionRule, suite: str) -> str:
    if rule.non_inferiority is None:
        return f"drop at most {(rule.max_regression or 0.0) * 100:.0f} pts"
    guard = rule.non_inferiority
    return f"non-inferior within {guard.margin_for(suite) * 100:.0f} pts, alpha {guard.alpha}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sims", type=int, default=SIMS)
    parser.add_argument("--noise", type=float, default=NOISE)
    args = parser.parse_args()
    contracts = [load_contract(CONTRACT_V1), load_contract(CONTRACT_V2)]
    print(tables(contracts, noise=args.noise, sims=args.sims))


if __name__ == "__main__":
    main()
