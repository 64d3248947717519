"""Contract v1 and the task bank: the promotion rule and its exact sign test, every checker kind
(references pass, wrong answers fail), the coding sandbox (no network, time and memory limits),
the contract held out from the bank, loading errors, and scoring through an engine."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import pytest
import yaml

from core.contract import NonInferiority, PromotionRule, RoutingRule, decide, decide_routing
from core.engine import GenerationChunk, GenerationRequest
from core.errors import ContractInvalid, TaskBankInvalid
from core.harness.artifact import root_version
from core.harness.hcp import build_context
from core.routing_labels import FollowUp
from core.statistics import non_inferiority_p_value, sign_test_p_value
from core.tasks import (
    NEAR_DUPLICATE,
    Checker,
    ExactChecker,
    GenUIChecker,
    PythonTestsChecker,
    RegexChecker,
    Task,
    ToolCallChecker,
    prompt_words,
    word_overlap,
)
from engines.instant import InstantEngine, fixed_reply
from learners.evaluation import sandbox
from learners.evaluation.checkers import check, well_formed
from learners.evaluation.contract_runner import (
    CONTRACT_V1,
    CONTRACT_V2,
    CONTRACT_V3,
    CONTRACT_V4,
    load_contract,
    run_contract,
)
from learners.evaluation.sandbox import python_tests_pass
from learners.routing.run import routing_suite
from learners.tasks import BANK_V1, load_bank

CONTRACT = load_contract(CONTRACT_V1)
V2 = load_contract(CONTRACT_V2)
V2_TASKS = [task for tasks in V2.suites.values() for task in tasks]
V3 = load_contract(CONTRACT_V3)
V3_TASKS = [task for tasks in V3.suites.values() for task in tasks]
ROOT = root_version()
BANK = load_bank()
CONTRACT_TASKS = [task for tasks in CONTRACT.suites.values() for task in tasks]
RULE = PromotionRule(min_gain=0.1, alpha=0.1, max_regression=0.02)
ADAPTERS = {name: f"{name}@1" for name in CONTRACT.specialists()}


def task(checker: Checker, specialist: str = "chat") -> Task:
    return Task(id="t", specialist=specialist, prompt="p", checker=checker, reference="r")


def outcomes(passes: int, total: int) -> list[bool]:
    return [True] * passes + [False] * (total - passes)


# --- the rule -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("wins", "losses", "expected"),
    [
        (0, 0, 1.0),
        (0, 4, 1.0),
        (5, 0, 1 / 32),
        (3, 1, 5 / 16),  # (C(4,3) + C(4,4)) / 2^4
        (6, 2, 37 / 256),  # (28 + 8 + 1) / 2^8
        (10, 3, 378 / 8192),  # (286 + 78 + 13 + 1) / 2^13
        (1, 1, 3 / 4),
    ],
)
def test_sign_test_p_values_are_exact(wins: int, losses: int, expected: float) -> None:
    assert sign_test_p_value(wins, losses) == expected


def test_a_large_significant_gain_without_regressions_passes() -> None:
    parent = {"coding": outcomes(4, 10), "general": outcomes(20, 24)}
    candidate = {"coding": outcomes(8, 10), "general": outcomes(20, 24)}
    decision = decide(candidate, parent, "coding", RULE)
    assert decision.passed
    assert decision.reasons == []
    assert decision.gain == pytest.approx(0.4)
    assert decision.p_value == 1 / 16
    assert decision.regressions == {"general": 0.0}


def test_a_significant_but_too_small_gain_fails() -> None:
    parent = {"chat": outcomes(50, 100)}
    candidate = {"chat": outcomes(58, 100)}  # 8 wins, no losses: p = 1/256, but only 8 points
    decision = decide(candidate, parent, "chat", RULE)
    assert not decision.passed
    assert decision.p_value == 1 / 256
    assert len(decision.reasons) == 1
    assert "8.0 points" in decision.reasons[0]


def test_a_large_gain_that_is_not_significant_fails() -> None:
    parent = {"agent": [True, False, False, False, True, True, False, False, False, False]}
    candidate = {"agent": [False, True, True, True, True, True, False, False, False, False]}
    decision = decide(candidate, parent, "agent", RULE)  # 3 wins, 1 loss: +20 points
    assert not decision.passed
    assert decision.gain == pytest.approx(0.2)
    assert decision.p_value == 5 / 16
    assert len(decision.reasons) == 1
    assert "not significant" in decision.reasons[0]


def test_a_regression_on_another_suite_fails() -> None:
    parent = {"genui": outcomes(2, 10), "general": outcomes(24, 24), "chat": outcomes(5, 12)}
    candidate = {"genui": outcomes(10, 10), "general": outcomes(23, 24), "chat": outcomes(6, 12)}
    decision = decide(candidate, parent, "genui", RULE)
    assert not decision.passed
    assert decision.regressions == pytest.approx({"general": 1 / 24, "chat": -1 / 12})
    assert len(decision.reasons) == 1
    assert decision.reasons[0].startswith("general drops by 4.2 points")


def test_gains_and_drops_exactly_at_the_limits_pass() -> None:
    rule = PromotionRule(min_gain=0.1, alpha=1.0, max_regression=0.02)
    parent = {"chat": outcomes(6, 10), "general": outcomes(50, 50)}
    candidate = {"chat": outcomes(7, 10), "general": outcomes(49, 50)}
    decision = decide(candidate, parent, "chat", rule)
    assert decision.passed, decision.reasons


def test_every_failed_condition_has_a_reason() -> None:
    parent = {"chat": outcomes(5, 10), "general": outcomes(10, 10)}
    candidate = {"chat": outcomes(5, 10), "general": outcomes(0, 10)}
    assert len(decide(candidate, parent, "chat", RULE).reasons) == 3


@pytest.mark.parametrize(
    ("candidate", "parent", "specialist"),
    [
        ({"chat": [True]}, {"chat": [True, False]}, "chat"),
        ({"chat": [True], "general": [True]}, {"chat": [True]}, "chat"),
        ({"chat": [True]}, {"chat": [True]}, "coding"),
        ({"chat": []}, {"chat": []}, "chat"),
    ],
)
def test_unpaired_outcomes_are_refused(
    candidate: dict[str, list[bool]], parent: dict[str, list[bool]], specialist: str
) -> None:
    with pytest.raises(ValueError):
        decide(candidate, parent, specialist, RULE)


GUARD = PromotionRule(
    min_gain=0.1,
    alpha=0.1,
    non_inferiority=NonInferiority(margin=0.05, alpha=0.05, margins={"chat": 0.1}),
)


def _flipped(passes: int, total: int, wins: int, losses: int) -> tuple[list[bool], list[bool]]:
    """Paired (candidate, parent) outcomes: ``passes`` tasks passed by both, then ``wins`` by the
    candidate only and ``losses`` by the parent only, the rest by neither."""
    rest = total - passes - wins - losses
    candidate = [True] * passes + [True] * wins + [False] * losses + [False] * rest
    parent = [True] * passes + [False] * wins + [True] * losses + [False] * rest
    return candidate, parent


def _brute_force_p_value(wins: int, losses: int, pairs: int, margin: float) -> float:
    """The same score test with the restricted MLE found by a grid search, not the root."""
    best, at = -math.inf, 0.0
    for step in range(1, 20000):
        q = step / 20000
        win_cell, both_or_neither = q - margin, 1 - 2 * q + margin
        if win_cell <= 0 or both_or_neither <= 0:
            continue
        likelihood = (
            wins * math.log(win_cell)
            + losses * math.log(q)
            + (pairs - wins - losses) * math.log(both_or_neither)
        )
        if likelihood > best:
            best, at = likelihood, q
    z = (wins - losses + pairs * margin) / math.sqrt(pairs * (2 * at - margin - margin**2))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.mark.parametrize(
    ("wins", "losses", "pairs", "margin"),
    [(0, 0, 150, 0.05), (3, 5, 150, 0.05), (10, 2, 40, 0.1), (0, 6, 24, 0.1), (2, 9, 150, 0.05)],
)
def test_the_non_inferiority_test_takes_the_restricted_mle(
    wins: int, losses: int, pairs: int, margin: float
) -> None:
    assert non_inferiority_p_value(wins, losses, pairs, margin) == pytest.approx(
        _brute_force_p_value(wins, losses, pairs, margin), abs=1e-3
    )


def test_the_non_inferiority_test_at_its_edges() -> None:
    # No task flips: 150 tasks show a 5-point margin, 24 cannot (too few to tell).
    assert non_inferiority_p_value(0, 0, 150, 0.05) < 0.005
    assert non_inferiority_p_value(0, 0, 24, 0.05) > 0.1
    # More losses, or a smaller margin, never make it easier to pass.
    values = [non_inferiority_p_value(2, losses, 150, 0.05) for losses in range(12)]
    assert values == sorted(values)
    assert non_inferiority_p_value(2, 4, 150, 0.03) > non_inferiority_p_value(2, 4, 150, 0.05)
    # Every task lost is as far from non-inferior as it gets.
    assert non_inferiority_p_value(0, 150, 150, 0.05) == pytest.approx(1.0)
    for bad in [(-1, 0, 10, 0.05), (6, 6, 10, 0.05), (0, 0, 0, 0.05), (0, 0, 10, 0.0)]:
        with pytest.raises(ValueError):
            non_inferiority_p_value(*bad)


def test_the_guard_lets_a_few_flips_through_and_stops_a_real_drop() -> None:
    own_c, own_p = _flipped(20, 40, 10, 0)
    few_c, few_p = _flipped(100, 150, 3, 4)  # 1 point down: within the 5-point margin
    drop_c, drop_p = _flipped(100, 150, 1, 15)  # 9.3 points down
    decision = decide(
        {"genui": own_c, "general": few_c}, {"genui": own_p, "general": few_p}, "genui", GUARD
    )
    assert decision.passed, decision.reasons
    assert decision.guard_p_values["general"] <= 0.05
    decision = decide(
        {"genui": own_c, "general": drop_c}, {"genui": own_p, "general": drop_p}, "genui", GUARD
    )
    assert not decision.passed
    [reason] = decision.reasons
    assert reason.startswith("general is not shown within 5.0 points of the parent")
    assert "(1 wins, 15 losses of 150 tasks)" in reason


def test_a_suite_may_have_its_own_margin() -> None:
    own_c, own_p = _flipped(20, 40, 10, 0)
    same = outcomes(30, 40)  # chat unchanged: 40 tasks show 10 points, not 5
    decision = decide(
        {"genui": own_c, "chat": same}, {"genui": own_p, "chat": same}, "genui", GUARD
    )
    assert decision.passed, decision.reasons
    strict = GUARD.model_copy(update={"non_inferiority": NonInferiority(margin=0.05, alpha=0.05)})
    decision = decide(
        {"genui": own_c, "chat": same}, {"genui": own_p, "chat": same}, "genui", strict
    )
    assert not decision.passed


@pytest.mark.parametrize(
    "rule",
    [
        {"min_gain": 0.1, "alpha": 0.1},  # no guard
        {
            "min_gain": 0.1,
            "alpha": 0.1,
            "max_regression": 0.02,
            "non_inferiority": {"margin": 0.05, "alpha": 0.05},
        },
        {"min_gain": 0.1, "alpha": 0.1, "non_inferiority": {"margin": 0.0, "alpha": 0.05}},
        {"min_gain": 0.1, "alpha": 0.1, "non_inferiority": {"margin": 1.0, "alpha": 0.05}},
        {
            "min_gain": 0.1,
            "alpha": 0.1,
            "non_inferiority": {"margin": 0.05, "alpha": 0.05, "margins": {"general": 1.5}},
        },
    ],
)
def test_a_rule_without_exactly_one_sound_guard_is_refused(
    rule: dict[str, Any], tmp_path: Path
) -> None:
    data = yaml.safe_load(CONTRACT_V1.read_text(encoding="utf-8"))
    path = tmp_path / "contract.yaml"
    path.write_text(yaml.safe_dump({**data, "rule": rule}), encoding="utf-8")
    with pytest.raises(ContractInvalid, match="rule"):
        load_contract(path)


# --- the task files -------------------------------------------------------------------------


def test_contract_v1_has_its_rule_and_suites() -> None:
    assert CONTRACT.version == "contract-1"
    assert CONTRACT.rule == RULE
    sizes = {suite: len(tasks) for suite, tasks in CONTRACT.suites.items()}
    assert sizes == {"chat": 12, "agent": 24, "coding": 12, "genui": 24, "general": 24}
    assert {t.specialist for t in CONTRACT.suites["general"]} == set(CONTRACT.specialists())


def test_the_bank_has_every_specialist() -> None:
    counts: dict[str, int] = {}
    for bank_task in BANK:
        counts[bank_task.specialist] = counts.get(bank_task.specialist, 0) + 1
    assert counts == {"genui": 120, "agent": 144, "coding": 40, "chat": 40}


@pytest.mark.parametrize(
    "case", CONTRACT_TASKS + V2_TASKS + V3_TASKS + BANK + load_bank(BANK_V1), ids=lambda t: t.id
)
def test_every_reference_passes_its_checker(case: Task) -> None:
    assert check(case, case.reference)


def test_contract_v3_is_v2_with_every_task_checking_content() -> None:
    """The same prompts and rule as contract 2s; every calculator task checks the result, every
    notes or todo task the operation and the words it stores, every GenUI task at least as
    many words as v2 did, and the bank (v2) is as strict."""
    assert V3.version == "contract-3" and V3.rule.sequential is not None
    assert [t.prompt for t in V3_TASKS] == [t.prompt for t in V2_TASKS]
    assert {t.id.replace("c3-", "c2-", 1) for t in V3_TASKS} == {t.id for t in V2_TASKS}
    for case in V3_TASKS + BANK:
        checker = case.checker
        if isinstance(checker, ToolCallChecker) and checker.tool == "calculator":
            assert set(checker.result) == {"value"} and not checker.args, case.id
        elif isinstance(checker, ToolCallChecker) and checker.tool in ("notes", "todo"):
            stores = {"set": "value", "add": "text"}.get(str(checker.args["op"]))
            assert stores is None or stores in checker.args or stores in checker.contains, case.id
    strict = {t.id.replace("c3-", "c2-", 1): t.checker for t in V3_TASKS}
    for case in V2_TASKS:
        if isinstance(case.checker, GenUIChecker):
            v3 = strict[case.id]
            assert isinstance(v3, GenUIChecker) and set(case.checker.must_contain) <= set(
                v3.must_contain
            )


def test_contract_v4_is_v3_with_follow_ups_in_its_routing_suite() -> None:
    """v4 judges adapters as v3 does; its router versions are also judged on the multi-turn
    cases, each a ``FollowUp`` routed after its previous turn. It is contract 5's development
    split."""
    v4 = load_contract(CONTRACT_V4)
    assert v4.version == "contract-4"
    assert (v4.suites, v4.rule, v4.answer_tokens) == (V3.suites, V3.rule, V3.answer_tokens)
    assert v4.routing is not None and V3.routing is not None and V3.routing.follow_ups is None
    assert v4.routing.model_copy(update={"follow_ups": None}) == V3.routing
    turns = routing_suite(CONTRACT_V4.parent, v4.routing)
    follow_ups = [t for t in turns if isinstance(t, FollowUp)]
    assert (len(turns), len(follow_ups)) == (248 + 60, 60)
    assert turns[-60:] == follow_ups and len(routing_suite(CONTRACT_V3.parent, V3.routing)) == 248


SUBTRACT = next(t for t in V3_TASKS if t.prompt == "Subtract 19 from 250.")


@pytest.mark.parametrize(
    ("expression", "passes"),
    [("250-19", True), ("-19 + 250", True), ("2+2", False), ("19-250", False), ("250", False)],
)
def test_a_v3_calculator_task_checks_the_result_not_only_the_call(
    expression: str, passes: bool
) -> None:
    call = json.dumps({"tool": "calculator", "args": {"expression": expression}})
    assert check(SUBTRACT, call) is passes
    v2 = next(t for t in V2_TASKS if t.prompt == SUBTRACT.prompt)
    assert check(v2, call)  # v2 took any calculator call


def test_the_contract_is_held_out_from_the_bank() -> None:
    assert not {t.id for t in CONTRACT_TASKS} & {t.id for t in BANK}
    for held_out in CONTRACT_TASKS:
        for trained in BANK:
            similarity = word_overlap(prompt_words(held_out.prompt), prompt_words(trained.prompt))
            assert similarity < NEAR_DUPLICATE, (held_out.prompt, trained.prompt)


def test_contract_v2_is_held_out_from_the_bank_and_from_v1() -> None:
    others = BANK + CONTRACT_TASKS
    assert not {t.id for t in V2_TASKS} & {t.id for t in others}
    seen = [(prompt_words(t.prompt), t.prompt) for t in others]
    for held_out in V2_TASKS:
        a = prompt_words(held_out.prompt)
        for b, prompt in seen:
            assert word_overlap(a, b) < NEAR_DUPLICATE, (held_out.prompt, prompt)
    assert len({t.prompt for t in V2_TASKS}) == len(V2_TASKS)
    words = [(prompt_words(t.prompt), t.id) for t in V2_TASKS]
    for index, (a, first) in enumerate(words):
        for b, second in words[index + 1 :]:
            assert word_overlap(a, b) < 0.8, (first, second)


def test_near_duplicates_ignore_case_punctuation_and_numbers() -> None:
    a = prompt_words("What is 12 + 30?")
    assert a == prompt_words("what is 7 + 8") == {"what", "is", "#"}
    assert word_overlap(a, prompt_words("What is the capital of Peru?")) == 2 / 7


def test_contract_v2_has_suites_that_can_tell() -> None:
    sizes = {suite: len(tasks) for suite, tasks in V2.suites.items()}
    assert all(sizes[s] >= 40 for s in V2.specialists()) and sizes["general"] >= 150
    general = {t.specialist for t in V2.suites["general"]}
    assert general == set(V2.specialists()) == {"chat", "agent", "coding", "genui"}
    assert V2.rule.non_inferiority is not None and V2.rule.max_regression is None
    refusals = [t for t in V2.suites["general"] if "refuse" in str(t.checker)]
    assert len(refusals) >= 12


def test_bank_prompts_are_unique() -> None:
    assert len({t.prompt for t in BANK}) == len(BANK)


# --- checkers -------------------------------------------------------------------------------


def test_exact_compares_stripped_text() -> None:
    exact = task(ExactChecker(kind="exact", expected="ready"))
    assert check(exact, "  ready\n")
    assert not check(exact, "ready.")
    assert not check(exact, "Ready")


def test_regex_searches_across_lines() -> None:
    regex = task(RegexChecker(kind="regex", pattern=r"(?i)first.*second"))
    assert check(regex, "First line\nsecond line")
    assert not check(regex, "second then first")


def test_a_bad_regex_is_refused() -> None:
    with pytest.raises(ValueError, match="not a regular expression"):
        RegexChecker(kind="regex", pattern="(unclosed")


GENUI = task(GenUIChecker(kind="genui", must_contain=["Budget", "march"]), "genui")
GOOD_TREE = (
    '{"type": "Card", "title": "Budget", "children": '
    '[{"type": "Table", "columns": ["Month"], "rows": [["March"]]}]}'
)


def test_genui_accepts_a_valid_tree_with_the_words_in_its_text() -> None:
    assert check(GENUI, GOOD_TREE)
    assert check(GENUI, f"```json\n{GOOD_TREE}\n```")


@pytest.mark.parametrize(
    "output",
    [
        "Here is your budget for March.",
        '{"type": "Card", "title": "Budget", "children": [',
        '{"type": "Card", "title": "Budget", "children": [{"type": "Text", "text": "April"}]}',
        '{"type": "Card", "title": "Budget", "children": [{"type": "Button", "label": "March"}]}',
    ],
    ids=["prose", "truncated", "missing-word", "invalid-tree"],
)
def test_genui_rejects_wrong_answers(output: str) -> None:
    assert not check(GENUI, output)


def test_genui_values_are_numbers_of_the_tree_or_of_its_text() -> None:
    chart = task(GenUIChecker(kind="genui", must_contain=["cats"], values=[5, 3.5]), "genui")
    tree = {"type": "Chart", "kind": "bar", "labels": ["dogs", "cats"]}
    series = [{"name": "pets", "values": [5, 3.5]}]
    assert check(chart, json.dumps({**tree, "series": series}))
    assert not check(chart, json.dumps({**tree, "series": [{"name": "pets", "values": [5, 3]}]}))
    text = {"type": "Text", "text": "cats: 3.5, dogs: 5"}
    assert check(chart, json.dumps(text))
    assert not check(chart, json.dumps({"type": "Text", "text": "cats: 35, dogs: 5"}))


def test_tool_call_contains_and_result_check_what_the_call_does() -> None:
    remember = task(
        ToolCallChecker(
            kind="tool_call", tool="notes", args={"op": "set"}, contains={"value": ["Olga"]}
        ),
        "agent",
    )
    assert check(remember, '{"tool": "notes", "args": {"op": "set", "key": "n", "value": "olga"}}')
    assert not check(remember, '{"tool": "notes", "args": {"op": "set", "key": "n", "value": "O"}}')
    half = task(ToolCallChecker(kind="tool_call", tool="calculator", result={"value": 0.3}))
    assert check(half, '{"tool": "calculator", "args": {"expression": "0.1 + 0.2"}}')
    assert not check(half, '{"tool": "calculator", "args": {"expression": "1 / 0"}}')


def test_genui_words_count_only_in_text_not_in_structure() -> None:
    button = task(GenUIChecker(kind="genui", must_contain=["button"]), "genui")
    assert not check(button, '{"type": "Button", "id": "button", "label": "Go"}')


NOTE_SET = task(
    ToolCallChecker(kind="tool_call", tool="notes", args={"op": "set", "key": "gate"}), "agent"
)


def test_tool_call_accepts_a_valid_call_containing_the_args() -> None:
    assert check(NOTE_SET, '{"tool": "notes", "args": {"op": "set", "key": "GATE", "value": "1"}}')


@pytest.mark.parametrize(
    "output",
    [
        "I saved it.",
        '{"tool": "todo", "args": {"op": "add", "text": "gate"}}',
        '{"tool": "notes", "args": {"op": "set", "key": "gate"}}',
        '{"tool": "notes", "args": {"op": "set", "key": "door", "value": "1"}}',
        '{"tool": "notes", "args": {"op": "set", "key": "gate", "value": "1"}} done',
    ],
    ids=["prose", "wrong-tool", "invalid-args", "other-arg-value", "trailing-text"],
)
def test_tool_call_rejects_wrong_answers(output: str) -> None:
    assert not check(NOTE_SET, output)


def test_tool_call_allows_calls_that_need_earlier_state() -> None:
    get = task(ToolCallChecker(kind="tool_call", tool="notes", args={"op": "get"}), "agent")
    assert check(get, '{"tool": "notes", "args": {"op": "get", "key": "passport"}}')
    done = task(ToolCallChecker(kind="tool_call", tool="todo", args={"id": 4}), "agent")
    assert check(done, '{"tool": "todo", "args": {"op": "complete", "id": 4}}')
    assert not check(done, '{"tool": "todo", "args": {"op": "complete", "id": 5}}')


def test_tool_call_expressions_match_ignoring_spaces_but_must_run() -> None:
    calc = task(ToolCallChecker(kind="tool_call", tool="calculator", args={}), "agent")
    assert check(calc, '{"tool": "calculator", "args": {"expression": "2 ** 20"}}')
    assert not check(calc, '{"tool": "calculator", "args": {"expression": "__import__(\'os\')"}}')
    product = task(
        ToolCallChecker(kind="tool_call", tool="calculator", args={"expression": "12*7"}), "agent"
    )
    assert check(product, '{"tool": "calculator", "args": {"expression": " 12 * 7 "}}')
    assert not check(product, '{"tool": "calculator", "args": {"expression": "7 * 12"}}')


DOUBLE = task(PythonTestsChecker(kind="python_tests", tests="assert double(4) == 8\n"), "coding")


def test_python_tests_run_the_first_python_block_or_the_whole_answer() -> None:
    assert check(DOUBLE, "Here:\n```python\ndef double(x):\n    return 2 * x\n```\nDone.")
    assert check(DOUBLE, "def double(x):\n    return x + x\n")
    two_blocks = "```python\ndef double(x):\n    return 2 * x\n```\n```python\ndouble = 3\n```"
    assert check(DOUBLE, two_blocks)


@pytest.mark.parametrize(
    "output",
    [
        "```python\ndef double(x):\n    return x * x\n```",
        "```python\ndef double(x) return 2 * x\n```",
        "I cannot help with that.",
        "```python\nimport sys\nsys.exit(0)\n```",
        "```python\nimport os\nos._exit(0)\n```",
    ],
    ids=["wrong", "syntax-error", "prose", "exits-before-the-tests", "hard-exit"],
)
def test_python_tests_reject_wrong_answers(output: str) -> None:
    assert not check(DOUBLE, output)


def test_the_sandbox_has_no_network() -> None:
    code = "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=3)\n"
    assert not python_tests_pass(code, "")
    only_loopback = "import socket\nassert [n for _, n in socket.if_nameindex()] == ['lo']\n"
    assert python_tests_pass(only_loopback, "")


def test_the_sandbox_has_an_empty_environment() -> None:
    probe = (
        "import os\nassert os.environ['PATH'] == '/usr/bin:/bin'\nassert 'HOME' not in os.environ"
    )
    assert python_tests_pass(probe, "assert os.listdir('.') == ['program.py']")


def test_the_sandbox_stops_an_endless_loop_at_the_timeout() -> None:
    started = time.monotonic()
    assert not python_tests_pass("while True:\n    pass\n", "", timeout_s=1.0)
    assert time.monotonic() - started < 6.0


def test_the_sandbox_limits_memory() -> None:
    assert not python_tests_pass("block = bytearray(1024 ** 3)\n", "")


def test_without_unshare_the_sandbox_refuses_to_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    sandbox._network_jail.cache_clear()
    try:
        assert not python_tests_pass("pass\n", "")
    finally:
        sandbox._network_jail.cache_clear()


# --- loading --------------------------------------------------------------------------------


def _contract_data() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(CONTRACT_V1.read_text(encoding="utf-8"))
    return data


def _write(tmp_path: Path, data: object) -> Path:
    path = tmp_path / "contract.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def test_a_missing_or_malformed_file_is_contract_invalid(tmp_path: Path) -> None:
    with pytest.raises(ContractInvalid, match="cannot be read"):
        load_contract(tmp_path / "absent.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("suites: [unclosed\n", encoding="utf-8")
    with pytest.raises(ContractInvalid, match="not valid YAML") as raised:
        load_contract(broken)
    assert raised.value.code == "contract_invalid"


def test_duplicate_task_ids_are_contract_invalid(tmp_path: Path) -> None:
    data = _contract_data()
    data["suites"]["chat"][1]["id"] = data["suites"]["chat"][0]["id"]
    with pytest.raises(ContractInvalid, match="used more than once"):
        load_contract(_write(tmp_path, data))


def test_a_task_in_another_specialists_suite_is_contract_invalid(tmp_path: Path) -> None:
    data = _contract_data()
    data["suites"]["chat"][0]["specialist"] = "coding"
    with pytest.raises(ContractInvalid, match="is in suite 'chat'"):
        load_contract(_write(tmp_path, data))


def test_bad_fields_and_unknown_tools_are_contract_invalid(tmp_path: Path) -> None:
    data = _contract_data()
    data["rule"]["alpha"] = 0
    with pytest.raises(ContractInvalid, match=r"rule\.alpha"):
        load_contract(_write(tmp_path, data))
    data = _contract_data()
    data["suites"]["agent"][0]["checker"]["tool"] = "browser"
    with pytest.raises(ContractInvalid, match="expects tool 'browser'"):
        load_contract(_write(tmp_path, data))


def test_a_task_overlapping_the_bank_is_contract_invalid(tmp_path: Path) -> None:
    trained = BANK[0]
    data = _contract_data()
    first = data["suites"][trained.specialist][0]
    first["prompt"] = trained.prompt + " Please."
    with pytest.raises(ContractInvalid, match=f"task '{first['id']}' asks what bank task"):
        load_contract(_write(tmp_path, data))
    data = _contract_data()
    data["suites"]["chat"][0]["id"] = trained.id
    with pytest.raises(ContractInvalid, match=f"task '{trained.id}' has the id of bank task"):
        load_contract(_write(tmp_path, data))


def test_an_unknown_checker_is_contract_invalid(tmp_path: Path) -> None:
    data = _contract_data()
    data["suites"]["chat"][0]["checker"] = {"kind": "llm_judge", "rubric": "be nice"}
    with pytest.raises(ContractInvalid, match=r"suites\.chat\.0\.checker"):
        load_contract(_write(tmp_path, data))


def test_a_malformed_bank_is_task_bank_invalid(tmp_path: Path) -> None:
    path = tmp_path / "bank.yaml"
    path.write_text("version: bank-x\ntasks: []\n", encoding="utf-8")
    with pytest.raises(TaskBankInvalid, match="tasks"):
        load_bank(path)


# --- running through an engine --------------------------------------------------------------


def _answering(tasks: list[Task]) -> InstantEngine:
    """An engine that answers each task with its reference, if it gets the task's HCP context."""
    answers = {}
    for t in tasks:
        messages = build_context(ROOT, t.specialist, [], t.prompt).messages()
        answers[(messages[0]["content"], messages[-1]["content"])] = t.reference
    engine = InstantEngine(lambda m: answers[(m[0]["content"], m[-1]["content"])])
    for adapter in ADAPTERS.values():
        engine.load_adapter(adapter, "unused")
    return engine


