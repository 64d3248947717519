"""Sequential decisions: the alpha-spending boundaries, the contract's plan checked at load, and
the rule stopping early on a clear win and a clear loss but running to the end on a tie, both
on constructed outcomes and through ``judge`` serving a contract on an engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from pathlib import Path
from statistics import NormalDist

import pytest
import yaml

from core.contract import decide
from core.engine import GenerationChunk, GenerationRequest
from core.errors import ContractInvalid
from core.harness.artifact import root_version
from core.sequential import decide_at_look, schedule
from core.statistics import nominal_levels
from engines.instant import InstantEngine
from learners.evaluation.contract_runner import (
    CONTRACT_V2,
    CONTRACT_V2S,
    Baseline,
    judge,
    load_contract,
    run_contract,
)
from learners.evaluation.power import simulate

CONTRACT = load_contract(CONTRACT_V2S)
RULE = CONTRACT.rule
OWN = "genui"
HARNESS = root_version()
ADAPTERS = {name: f"{name}@0" for name in CONTRACT.specialists()}


def _z(levels: tuple[float, ...]) -> list[float]:
    return [round(NormalDist().inv_cdf(1 - level), 2) for level in levels]


def test_the_boundaries_are_the_published_ones() -> None:
    """Lan-DeMets O'Brien-Fleming type, one-sided 0.025, four equal looks: 4.33, 2.96, 2.36,
    2.01 (Jennison and Turnbull, table 7.6); Pocock type starts at the alpha it spends."""
    looks = (0.25, 0.5, 0.75, 1.0)
    assert _z(nominal_levels("obrien-fleming", 0.025, looks)) == [4.33, 2.96, 2.36, 2.01]
    assert _z(nominal_levels("pocock", 0.025, looks)) == [2.37, 2.37, 2.36, 2.35]
    assert nominal_levels("obrien-fleming", 0.1, (1.0,)) == pytest.approx([0.1])
    with pytest.raises(ValueError, match="rise"):
        nominal_levels("pocock", 0.05, (0.5, 0.5, 1.0))


@pytest.mark.parametrize(
    ("sequential", "problem"),
    [
        ({"looks": [0.5, 0.25, 1.0], "spending": "pocock"}, "rise strictly"),
        ({"looks": [0.25, 0.5], "spending": "pocock"}, "last look"),
        ({"looks": [0.0, 1.0], "spending": "pocock"}, "in (0, 1]"),
        ({"looks": [1.0], "spending": "haybittle"}, "obrien-fleming"),
        ({"looks": [], "spending": "pocock"}, "at least 1"),
    ],
)
def test_a_plan_that_does_not_add_up_is_contract_invalid(
    tmp_path: Path, sequential: dict[str, object], problem: str
) -> None:
    path = _sequential_contract(tmp_path, {**RULE.model_dump(), "sequential": sequential})
    with pytest.raises(ContractInvalid, match=problem.replace("(", r"\(").replace("]", r"\]")):
        load_contract(path)


def test_a_plan_with_alpha_out_of_range_or_a_threshold_guard_is_contract_invalid(
    tmp_path: Path,
) -> None:
    plan = {"looks": [0.5, 1.0], "spending": "pocock"}
    wide = {**RULE.model_dump(), "alpha": 0.6, "sequential": plan}
    with pytest.raises(ContractInvalid, match=r"alpha under 0\.5"):
        load_contract(_sequential_contract(tmp_path, wide))
    threshold = {"min_gain": 0.1, "alpha": 0.1, "max_regression": 0.02, "sequential": plan}
    with pytest.raises(ContractInvalid, match="needs the non_inferiority guard"):
        load_contract(_sequential_contract(tmp_path, threshold))


def test_extends_names_a_file_beside_it(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("extends: ../contract-v2.yaml\nversion: x\n")
    with pytest.raises(ContractInvalid, match="same folder"):
        load_contract(tmp_path / "c.yaml")


def _sequential_contract(folder: Path, rule: dict[str, object]) -> Path:
    (folder / "contract-v2.yaml").write_text(CONTRACT_V2.read_text())
    path = folder / "contract-seq.yaml"
    path.write_text(yaml.safe_dump({"extends": "contract-v2.yaml", "version": "s", "rule": rule}))
    return path


# --- the rule, look by look -----------------------------------------------------------------

PARENT = {
    suite: [i % 2 == 0 for i in range(len(tasks))] for suite, tasks in CONTRACT.suites.items()
}
CHUNKS = schedule(CONTRACT, frozenset({OWN}))
INHERITED = {
    suite: [task.specialist != OWN for task in tasks] for suite, tasks in CONTRACT.suites.items()
}


def _looks(candidate: dict[str, list[bool]]) -> list[dict[str, list[bool | None]]]:
    """The candidate's known outcomes after each look: the parent's on inherited tasks."""
    looks, seen = [], set()
    for chunk in CHUNKS:
        seen |= set(chunk)
        looks.append(
            {
                suite: [
                    candidate[suite][i]
                    if (suite, i) in seen or CONTRACT.suites[suite][i].specialist != OWN
                    else None
                    for i in range(len(done))
                ]
                for suite, done in candidate.items()
            }
        )
    return looks


def _candidate(genui: bool | None) -> dict[str, list[bool]]:
    """Every genui task passed (``True``), failed (``False``), or as the parent (``None``)."""
    return {
        suite: [
            p if genui is None or task.specialist != OWN or suite != OWN else genui
            for p, task in zip(PARENT[suite], CONTRACT.suites[suite], strict=True)
        ]
        for suite in PARENT
    }


def test_the_changed_tasks_are_run_a_quarter_at_a_time_in_hash_order() -> None:
    assert [len(chunk) for chunk in CHUNKS] == [16, 16, 16, 16]  # 44 own, 20 general
    assert [sum(suite == OWN for suite, _ in chunk) for chunk in CHUNKS] == [11, 11, 11, 11]
    genui = [
        (s, i) for s, t in CONTRACT.suites.items() for i, x in enumerate(t) if x.specialist == OWN
    ]
    assert sorted(key for chunk in CHUNKS for key in chunk) == sorted(genui)
    assert CHUNKS[0] != sorted(CHUNKS[0])  # not the file's order
    assert schedule(CONTRACT, frozenset({OWN})) == CHUNKS


@pytest.mark.parametrize(("genui", "passed", "look"), [(True, True, 2), (False, False, 2)])
def test_a_clear_win_or_loss_stops_early(genui: bool, passed: bool, look: int) -> None:
    looks = _looks(_candidate(genui))
    assert decide_at_look(looks[:1], PARENT, OWN, RULE, INHERITED) is None
    settled = decide_at_look(looks[:look], PARENT, OWN, RULE, INHERITED)
    assert settled is not None
    decision, stop = settled
    assert (decision.passed, stop.look, stop.looks) == (passed, look, 4)
    full = decide(_candidate(genui), PARENT, OWN, RULE)
    assert full.passed == passed  # the verdict a full look would reach


def test_a_tie_runs_to_the_last_look() -> None:
    looks = _looks(_candidate(None))
    assert all(decide_at_look(looks[:k], PARENT, OWN, RULE, INHERITED) is None for k in (1, 2, 3))
    settled = decide_at_look(looks, PARENT, OWN, RULE, INHERITED)
    assert settled is not None
    decision, stop = settled
    assert not decision.passed and stop.look == 4
    assert stop.why.startswith("gain on genui")


def test_without_a_plan_the_rule_looks_once_as_decide_does() -> None:
    fixed = RULE.model_copy(update={"sequential": None})
    candidate = _candidate(True)
    settled = decide_at_look([candidate], PARENT, OWN, fixed)
    assert settled is not None and settled[0] == decide(candidate, PARENT, OWN, fixed)
    with pytest.raises(ValueError, match="every outcome"):
        decide_at_look(_looks(candidate)[:1], PARENT, OWN, fixed)


def test_an_unlearning_candidate_needs_no_gain_but_must_hold_its_own_suite() -> None:
    """Judged against the release it would fall back to, a candidate that ties on its own suite
    passes at the last look (the gain rule rejects the same outcomes), and one that loses its
    own suite fails on that suite's guard, as a single look at every task does."""
    tie = _looks(_candidate(None))
    settled = decide_at_look(tie, PARENT, OWN, RULE, INHERITED, needs_gain=False)
    assert settled is not None
    decision, stop = settled
    assert decision.passed and stop.why == "every guard is shown"
    assert set(decision.guard_p_values) == set(PARENT) and decision.guard_p_values[OWN] <= 0.05
    assert decision.p_value == 1.0  # the sign test, reported: no wins, no losses
    assert not decide(_candidate(None), PARENT, OWN, RULE).passed
    assert decide(_candidate(None), PARENT, OWN, RULE, needs_gain=False).passed
    lost = _looks(_candidate(False))
    settled = next(
        r
        for k in range(1, 5)
        if (r := decide_at_look(lost[:k], PARENT, OWN, RULE, INHERITED, needs_gain=False))
    )
    assert not settled[0].passed and settled[1].why.startswith(f"{OWN} is not shown")
    fixed = decide(_candidate(False), PARENT, OWN, RULE, needs_gain=False)
    assert not fixed.passed and fixed.reasons[-1].startswith(f"{OWN} is not shown")


