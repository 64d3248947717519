"""The registry's records, typed: what the learning loop and the server write to the registry
of adapter versions, training runs, evaluations, promotions and router runs (stored by
``infra.postgres``), one object each instead of a field-by-field argument list."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal
from uuid import UUID

from core.log import Positions
from core.release import AdapterRef

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


# What the registry gives back: each back end maps its rows to these at its own edge.

RunStatus = Literal["queued", "running", "succeeded", "failed"]


@dataclass(frozen=True)
class DatasetSnapshot:
    """An immutable slice of one specialist's experience: ``[start_offset, end_offset)`` of
    one partition, read under ``filter_version``, whose records chain to ``content_hash``."""

    snapshot_id: UUID
    specialist: str
    partition: int
    start_offset: int
    end_offset: int
    filter_version: str
    content_hash: str
    record_count: int
    rewards_hashed: bool = True
    """Whether its live rewards are in ``content_hash`` (not for a range begun before they were)."""
    backfills: tuple[UUID, ...] = ()
    """The backfills that appended any of its records (replayed history)."""
    left_out_tenants: tuple[str, ...] = ()
    """Forgotten tenants whose records in the range it leaves out (a retraining)."""


@dataclass(frozen=True)
class TrainingRun:
    """A training run as the registry holds it: what it trains from, where it stands, and what
    it made once it succeeded (an adapter version or a harness version) or why it failed."""

    run_id: UUID
    specialist: str
    parent_adapter_id: int
    snapshot_id: UUID
    kind: RunKind
    recipe: str
    status: RunStatus
    unlearning: bool
    created_at: datetime
    result_adapter_id: int | None = None
    result_harness_version: int | None = None
    metrics: Mapping[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass(frozen=True)
class RunResult:
    """Where a run stands and, once it succeeded, the adapter (``specialist@version``) or the
    harness version it made."""

    status: RunStatus
    specialist: str | None
    version: int | None
    harness_version: int | None


@dataclass(frozen=True)
class RunVerdicts:
    """A run with its evaluation (``scores``, ``passed``; ``None`` before it) and its latest
    promotion decision (``promotion``: its kind, and its reason; ``None`` before it)."""

    run: TrainingRun
    scores: Mapping[str, Any] | None
    passed: bool | None
    promotion: str | None
    promotion_reason: str | None


@dataclass(frozen=True)
class AdapterVersion:
    """A registered adapter version: the reference engines load, its parent's id (``None``
    for version 0) and the base model it was trained on."""

    ref: AdapterRef
    parent_id: int | None
    base_model: str


@dataclass(frozen=True)
class PromotionRequest:
    """A request to make ``release_id`` active (``promote``) or to go back to it
    (``rollback``): who asked, for which run, and how it ended (``pending`` until it does)."""

    request_id: UUID
    kind: Literal["promote", "rollback"]
    release_id: str
    run_id: UUID | None
    requested_by: str
    status: Literal["pending", "done", "failed"]
    reason: str | None


@dataclass(frozen=True)
class RouterRun:
    """A router run: the labels it fits on (up to ``labels_end``, ``label_count`` of them), the
    forgotten tenants it leaves out and, for such a run, the router it is judged against
    (``judged_against``: the newest ancestor fitted on none of their labels; ``None``: the
    active router), where it stands, and what it made and how it was judged."""

    run_id: UUID
    labels_end: Positions
    label_count: int
    status: Literal["queued", "running", "passed", "refused", "failed"]
    left_out_tenants: tuple[str, ...]
    judged_against: str | None = None
    parent_router_version: str | None = None
    router_version: str | None = None
    release_id: str | None = None
    evaluation: Mapping[str, Any] | None = None
    error: str | None = None


@dataclass(frozen=True)
class ProducingRun:
    """The succeeded run that trained an adapter version: its id, recipe and snapshot."""

    run_id: UUID
    recipe: str
    snapshot: DatasetSnapshot


@dataclass(frozen=True)
class TrainedAdapter:
    """An adapter version as exposure sees it: its parent and, when a run trained it, the end
    of the snapshot it trained on, the tenants that snapshot left out and when the run was
    queued (``None``, ``()`` and ``None`` for a version-0 adapter or one registered by hand)."""

    adapter_version_id: int
    specialist: str
    version: int
    parent_id: int | None
    trained_to: Positions | None
    left_out_tenants: tuple[str, ...]
    queued_at: datetime | None

    @property
    def name(self) -> str:
        return f"{self.specialist}@{self.version}"


@dataclass(frozen=True)
class TrainedRouter:
    """A router version a run fitted: the end of the labels it was fitted on, the forgotten
    tenants whose labels it left out and when the run was queued."""

    router_version: str
    labels_end: Positions
    left_out_tenants: tuple[str, ...]
    queued_at: datetime


@dataclass(frozen=True)
class ReleaseParts:
    """A release's adapter version ids and router version, and whether it is active."""

    release_id: str
    active: bool
    router_version: str
    adapter_ids: tuple[int, ...]


@dataclass(frozen=True)
class HarnessEntry:
    """A registered harness version as a listing shows it."""

    name: str
    sha256: str
    parent_version: int | None
    created_at: datetime


@dataclass(frozen=True)
class StoredOutcomes:
    """One earlier record of a release's per-task contract outcomes, as stored: JSON that the
    reader validates (``outcomes``: passed per suite, ``well_formed`` per suite, ``tasks``: the
    tasks' content keys per suite, none before contract 5) and the digest stored with them."""

    outcomes: Any
    well_formed: Any
    tasks: Any
    digest: str | None


@dataclass(frozen=True)
class LiveScore:
    """A release's and specialist's live counters, summed over its turns."""

    release_id: str
    specialist: str
    turns: int
    ups: int
    downs: int
    edits: int
    regenerates: int
    actions: int
    actions_ok: int
    genui: int
    genui_valid: int
    latency_ms: float


@dataclass(frozen=True)
class ContractScore:
    """A release's contract scores under one contract version (share of tasks passed and share
    well-formed, per suite), as its first complete evaluation measured them."""

    release_id: str
    contract_version: str
    released_at: datetime
    scores: Mapping[str, Any]
    well_formed: Mapping[str, Any] | None


@dataclass(frozen=True)
class BackfillState:
    """Where a backfill stands: ``running`` or ``done``, the records it appended, and the
    schema of its join state."""

    status: Literal["running", "done"]
    records: int
    schema_name: str
