"""Environments and verifiers: what a rollout is sampled in and judged by.

An environment wraps one task of the training bank: its prompt, the action substrate (a fresh
tool state per episode: the model calls a tool, sees the result, and calls again or answers)
and a verifier. The verifier here is the contract's checkers (tool call executed and right,
GenUI tree valid and containing what was asked, Python tests in the sandbox, exact or regex),
turned into a reward in [0, 1]. A hint, for STaR-style rationalization, is derived from the
checker, never from the task's reference answer.

The contract's held-out tasks are never an environment: ``environments`` refuses a bank whose
task is (nearly) a contract task, as loading the contract does.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from core.contract import Contract, GenUIChecker, Task, ToolCallChecker
from core.errors import ConfigError, TaskBankInvalid
from core.events import RolloutStep
from learners.checkers import check
from learners.contract_runner import bank_conflict
from learners.files import load_yaml_model
from learners.tasks import BANK_V1, TaskBank

VERIFIER_VERSION = "verifier-1"
"""The contract's checkers as rewards: 1.0 when the first step passes its checker, else 0.0."""


@dataclass(frozen=True)
class Verdict:
    """A verifier's judgement of one episode: a reward in [0, 1] and whether it passed, or the
    reason the verifier could not judge it (``failure``; no reward)."""

    reward: float | None
    passed: bool
    failure: str | None = None


class Verifier(Protocol):
    name: str
    version: str

    def reward(self, task: Task, steps: Sequence[RolloutStep]) -> float:
        """The episode's reward; may raise (the verifier crashed)."""
        ...


class CheckerVerifier:
    """The task's contract checker on the episode's first step (the answer, or the tool call
    the model made first: what a record teaches)."""

    name = "checker"
    version = VERIFIER_VERSION

    def reward(self, task: Task, steps: Sequence[RolloutStep]) -> float:
        return 1.0 if check(task, steps[0].output) else 0.0


@dataclass(frozen=True)
class Environment:
    bank_version: str
    task: Task

    @property
    def id(self) -> str:
        return f"{self.bank_version}/{self.task.id}"

    @property
    def hint(self) -> str | None:
        """What the checker asks for, said plainly (the tool to call, the words the tree must
        show); ``None`` when the checker's expectation would be the answer itself."""
        checker = self.task.checker
        if isinstance(checker, ToolCallChecker):
            return f"Answer with a call of the {checker.tool} tool."
        if isinstance(checker, GenUIChecker) and checker.must_contain:
            words = ", ".join(repr(word) for word in checker.must_contain)
            return f"Answer with a GenUI tree whose text shows {words}."
        return None


def judge(verifier: Verifier, task: Task, steps: Sequence[RolloutStep]) -> Verdict:
    """The verifier's verdict; a crash or a reward outside [0, 1] is a failed verdict (the
    rollout teaches nothing), never an exception."""
    try:
        reward = float(verifier.reward(task, steps))
    except Exception as exc:
        return Verdict(None, False, f"verifier_error: {type(exc).__name__}: {exc}"[:500])
    if not math.isfinite(reward) or not 0.0 <= reward <= 1.0:
        return Verdict(None, False, f"reward_out_of_range: {reward!r}")
    return Verdict(reward, reward >= 1.0)


def load_environments(contract: Contract, bank_path: Path = BANK_V1) -> dict[str, Environment]:
    """The tasks of the bank at ``bank_path`` as environments, by task id; ``ConfigError``
    when a task of ``contract`` is among them."""
    bank = load_yaml_model(bank_path, TaskBank, TaskBankInvalid)
    held_out = [task for tasks in contract.suites.values() for task in tasks]
    for task in held_out:
        conflict = bank_conflict(task, bank.tasks)
        if conflict is not None:
            raise ConfigError(f"contract task {task.id!r} {conflict}: it cannot be an environment")
    return {task.id: Environment(bank.version, task) for task in bank.tasks}
