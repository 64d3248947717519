"""The training trigger: when a specialist has ``threshold`` new teaching records (SFT,
preference, rollout group) of one filter version since its last snapshot and no run in
flight, it defines a dataset snapshot (the log range of those records, the filter version,
their content hash), records a queued training run and a ``TrainingRequested`` event, and,
after the commit, enqueues the run (task id = run id).

A specialist's records are the events of one key, so one partition in order: the snapshot is
``[start_offset, end_offset)`` there, and its hash chains the records' payload hashes in log
order, which is exactly what replaying that range under the snapshot's filter version gives
back (each filter version's records are counted apart; a backfill's records, which carry its
id as correlation id, name it in the snapshot). ``train_now`` snapshots the pending records
before the threshold (``macaron train``). Live rewards (``trajectory`` records) ride along:
they are in the range and the hash but do not count toward the threshold (a busy agent would
otherwise start runs with little else to learn from). The rules
(``counted``, ``recounted``, ``due``, ``training_request``) are pure; the state lives in
PostgreSQL (``infra.postgres.trigger``).

A forgotten tenant's records read as ``Forgotten`` markers. When the trigger meets
``TenantForgotten`` it counts every pending range again from the log without the records it
can no longer read, and the range remembers whose they were; a marker met later adds its
tenant the same way. The snapshot then leaves those tenants out and opens, where one made
from the old count would be ``snapshot_forgotten``. A replay of the trigger never read those
records, so where they made a range due, its counts differ from the live ones: the live run
acted on them then.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from uuid import UUID

from core.errors import AdapterNotFound, NothingToTrain, TrainingInFlight
from core.events import ExperienceRecorded, NewEvent, TenantForgotten, TrainingRequested
from core.events.privacy import Forgotten
from core.experience import EMPTY_CHAIN, chain_record, experience_key
from core.ids import derived_id
from core.log import EventLog, RecordedEvent
from core.registry import DatasetSnapshot, QueuedRun
from core.release import AdapterRef
from infra.postgres.backfills import is_backfill
from infra.postgres.db import DictConnection
from infra.postgres.registry import active_adapter
from infra.postgres.runs import (
    queue_run,
    record_snapshot,
    run_in_flight,
    run_result,
)
from infra.postgres.trigger import (
    PendingRecords,
    clear_pending,
    every_pending,
    locked_pending,
    pending_records,
    save_pending,
)

RECIPE = "lora"
"""What a queued adapter run is trained with: the successor-adapter recipe
(``learners/recipes/lora.py``); which of its configs (``lora-cpu``, ``lora-rloo``, ...) is the
worker's setting, and the run's ``recipe`` names it once trained."""


@dataclass(frozen=True)
class TrainingRequest:
    """What a due trigger records: the snapshot, and the queued run's event (id = run id)."""

    snapshot: DatasetSnapshot
    parent_adapter_id: int
    event: NewEvent

    @property
    def run_id(self) -> UUID:
        return self.event.event_id


class TrainingTrigger:
    name = "training-trigger-1"
    tables: tuple[str, ...] = ("trigger_state",)

    def __init__(
        self,
        threshold: int,
        enqueue: Callable[[UUID, Mapping[str, str]], None],
        log: EventLog,
    ) -> None:
        self.threshold = threshold
        self.enqueue = enqueue
        self.log = log

    def handle(self, conn: DictConnection, event: RecordedEvent) -> list[NewEvent]:
        record = event.payload
        if isinstance(record, TenantForgotten):
            self._recount(conn, record.tenant)
            return []
        if isinstance(record, Forgotten) and record.original_type == "ExperienceRecorded":
            _leave_out(conn, event.envelope.key, event.envelope.tenant_id)
        if not isinstance(record, ExperienceRecorded):
            return []
        where = event.position
        specialist, version = record.specialist, record.filter_version
        pending = pending_records(conn, specialist, version, where.partition, where.offset)
        if event.envelope.tenant_id in pending.left_out_tenants:
            return []  # forgotten, though a process's key cache could still open it
        backfill = event.envelope.correlation_id
        replayed = backfill if backfill is not None and is_backfill(conn, backfill) else None
        pending = counted(pending, record, where.offset, replayed)
        save_pending(conn, pending)
        if not due(pending, self.threshold) or run_in_flight(conn, specialist):
            return []
        request = _snapshot(conn, pending, event.envelope.event_id)
        return [] if request is None else [request.event]

    def after_commit(self, derived: Sequence[NewEvent]) -> None:
        for event in derived:
            if isinstance(event.payload, TrainingRequested):
                self.enqueue(event.payload.run_id, event.trace)

    def _recount(self, conn: DictConnection, tenant: str) -> None:
        """Count every pending range again from the log without ``tenant``'s records."""
        for pending in every_pending(conn):
            if pending.end_offset is None:
                continue
            events = self.log.read(
                start={pending.partition: pending.start_offset},
                end={pending.partition: pending.end_offset},
                key=experience_key(pending.specialist),
                types=["ExperienceRecorded"],
            )
            save_pending(conn, recounted(pending, events, tenant))


def _leave_out(conn: DictConnection, key: str, tenant: str) -> None:
    """A forgotten tenant's record (never counted) on ``key``: its specialist's ranges leave
    the tenant out."""
    for pending in every_pending(conn):
        if pending.end_offset is not None and experience_key(pending.specialist) == key:
            tenants = tuple(sorted({*pending.left_out_tenants, tenant}))
            save_pending(conn, replace(pending, left_out_tenants=tenants))


