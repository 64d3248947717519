"""The training trigger: when a specialist has ``threshold`` new teaching records (SFT,
preference, rollout group) since its last snapshot and no run in flight, it defines a dataset
snapshot (the log range of those records, the filter version, their content hash), records a
queued training run and a ``TrainingRequested`` event, and, after the commit, enqueues the run
(task id = run id).

A specialist's records are the events of one key, so one partition in order: the snapshot is
``[start_offset, end_offset)`` there, and its hash chains the records' payload hashes in log
order, which is exactly what replaying that range gives back. Live rewards (``trajectory``
records) ride along: they are in the range and the hash but do not count toward the threshold
(a busy agent would otherwise start runs with little else to learn from). The rules
(``counted``, ``due``, ``training_request``) are pure; the state lives in PostgreSQL
(``infra.postgres.trigger``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from uuid import UUID

from core.events import ExperienceRecorded, NewEvent, TrainingRequested
from core.experience import FILTER_VERSION, chain_record
from core.ids import derived_id
from core.log import RecordedEvent
from core.release import AdapterRef
from infra.postgres.db import DictConnection
from infra.postgres.registry import active_adapter
from infra.postgres.runs import SnapshotRange, queue_run, record_snapshot, run_in_flight
from infra.postgres.trigger import PendingRecords, clear_pending, pending_records, save_pending

RECIPE = "lora-sft-dpo-1"


@dataclass(frozen=True)
class TrainingRequest:
    """What a due trigger records: the snapshot, and the queued run's event (id = run id)."""

    snapshot: SnapshotRange
    parent_adapter_id: int
    event: NewEvent

    @property
    def run_id(self) -> UUID:
        return self.event.event_id


class TrainingTrigger:
    name = "training-trigger-1"
    tables: tuple[str, ...] = ("trigger_state",)

    def __init__(self, threshold: int, enqueue: Callable[[UUID, Mapping[str, str]], None]) -> None:
        self.threshold = threshold
        self.enqueue = enqueue

    def handle(self, conn: DictConnection, event: RecordedEvent) -> list[NewEvent]:
        record = event.payload
        if not isinstance(record, ExperienceRecorded):
            return []
        where = event.position
        pending = counted(
            pending_records(conn, record.specialist, where.partition, where.offset), record
        )
        save_pending(conn, pending)
        if not due(pending, self.threshold) or run_in_flight(conn, record.specialist):
            return []
        parent = active_adapter(conn, record.specialist)
        # The next record starts the next range (also when there is nothing to improve: the
        # serving release has no adapter for this specialist).
        clear_pending(conn, record.specialist)
        if parent is None:
            return []
        request = training_request(event, pending, parent)
        record_snapshot(conn, request.snapshot)
        queue_run(
            conn,
            run_id=request.run_id,
            specialist=record.specialist,
            parent_adapter_id=request.parent_adapter_id,
            snapshot_id=request.snapshot.snapshot_id,
            recipe=RECIPE,
        )
        return [request.event]

    def after_commit(self, derived: Sequence[NewEvent]) -> None:
        for event in derived:
            if isinstance(event.payload, TrainingRequested):
                self.enqueue(event.payload.run_id, event.trace)


def counted(pending: PendingRecords, record: ExperienceRecorded) -> PendingRecords:
    """``pending`` with one more record (counted toward the threshold unless a live reward,
    chained unless a live reward in a range begun before they were)."""
    if record.kind == "trajectory" and not pending.rewards_hashed:
        return pending
    return replace(
        pending,
        count=pending.count + (record.kind != "trajectory"),
        running_hash=chain_record(pending.running_hash, record),
    )


def due(pending: PendingRecords, threshold: int) -> bool:
    """Whether the pending records are enough to train on (a run in flight still waits)."""
    return pending.count >= threshold


def training_request(
    event: RecordedEvent, pending: PendingRecords, parent: AdapterRef
) -> TrainingRequest:
    """The snapshot of the pending records up to and including ``event``, and the request to
    train ``parent``'s successor on it; ids derive from the range, so a replay gives the same."""
    partition, end = event.position.partition, event.position.offset + 1
    specialist, start = pending.specialist, pending.start_offset
    snapshot_id = derived_id("snapshot", specialist, partition, start, end, FILTER_VERSION)
    run_id = derived_id("run", snapshot_id)
    snapshot = SnapshotRange(
        snapshot_id=snapshot_id,
        specialist=specialist,
        partition=partition,
        start_offset=start,
        end_offset=end,
        filter_version=FILTER_VERSION,
        content_hash=pending.running_hash,
        record_count=pending.count,
        rewards_hashed=pending.rewards_hashed,
    )
    payload = TrainingRequested(
        run_id=run_id,
        specialist=specialist,
        parent_adapter_version=parent.name,
        snapshot_id=snapshot_id,
        recipe=RECIPE,
    )
    requested = NewEvent(
        payload=payload,
        tenant_id="system",
        key=f"training.{specialist}",
        event_id=run_id,
        causation_id=event.envelope.event_id,
    )
    return TrainingRequest(snapshot, parent.adapter_version_id, requested)
