"""Development and test splits: contract 5's suites and routing files are its sealed test split,
written apart from everything trained on or chosen on (the leak test); contract 4's, with tasks
that want no call, are its development split; a shipped version whose content changes without a
new version is refused; the test split's calculator tasks check the call's operands and
operation, and the agent suites of both splits ask for text with no call where no tool
serves."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from core.errors import ContractChanged, ContractInvalid
from core.harness.artifact import root_harness
from core.tasks import (
    NEAR_DUPLICATE,
    Calculation,
    NoCallChecker,
    Task,
    ToolCallChecker,
    prompt_words,
)
from core.tasks import word_overlap as overlap
from learners.evaluation.checkers import check, well_formed
from learners.evaluation.contract_runner import (
    CONTRACT_V4,
    CONTRACT_V4_NOCALL,
    CONTRACT_V5,
    CONTRACTS,
    DEFAULT_CONTRACT,
    ContractRun,
    Split,
    load_contract,
    load_split,
)
from learners.evaluation.seals import CONTRACT_SEALS, seal
from learners.files import DATA
from learners.routing.run import routing_suite
from learners.routing.training import SEED_EXAMPLES
from learners.tasks import BANK_V1, BANK_V2, BANK_V3, load_bank

V5 = load_contract(CONTRACT_V5)
TEST_TASKS = [task for tasks in V5.suites.values() for task in tasks]


def _jsonl_rows(path: Path) -> list[tuple[int, str]]:
    """Each text of a routing file (a turn's, and a follow-up's previous turn's) by its line."""
    return [
        (number, text)
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if line.strip()
        for text in (json.loads(line)["text"], json.loads(line).get("previous_text"))
        if text
    ]


def _jsonl_texts(path: Path) -> list[str]:
    return [text for _, text in _jsonl_rows(path)]


def _trained_or_chosen_on() -> dict[str, list[str]]:
    """Every text the loop trains on (the banks, the router's seed examples, harness@0's
    exemplars) or that choices were made on (the development split: every earlier contract
    version's suites and routing files, and the routing development files), by where it
    comes from."""
    texts: dict[str, list[str]] = {
        "bank": [task.prompt for bank in (BANK_V1, BANK_V2, BANK_V3) for task in load_bank(bank)],
        "router seed examples": _jsonl_texts(SEED_EXAMPLES),
        "harness exemplars": [
            shot.user
            for specialist in root_harness().specialists.values()
            for shot in specialist.exemplars
        ],
    }
    for name in ("routing-dev.jsonl", "routing-followups-dev.jsonl"):
        texts[name] = _jsonl_texts(DATA / name)
    for path in CONTRACTS:
        if path == CONTRACT_V5:
            continue
        contract = load_contract(path)
        texts[path.name] = [task.prompt for tasks in contract.suites.values() for task in tasks]
        if contract.routing is not None:
            for name in filter(None, (contract.routing.suite, contract.routing.follow_ups)):
                texts[name] = _jsonl_texts(DATA / name)
    return texts


def _test_split_texts() -> list[tuple[str, str]]:
    assert V5.routing is not None and V5.routing.follow_ups is not None
    rows = [(task.id, task.prompt) for task in TEST_TASKS]
    for name in (V5.routing.suite, V5.routing.follow_ups):
        rows += [(f"{name}:{line}", text) for line, text in _jsonl_rows(DATA / name)]
    return rows


def test_the_test_split_leaks_into_nothing_trained_or_chosen_on() -> None:
    """No test-split prompt (a task's, a routing turn's, a follow-up's or its previous turn's)
    is asked, or nearly asked, by the bank, the router's seed examples, the harness's
    exemplars or the development split. Short texts ("make it blue") are compared whole."""
    elsewhere = {
        source: [(text, prompt_words(text)) for text in texts]
        for source, texts in _trained_or_chosen_on().items()
    }
    leaks = []
    for name, text in _test_split_texts():
        words = prompt_words(text)
        near = 1.0 if len(words) <= 6 else NEAR_DUPLICATE
        for source, others in elsewhere.items():
            for other, other_words in others:
                if text.casefold() == other.casefold() or overlap(words, other_words) >= near:
                    leaks.append(f"{name} {text!r} ~ {source} {other!r}")
    assert not leaks, "\n".join(leaks)


def test_a_planted_leak_is_found() -> None:
    """The leak test's comparison catches a bank prompt reworded by a word."""
    bank_prompt = load_bank(BANK_V2)[0].prompt
    reworded = bank_prompt.replace("Make", "Build", 1)
    assert reworded != bank_prompt
    assert overlap(prompt_words(reworded), prompt_words(bank_prompt)) >= NEAR_DUPLICATE


def test_contract_5_is_the_default_and_its_development_split_is_contract_4_with_no_calls() -> None:
    """The development split is contract 4's tasks and, after them, tasks that want no call."""
    assert DEFAULT_CONTRACT == CONTRACT_V5 and V5.version == "contract-5"
    development = load_split(CONTRACT_V5, "development")
    assert development == load_contract(CONTRACT_V4_NOCALL)
    assert load_split(CONTRACT_V5, "test") == V5
    v4 = load_contract(CONTRACT_V4)
    assert development.routing == v4.routing and development.rule == v4.rule
    for suite, tasks in v4.suites.items():
        added = development.suites[suite][len(tasks) :]
        assert development.suites[suite][: len(tasks)] == tasks
        assert all(isinstance(task.checker, NoCallChecker) for task in added), suite
    assert set(V5.suites) == set(development.suites)
    assert not {t.id for t in TEST_TASKS} & {
        t.id for tasks in development.suites.values() for t in tasks
    }
    with pytest.raises(ContractInvalid, match="names no development split"):
        load_split(CONTRACT_V4, "development")
    assert V5.routing is not None and V5.routing.follow_ups is not None
    assert len(routing_suite(CONTRACT_V5.parent, V5.routing)) >= 150


def test_every_test_task_has_a_reference_that_passes_it() -> None:
    assert all(check(task, task.reference) for task in TEST_TASKS)


def test_the_test_splits_calculator_tasks_check_the_calls_operands_and_operation() -> None:
    """Each calculator task names what the call must compute: its result alone would pass
    ``calculator("540")``, a number the model worked out itself."""
    calculators = [
        task
        for task in TEST_TASKS
        if isinstance(task.checker, ToolCallChecker) and task.checker.tool == "calculator"
    ]
    assert len(calculators) >= 15
    for task in calculators:
        assert isinstance(task.checker, ToolCallChecker)
        assert task.checker.calculation is not None and task.checker.result, task.id
        value = task.checker.result["value"]
        worked_out = json.dumps({"tool": "calculator", "args": {"expression": str(value)}})
        assert not check(task, worked_out), task.id


@pytest.mark.parametrize("split", ["development", "test"])
def test_the_agent_suites_no_call_tasks_fail_any_call(split: Split) -> None:
    """Where no offered tool serves, the right answer is text: a call of any tool fails it. Both
    splits ask for it (the development split, so that "always call" shows where choices are
    made)."""
    contract = load_split(CONTRACT_V5, split)
    no_calls = [t for t in contract.suites["agent"] if isinstance(t.checker, NoCallChecker)]
    assert len(no_calls) >= 10
    for task in no_calls:
        for tool in ('{"tool": "clock", "args": {}}', '{"tool": "notes", "args": {"op": "list"}}'):
            assert not check(task, tool), task.id
        assert check(task, task.reference), task.id


def test_a_contract_that_extends_another_adds_tasks_per_suite(tmp_path: Path) -> None:
    """``adds`` puts tasks after the extended contract's, suite by suite; anything but a list
    of tasks per suite is refused."""
    shutil.copy(DATA / "contract-v3.yaml", tmp_path / "contract-v3.yaml")
    task = {
        "id": "x-agent-1",
        "specialist": "agent",
        "prompt": "What is a kilometre?",
        "checker": {"kind": "no_call", "pattern": "metres"},
        "reference": "A thousand metres.",
    }
    path = tmp_path / "contract-x.yaml"
    document = {"extends": "contract-v3.yaml", "version": "contract-x", "adds": {"agent": [task]}}
    path.write_text(yaml.safe_dump(document))
    v3 = load_contract(DATA / "contract-v3.yaml")
    added = load_contract(path)
    assert added.suites["agent"][:-1] == v3.suites["agent"]
    assert added.suites["agent"][-1].id == "x-agent-1"
    assert {s: len(t) for s, t in added.suites.items() if s != "agent"} == {
        s: len(t) for s, t in v3.suites.items() if s != "agent"
    }
    path.write_text(yaml.safe_dump({**document, "adds": [task]}))
    with pytest.raises(ContractInvalid, match="adds lists, per suite, tasks added"):
        load_contract(path)


def test_every_shipped_contract_is_sealed_as_it_stands() -> None:
    """Each shipped version is in the seals file with the content it has; a new version is
    sealed by adding the entry this test prints."""
    seals = json.loads(CONTRACT_SEALS.read_text())
    for path in CONTRACTS:
        contract = load_contract(path)
        entry = json.dumps({contract.version: seal(path, contract)}, indent=1, sort_keys=True)
        assert seals.get(contract.version) == seal(path, contract), (
            f"{contract.version} is not sealed as it stands; its entry:\n{entry}"
        )


def _copy(tmp_path: Path) -> Path:
    """Contract 5 and the files it names, copied where a test may change them."""
    for name in (CONTRACT_V5.name, CONTRACT_V4_NOCALL.name, "contract-v3.yaml"):
        shutil.copy(DATA / name, tmp_path / name)
    assert V5.routing is not None and V5.routing.follow_ups is not None
    for name in (V5.routing.suite, V5.routing.follow_ups):
        shutil.copy(DATA / name, tmp_path / name)
    return tmp_path / CONTRACT_V5.name


def test_a_sealed_version_whose_task_changed_is_refused_naming_it(tmp_path: Path) -> None:
    path = _copy(tmp_path)
    assert load_contract(path) == V5
    document = yaml.safe_load(path.read_text())
    task = document["suites"]["genui"][3]
    task["prompt"] += " Please."
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    with pytest.raises(ContractChanged, match=task["id"]) as refused:
        load_contract(path)
    assert refused.value.code == "contract_changed"
    assert Task.model_validate(task).id == task["id"]


def test_a_sealed_version_whose_routing_file_changed_is_refused(tmp_path: Path) -> None:
    path = _copy(tmp_path)
    assert V5.routing is not None
    suite = tmp_path / V5.routing.suite
    suite.write_text(suite.read_text() + '{"text": "hello there", "specialist": "chat"}\n')
    with pytest.raises(ContractChanged, match=f"routing:{V5.routing.suite}"):
        load_contract(path)


def test_a_new_version_may_change_tasks(tmp_path: Path) -> None:
    """The same change under a version of its own loads: it is a new contract."""
    path = _copy(tmp_path)
    document = yaml.safe_load(path.read_text())
    document["version"] = "contract-5-local"
    document["suites"]["genui"][3]["prompt"] += " Please."
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    assert load_contract(path).version == "contract-5-local"


MULTIPLY = Task.model_validate(
    {
        "id": "multiply",
        "specialist": "agent",
        "prompt": "Multiply 45 by 12.",
        "checker": {
            "kind": "tool_call",
            "tool": "calculator",
            "result": {"value": 540},
            "calculation": {"operands": [45, 12], "operators": ["*"]},
        },
        "reference": '{"tool": "calculator", "args": {"expression": "45 * 12"}}',
    }
)
SUBTRACT = MULTIPLY.model_copy(
    update={
        "checker": ToolCallChecker(
            kind="tool_call",
            tool="calculator",
            result={"value": 231},
            calculation=Calculation(operands=[250, 19], operators=["-"]),
        )
    }
)


@pytest.mark.parametrize(
    ("task", "expression", "passes"),
    [
        (MULTIPLY, "45 * 12", True),
        (MULTIPLY, "12*45", True),
        (MULTIPLY, "(45) * (12)", True),
        (MULTIPLY, "540", False),
        (MULTIPLY, "45 * 12 + 0", True),
        (MULTIPLY, "540 * 1", False),
        (MULTIPLY, "45 + 495", False),
        (SUBTRACT, "250 - 19", True),
        (SUBTRACT, "-19 + 250", True),
        (SUBTRACT, "231", False),
        (SUBTRACT, "200 + 31", False),
    ],
)
def test_a_calculation_checks_the_operands_and_operators_the_call_writes(
    task: Task, expression: str, passes: bool
) -> None:
    output = json.dumps({"tool": "calculator", "args": {"expression": expression}})
    assert check(task, output) is passes


def test_a_calculation_is_a_calculators() -> None:
    with pytest.raises(ValueError, match="only a calculator call"):
        ToolCallChecker(
            kind="tool_call",
            tool="notes",
            calculation=Calculation(operands=[1], operators=["+"]),
        )


@pytest.mark.parametrize(
    ("output", "passes", "formed"),
    [
        (
            "Sorry, I can't book tables: I have a calculator, notes, a to-do list and a clock.",
            True,
            True,
        ),
        ("Done! Your table is booked.", False, True),  # no call, but not what it asks
        ('{"tool": "todo", "args": {"op": "add", "text": "book a table"}}', False, False),
        ('  {"tool": "clock", "args": {}}', False, False),
    ],
)
def test_a_no_call_task_wants_text_that_says_what_it_asks(
    output: str, passes: bool, formed: bool
) -> None:
    """It passes text that says what it asks; its form is text, not a call (the no-call rate
    the tables report beside the call accuracy)."""
    task = Task.model_validate(
        {
            "id": "no-call",
            "specialist": "agent",
            "prompt": "Book me a table for two tonight.",
            "checker": {"kind": "no_call", "pattern": r"(?i)\bcan(no|')t\b"},
            "reference": "I can't book tables.",
        }
    )
    assert check(task, output) is passes
    assert well_formed(task, output) is formed


def test_the_call_rates_are_the_call_tasks_passed_and_the_no_call_tasks_without_a_call() -> None:
    """``call_rates`` over every suite: tool-call tasks called right, no-call tasks answered
    without a call (right or not); other tasks count in neither."""
    outcomes: dict[tuple[str, int], tuple[bool, bool | None]] = {}
    calls: list[bool] = []
    no_calls: list[bool] = []
    for suite, tasks in V5.suites.items():
        for index, task in enumerate(tasks):
            if task.checker.kind == "tool_call":
                calls.append(len(calls) % 4 != 0)  # three in four right
                outcomes[(suite, index)] = (calls[-1], True)
            elif task.checker.kind == "no_call":
                no_calls.append(len(no_calls) % 2 == 0)  # every other one called a tool
                outcomes[(suite, index)] = (False, no_calls[-1])
            else:
                outcomes[(suite, index)] = (True, None)
    rates = ContractRun.of(V5, outcomes).call_rates(V5)
    assert rates == {"calls": sum(calls) / len(calls), "no_call": sum(no_calls) / len(no_calls)}
    assert 0.7 < rates["calls"] < 0.8 and 0.4 < rates["no_call"] < 0.6
    assert ContractRun.of(V5, {}).call_rates(V5) == {}  # nothing ran
    v4 = load_contract(CONTRACT_V4)  # calls, and no no-call task
    every = {
        (suite, i): (True, True) for suite, tasks in v4.suites.items() for i in range(len(tasks))
    }
    assert ContractRun.of(v4, every).call_rates(v4) == {"calls": 1.0}
