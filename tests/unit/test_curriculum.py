"""The self mode's curriculum: the whole bank once before any task again, then fewer of the
tasks that teach little (never solved, almost always solved)."""

from __future__ import annotations

from collections import Counter
from itertools import islice

import pytest

from core.errors import ConfigError
from core.tasks import RegexChecker, Task
from learners.rollouts.curriculum import Curriculum


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
