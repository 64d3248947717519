"""The simulator's training task bank: tasks in the contract's format, disjoint from the contract.

Bank tasks are what simulated users ask, and their references become training data; the
contract's held-out tasks must never be among them (``tests/unit/test_contract.py`` checks ids,
prompts and near-duplicate prompts).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from core.errors import TaskBankInvalid
from core.tasks import Task
from learners.files import load_yaml_model

BANK_V1 = Path(__file__).with_name("bank-v1.yaml")
BANK_V2 = Path(__file__).with_name("bank-v2.yaml")
BANK_V3 = Path(__file__).with_name("bank-v3.yaml")
DEFAULT_BANK = BANK_V3
"""The bank rollouts and simulated users draw from unless ``MACARON_TASK_BANK_PATH`` names
another: v2's tasks (v1's prompts with checkers as strict as contract v3's) and agent tasks
whose right answer is text and no call."""


class TaskBank(BaseModel):
    """One version of the bank: its tasks, each id used once. A bank that ``extends`` another
    may list ``adds``: tasks after the other bank's."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: str = Field(min_length=1, max_length=100)
    tasks: list[Task] = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _added(cls, data: Any) -> Any:
        if isinstance(data, dict) and "adds" in data:
            data = dict(data)
            added = data.pop("adds")
            if not isinstance(added, list) or not isinstance(data.get("tasks"), list):
                raise ValueError("adds lists tasks added to an extended bank's tasks")
            data["tasks"] = [*data["tasks"], *added]
        return data

    @model_validator(mode="after")
    def _unique_ids(self) -> TaskBank:
        seen: set[str] = set()
        for task in self.tasks:
            if task.id in seen:
                raise ValueError(f"task id {task.id!r} is used more than once")
            seen.add(task.id)
        return self


def load_bank(path: Path = DEFAULT_BANK) -> list[Task]:
    """The bank's tasks in file order; any problem is ``TaskBankInvalid`` with the reason."""
    return load_yaml_model(path, TaskBank, TaskBankInvalid).tasks