def test_each_answer_gets_the_budget_of_the_specialist_it_names() -> None:
    budgets: dict[str, int] = {}
    engine = _answering(CONTRACT_TASKS)
    serve = engine.generate

    def recording(request: GenerationRequest) -> AsyncGenerator[GenerationChunk, None]:
        budgets[request.request_id.removeprefix("contract-")] = request.params.max_tokens
        return serve(request)

    engine.generate = recording  # type: ignore[method-assign]
    asyncio.run(run_contract(engine, ADAPTERS, CONTRACT, harness=ROOT))
    assert budgets == {t.id: CONTRACT.answer_budget(t.specialist) for t in CONTRACT_TASKS}
    assert CONTRACT.answer_budget("chat") == 96  # named in contract-v1.yaml
    assert CONTRACT.model_copy(update={"answer_tokens": {}}).answer_budget("chat") == 256


def test_run_contract_serves_each_task_with_its_specialists_adapter() -> None:
    results = asyncio.run(
        run_contract(_answering(CONTRACT_TASKS), ADAPTERS, CONTRACT, harness=ROOT)
    )
    assert {suite: all(passed) for suite, passed in results.passed.items()} == dict.fromkeys(
        CONTRACT.suites, True
    )
    nope = InstantEngine(fixed_reply("nope"))
    for adapter in ADAPTERS.values():
        nope.load_adapter(adapter, "unused")
    wrong = asyncio.run(run_contract(nope, ADAPTERS, CONTRACT, harness=ROOT))
    assert {suite: any(passed) for suite, passed in wrong.passed.items()} == dict.fromkeys(
        CONTRACT.suites, False
    )