def train_now(conn: DictConnection, specialist: str, filter_version: str) -> TrainingRequest:
    """Snapshot the specialist's pending records of ``filter_version`` now, whatever their
    count, and queue the run (``macaron train``); the caller appends the request's event and,
    after the commit, enqueues the run."""
    pending = locked_pending(conn, specialist, filter_version)
    if pending is None or pending.end_offset is None or not pending.count:
        raise NothingToTrain(
            f"{specialist} has no {filter_version} record to teach since its last snapshot"
        )
    if run_in_flight(conn, specialist):
        raise TrainingInFlight(f"a run of {specialist} is queued or running; it goes first")
    request = _snapshot(conn, pending, None)
    if request is None:
        raise AdapterNotFound(f"the active release serves no adapter of {specialist}")
    return request


def _snapshot(
    conn: DictConnection, pending: PendingRecords, cause: UUID | None
) -> TrainingRequest | None:
    """Record the snapshot of ``pending`` and queue the run on it; the next record starts the
    next range (also when there is nothing to improve: the serving release has no adapter for
    the specialist, and then no run)."""
    parent = active_adapter(conn, pending.specialist)
    clear_pending(conn, pending.specialist, pending.filter_version)
    if parent is None:
        return None
    request = training_request(pending, parent, cause)
    record_snapshot(conn, request.snapshot)
    queued = queue_run(
        conn,
        QueuedRun(
            run_id=request.run_id,
            specialist=pending.specialist,
            parent_adapter_id=request.parent_adapter_id,
            snapshot_id=request.snapshot.snapshot_id,
            kind="adapter",
            recipe=RECIPE,
        ),
    )
    if not queued and run_result(conn, request.run_id) is None:
        # Another filter version's run was queued meanwhile (each version's records lock a row
        # of their own): roll back, so these records stay pending until it is done.
        raise TrainingInFlight(f"a run of {pending.specialist} was queued first; it goes first")
    return request


def counted(
    pending: PendingRecords,
    record: ExperienceRecorded,
    offset: int,
    backfill: UUID | None = None,
) -> PendingRecords:
    """``pending`` with one more record, at ``offset`` (counted toward the threshold unless a
    live reward, chained unless a live reward in a range begun before they were), appended by
    ``backfill`` if one did."""
    if record.kind == "trajectory" and not pending.rewards_hashed:
        return pending
    backfills = pending.backfills
    if backfill is not None and backfill not in backfills:
        backfills = (*backfills, backfill)
    return replace(
        pending,
        count=pending.count + (record.kind != "trajectory"),
        running_hash=chain_record(pending.running_hash, record),
        end_offset=offset + 1,
        backfills=backfills,
    )


def recounted(
    pending: PendingRecords, events: Iterable[RecordedEvent], forgotten: str
) -> PendingRecords:
    """``pending`` counted again from its range's records (``events``) once ``forgotten`` is
    forgotten: those of its filter version that can be read are counted and chained; the
    tenants of those that cannot (the ``Forgotten`` markers, and ``forgotten``'s records,
    which a process's key cache may still open for a moment) are left out. Its end and
    backfills stay."""
    fresh = replace(pending, count=0, running_hash=EMPTY_CHAIN)
    left_out = set(pending.left_out_tenants)
    for event in events:
        record, tenant = event.payload, event.envelope.tenant_id
        if isinstance(record, Forgotten) or tenant == forgotten or tenant in left_out:
            left_out.add(tenant)
        elif (
            isinstance(record, ExperienceRecorded)
            and record.filter_version == pending.filter_version
        ):
            fresh = counted(fresh, record, event.position.offset)
    return replace(
        fresh,
        end_offset=pending.end_offset,
        backfills=pending.backfills,
        left_out_tenants=tuple(sorted(left_out)),
    )


def due(pending: PendingRecords, threshold: int) -> bool:
    """Whether the pending records are enough to train on (a run in flight still waits)."""
    return pending.count >= threshold


def training_request(
    pending: PendingRecords, parent: AdapterRef, cause: UUID | None = None
) -> TrainingRequest:
    """The snapshot of the pending records and the request to train ``parent``'s successor on
    it, caused by the record that made it due (``None``: asked for by hand); ids derive from
    the range and the filter version, so a replay gives the same."""
    if pending.end_offset is None:
        raise ValueError("no record is pending")
    specialist, partition = pending.specialist, pending.partition
    start, end, version = pending.start_offset, pending.end_offset, pending.filter_version
    left_out = pending.left_out_tenants
    tagged = ("left-out", *left_out) if left_out else ()  # never an unlearning run's id
    snapshot_id = derived_id("snapshot", specialist, partition, start, end, version, *tagged)
    run_id = derived_id("run", snapshot_id)
    snapshot = DatasetSnapshot(
        snapshot_id=snapshot_id,
        specialist=specialist,
        partition=partition,
        start_offset=start,
        end_offset=end,
        filter_version=version,
        content_hash=pending.running_hash,
        record_count=pending.count,
        rewards_hashed=pending.rewards_hashed,
        backfills=pending.backfills,
        left_out_tenants=left_out,
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
        causation_id=cause,
    )
    return TrainingRequest(snapshot, parent.adapter_version_id, requested)