def test_the_simulated_type_one_error_stays_within_alpha() -> None:
    """The gain test alone (no minimum gain) with tasks flipping by chance, and the guard at a
    true drop of exactly its margin, on a suite run whole and on one whose 20 changed tasks of
    150 carry the drop: each passes at most its alpha (plus simulation error)."""
    alone = RULE.model_copy(update={"min_gain": 0.0})
    inherited = (150, (0.0, 0.0), 0)
    error, _ = simulate(alone, (44, (0.15, 0.15), 44), inherited, sims=1500, seed=11)
    assert error <= RULE.alpha + 0.015
    guard = RULE.non_inferiority
    assert guard is not None
    drop = guard.margin_for("general")
    for changed in (150, 20):
        at_margin = (150, (0.05, 0.05 + drop * 150 / changed), changed)
        error, _ = simulate(RULE, (44, (1.0, 0.0), 44), at_margin, sims=1500, seed=12)
        assert error <= guard.alpha + 0.015, changed


def test_a_few_changed_tasks_that_all_lose_fail_the_guard_however_many_are_inherited() -> None:
    """The general suite's 20 genui tasks, each passed by the parent and lost by the candidate,
    are a 13-point drop of the 150-task suite: counted among 130 inherited ties they would look
    like a small one at the first look; counted alone against the scaled margin they fail."""
    parent = {suite: [suite != OWN] * len(tasks) for suite, tasks in CONTRACT.suites.items()}
    candidate = {  # genui's own suite all won, its general tasks all lost, the rest inherited
        suite: [suite == OWN or task.specialist != OWN for task in tasks]
        for suite, tasks in CONTRACT.suites.items()
    }
    looks = _looks(candidate)
    settled = next(
        r for k in range(1, 5) if (r := decide_at_look(looks[:k], parent, OWN, RULE, INHERITED))
    )
    decision, stop = settled
    assert not decision.passed and stop.why.startswith("general is not shown")
    assert decision.regressions["general"] > 0.13 - 1e-9


