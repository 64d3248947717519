"""Tasks the loop writes itself: the rules that derive a checker from a prompt alone (sound on
every bank prompt of their family, whose human-written reference passes the derived checker),
what they refuse, and why a proposal is kept or dropped."""

from __future__ import annotations

import json

import pytest
from pydantic import JsonValue, ValidationError

from core.events import WrittenProposal
from core.tasks import GenUIChecker, Task, ToolCallChecker
from learners.evaluation.checkers import check
from learners.evaluation.contract_runner import held_out_tasks
from learners.rollouts.writing import (
    FAMILIES,
    Family,
    calculator_checker,
    derive_checker,
    family_examples,
    first_line,
    genui_checker,
    judge_proposal,
)
from learners.tasks import load_bank

BANK = load_bank()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_each_rule_derives_from_the_bank_prompt_a_checker_its_reference_passes(
    family: Family,
) -> None:
    """The rules are checked against answers they never saw: every bank prompt of the family
    gets a checker from its words alone, and the bank's reference answer passes it."""
    examples = family_examples(family, BANK)
    assert len(examples) >= 20
    for task in examples:
        derived = task.model_copy(update={"checker": derive_checker(family, task.prompt)})
        assert check(derived, task.reference), task.id


def test_the_genui_rule_takes_the_quoted_texts() -> None:
    checker = genui_checker("Make a card titled 'Rain later' that says \"Take an umbrella\".")
    assert checker == GenUIChecker(kind="genui", must_contain=["Rain later", "Take an umbrella"])
    assert genui_checker("I'm making a card with 'Hello' on it") == GenUIChecker(
        kind="genui", must_contain=["Hello"]
    )
    assert genui_checker("Make a nice card for me") is None  # nothing quoted: nothing to check
    assert genui_checker("Show '42' and '7'") is None  # a text with no letter says nothing
    assert genui_checker("Show 'a' 'b' 'c' 'd' 'e'") is None  # more than four: not a card


@pytest.mark.parametrize(
    ("prompt", "operands", "operator", "value"),
    [
        ("What is 45 times 12?", [45, 12], "*", 540),
        ("Subtract 19 from 250.", [250, 19], "-", 231),
        ("How much is 7 divided by 2?", [7, 2], "/", 3.5),
        ("Add 12.5 and 0.5", [12.5, 0.5], "+", 13),
        ("What is 1254 x 25?", [1254, 25], "*", 31350),  # a sign between the numbers
    ],
)
def test_the_calculator_rule_computes_the_value_and_asks_for_the_operands(
    prompt: str, operands: list[float], operator: str, value: float
) -> None:
    checker = calculator_checker(prompt)
    assert isinstance(checker, ToolCallChecker) and checker.calculation is not None
    assert checker.calculation.operands == operands
    assert checker.calculation.operators == [operator]
    assert checker.result == {"value": value}
    task = Task(id="t", specialist="agent", prompt=prompt, checker=checker, reference="-")
    assert not check(task, json.dumps({"tool": "calculator", "args": {"expression": str(value)}}))


@pytest.mark.parametrize(
    "prompt",
    [
        "What is 3 plus 4 plus 5?",
        "Divide 7 by 0",
        "What is 9?",
        "Tell me a joke",
        "6 times 7 minus 2",
    ],
)
def test_the_calculator_rule_refuses_what_it_cannot_check(prompt: str) -> None:
    assert calculator_checker(prompt) is None


def test_a_proposal_is_kept_only_when_checkable_and_new() -> None:
    held_out = held_out_tasks()
    bank_prompt = family_examples("calculator", BANK)[0].prompt
    contract_prompt = next(t.prompt for t in held_out if calculator_checker(t.prompt) is not None)
    new = "Could you figure out 5521 times 86 for my invoice?"

    def judged(prompt: str, kept: list[Task] | None = None) -> str | None:
        return judge_proposal("calculator", prompt, BANK, held_out, kept or []).dropped

    assert judged("Tell me about the weather") == "no_checker"
    assert judged("") == "no_checker"
    assert judged(bank_prompt) == "copies_the_bank"
    assert judged(contract_prompt) == "near_a_contract_task"
    kept = judge_proposal("calculator", new, BANK, held_out, [])
    assert kept.dropped is None and kept.task is not None
    assert kept.task.specialist == "agent" and kept.task.id.startswith("written-")
    assert kept.task.checker == calculator_checker(new)
    assert judged(new, [kept.task]) == "repeated"
    again = judge_proposal("calculator", new, BANK, held_out, [])
    assert again.task == kept.task  # the id is the task's content


def test_the_writers_answer_is_its_first_line_without_marks() -> None:
    assert first_line("\n- 'What is 4 plus 5?'\nmore") == "What is 4 plus 5?"
    assert first_line("1. Make a card titled 'Hi'") == "Make a card titled 'Hi'"
    assert first_line("  \n\n") == ""


def test_a_written_proposal_is_kept_or_dropped_never_both() -> None:
    task: dict[str, JsonValue] = {"id": "written-1", "specialist": "agent", "prompt": "p"}
    with pytest.raises(ValidationError, match="either kept as a task or dropped"):
        WrittenProposal(family="calculator", prompt="p", task=task, dropped="no_checker")
    with pytest.raises(ValidationError, match="either kept as a task or dropped"):
        WrittenProposal(family="calculator", prompt="p", task=None, dropped=None)
