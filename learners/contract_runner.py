"""The contract runner: load a contract version, serve its tasks, and check the answers.

Each task is served exactly as a user turn would be (the HCP context of its specialist, greedy
decoding) so the score measures what users get. Coding answers are untrusted code: they run in
a subprocess with no network, no environment, an empty working folder and resource limits, and
are not run at all where the network cannot be taken away.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import re
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, assert_never

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
from learners.tasks import load_bank

CONTRACT_V1 = Path(__file__).with_name("contract-v1.yaml")
CONTRACT_V2 = Path(__file__).with_name("contract-v2.yaml")
DEFAULT_CONTRACT = CONTRACT_V2
"""The contract the loop judges by unless `MACARON_CONTRACT_PATH` names another."""
PYTHON_TIMEOUT_S = 10.0
PYTHON_MEMORY_BYTES = 512 * 2**20
PYTHON_FILE_BYTES = 16 * 2**20
"""Largest file the tested code may write, its output included."""
CONCURRENCY = 16
"""Requests in flight at once per contract run (the local engine's batch): the engine batches
concurrent requests, mixed adapters and all, and the loop runs parent and candidate at once."""

_log = logging.getLogger(__name__)


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


_PYTHON_FENCE = re.compile(r"```python[ \t]*\n(.*?)```", re.DOTALL)


def code_of(output: str) -> str:
    """The first fenced ```python block of an answer, or the whole answer when it has none."""
    fenced = _PYTHON_FENCE.search(output)
    return fenced.group(1) if fenced else output


@functools.cache
def _network_jail() -> tuple[str, ...] | None:
    """The command prefix that runs a program in a new, empty network namespace, if it works."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    prefix = (unshare, "--net", "--map-root-user")
    try:
        trial = subprocess.run([*prefix, "/bin/true"], capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return prefix if trial.returncode == 0 else None


def python_tests_pass(code: str, tests: str, *, timeout_s: float = PYTHON_TIMEOUT_S) -> bool:
    """Run ``code`` then ``tests`` as one program in the sandbox; ``True`` when the tests finish.

    The program ends by printing a random token, so code that exits early (``sys.exit(0)``)
    fails. A timeout, a crash, a resource limit or a failed assertion is ``False``; so is every
    run where ``unshare`` cannot remove the network, because untrusted code never runs with one.
    """
    jail = _network_jail()
    if jail is None:
        _log.warning("python_tests checker refused to run: 'unshare --net' is not available")
        return False
    token = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="macaron-check-") as scratch:
        workdir, stdout = Path(scratch, "run"), Path(scratch, "stdout")
        workdir.mkdir()
        program = workdir / "program.py"
        program.write_text(f"{code}\n\n{tests}\n\nprint({token!r})\n", encoding="utf-8")
        command = [*jail, sys.executable, "-I", "-S", program.name]
        with stdout.open("wb") as out:
            exited_cleanly = _exits_cleanly(command, workdir, out, timeout_s)
        return exited_cleanly and stdout.read_bytes().endswith(f"{token}\n".encode())


def _exits_cleanly(
    command: Sequence[str], workdir: Path, stdout: IO[bytes], timeout_s: float
) -> bool:
    process = subprocess.Popen(
        command,
        cwd=workdir,
        env={"PATH": "/usr/bin:/bin"},
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.DEVNULL,
        preexec_fn=functools.partial(_limit_resources, cpu_s=int(timeout_s) + 1),
        start_new_session=True,
    )
    try:
        return process.wait(timeout=timeout_s) == 0
    except subprocess.TimeoutExpired:
        return False
    finally:
        _kill_group(process)


def _limit_resources(cpu_s: int) -> None:
    """Runs in the child before ``exec``: the limits hold for the tested code and its children."""
    resource.setrlimit(resource.RLIMIT_AS, (PYTHON_MEMORY_BYTES, PYTHON_MEMORY_BYTES))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
    resource.setrlimit(resource.RLIMIT_FSIZE, (PYTHON_FILE_BYTES, PYTHON_FILE_BYTES))


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    """End the tested program and anything it started (its own session and process group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


# --- running --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ContractRun:
    """Per suite, per task: whether the answer passed its checker, and whether it was
    well-formed (a GenUI tree that validates, a tool call that parses; ``None`` where the task
    asks for no format). Format and content are apart, so a grammar's gain is never taken for
    the model's."""

    passed: dict[str, list[bool]]
    well_formed: dict[str, list[bool | None]]

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
) -> ContractRun:
    """Outcomes of every suite, each task served with the adapter of the specialist it names,
    the context ``harness`` builds for it, the grammar it enforces and that specialist's answer
    budget. An engine error fails the whole run: a score with answers missing would mislead."""
    missing = sorted(set(contract.specialists()) - adapters.keys())
    if missing:
        raise ValueError(f"no adapter given for specialists: {', '.join(missing)}")
    served = [
        (task, adapters[task.specialist]) for tasks in contract.suites.values() for task in tasks
    ]
    outputs = await _answers(engine, contract, served, harness, seed)
    passed = [check(task, output) for (task, _), output in zip(served, outputs, strict=True)]
    formed = [well_formed(task, output) for (task, _), output in zip(served, outputs, strict=True)]
    run = ContractRun({}, {})
    start = 0
    for suite, tasks in contract.suites.items():
        run.passed[suite] = passed[start : start + len(tasks)]
        run.well_formed[suite] = formed[start : start + len(tasks)]
        start += len(tasks)
    return run


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
