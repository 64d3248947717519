"""What the promotion rule can tell at a contract's suite sizes, by simulating paired outcomes.

Model: on each task the parent passes with probability ``base``; a share ``noise`` of the tasks
flips by chance (half to a win for the candidate, half to a loss), and a true change ``delta``
adds wins (a gain) or losses (a drop) on top, so the candidate's pass rate is the parent's plus
``delta``. For each suite size and change, the share of simulated candidates the rule passes:
on its own suite (gain at least ``min_gain``, sign test at ``alpha``) and on a guarded suite
(contract v1's threshold, or v2's non-inferiority test). Deterministic (seeded).

Usage: python -m learners.evaluation.power [--sims N] [--noise R]
"""

from __future__ import annotations

import argparse
import functools
import math
import random
from collections.abc import Callable, Sequence

from core.contract import Contract, PromotionRule
from core.sequential import decide_at_look
from core.statistics import SequentialPlan, non_inferiority_p_value, sign_test_p_value
from learners.evaluation.contract_runner import (
    CONTRACT_V1,
    CONTRACT_V2,
    CONTRACT_V2S,
    load_contract,
)

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


Draw = tuple[float, float]
"""A suite's chance per task of a win and of a loss for the candidate."""
Suite = tuple[int, Draw, int]
"""A simulated suite: its tasks, the draw of its changed tasks, and how many are changed (run
look by look); the rest are inherited, ties known from the first look, as the tasks of the
specialists a candidate does not change."""
LOOKS = [0.25, 0.5, 0.75, 1.0]


def simulate(
    rule: PromotionRule, own: Suite, guard: Suite, *, sims: int, seed: int
) -> tuple[float, float]:
    """The share of ``sims`` simulated candidates ``rule`` passes, and the mean share of the
    changed tasks run by its stop: an own suite and one guarded suite, their changed tasks
    served look by look in random order (``core.sequential.decide_at_look``)."""
    rng = random.Random(seed)  # noqa: S311 (a simulation, not a secret)
    looks = rule.sequential.looks if rule.sequential else [1.0]
    shapes = {"own": own, "guard": guard}
    inherited = {name: [i >= c for i in range(n)] for name, (n, _, c) in shapes.items()}
    passed, run = 0, 0.0
    for _ in range(sims):
        suites = {
            name: _pairs(rng, changed, draw) + [(False, False)] * (n - changed)
            for name, (n, draw, changed) in shapes.items()
        }
        parent = {name: [p for _, p in pairs] for name, pairs in suites.items()}
        known = [
            {
                name: [
                    c if inherited[name][i] or i < math.ceil(t * shapes[name][2] - 1e-9) else None
                    for i, (c, _) in enumerate(pairs)
                ]
                for name, pairs in suites.items()
            }
            for t in looks
        ]
        settled = decide_at_look(known, parent, "own", rule, inherited)
        assert settled is not None
        decision, stop = settled
        passed += decision.passed
        run += looks[stop.look - 1]
    return passed / sims, run / sims


def _pairs(rng: random.Random, n: int, draw: Draw) -> list[tuple[bool, bool]]:
    """(candidate passed, parent passed) per task: a win, a loss, or a tie (both fail)."""
    win, loss = draw
    kinds = ((True, False), (False, True), (False, False))
    return rng.choices(kinds, (win, loss, 1 - win - loss), k=n)


def _flips(noise: float, delta: float) -> Draw:
    return noise / 2 + max(delta, 0.0), noise / 2 + max(-delta, 0.0)


def sequential_tables(contract: Contract, *, sims: int) -> str:
    """The plan of ``contract`` against one look: error rates, power and tasks run."""
    rule = contract.rule
    assert rule.sequential is not None and rule.non_inferiority is not None
    designs = {
        "one look": rule.model_copy(update={"sequential": None}),
        **{
            f"{len(LOOKS)} looks, {spending}": rule.model_copy(
                update={"sequential": SequentialPlan(looks=LOOKS, spending=spending)}
            )
            for spending in ("obrien-fleming", "pocock")
        },
    }
    return "\n".join(_gain_rows(contract, designs, sims) + _guard_rows(contract, designs, sims))


