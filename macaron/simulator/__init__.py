"""The user simulator: simulated users play task-bank prompts against a running chat server over
WebSocket protocol v1, and an oracle gives the feedback a careful user would.

Each user holds one connection and asks one task per conversation (a ``hello`` starts a fresh
one), with the task's specialist as the hint. The answer is what a client shows: the model's
first tool call when an ``action`` frame arrived, else the GenUI tree as compact JSON, else the
streamed text. The oracle checks it with the task's checker: ``up`` when it passes, otherwise an
``edit`` whose text is the task's reference, so wrong answers become training data with the
correct target. ``rate_limited`` errors wait and retry; any other error frame ends that turn and
is counted, never ending the run.
"""

from macaron.simulator.plan import (
    DEFAULT_SPECIALISTS,
    SIMULATOR_TENANT,
    bank_tasks,
    pick_tasks,
    task_stream,
)
from macaron.simulator.play import run_simulation
from macaron.simulator.report import PlayedTurn, SimulationReport, SpecialistStats, report_table
from macaron.simulator.user import SimulationFailed

__all__ = [
    "DEFAULT_SPECIALISTS",
    "SIMULATOR_TENANT",
    "PlayedTurn",
    "SimulationFailed",
    "SimulationReport",
    "SpecialistStats",
    "bank_tasks",
    "pick_tasks",
    "report_table",
    "run_simulation",
    "task_stream",
]
