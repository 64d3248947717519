"""The registry port for training runs, as the learning loop carries them out: the runs, the
dataset snapshots they train on and the adapter versions they start from and make, each call
one transaction, typed records in and out (``core.registry``). PostgreSQL implements it
(``infra.postgres.run_registry``), and so does an in-memory registry for unit tests
(``infra.memory_registry``); both pass ``tests/contract/run_registry_contract.py``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol
from uuid import UUID

from core.registry import (
    AdapterVersion,
    DatasetSnapshot,
    NewAdapterVersion,
    QueuedRun,
    RunOutput,
    RunResult,
    TrainingRun,
)
from core.release import AdapterRef


@dataclass(frozen=True)
class Candidate:
    """A trained adapter to register as its specialist's next version: from ``parent_id``, its
    files' content address and stored path, its rank and base model."""

    specialist: str
    parent_id: int
    sha256: str
    path: str
    rank: int
    base_model: str


class RunRegistry(Protocol):
    """Training runs, their snapshots and their adapters. A run is ``queued``, then
    ``running`` under a lease while one worker trains it, then ``succeeded`` or ``failed``; at
    most one run per specialist is queued or running."""

    def register_adapter(self, adapter: NewAdapterVersion) -> AdapterRef:
        """Record an adapter version (a version 0, or one made elsewhere)."""
        ...

    def adapter(self, adapter_version_id: int) -> AdapterVersion | None: ...

    def record_snapshot(self, snapshot: DatasetSnapshot) -> None:
        """Record a snapshot once (recording the same id again changes nothing)."""
        ...

    def snapshot(self, snapshot_id: UUID) -> DatasetSnapshot | None: ...

    def queue(self, run: QueuedRun) -> bool:
        """Queue the run; ``False`` when it was not (it exists, or a run of its specialist is
        queued or running)."""
        ...

    def claim(self, run_id: UUID, lease_seconds: int) -> TrainingRun | None:
        """Take the run, now ``running`` under a lease of ``lease_seconds``, if it is queued or
        its last worker's lease ran out; ``None`` otherwise (done, or a live worker has it)."""
        ...

    def renew_lease(self, run_id: UUID, lease_seconds: int) -> None: ...

    def run(self, run_id: UUID) -> TrainingRun | None: ...

    def result(self, run_id: UUID) -> RunResult | None:
        """Where the run stands and what it made."""
        ...

    def fail(self, run_id: UUID, error: str) -> None: ...

    def record_candidate(self, run_id: UUID, candidate: Candidate, output: RunOutput) -> AdapterRef:
        """Register the run's trained adapter as its specialist's next version and mark the
        run succeeded with it (``output``'s adapter id is the new version's), in one step."""
        ...