def _gain_rows(contract: Contract, designs: dict[str, PromotionRule], sims: int) -> list[str]:
    own, general = _suite_size(contract, "genui"), _suite_size(contract, "general")
    inherited: Suite = (general, (0.0, 0.0), 0)
    alpha = contract.rule.alpha
    lines = [
        f"Gain test, own suite of {own} tasks run (the general suite inherited): share of "
        f"candidates passed and share of the tasks run, {sims} simulations each. Type-I error: "
        "the test alone (no minimum gain) with 30 % of tasks flipping by chance and no true "
        f"gain; it must stay at most alpha = {alpha}.",
        "",
        "| design | type-I error | +0 pts | +10 pts | +20 pts | +30 pts | run at +0 | at +20 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, design in designs.items():
        alone = design.model_copy(update={"min_gain": 0.0})
        error, _ = simulate(alone, (own, _flips(0.3, 0.0), own), inherited, sims=sims, seed=3)
        cells = [
            simulate(design, (own, _flips(NOISE, g), own), inherited, sims=sims, seed=4)
            for g in (0.0, 0.1, 0.2, 0.3)
        ]
        rates = " | ".join(f"{p:.0%}" for p, _ in cells)
        lines.append(f"| {name} | {error:.1%} | {rates} | {cells[0][1]:.0%} | {cells[2][1]:.0%} |")
    return lines


def _guard_rows(contract: Contract, designs: dict[str, PromotionRule], sims: int) -> list[str]:
    own, general = _suite_size(contract, "genui"), _suite_size(contract, "general")
    share = sum(task.specialist == "genui" for task in contract.suites["general"])
    guard = contract.rule.non_inferiority
    assert guard is not None
    margin = guard.margin_for("general")
    lines = [
        "",
        f"Guard, general suite of {general} tasks (the own suite wins every task): share of "
        "candidates let through at a true change of the whole suite, and share of its changed "
        f"tasks run; every task changed, or only genui's {share} (the change then falls on "
        f"those). At -{margin * 100:.0f} pts (the margin) it is the type-I error, which must stay "
        f"at most alpha = {guard.alpha}.",
        "",
        f"| design | changed | -{margin * 100:.0f} pts | -10 pts | +0 pts | +5 pts "
        "| run at +0 | at -10 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    wins: Suite = (own, (1.0, 0.0), own)
    for name, design in designs.items():
        for changed in (general, share):
            cells = [
                simulate(
                    design,
                    wins,
                    (general, _flips(NOISE, d * general / changed), changed),
                    sims=sims,
                    seed=5,
                )
                for d in (-margin, -0.1, 0.0, 0.05)
            ]
            rates = " | ".join(f"{p:.1%}" for p, _ in cells)
            lines.append(
                f"| {name} | {changed} | {rates} | {cells[2][1]:.0%} | {cells[1][1]:.0%} |"
            )
    return lines


def _guard_text(rule: PromotionRule, suite: str) -> str:
    if rule.non_inferiority is None:
        return f"drop at most {(rule.max_regression or 0.0) * 100:.0f} pts"
    guard = rule.non_inferiority
    return f"non-inferior within {guard.margin_for(suite) * 100:.0f} pts, alpha {guard.alpha}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sims", type=int, default=SIMS)
    parser.add_argument("--noise", type=float, default=NOISE)
    args = parser.parse_args(argv)
    contracts = [load_contract(CONTRACT_V1), load_contract(CONTRACT_V2)]
    print(tables(contracts, noise=args.noise, sims=args.sims))
    print()
    print(sequential_tables(load_contract(CONTRACT_V2S), sims=args.sims))


if __name__ == "__main__":
    main()
