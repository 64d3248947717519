"""Playing a plan: simulated users at once, each taking the next task until none is left."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from core.errors import ConfigError, MacaronError
from core.tasks import Task
from macaron.simulator.report import PlayedTurn, SimulationReport
from macaron.simulator.user import SimulatedUser


async def run_simulation(
    url: str,
    key: str,
    plan: Sequence[Task],
    *,
    concurrency: int,
    on_turn: Callable[[PlayedTurn], None] | None = None,
    until: Callable[[], object] | None = None,
) -> SimulationReport:
    """Play every task of ``plan`` once, with at most ``concurrency`` users at a time; when
    ``until`` is given and is true after a turn, no further turn starts (those under way end)."""
    if concurrency < 1:
        raise ConfigError("concurrency must be at least 1")
    queue: asyncio.Queue[tuple[int, Task]] = asyncio.Queue()
    for index, task in enumerate(plan):
        queue.put_nowait((index, task))
    played: list[PlayedTurn] = []

    def record(turn: PlayedTurn) -> None:
        played.append(turn)
        if on_turn is not None:
            on_turn(turn)
        if until is not None and until():
            while not queue.empty():
                queue.get_nowait()

    started = time.monotonic()
    try:
        async with asyncio.TaskGroup() as users:
            for _ in range(min(concurrency, len(plan))):
                users.create_task(SimulatedUser(url, key, record).play(queue))
    except* MacaronError as failed:
        raise failed.exceptions[0] from None
    return SimulationReport(sorted(played, key=lambda t: t.index), time.monotonic() - started)
