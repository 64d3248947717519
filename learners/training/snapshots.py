"""Dataset snapshots read back from the log: the records a run trains on, checked against the
hash the trigger gave the snapshot."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

from core.experience import EMPTY_CHAIN, chain_record, snapshot_events
from core.log import EventLog
from core.registry import DatasetSnapshot
from infra import observe
from learners.runtime import SnapshotForgotten, SnapshotMismatch


@dataclass(frozen=True)
class Replayed:
    """A snapshot's records, the specialist's older records (against forgetting), and how
    many tenants the snapshot's records came from (lineage counts them, never shows them)."""

    records: list[Any]
    older: list[Any]
    tenants: int


def materialize(log: EventLog, snapshot: DatasetSnapshot) -> Replayed:
    """Replay the snapshot's log range and the older records of the same specialist. The
    records must hash to the snapshot's hash, and as many of them teach as it counted (live
    rewards are hashed, not counted: ``streams.trigger``)."""
    events = snapshot_events(log, snapshot)
    if events.forgotten:
        raise SnapshotForgotten(
            f"snapshot {snapshot.snapshot_id} holds {events.forgotten} record(s) of forgotten "
            "tenants: it is not trained on"
        )
    records: list[Any] = [event.payload for event in events.records]
    running = EMPTY_CHAIN
    for event, record in zip(events.records, records, strict=True):
        running = chain_record(running, record)
        _link_to(event.envelope.trace)
    teaching = sum(1 for r in records if r.kind != "trajectory")
    if running != snapshot.content_hash or teaching != snapshot.record_count:
        raise SnapshotMismatch(
            f"snapshot {snapshot.snapshot_id} does not replay to its hash: its "
            f"{snapshot.filter_version} records chain to {running[:12]} ({teaching} teaching), "
            f"it was defined as {snapshot.content_hash[:12]} ({snapshot.record_count})"
        )
    tenants = {event.envelope.tenant_id for event in events.records}
    return Replayed(records, [event.payload for event in events.older], len(tenants))


def _link_to(headers: dict[str, str]) -> None:
    """Link the current span (the training task's) to the turn a record came from."""
    link = observe.link_of(headers)
    if link is not None:
        trace.get_current_span().add_link(link.context)
