"""The contract's checkers: whether an answer is right (``check``) and whether it has the form
its task asks for (``well_formed``), format and content apart. Coding answers are untrusted
code, run only in ``learners.evaluation.sandbox``."""

from __future__ import annotations

import ast
import math
import re
import types
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any, assert_never

from pydantic import JsonValue

from core.conversation import empty_tool_state
from core.harness.actions import execute
from core.harness.genui import parse_genui_output
from core.harness.hcp import tool_call_of
from core.tasks import (
    Calculation,
    ExactChecker,
    GenUIChecker,
    NoCallChecker,
    PythonTestsChecker,
    RegexChecker,
    Task,
    ToolCallChecker,
)
from learners.evaluation.sandbox import code_of, python_tests_pass


def check(task: Task, output: str) -> bool:
    """Whether ``output`` is a correct answer to ``task``, by the task's checker."""
    checker = task.checker
    if isinstance(checker, ExactChecker):
        return output.strip() == checker.expected.strip()
    if isinstance(checker, RegexChecker):
        return re.search(checker.pattern, output, re.DOTALL) is not None
    if isinstance(checker, GenUIChecker):
        return _genui_passes(checker, output)
    if isinstance(checker, ToolCallChecker):
        return _tool_call_passes(checker, output)
    if isinstance(checker, NoCallChecker):
        return (
            tool_call_of(output) is None
            and re.search(checker.pattern, output, re.DOTALL) is not None
        )
    if isinstance(checker, PythonTestsChecker):
        return python_tests_pass(code_of(output), checker.tests)
    assert_never(checker)


_STRUCTURAL_KEYS = frozenset(("type", "id", "action", "kind"))


def _genui_passes(checker: GenUIChecker, output: str) -> bool:
    return genui_credit(checker, output) == 1.0


def genui_credit(checker: GenUIChecker, output: str) -> float:
    """The share of what a GenUI task asks that ``output`` gives: a valid tree counts as one
    thing asked, and so does each word and value to show; 0.0 for no valid tree, 1.0 exactly
    when the checker passes. Words are looked for case-insensitively in the tree's text, not
    in its structure; a value may be a number of the tree (a chart's, a table cell) or a
    number written in its text."""
    result = parse_genui_output(output)
    if not result.valid or result.tree is None:
        return 0.0
    texts = [text.casefold() for text in _leaves(result.tree, str)]
    words = sum(any(word.casefold() in text for text in texts) for word in checker.must_contain)
    shown = [*_leaves(result.tree, int | float), *(n for t in texts for n in _numbers_in(t))]
    values = sum(any(_same_number(value, n) for n in shown) for value in checker.values)
    asked = 1 + len(checker.must_contain) + len(checker.values)
    return (1 + words + values) / asked


def _leaves(value: JsonValue, kind: type | types.UnionType) -> Iterator[Any]:
    """The tree's leaves of ``kind`` outside its structural keys (never a bool)."""
    if isinstance(value, list):
        for item in value:
            yield from _leaves(item, kind)
    elif isinstance(value, dict):
        for key, item in value.items():
            if key not in _STRUCTURAL_KEYS:
                yield from _leaves(item, kind)
    elif isinstance(value, kind) and not isinstance(value, bool):
        yield value


def _numbers_in(text: str) -> Iterator[float]:
    """The numbers written in ``text`` (``1,250`` is 1250)."""
    for match in re.finditer(r"-?\d[\d,]*(?:\.\d+)?", text):
        yield float(match.group().replace(",", ""))


def _same_number(expected: float, actual: JsonValue) -> bool:
    if isinstance(actual, bool) or not isinstance(actual, int | float):
        return False
    return math.isclose(expected, actual, rel_tol=1e-9, abs_tol=1e-9)


_STATE_DEPENDENT = frozenset(("note_not_found", "todo_not_found"))
"""Tool errors that only say the fresh state lacks what a well-formed call refers to."""
_CHECK_TIME = datetime(2025, 1, 1, tzinfo=UTC)


