"""Which tasks the simulated users ask, in a seeded order, and as which tenant."""

from __future__ import annotations

import random
from collections.abc import Iterable, Iterator, Sequence

from core.errors import ConfigError
from core.tasks import Task

DEFAULT_SPECIALISTS = ("genui", "agent")
SIMULATOR_TENANT = "simulator"
"""The tenant whose key simulated users use when none is given."""


def bank_tasks(bank: Iterable[Task], specialists: Sequence[str]) -> list[Task]:
    """The bank's tasks of ``specialists``; ``ConfigError`` when a name has none."""
    tasks = [task for task in bank if task.specialist in specialists]
    empty = sorted(set(specialists) - {task.specialist for task in tasks})
    if empty:
        known = sorted({task.specialist for task in bank})
        raise ConfigError(
            f"the task bank has no tasks for {', '.join(empty)}; it has: {', '.join(known)}"
        )
    return tasks


def task_stream(tasks: Sequence[Task], seed: int) -> Iterator[Task]:
    """Endless seeded play order: every task once in a shuffled round, then a new round."""
    if not tasks:
        raise ConfigError("no tasks to play")
    rng = random.Random(seed)  # noqa: S311 (play order, not secrets)
    while True:
        order = list(tasks)
        rng.shuffle(order)
        yield from order


def pick_tasks(tasks: Sequence[Task], turns: int, seed: int) -> list[Task]:
    """The first ``turns`` tasks of ``task_stream``."""
    stream = task_stream(tasks, seed)
    return [next(stream) for _ in range(turns)]
