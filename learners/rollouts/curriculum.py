"""The self mode's curriculum: which bank tasks to roll out next.

Every task is rolled out once, in a seeded shuffle, before any is rolled out again, so the
whole bank is seen over the generations. After that first round, a task teaches by how its
rollouts have scored: one never solved gives no verified answer and one almost always solved
gives groups scored alike (no advantage), so each later round holds them with probability
``LOW_WEIGHT`` and every task in between always.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from core.errors import ConfigError
from core.tasks import Task

LOW_WEIGHT = 0.25
"""How often a later round holds a task never solved or almost solved."""
ALMOST_SOLVED = 0.875
"""The pass rate from which a task counts as almost solved (7 of 8 samples)."""


@dataclass
class Curriculum:
    """An endless play order over ``tasks`` that weighs what their rollouts taught so far
    (``record``); seeded, so the same rollouts give the same order."""

    tasks: Sequence[Task]
    seed: int
    passed: dict[str, int] = field(default_factory=dict)
    judged: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ConfigError("no tasks to roll out")
        self._order = self._rounds()

    def __iter__(self) -> Iterator[Task]:
        return self

    def __next__(self) -> Task:
        return next(self._order)

    def record(self, by_task: Mapping[str, tuple[int, int]]) -> None:
        """Add a job's samples passed and judged per task."""
        for task_id, (passed, judged) in by_task.items():
            self.passed[task_id] = self.passed.get(task_id, 0) + passed
            self.judged[task_id] = self.judged.get(task_id, 0) + judged

    def weight(self, task: Task) -> float:
        """1 for a task not yet judged or in the learning zone, ``LOW_WEIGHT`` for one never
        solved or almost solved."""
        judged = self.judged.get(task.id, 0)
        if not judged:
            return 1.0
        rate = self.passed.get(task.id, 0) / judged
        return LOW_WEIGHT if rate == 0.0 or rate >= ALMOST_SOLVED else 1.0

    def _rounds(self) -> Iterator[Task]:
        rng = random.Random(self.seed)  # noqa: S311 (play order, not secrets)
        order = list(self.tasks)
        rng.shuffle(order)
        yield from order
        while True:
            chosen: list[Task] = []
            while not chosen:
                chosen = [t for t in self.tasks if rng.random() < self.weight(t)]
            rng.shuffle(chosen)
            yield from chosen
