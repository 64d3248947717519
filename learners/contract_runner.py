"""The contract runner: load a contract version, serve its tasks, and check the answers.

Each task is served exactly as a user turn would be (the HCP context of its specialist, greedy
decoding) so the score measures what users get. Coding answers are untrusted code, run only in
``learners.sandbox``.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import assert_never

from pydantic import JsonValue

from core.contract import (
    NEAR_DUPLICATE,
    Contract,
    ExactChecker,
    GenUIChecker,
    PythonTestsChecker,
    RegexChecker,
    Task,
    ToolCallChecker,
    prompt_words,
    word_overlap,
)
from core.conversation import empty_tool_state
from core.engine import Engine, GenerationRequest, SamplingParams
from core.errors import ContractInvalid
from core.harness.actions import TOOLS, execute
from core.harness.artifact import HarnessVersion
from core.harness.genui import parse_genui_output
from core.harness.grammars import output_constraint
from core.harness.hcp import build_context, tool_call_of
from learners.files import load_yaml_model
from learners.sandbox import code_of, python_tests_pass
from learners.tasks import load_bank

CONTRACT_V1 = Path(__file__).with_name("contract-v1.yaml")
CONTRACT_V2 = Path(__file__).with_name("contract-v2.yaml")
DEFAULT_CONTRACT = CONTRACT_V2
"""The contract the loop judges by unless `MACARON_CONTRACT_PATH` names another."""
CONCURRENCY = 16
"""Requests in flight at once per contract run (the local engine's batch): the engine batches
concurrent requests, mixed adapters and all, and the loop runs parent and candidate at once."""

# --- loading --------------------------------------------------------------------------------


def load_contract(path: Path) -> Contract:
    """A contract version from its YAML file; any problem is ``ContractInvalid`` with the reason."""
    contract = load_yaml_model(path, Contract, ContractInvalid)
    known_tools = {tool.name for tool in TOOLS}
    for tasks in contract.suites.values():
        for task in tasks:
            checker = task.checker
            if isinstance(checker, ToolCallChecker) and checker.tool not in known_tools:
                raise ContractInvalid(
                    f"{path}: task {task.id!r} expects tool {checker.tool!r}; "
                    f"tools: {', '.join(sorted(known_tools))}"
                )
    _check_held_out(path, contract, load_bank())
    return contract


def _check_held_out(path: Path, contract: Contract, bank: Sequence[Task]) -> None:
    """``ContractInvalid`` naming the first contract task that shares an id with a bank task or
    asks (nearly) the same: the bank is trained on, the contract must be held out."""
    for tasks in contract.suites.values():
        for task in tasks:
            conflict = bank_conflict(task, bank)
            if conflict is not None:
                raise ContractInvalid(f"{path}: task {task.id!r} {conflict}")


def bank_conflict(task: Task, bank: Sequence[Task]) -> str | None:
    """Why the contract task ``task`` is among the tasks of ``bank`` (its id, or (nearly) its
    prompt), or ``None`` when it is held out from them."""
    words = prompt_words(task.prompt)
    for other in bank:
        if other.id == task.id:
            return f"has the id of bank task {other.id!r}"
        overlap = word_overlap(words, prompt_words(other.prompt))
        if overlap >= NEAR_DUPLICATE:
            return (
                f"asks what bank task {other.id!r} asks ({overlap:.0%} of their words shared): "
                "contract tasks are held out from the bank, which is trained on"
            )
    return None


# --- checkers -------------------------------------------------------------------------------


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


# --- running --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ContractRun:
    """Per suite, per task: whether the answer passed its checker, and whether it was
    well-formed (a GenUI tree that validates, a tool call that parses; ``None`` where the task
    asks for no format). Format and content are apart, so a grammar's gain is never taken for
    the model's."""

    passed: dict[str, list[bool]]
    well_formed: dict[str, list[bool | None]]
    inherited: dict[str, list[bool]] = field(default_factory=dict, compare=False)
    """Per suite, per task: whether the outcome is the parent's (``Inheritance``), not run; where
    an outcome came from, not part of it (two runs with the same outcomes are equal)."""

    def scores(self) -> dict[str, float]:
        """Each suite's share of tasks passed."""
        return {suite: sum(done) / len(done) for suite, done in self.passed.items() if done}

    def format_scores(self) -> dict[str, float]:
        """Each suite's share of well-formed answers, over its tasks that ask for a format."""
        rates = {}
        for suite, formed in self.well_formed.items():
            asked = [ok for ok in formed if ok is not None]
            if asked:
                rates[suite] = sum(asked) / len(asked)
        return rates


@dataclass(frozen=True)
class Inheritance:
    """What a candidate keeps of its parent: the parent's outcomes on the tasks of every
    specialist but ``changed``. Each task is served by the specialist it names with greedy
    decoding, which gives the same tokens alone and in any batch, so those answers cannot
    differ (``core.release.changed_specialists``)."""

    parent: ContractRun
    changed: frozenset[str]


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


async def run_contract(
    engine: Engine,
    adapters: Mapping[str, str | None],
    contract: Contract,
    *,
    harness: HarnessVersion,
    seed: int = 0,
    inherit: Inheritance | None = None,
) -> ContractRun:
    """Outcomes of every suite, each task served with the adapter of the specialist it names,
    the context ``harness`` builds for it, the grammar it enforces and that specialist's answer
    budget; with ``inherit``, only the tasks of its changed specialists are served, and the
    rest keep the parent's outcomes (marked inherited). An engine error fails the whole run:
    a score with answers missing would mislead."""
    missing = sorted(set(contract.specialists()) - adapters.keys())
    if missing:
        raise ValueError(f"no adapter given for specialists: {', '.join(missing)}")
    served = [
        (suite, index, task)
        for suite, tasks in contract.suites.items()
        for index, task in enumerate(tasks)
        if inherit is None or task.specialist in inherit.changed
    ]
    outputs = await _answers(
        engine,
        contract,
        [(task, adapters[task.specialist]) for _, _, task in served],
        harness,
        seed,
    )
    fresh = {
        (suite, index): (check(task, output), well_formed(task, output))
        for (suite, index, task), output in zip(served, outputs, strict=True)
    }
    outcomes = {} if inherit is None else _outcomes(inherit.parent)
    outcomes.update(fresh)
    run = ContractRun({}, {}, {})
    for suite, tasks in contract.suites.items():
        keys = [(suite, index) for index in range(len(tasks))]
        run.passed[suite] = [outcomes[key][0] for key in keys]
        run.well_formed[suite] = [outcomes[key][1] for key in keys]
        run.inherited[suite] = [key not in fresh for key in keys]
    return run


def _outcomes(run: ContractRun) -> dict[tuple[str, int], tuple[bool, bool | None]]:
    """Each task's outcome in ``run``, by suite and place."""
    return {
        (suite, index): (passed, run.well_formed[suite][index])
        for suite, done in run.passed.items()
        for index, passed in enumerate(done)
    }


async def _answers(
    engine: Engine,
    contract: Contract,
    served: list[tuple[Task, str | None]],
    harness: HarnessVersion,
    seed: int,
) -> list[str]:
    """Generate every answer before any is checked: checks block, and would stall the engine."""
    slots = asyncio.Semaphore(CONCURRENCY)

    async def answer(task: Task, adapter: str | None) -> str:
        messages = build_context(harness, task.specialist, [], task.prompt).messages()
        request = GenerationRequest(
            request_id=f"contract-{task.id}",
            prompt=engine.chat_prompt(messages),
            adapter=adapter,
            params=SamplingParams(
                temperature=0.0, seed=seed, max_tokens=contract.answer_budget(task.specialist)
            ),
            constraint=output_constraint(harness.spec, task.specialist),
        )
        async with slots:
            return "".join([chunk.text async for chunk in engine.generate(request)])

    return list(await asyncio.gather(*(answer(task, adapter) for task, adapter in served)))
