"""What every learning step runs with (``Runtime``, built only by ``macaron.wiring``) and the
errors a run can end in."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from uuid import UUID

from core.engine import Engine
from core.errors import MacaronError
from core.ids import derived_id
from core.log import EventLog
from core.routing_labels import RouterTrainer
from core.run_registry import RunRegistry
from core.settings import Settings
from infra.artifacts import ArtifactStore
from infra.postgres.db import Pool
from learners.recipes.config import TrainingConfig

Progress = Callable[[int, int, dict[str, float]], None]


class RunFailed(MacaronError):
    code = "run_failed"


class SnapshotMismatch(RunFailed):
    """A snapshot's records, read back from the log, no longer chain to its hash."""

    code = "snapshot_mismatch"


class SnapshotForgotten(RunFailed):
    """A snapshot holds records of a forgotten tenant: it is never trained on, not even in part
    (``macaron tenants exposure`` names what learned from them)."""

    code = "snapshot_forgotten"


class RunBusy(MacaronError):
    """Another worker holds a live lease on the run: try again once it may have run out."""

    code = "run_busy"
    retryable = True


@dataclass
class Runtime:
    settings: Settings
    pool: Pool
    runs: RunRegistry
    """The training runs, their snapshots and adapters (the rest of the registry: ``pool``)."""
    log: EventLog
    store: ArtifactStore
    model_dir: Path
    training: TrainingConfig
    contract_path: Path
    router_trainer: Callable[[], RouterTrainer]
    """A fresh router trainer on the seed examples (it embeds with the router's model)."""
    contract_engine: Callable[[], Engine]
    """A fresh engine on the base model, to run the contract with (closed after each run)."""


def step_id(run_id: UUID, step: str) -> UUID:
    """The id of a run's step (its event's id), the same on every redelivery."""
    return derived_id("run", run_id, step)
