"""The contract runner: load a contract version, serve its tasks, check the answers
(``learners.evaluation.checkers``), and judge a candidate look by look (``core.sequential``).

Each task is served exactly as a user turn would be (the HCP context of its specialist, greedy
decoding) so the score measures what users get.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from core.canonical import canonical_json, sha256_hex
from core.contract import Contract, Decision
from core.engine import Engine, GenerationRequest, SamplingParams
from core.errors import ContractInvalid, TaskBankInvalid
from core.harness.actions import TOOLS
from core.harness.artifact import HarnessVersion
from core.harness.grammars import output_constraint
from core.harness.hcp import build_context
from core.sequential import Key, Stop, decide_at_look, schedule
from core.tasks import NEAR_DUPLICATE, Task, ToolCallChecker, prompt_words, word_overlap
from learners.evaluation.checkers import check, well_formed
from learners.evaluation.seals import check_sealed
from learners.files import DATA, load_yaml_model
from learners.tasks import DEFAULT_BANK, TaskBank, load_bank

CONTRACT_V1 = DATA / "contract-v1.yaml"
CONTRACT_V2 = DATA / "contract-v2.yaml"
CONTRACT_V2S = DATA / "contract-v2s.yaml"
CONTRACT_V3 = DATA / "contract-v3.yaml"
CONTRACT_V4 = DATA / "contract-v4.yaml"
CONTRACT_V4_NOCALL = DATA / "contract-v4-nocall.yaml"
OUTSIDE = DATA / "outside-bfcl-irrelevance.yaml"
"""The outside measure: requests from BFCL (Apache 2.0) that none of the tools serves, written
outside the project; reported, never chosen on or trained on."""
CONTRACT_V5 = DATA / "contract-v5.yaml"
CONTRACTS = (
    CONTRACT_V1,
    CONTRACT_V2,
    CONTRACT_V2S,
    CONTRACT_V3,
    CONTRACT_V4,
    CONTRACT_V4_NOCALL,
    CONTRACT_V5,
    OUTSIDE,
)
"""Every contract version, oldest first, and the outside measure: a bank is held out from all
of them, and each is sealed."""
DEFAULT_CONTRACT = CONTRACT_V5
"""The contract the loop judges by unless `MACARON_CONTRACT_PATH` names another: the sealed
test split; its development split is contract 4's suites with tasks that want no call
(``CONTRACT_V4_NOCALL``)."""
CALL_RATES = {"calls": "tool calls right", "no_call": "no call where none is asked"}
"""What ``ContractRun.call_rates`` reports, as tables name it."""
Split = Literal["development", "test", "outside"]
CONCURRENCY = 16
"""Requests in flight at once per contract run (the local engine's batch): the engine batches
concurrent requests, mixed adapters and all."""

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
    check_sealed(path, contract)
    return contract


def load_split(path: Path, split: Split) -> Contract:
    """The contract at ``path`` (``test``: its own suites, the sealed test split), or the
    contract its ``development`` names (``development``), whose suites choices are made on
    (``ContractInvalid`` when it names none), or the outside measure (``outside``: written
    outside the project, whatever the contract)."""
    contract = load_contract(path)
    if split == "outside":
        return load_contract(OUTSIDE)
    if split == "test":
        return contract
    if contract.development is None:
        raise ContractInvalid(f"{path}: {contract.version} names no development split")
    return load_contract(path.with_name(contract.development))


def load_training_bank(path: Path = DEFAULT_BANK, contract: Contract | None = None) -> TaskBank:
    """The bank at ``path`` to train on (rollouts, simulated users), refused
    (``TaskBankInvalid``) when it holds (nearly) a task of any contract version or of
    ``contract``, the one in use: a task trained on cannot tell held-out progress."""
    bank = load_yaml_model(path, TaskBank, TaskBankInvalid)
    for task in held_out_tasks(contract):
        conflict = bank_conflict(task, bank.tasks)
        if conflict is not None:
            raise TaskBankInvalid(f"{path}: contract task {task.id!r} {conflict}")
    return bank


def held_out_tasks(contract: Contract | None = None) -> tuple[Task, ...]:
    """Every task of every contract version, and of ``contract`` (the one in use): what
    nothing trained on may ask, nearly or exactly."""
    return (*_shipped_tasks(), *([] if contract is None else _tasks(contract)))


@functools.cache
def _shipped_tasks() -> tuple[Task, ...]:
    return tuple(task for path in CONTRACTS for task in _tasks(load_contract(path)))


def _tasks(contract: Contract) -> list[Task]:
    return [task for tasks in contract.suites.values() for task in tasks]


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


# --- running --------------------------------------------------------------------------------


Outcome = tuple[bool, bool | None]
"""A task's outcome: whether it passed, and whether it was well-formed (``None``: no form)."""


@dataclass(frozen=True)
class ContractRun:
    """Per suite, per task: whether the answer passed its checker (``None``: not run, the
    verdict was known first), and whether it was well-formed (a GenUI tree that validates, a
    tool call that parses; ``None`` where the task asks for no format or did not run). Format
    and content are apart, so a grammar's gain is never taken for the model's."""

    passed: dict[str, list[bool | None]]
    well_formed: dict[str, list[bool | None]]
    inherited: dict[str, list[bool]] = field(default_factory=dict, compare=False)
    """Per suite, per task: whether the outcome is the parent's, not run; where an outcome
    came from, not part of it (two runs with the same outcomes are equal)."""

    @classmethod
    def of(
        cls, contract: Contract, outcomes: Mapping[Key, Outcome], inherited: Collection[Key] = ()
    ) -> ContractRun:
        """The run with ``outcomes`` known (the rest not run), ``inherited`` of them marked."""
        run = cls({}, {}, {})
        for suite, tasks in contract.suites.items():
            known = [outcomes.get((suite, index)) for index in range(len(tasks))]
            run.passed[suite] = [None if o is None else o[0] for o in known]
            run.well_formed[suite] = [None if o is None else o[1] for o in known]
            run.inherited[suite] = [(suite, index) in inherited for index in range(len(tasks))]
        return run

    def outcomes(self) -> dict[Key, Outcome]:
        """Each task's outcome that is known, by suite and place."""
        return {
            (suite, index): (passed, self.well_formed[suite][index])
            for suite, done in self.passed.items()
            for index, passed in enumerate(done)
            if passed is not None
        }

    def missing(self) -> list[Key]:
        """The tasks not run."""
        return [
            (suite, index)
            for suite, done in self.passed.items()
            for index, passed in enumerate(done)
            if passed is None
        ]

    def complete(self) -> dict[str, list[bool]]:
        """Every outcome (``ValueError`` when a task has not run)."""
        if self.missing():
            raise ValueError(f"{len(self.missing())} tasks have not run")
        return {suite: [bool(p) for p in done] for suite, done in self.passed.items()}

    def digest(self, contract_version: str, tasks: Mapping[str, Sequence[str]]) -> str:
        """What a record stores beside these outcomes and the tasks they were got on (per
        suite, each task's ``Task.key``), so a changed record is not reused."""
        return sha256_hex(
            canonical_json(
                {
                    "contract": contract_version,
                    "tasks": tasks,
                    "passed": self.passed,
                    "formed": self.well_formed,
                }
            )
        )

    def scores(self) -> dict[str, float]:
        """Each suite's share of tasks passed, over its tasks that ran."""
        rates = {}
        for suite, done in self.passed.items():
            known = [ok for ok in done if ok is not None]
            if known:
                rates[suite] = sum(known) / len(known)
        return rates

    def call_rates(self, contract: Contract) -> dict[str, float]:
        """Over every suite: ``calls``, the share of tasks that ask for a tool call whose call
        was right, and ``no_call``, the share of tasks that ask for none answered without one
        (each only where the contract has such tasks and they ran)."""
        found: dict[str, list[bool]] = {"calls": [], "no_call": []}
        for suite, tasks in contract.suites.items():
            for index, task in enumerate(tasks):
                passed, formed = self.passed[suite][index], self.well_formed[suite][index]
                if task.checker.kind == "tool_call" and passed is not None:
                    found["calls"].append(passed)
                elif task.checker.kind == "no_call" and formed is not None:
                    found["no_call"].append(formed)
        return {name: sum(done) / len(done) for name, done in found.items() if done}

    def format_scores(self) -> dict[str, float]:
        """Each suite's share of well-formed answers, over its tasks that ask for a format."""
        rates = {}
        for suite, formed in self.well_formed.items():
            asked = [ok for ok in formed if ok is not None]
            if asked:
                rates[suite] = sum(asked) / len(asked)
        return rates


async def serve(
    engine: Engine,
    adapters: Mapping[str, str | None],
    contract: Contract,
    keys: Sequence[Key],
    *,
    harness: HarnessVersion,
    seed: int = 0,
) -> dict[Key, Outcome]:
    """The outcomes of the tasks ``keys`` names (``answers``, then their checkers)."""
    outputs = await answers(engine, adapters, contract, keys, harness=harness, seed=seed)
    return {
        key: (check(task, outputs[key]), well_formed(task, outputs[key]))
        for key, task in ((key, contract.suites[key[0]][key[1]]) for key in keys)
    }


async def answers(
    engine: Engine,
    adapters: Mapping[str, str | None],
    contract: Contract,
    keys: Sequence[Key],
    *,
    harness: HarnessVersion,
    seed: int = 0,
) -> dict[Key, str]:
    """The answers to the tasks ``keys`` names, each served with the adapter of the specialist
    it names, the context ``harness`` builds for it, the grammar it enforces and that
    specialist's answer budget, greedily and all at once (the engine batches them, mixed
    adapters and all). An engine error fails the whole call: a score with answers missing
    would mislead."""
    missing = sorted(set(contract.specialists()) - adapters.keys())
    if missing:
        raise ValueError(f"no adapter given for specialists: {', '.join(missing)}")
    tasks = [contract.suites[suite][index] for suite, index in keys]
    outputs = await _answers(
        engine, contract, [(task, adapters[task.specialist]) for task in tasks], harness, seed
    )
    return dict(zip(keys, outputs, strict=True))


async def run_contract(
    engine: Engine,
    adapters: Mapping[str, str | None],
    contract: Contract,
    *,
    harness: HarnessVersion,
    seed: int = 0,
) -> ContractRun:
    """Outcomes of every task of every suite (``serve``)."""
    keys = [(suite, i) for suite, tasks in contract.suites.items() for i in range(len(tasks))]
    outcomes = await serve(engine, adapters, contract, keys, harness=harness, seed=seed)
    return ContractRun.of(contract, outcomes)


@dataclass(frozen=True)
class Verdict:
    """A candidate judged against its parent: its outcomes at the stop, the decision, where
    it stopped, and how many of the tasks it could have run it ran."""

    run: ContractRun
    decision: Decision
    stop: Stop
    tasks_run: int
    tasks_planned: int


@dataclass(frozen=True)
class Baseline:
    """What a candidate is judged against: the parent's outcomes, the specialists the change
    touches (``None``: every one), the specialist whose gain counts, and whether it must gain
    (``False``: every suite only guarded)."""

    parent: ContractRun
    changed: frozenset[str] | None
    specialist: str
    needs_gain: bool = True


async def judge(
    engine: Engine,
    adapters: Mapping[str, str | None],
    contract: Contract,
    harness: HarnessVersion,
    baseline: Baseline,
    seed: int = 0,
) -> Verdict:
    """Serve the candidate the tasks of the baseline's changed specialists look by look
    (``core.sequential.schedule``) and stop once the rule's verdict is known
    (``core.sequential.decide_at_look``). The other tasks keep the parent's outcomes (marked
    inherited): each task is served by the specialist it names with greedy decoding, which
    gives the same tokens alone and in any batch, so those answers cannot differ
    (``core.release.changed_specialists``)."""
    parent = baseline.parent
    chunks = schedule(contract, baseline.changed)
    planned = {key for chunk in chunks for key in chunk}
    inherited = {k: o for k, o in parent.outcomes().items() if k not in planned}
    fresh: dict[Key, Outcome] = {}
    looks: list[ContractRun] = []
    for chunk in chunks:
        fresh |= await serve(engine, adapters, contract, chunk, harness=harness, seed=seed)
        looks.append(ContractRun.of(contract, inherited | fresh, inherited.keys()))
        settled = decide_at_look(
            [look.passed for look in looks],
            parent.complete(),
            baseline.specialist,
            contract.rule,
            looks[-1].inherited,
            needs_gain=baseline.needs_gain,
        )
        if settled is not None:
            return Verdict(looks[-1], *settled, len(fresh), len(planned))
    raise AssertionError("decide_at_look settles at the last look")


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
