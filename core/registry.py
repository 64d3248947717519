"""The registry's records, typed: what the learning loop and the server write to the registry
of adapter versions, training runs, evaluations, promotions and router runs (stored by
``infra.postgres``), one object each instead of a field-by-field argument list."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal
from uuid import UUID

RunKind = Literal["adapter", "harness"]
"""What a training run makes: an ``adapter`` (trained) or a ``harness`` (proposed)."""


@dataclass(frozen=True)
class NewAdapterVersion:
    """An adapter version to register: ``version`` of ``specialist``, its parent's id (``None``
    for version 0), its files' content address and stored path, its rank and base model."""

    specialist: str
    version: int
    parent_id: int | None
    sha256: str
    path: str
    rank: int
    base_model: str


@dataclass(frozen=True)
class QueuedRun:
    """A training run to queue: of ``kind``, from the parent adapter and the dataset snapshot,
    with ``recipe``; ``unlearning``: it retrains without forgotten tenants."""

    run_id: UUID
    specialist: str
    parent_adapter_id: int
    snapshot_id: UUID
    kind: RunKind
    recipe: str
    unlearning: bool = False


@dataclass(frozen=True)
class RunOutput:
    """What a run that succeeded made (a trained adapter or a proposed harness), with its
    config and metrics; ``recipe``, when given, names what it was trained with."""

    config: dict[str, Any]
    metrics: dict[str, float]
    adapter_version_id: int | None = None
    harness_version: int | None = None
    recipe: str | None = None


@dataclass(frozen=True)
class EvaluationRecord:
    """A candidate's contract evaluation: its scores and whether it passed."""

    evaluation_id: UUID
    run_id: UUID
    adapter_version_id: int | None
    contract_version: str
    scores: dict[str, Any]
    passed: bool


@dataclass(frozen=True)
class Promotion:
    """What happened to a promotion request (``promoted``, ``rolled_back`` or ``rejected``),
    from which release to which, for lineage."""

    promotion_id: UUID
    kind: str
    from_release_id: str
    to_release_id: str
    run_id: UUID | None
    reason: str


@dataclass(frozen=True)
class RouterRunEnd:
    """How a router run ended: its status and, when it made one, the router version and the
    release that serves it, its parent and its evaluation; or its error."""

    status: str
    parent: str | None = None
    router_version: str | None = None
    release_id: str | None = None
    evaluation: Mapping[str, Any] | None = None
    error: str | None = None