# --- through the engine ---------------------------------------------------------------------


class _Scripted(InstantEngine):
    """Answers a genui task with its reference (``right``), a wrong reply, or as the parent
    did (``None``); every other task as the parent did. Counts what it served."""

    def __init__(self, right: bool | None) -> None:
        self.served = 0
        answers = {}
        for suite, tasks in CONTRACT.suites.items():
            for index, task in enumerate(tasks):
                good = PARENT[suite][index] if right is None or task.specialist != OWN else right
                answers[task.prompt] = task.reference if good else "nope"
        super().__init__(lambda messages: answers[messages[-1]["content"]])
        for adapter in ADAPTERS.values():
            self.load_adapter(adapter, "unused")

    def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        self.served += 1
        return super().generate(request)


@pytest.mark.parametrize(
    ("right", "passed", "look"), [(True, True, 2), (False, False, 2), (None, False, 4)]
)
def test_judge_serves_only_until_the_verdict_is_known(
    right: bool | None, passed: bool, look: int
) -> None:
    parent = asyncio.run(run_contract(_Scripted(None), ADAPTERS, CONTRACT, harness=HARNESS))
    assert parent.complete() == PARENT  # every reference passes, "nope" fails
    engine = _Scripted(right)
    verdict = asyncio.run(
        judge(
            engine,
            ADAPTERS,
            CONTRACT,
            HARNESS,
            Baseline(parent, frozenset({OWN}), OWN),
        )
    )
    assert (verdict.decision.passed, verdict.stop.look) == (passed, look)
    assert engine.served == verdict.tasks_run == 16 * look
    assert verdict.tasks_planned == 64
    missing = verdict.run.missing()
    assert len(missing) == 64 - 16 * look
    assert all(CONTRACT.suites[suite][i].specialist == OWN for suite, i in missing)
    assert (
        verdict.run.outcomes().items()
        >= {
            k: o
            for k, o in parent.outcomes().items()
            if CONTRACT.suites[k[0]][k[1]].specialist != OWN
        }.items()
    )
