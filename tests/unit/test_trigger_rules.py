"""The training trigger's rules without a database: counting records into the pending range,
the threshold, and the snapshot and run a due trigger defines."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime
from uuid import UUID

import pytest

from core.events import EventPayload, ExperienceRecorded, NewEvent, TrainingRequested
from core.events.privacy import Forgotten
from core.experience import EMPTY_CHAIN, chain_record
from core.log import LogPosition, RecordedEvent
from core.mapper import Mapper
from core.registry import DatasetSnapshot
from core.release import AdapterRef
from infra.memory import InMemoryEventLog
from infra.postgres.trigger import PendingRecords
from streams.trigger import RECIPE, TrainingTrigger, counted, due, recounted, training_request

TURN = UUID("0190f0a0-0000-7000-8000-000000000001")
EVENT = UUID("0190f0a0-0000-7000-8000-0000000000e1")
AT = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
PARENT = AdapterRef(
    adapter_version_id=42, specialist="coding", version=3, sha256="a" * 64, path="p", rank=8
)


def record(n: int, specialist: str = "coding") -> ExperienceRecorded:
    return ExperienceRecorded(
        experience_id=UUID(int=n),
        kind="sft",
        specialist=specialist,
        turn_id=TURN,
        filter_version="experience-1",
        source="feedback",
        record={"messages": [], "target": f"answer {n}"},
    )


def reward(n: int) -> ExperienceRecorded:
    """A live reward: a thumbs down on answer ``n``."""
    return ExperienceRecorded(
        experience_id=UUID(int=1000 + n),
        kind="trajectory",
        specialist="coding",
        turn_id=TURN,
        filter_version="experience-1",
        source="feedback",
        record={"messages": [], "actions": [], "answer": f"answer {n}", "reward": 0.0},
    )


def recorded(payload: EventPayload, partition: int = 0, offset: int = 10) -> RecordedEvent:
    event = NewEvent(
        payload=payload, tenant_id="acme", key="experience.coding", event_id=EVENT, occurred_at=AT
    )
    sealed = Mapper().seal(event, 1, None)
    return RecordedEvent(LogPosition(partition, offset), sealed.envelope, sealed.payload)


def fresh(start: int = 7) -> PendingRecords:
    return PendingRecords(
        specialist="coding",
        filter_version="experience-1",
        partition=0,
        start_offset=start,
        count=0,
        running_hash=EMPTY_CHAIN,
    )


def ending(pending: PendingRecords, offset: int, partition: int = 0) -> PendingRecords:
    """``pending`` whose last record is at ``offset`` of ``partition``."""
    return replace(pending, partition=partition, end_offset=offset + 1)


def test_a_record_counts_and_extends_the_chain() -> None:
    one = counted(fresh(), record(1), 10)
    assert one == replace(
        fresh(), count=1, running_hash=chain_record(EMPTY_CHAIN, record(1)), end_offset=11
    )
    two = counted(one, record(2), 11)
    assert two.count == 2
    assert two.start_offset == 7
    assert two.running_hash == chain_record(chain_record(EMPTY_CHAIN, record(1)), record(2))


def test_a_live_reward_is_chained_but_not_counted() -> None:
    """It rides in the next snapshot (its range and hash) without starting one."""
    one = counted(counted(fresh(), record(1), 10), reward(1), 11)
    assert one.count == 1
    assert one.running_hash == chain_record(chain_record(EMPTY_CHAIN, record(1)), reward(1))
    assert not due(counted(fresh(), reward(1), 10), 1)


def test_a_range_begun_before_live_rewards_were_hashed_goes_on_without_them() -> None:
    """A range the trigger began before the upgrade hashes as it was begun (its snapshot says
    so, and the run replays it the same way)."""
    old = replace(fresh(), rewards_hashed=False)
    assert counted(old, reward(1), 10) == old
    assert counted(counted(old, record(1), 10), reward(1), 11).running_hash == chain_record(
        EMPTY_CHAIN, record(1)
    )


def test_the_chain_is_pinned() -> None:
    """Snapshots store this hash and the training run checks the replay against it; a record
    written before sources (v2, read back with none) hashes as it always did."""
    assert counted(fresh(), record(1), 10).running_hash == (
        "94917d085ee90c5c7cee37c6bf58b16de87fc1bf8686c93002bf5edba6f95f0d"
    )
    before_sources = record(1).model_copy(update={"source": None})
    assert counted(fresh(), before_sources, 10).running_hash == (
        "34ecdedbb0ba0fdbccdebd21d04303a3937f4ad0cdedbd31722f4ba536aa4e07"
    )


def test_the_order_of_records_changes_the_hash() -> None:
    forward = counted(counted(fresh(), record(1), 10), record(2), 11)
    backward = counted(counted(fresh(), record(2), 10), record(1), 11)
    assert forward.count == backward.count == 2
    assert forward.running_hash != backward.running_hash


@pytest.mark.parametrize(
    ("count", "threshold", "expected"),
    [(0, 1, False), (1, 1, True), (2, 3, False), (3, 3, True), (4, 3, True), (49, 50, False)],
)
def test_due_at_the_threshold(count: int, threshold: int, expected: bool) -> None:
    pending = PendingRecords("coding", "experience-1", 0, 0, count, EMPTY_CHAIN)
    assert due(pending, threshold) is expected


def test_the_request_snapshots_the_range_up_to_the_event() -> None:
    pending = PendingRecords("coding", "experience-1", 0, 7, 4, "b" * 64)
    request = training_request(ending(pending, 10, partition=2), PARENT, EVENT)
    assert request.snapshot == DatasetSnapshot(
        snapshot_id=request.snapshot.snapshot_id,
        specialist="coding",
        partition=2,
        start_offset=7,
        end_offset=11,
        filter_version="experience-1",
        content_hash="b" * 64,
        record_count=4,
    )
    assert request.parent_adapter_id == 42


def test_the_snapshot_and_run_ids_are_pinned() -> None:
    pending = PendingRecords("coding", "experience-1", 0, 7, 4, "b" * 64)
    request = training_request(ending(pending, 10), PARENT, EVENT)
    assert request.snapshot.snapshot_id == UUID("c186ad59-6fbd-5b81-857d-6d8976853ff2")
    assert request.run_id == UUID("5040dd31-4caa-576f-9b60-de2f5a0d6c88")


def test_the_request_event_asks_to_train_the_parents_successor() -> None:
    pending = PendingRecords("coding", "experience-1", 0, 7, 4, "b" * 64)
    request = training_request(ending(pending, 10), PARENT, EVENT)
    event = request.event
    assert event.payload == TrainingRequested(
        run_id=request.run_id,
        specialist="coding",
        parent_adapter_version="coding@3",
        snapshot_id=request.snapshot.snapshot_id,
        recipe=RECIPE,
    )
    assert event.event_id == request.run_id
    assert event.tenant_id == "system"
    assert event.key == "training.coding"
    assert event.causation_id == EVENT


def test_the_same_range_gives_the_same_ids() -> None:
    pending = PendingRecords("coding", "experience-1", 0, 7, 4, "b" * 64)
    first = training_request(ending(pending, 10), PARENT, EVENT)
    again = training_request(ending(pending, 10), PARENT, EVENT)
    assert first.snapshot == again.snapshot
    assert first.event.event_id == again.event.event_id
    assert first.event.payload == again.event.payload


@pytest.mark.parametrize(
    ("pending", "offset"),
    [
        (PendingRecords("coding", "experience-1", 0, 8, 4, "b" * 64), 10),  # another start
        (PendingRecords("coding", "experience-1", 0, 7, 4, "b" * 64), 11),  # another end
        (PendingRecords("genui", "experience-1", 0, 7, 4, "b" * 64), 10),  # another specialist
    ],
)
def test_another_range_gives_other_ids(pending: PendingRecords, offset: int) -> None:
    base = training_request(
        ending(PendingRecords("coding", "experience-1", 0, 7, 4, "b" * 64), 10), PARENT, EVENT
    )
    other = training_request(ending(pending, offset), PARENT, EVENT)
    assert other.snapshot.snapshot_id != base.snapshot.snapshot_id
    assert other.run_id != base.run_id


def test_the_hash_and_count_do_not_change_the_ids() -> None:
    """A range is its identity; what it holds is checked against the hash when it is read."""
    one = training_request(
        ending(PendingRecords("coding", "experience-1", 0, 7, 4, "b" * 64), 10), PARENT, EVENT
    )
    two = training_request(
        ending(PendingRecords("coding", "experience-1", 0, 7, 5, "c" * 64), 10), PARENT, EVENT
    )
    assert one.run_id == two.run_id


def test_after_commit_enqueues_each_requested_run_with_its_trace() -> None:
    enqueued: list[tuple[UUID, Mapping[str, str]]] = []
    trigger = TrainingTrigger(
        3, lambda run_id, trace: enqueued.append((run_id, trace)), InMemoryEventLog()
    )
    pending = PendingRecords("coding", "experience-1", 0, 7, 4, "b" * 64)
    requested = training_request(ending(pending, 10), PARENT, EVENT).event
    traced = requested.model_copy(update={"trace": {"traceparent": "00-abc-def-01"}})
    other = NewEvent(payload=record(5), tenant_id="acme", key="experience.coding")
    trigger.after_commit([other, traced])
    assert enqueued == [(requested.event_id, {"traceparent": "00-abc-def-01"})]


def test_a_backfills_records_name_it_once() -> None:
    backfill = UUID("0190f0a0-0000-7000-8000-0000000000b1")
    one = counted(fresh(), record(1), 10, backfill)
    two = counted(one, record(2), 11, backfill)
    three = counted(two, record(3), 12)
    assert three.backfills == (backfill,) and three.end_offset == 13
    request = training_request(three, PARENT)
    assert request.snapshot.backfills == (backfill,)
    assert request.event.causation_id is None  # asked for by hand


def test_each_filter_version_has_its_own_snapshot_ids() -> None:
    v1 = training_request(ending(fresh(), 10), PARENT, EVENT)
    v2 = training_request(ending(replace(fresh(), filter_version="experience-2"), 10), PARENT)
    assert v2.snapshot.filter_version == "experience-2"
    assert v2.snapshot.snapshot_id != v1.snapshot.snapshot_id


def test_a_range_counted_again_leaves_out_the_records_it_cannot_read() -> None:
    """A range whose second record is now an earlier-forgotten tenant's marker, and whose fifth
    is a record of the tenant being forgotten (a key cache could still open it), counts the
    other two, chains them alone, keeps its end and backfills and names both tenants; another
    filter version's record is not counted, and the snapshot's id says who was left out."""
    backfill = UUID("0190f0a0-0000-7000-8000-0000000000b1")
    live = counted(counted(counted(fresh(), record(1), 10, backfill), record(2), 11), record(3), 12)
    other = record(4).model_copy(update={"filter_version": "experience-2"})
    marker = recorded(Forgotten(original_type="ExperienceRecorded"), offset=11)
    leaving = recorded(record(5), offset=14)
    events = [
        recorded(record(1), offset=10),
        RecordedEvent(marker.position, replace(marker.envelope, tenant_id="gone"), marker.payload),
        recorded(other, offset=12),
        recorded(record(3), offset=13),
        RecordedEvent(leaving.position, replace(leaving.envelope, tenant_id="leaving"), record(5)),
    ]
    again = recounted(replace(live, end_offset=15), events, "leaving")
    expected = chain_record(chain_record(EMPTY_CHAIN, record(1)), record(3))
    assert (again.count, again.running_hash) == (2, expected)
    assert (again.end_offset, again.backfills) == (15, (backfill,))
    assert again.left_out_tenants == ("gone", "leaving")
    left = training_request(again, PARENT, EVENT).snapshot
    kept = training_request(replace(again, left_out_tenants=()), PARENT, EVENT).snapshot
    assert left.left_out_tenants == ("gone", "leaving") and left.snapshot_id != kept.snapshot_id
