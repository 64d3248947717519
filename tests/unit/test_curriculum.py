"""The self mode's curriculum: the whole bank once before any task again, then fewer of the
tasks that teach little (never solved, almost always solved)."""

from __future__ import annotations

from collections import Counter
from itertools import islice

import pytest

from core.contract import RegexChecker, Task
from core.errors import ConfigError
from learners.curriculum import Curriculum
from macaron.demo.generations import draw_prompts


def bank(n: int) -> list[Task]:
    checker = RegexChecker(kind="regex", pattern="x")
    return [
        Task(id=f"t-{i}", specialist="chat", prompt=f"p {i}", checker=checker, reference="x")
        for i in range(n)
    ]


def test_every_task_once_before_any_again_and_seeded() -> None:
    tasks = bank(20)
    first = [t.id for t in islice(Curriculum(tasks, seed=3), 20)]
    assert sorted(first) == sorted(t.id for t in tasks) and first != [t.id for t in tasks]
    assert first == [t.id for t in islice(Curriculum(tasks, seed=3), 20)]
    assert first != [t.id for t in islice(Curriculum(tasks, seed=4), 20)]


def test_tasks_never_or_almost_always_solved_come_about_a_quarter_as_often() -> None:
    tasks = bank(30)
    curriculum = Curriculum(tasks, seed=0)
    list(islice(curriculum, 30))
    curriculum.record({f"t-{i}": (0, 8) for i in range(10)})  # never solved
    curriculum.record({f"t-{i}": (8, 8) for i in range(10, 20)})  # always solved
    curriculum.record({f"t-{i}": (3, 8) for i in range(20, 30)})  # learning zone
    counts = Counter(t.id for t in islice(curriculum, 3000))
    low = sum(counts[f"t-{i}"] for i in range(20)) / 20
    zone = sum(counts[f"t-{i}"] for i in range(20, 30)) / 10
    assert 0.15 < low / zone < 0.35
    curriculum.record({"t-0": (2, 8)})  # solved at last: 2 of 16
    assert curriculum.weight(tasks[0]) == 1.0
    curriculum.record({"t-10": (0, 8)})  # 8 of 16: no longer almost always
    assert curriculum.weight(tasks[10]) == 1.0


def test_an_empty_bank_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no tasks"):
        Curriculum([], seed=0)


def test_prompts_of_a_specialist_whose_run_is_queued_wait_for_the_next_generation() -> None:
    """``draw_prompts``: only the due specialists' prompts are drawn; the others' wait, once
    each, and are drawn first when their specialist is due again, none lost."""
    checker = RegexChecker(kind="regex", pattern="x")
    tasks = [
        Task(id=f"{name}-{i}", specialist=name, prompt="p", checker=checker, reference="x")
        for i in range(6)
        for name in ("agent", "genui")
    ]
    plays = Curriculum(tasks, seed=1)
    waiting: list[Task] = []
    drawn = draw_prompts(plays, waiting, 5, {"agent"})
    assert [t.specialist for t in drawn] == ["agent"] * 5
    assert waiting and {t.specialist for t in waiting} == {"genui"}
    assert len({t.id for t in waiting}) == len(waiting)
    held = list(waiting)
    again = draw_prompts(plays, waiting, len(held) + 1, {"agent", "genui"})
    assert again[: len(held)] == held and not waiting
    first_round = {t.id for t in [*drawn, *again]}
    assert len(first_round) == len(drawn) + len(again)  # the first round repeats no prompt
