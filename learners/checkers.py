"""The contract's checkers: whether an answer is right (``check``) and whether it has the form
its task asks for (``well_formed``), format and content apart. Coding answers are untrusted
code, run only in ``learners.sandbox``."""

from __future__ import annotations

import re
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import assert_never

from pydantic import JsonValue

from core.contract import (
    ExactChecker,
    GenUIChecker,
    PythonTestsChecker,
    RegexChecker,
    Task,
    ToolCallChecker,
)
from core.conversation import empty_tool_state
from core.harness.actions import execute
from core.harness.genui import parse_genui_output
from core.harness.hcp import tool_call_of
from learners.sandbox import code_of, python_tests_pass


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
    if isinstance(checker, PythonTestsChecker):
        return python_tests_pass(code_of(output), checker.tests)
    assert_never(checker)


_STRUCTURAL_KEYS = frozenset(("type", "id", "action", "kind"))


def _genui_passes(checker: GenUIChecker, output: str) -> bool:
    """Words are looked for case-insensitively in the tree's text, not in its structure."""
    result = parse_genui_output(output)
    if not result.valid or result.tree is None:
        return False
    texts = [text.casefold() for text in _texts(result.tree)]
    return all(any(word.casefold() in text for text in texts) for word in checker.must_contain)


def _texts(value: JsonValue) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from _texts(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            if key not in _STRUCTURAL_KEYS:
                yield from _texts(item)


_STATE_DEPENDENT = frozenset(("note_not_found", "todo_not_found"))
"""Tool errors that only say the fresh state lacks what a well-formed call refers to."""
_CHECK_TIME = datetime(2025, 1, 1, tzinfo=UTC)


def _tool_call_passes(checker: ToolCallChecker, output: str) -> bool:
    """The call must run on a fresh state (or fail only for want of an earlier note or todo).

    Expected string arguments match ignoring case and whitespace (``12*7`` is ``12 * 7``).
    """
    call = tool_call_of(output)
    if call is None or call.tool != checker.tool:
        return False
    outcome = execute(call, empty_tool_state(), _CHECK_TIME)
    if not outcome.ok and _error_code(outcome.result) not in _STATE_DEPENDENT:
        return False
    return all(
        key in call.args and _normalised(call.args[key]) == _normalised(expected)
        for key, expected in checker.args.items()
    )


def _error_code(result: JsonValue) -> JsonValue:
    error = result.get("error") if isinstance(result, dict) else None
    return error.get("code") if isinstance(error, dict) else None


def _normalised(value: JsonValue) -> JsonValue:
    return "".join(value.split()).casefold() if isinstance(value, str) else value


def well_formed(task: Task, output: str) -> bool | None:
    """Whether ``output`` has the form ``task`` asks for, right or wrong: a GenUI tree that
    renders, a tool call that parses, Python code that compiles (``None``: no form asked)."""
    checker = task.checker
    if isinstance(checker, GenUIChecker):
        return parse_genui_output(output).valid
    if isinstance(checker, ToolCallChecker):
        return tool_call_of(output) is not None
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