def _tool_call_passes(checker: ToolCallChecker, output: str) -> bool:
    """The call must run on a fresh state (or fail only for want of an earlier note or todo).

    Expected string arguments match ignoring case and whitespace (``12*7`` is ``12 * 7``);
    contained words are looked for case-insensitively; an expected result's numbers match
    within rounding (``0.1+0.2`` is ``0.3``).
    """
    call = tool_call_of(output)
    if call is None or call.tool != checker.tool:
        return False
    outcome = execute(call, empty_tool_state(), _CHECK_TIME)
    if not outcome.ok and _error_code(outcome.result) not in _STATE_DEPENDENT:
        return False
    if checker.result and not (outcome.ok and isinstance(outcome.result, dict)):
        return False
    if checker.calculation is not None and not _calculates(checker.calculation, call.args):
        return False
    return (
        all(
            key in call.args and _normalised(call.args[key]) == _normalised(expected)
            for key, expected in checker.args.items()
        )
        and all(
            isinstance(call.args.get(key), str)
            and all(word.casefold() in str(call.args[key]).casefold() for word in words)
            for key, words in checker.contains.items()
        )
        and all(
            isinstance(outcome.result, dict)
            and key in outcome.result
            and _same_result(expected, outcome.result[key])
            for key, expected in checker.result.items()
        )
    )


_OPERATORS = {
    ast.Add: "+",
    ast.Sub: "-",
    ast.USub: "-",  # -19 + 250 subtracts 19
    ast.Mult: "*",
    ast.Div: "/",
    ast.FloorDiv: "//",
    ast.Mod: "%",
    ast.Pow: "**",
}


def _calculates(calculation: Calculation, args: JsonValue) -> bool:
    """Whether a calculator call's expression uses each operand as a number literal and each
    operator (a number's sign is not its literal's: ``-19 + 250`` writes 19 and subtracts)."""
    expression = args.get("expression") if isinstance(args, dict) else None
    if not isinstance(expression, str):
        return False
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError):
        return False
    numbers = [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float)
    ]
    operators = {
        _OPERATORS[type(node.op)]
        for node in ast.walk(tree)
        if isinstance(node, ast.BinOp | ast.UnaryOp) and type(node.op) in _OPERATORS
    }
    return (
        all(
            any(_same_number(abs(operand), number) for number in numbers)
            for operand in calculation.operands
        )
        and set(calculation.operators) <= operators
    )


def _same_result(expected: JsonValue, actual: JsonValue) -> bool:
    if isinstance(expected, int | float) and not isinstance(expected, bool):
        return _same_number(expected, actual)
    return _normalised(expected) == _normalised(actual)


def _error_code(result: JsonValue) -> JsonValue:
    error = result.get("error") if isinstance(result, dict) else None
    return error.get("code") if isinstance(error, dict) else None


def _normalised(value: JsonValue) -> JsonValue:
    return "".join(value.split()).casefold() if isinstance(value, str) else value


def well_formed(task: Task, output: str) -> bool | None:
    """Whether ``output`` has the form ``task`` asks for, right or wrong: a GenUI tree that
    renders, a tool call that parses, text and no call where none is asked, Python code that
    compiles (``None``: no form asked)."""
    checker = task.checker
    if isinstance(checker, GenUIChecker):
        return parse_genui_output(output).valid
    if isinstance(checker, ToolCallChecker):
        return tool_call_of(output) is not None
    if isinstance(checker, NoCallChecker):
        return tool_call_of(output) is None
    if isinstance(checker, PythonTestsChecker):
        return _compiles(code_of(output))
    return None


def _compiles(code: str) -> bool:
    """Whether ``code`` is Python the interpreter accepts (compiled only, never run here)."""
    try:
        compile(code, "<answer>", "exec", dont_inherit=True)
    except (SyntaxError, ValueError):  # ValueError: a NUL byte in the source
        return False
    return True