def test_code_is_well_formed_when_it_compiles() -> None:
    coding = next(t for t in CONTRACT_TASKS if isinstance(t.checker, PythonTestsChecker))
    assert well_formed(coding, "```python\ndef f(x):\n    return x\n```") is True
    assert well_formed(coding, "```python\ndef f(x) return x\n```") is False
    assert well_formed(coding, "import os\nos.system('rm -rf /')") is True  # compiled, never run
    assert well_formed(coding, "x = '\x00'\x00") is False


def test_format_and_content_are_scored_apart() -> None:
    """A well-formed wrong answer counts as well-formed and failed; tasks asking no form have
    no format score."""
    answers = {
        "genui": '{"type": "Text", "text": "nothing asked for"}',
        "agent": '{"tool": "clock", "args": {}}',
    }
    prompts = {name: ROOT.spec.specialists[name].system_prompt for name in answers}

    def reply(messages: list[dict[str, str]]) -> str:
        for name, prompt in prompts.items():
            if messages[0]["content"].startswith(prompt):
                return answers[name]
        return "plain text"

    engine = InstantEngine(reply)
    for adapter in ADAPTERS.values():
        engine.load_adapter(adapter, "unused")
    run = asyncio.run(run_contract(engine, ADAPTERS, CONTRACT, harness=ROOT))
    genui = [t for t in CONTRACT_TASKS if isinstance(t.checker, GenUIChecker)]
    calls = [t for t in CONTRACT_TASKS if isinstance(t.checker, ToolCallChecker)]
    assert genui and calls
    for suite, tasks in CONTRACT.suites.items():
        for task, formed, passed in zip(
            tasks, run.well_formed[suite], run.passed[suite], strict=True
        ):
            if isinstance(task.checker, (GenUIChecker, ToolCallChecker)):
                assert formed is True, task.id
            elif isinstance(task.checker, PythonTestsChecker):
                assert formed is False, task.id  # "plain text" is not Python
            else:
                assert formed is None, task.id
            if isinstance(task.checker, GenUIChecker):
                assert passed is False, task.id
    formats = run.format_scores()
    assert formats["genui"] == 1.0 and formats["coding"] == 0.0 and "chat" not in formats
    assert run.scores()["genui"] == 0.0


