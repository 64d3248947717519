"""The outside measure: BFCL's irrelevance questions that none of the four tools serves, with
their source and licence recorded, sealed, held out from everything trained on, and run as the
``outside`` split."""

from __future__ import annotations

import re

from core.tasks import NoCallChecker
from learners.evaluation.checkers import check
from learners.evaluation.contract_runner import (
    CONTRACT_V5,
    OUTSIDE,
    held_out_tasks,
    load_contract,
    load_split,
)
from learners.files import DATA

SERVED_BY_A_TOOL = re.compile(
    r"(?i)\d|\b(calculat\w*|comput\w*|solve\w*|sum|add|subtract|multipl\w*|divid\w*|area|volume|"
    r"perimeter|integral|derivative|equation|roots?|math\w*|average|percent\w*|convert\w*|"
    r"how (many|much)|times?|clocks?|dates?|days?|today|tonight|tomorrow|now|hours?|minutes?|"
    r"remind\w*|notes?|remember|lists?|todo|to-do|tasks?|schedule\w*|agenda|probabilit\w*|"
    r"factor\w*|prime|interest|tax)\b"
)
"""What the import dropped: a question one of the four tools (calculator, notes, to-do list,
clock) could serve, by a digit or a word of arithmetic, time, dates, notes or lists."""


def test_the_outside_measure_is_bfcls_questions_that_no_tool_serves() -> None:
    outside = load_split(CONTRACT_V5, "outside")
    assert outside == load_contract(OUTSIDE) and outside.version == "outside-bfcl-irrelevance-1"
    [tasks] = outside.suites.values()
    assert len(tasks) == 148 and outside.routing is None
    for task in tasks:
        assert task.id.startswith("bfcl-irrelevance-") and task.specialist == "agent"
        assert not SERVED_BY_A_TOOL.search(task.prompt), task.id
        assert isinstance(task.checker, NoCallChecker)
        assert check(task, "I can't look that up with the tools I have.")
        assert not check(task, '{"tool": "clock", "args": {}}')
    assert len({task.prompt.casefold() for task in tasks}) == len(tasks)


def test_its_source_and_licence_are_recorded_beside_it() -> None:
    header = OUTSIDE.read_text().split("\nextends:", 1)[0]
    assert "github.com/ShishirPatil/gorilla" in header
    assert "BFCL_v4_irrelevance.json" in header and "Apache License 2.0" in header
    licence = (DATA / "LICENSE-BFCL.txt").read_text()
    assert "Apache License" in licence and "Version 2.0" in licence


def test_nothing_trained_on_may_ask_it() -> None:
    """The bank and the tasks the loop writes are held out from it, as from a contract."""
    held_out = {task.id for task in held_out_tasks()}
    assert {task.id for task in load_contract(OUTSIDE).suites["agent"]} <= held_out
