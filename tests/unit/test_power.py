"""The power table: simulated pass rates move the right way with the true change, the table
names both contracts' guarded suites, and the docs show what it prints."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.contract import NonInferiority, PromotionRule
from learners.evaluation.contract_runner import CONTRACT_V1, CONTRACT_V2, load_contract
from learners.evaluation.power import guarded_suite, main, own_suite, pass_rate, tables

GUARD = PromotionRule(
    min_gain=0.1, alpha=0.1, non_inferiority=NonInferiority(margin=0.07, alpha=0.05)
)


def test_a_bigger_gain_passes_more_often_and_a_bigger_drop_less() -> None:
    own = own_suite(GUARD)
    gains = [pass_rate(44, g, own, noise=0.1, sims=400, seed=1) for g in (0.0, 0.1, 0.3)]
    assert gains == sorted(gains) and gains[0] < 0.1 < 0.9 < gains[-1]
    guard = guarded_suite(GUARD, "general")
    drops = [pass_rate(150, d, guard, noise=0.1, sims=400, seed=2) for d in (0.05, -0.05, -0.15)]
    assert drops == sorted(drops, reverse=True) and drops[0] > 0.9 and drops[-1] < 0.05


def test_the_table_covers_both_contracts() -> None:
    text = tables([load_contract(CONTRACT_V1), load_contract(CONTRACT_V2)], noise=0.1, sims=50)
    assert "| contract-1 | general (24) | drop at most 2 pts |" in text
    assert "| contract-2 | general (150) | non-inferior within 7 pts, alpha 0.05 |" in text
    assert "| contract-2 | genui (44) |" in text


def test_the_tables_in_the_docs_are_what_the_simulation_prints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """docs/learning.md shows ``python -m learners.evaluation.power`` as it prints today, line for
    line (seeded, so a change of the rule or the simulation that moves a figure fails here)."""
    main([])
    printed = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    docs = (Path(__file__).resolve().parents[2] / "docs" / "learning.md").read_text()
    assert printed and [line for line in printed if line not in docs.splitlines()] == []
