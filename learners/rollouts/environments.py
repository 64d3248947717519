"""Environments and verifiers: what a rollout is sampled in and judged by.

An environment wraps one task of the training bank: its prompt, the action substrate (a fresh
tool state per episode: the model calls a tool, sees the result, and calls again or answers)
and a verifier. The verifier here is the contract's checkers (tool call executed and right,
GenUI tree valid and containing what was asked, Python tests in the sandbox, exact or regex),
turned into a reward in [0, 1]: graded for GenUI (the share of what was asked that the tree
gives), 0 or 1 otherwise; an episode passes when the checker does.

A group none of whose samples passed may get a second look (``HintMode``), STaR-style:
- ``tools``: a tool-call environment's group is decoded again, greedily, once per kind of call
  of the harness's tools (a tool, or one op of it: ``notes.set``), its first step held to it.
  It says nothing the harness does not (which tools and ops exist), so a system that only has
  verifiers can do it: it explores the first decisions, which tool and which op, that a base
  model gets wrong (it calls the calculator to remember a note);
- ``checker``: an ablation, sampled again with a hint after the prompt. The only hint this bank
  could give is what its checker expects (the tool to call, the words the tree must show),
  which a system that only has verifiers would not know. ``checker`` hints are reported apart,
  never taken for what the loop learns by itself.

The contract's held-out tasks are never an environment: ``load_environments`` refuses a bank
whose task is (nearly) a task of any contract version.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from core.contract import Contract
from core.events import RolloutStep
from core.tasks import GenUIChecker, Task, ToolCallChecker
from learners.evaluation.checkers import check, genui_credit
from learners.evaluation.contract_runner import load_training_bank
from learners.tasks import DEFAULT_BANK

HintMode = Literal["none", "tools", "checker"]
"""How a group with no passing sample is sampled again: ``none`` (it is not), ``tools`` (each kind
of call of the harness's tools in turn forced as the first step, where a tool call is judged) or
``checker`` (the ablation: what the checker expects, said plainly after the prompt)."""

VERIFIER_VERSION = "verifier-2"
"""The contract's checkers as rewards: 1.0 when the first step passes its checker, else 0.0;
but a GenUI task's reward is graded (``genui_credit``: a valid tree and each word and value
asked, in equal shares), so a group of trees that all fail the checker still scores apart
when some show more of what was asked. ``verifier-1`` gave GenUI 0.0 or 1.0 too."""


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
    the model made first: what a record teaches), GenUI graded (``VERIFIER_VERSION``). It
    passes exactly when the checker does (a reward of 1.0)."""

    name = "checker"
    version = VERIFIER_VERSION

    def reward(self, task: Task, steps: Sequence[RolloutStep]) -> float:
        if isinstance(task.checker, GenUIChecker):
            return genui_credit(task.checker, steps[0].output)
        return 1.0 if check(task, steps[0].output) else 0.0


@dataclass(frozen=True)
class Environment:
    bank_version: str
    task: Task

    @property
    def id(self) -> str:
        return f"{self.bank_version}/{self.task.id}"

    def resampled(self, mode: HintMode) -> bool:
        """Whether a group of this environment with no passing sample is sampled again under
        ``mode`` (a tool sweep needs a tool call to judge; a checker hint needs a hint)."""
        if mode == "tools":
            return isinstance(self.task.checker, ToolCallChecker)
        return self.hint(mode) is not None

    def hint(self, mode: HintMode) -> str | None:
        """The hint of ``mode``: with ``checker``, what the checker asks for, said plainly (the
        tool to call, the words the tree must show; ``None`` when the checker's expectation
        would be the answer itself); no other mode says anything after the prompt."""
        checker = self.task.checker
        if mode != "checker":
            return None
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


def load_environments(contract: Contract, bank_path: Path = DEFAULT_BANK) -> dict[str, Environment]:
    """The tasks of the bank at ``bank_path`` as environments, by task id; ``TaskBankInvalid``
    when a task of ``contract`` or of any contract version is among them."""
    bank = load_training_bank(bank_path, contract)
    return {task.id: Environment(bank.version, task) for task in bank.tasks}