def test_run_contract_needs_an_adapter_for_every_specialist() -> None:
    with pytest.raises(ValueError, match="no adapter given for specialists: agent"):
        asyncio.run(
            run_contract(InstantEngine(fixed_reply("nope")), {"chat": None}, CONTRACT, harness=ROOT)
        )


# --- the routing rule -----------------------------------------------------------------------

ROUTING_RULE = RoutingRule(suite="routing-v1.jsonl", margin=0.03, alpha=0.05, max_recall_drop=0.05)


def _routed(rights: dict[str, int], size: int = 62) -> dict[str, list[bool]]:
    """Per specialist, ``size`` turns of which the first ``rights[s]`` were routed right."""
    return {s: [n < right for n in range(size)] for s, right in rights.items()}


def test_a_router_as_good_as_its_parent_passes() -> None:
    same = _routed({"chat": 58, "agent": 57, "coding": 60, "genui": 59})
    decision = decide_routing(same, same, ROUTING_RULE)
    assert decision.passed and decision.gain == 0.0 and decision.p_value < 0.05


def test_a_router_that_loses_a_specialists_turns_is_refused() -> None:
    parent = _routed({"chat": 58, "agent": 57, "coding": 60, "genui": 59})
    candidate = _routed({"chat": 62, "agent": 50, "coding": 60, "genui": 62})  # gains, but agent
    decision = decide_routing(candidate, parent, ROUTING_RULE)
    assert not decision.passed
    assert decision.regressions["agent"] == pytest.approx(7 / 62)
    assert decision.reasons == ["agent recall drops by 11.3 points; at most 5.0 are allowed"]


def test_a_router_that_is_worse_overall_is_refused() -> None:
    parent = _routed({"chat": 60, "agent": 60, "coding": 60, "genui": 60})
    candidate = _routed({"chat": 57, "agent": 57, "coding": 57, "genui": 57})
    decision = decide_routing(candidate, parent, ROUTING_RULE)
    assert not decision.passed and decision.gain == pytest.approx(-12 / 248)
    assert "not shown within 3.0 points" in decision.reasons[0]


def test_routing_outcomes_must_be_paired() -> None:
    with pytest.raises(ValueError, match="paired"):
        decide_routing(_routed({"chat": 1}), _routed({"agent": 1}), ROUTING_RULE)
