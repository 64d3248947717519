"""Backfill: derive the experience of past events under a filter version and append it to the
experience stream (``macaron replay experience --filter-version N``).

An experience builder of that version (routing labels left out) reads the log from its start
to ``end``, so every turn it meets has its conversation and history joined, and appends the
records that events in ``[start, end)`` give. Its join state lives in a schema of its own and
its read position is saved with it, batch by batch, so a killed backfill resumes where it
stopped. Nothing old is rewritten: records carry the filter version, their source event as
causation and the backfill's id as correlation id; their ids derive from the filter version and
the source event, so a record already derived (live, or by an earlier backfill) is not appended
again, and a second run appends nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from itertools import islice
from typing import Any
from uuid import UUID

from core.errors import RangeOutsideLog
from core.events import ExperienceRecorded, NewEvent
from core.experience import known_filter
from core.ids import derived_id
from core.log import EventLog, Positions, RecordedEvent
from infra.postgres import backfills as store
from infra.postgres.db import Pool
from infra.postgres.positions import forget_positions, load_positions, save_positions
from infra.postgres.replay import copy_tables, drop_schema, search_first
from streams.experience import ExperienceBuilder

BATCH = 200
Progress = Callable[[int, int], None]
"""Called after each batch with the events read so far and how many there are to read."""


@dataclass(frozen=True)
class Backfill:
    """A backfill's outcome: its range, how many records it appended in all, and whether this
    call found it done already or resumed it."""

    backfill_id: UUID
    filter_version: str
    start: Positions
    end: Positions
    records: int
    resumed: bool = False
    already_done: bool = False


def backfill_range(
    log: EventLog, start: Mapping[int, int] | None, end: Mapping[int, int] | None
) -> tuple[Positions, Positions]:
    """The range to backfill (default: the whole log as it is now), checked against the log."""
    stored = log.end_positions()
    first = {p: 0 for p in stored} | dict(start or {})
    last = dict(stored) | dict(end or {})
    for partition in first.keys() | last.keys():
        if partition not in stored:
            raise RangeOutsideLog(f"the log has no partition {partition}")
        if not 0 <= first[partition] <= last[partition] <= stored[partition]:
            raise RangeOutsideLog(
                f"[{first[partition]}, {last[partition]}) is outside the log, which ends "
                f"before {stored[partition]} (partition {partition})"
            )
    return first, last


def backfill(
    log: EventLog,
    pool: Pool,
    filter_version: str,
    *,
    start: Mapping[int, int] | None = None,
    end: Mapping[int, int] | None = None,
    batch: int = BATCH,
    progress: Progress | None = None,
) -> Backfill:
    """Derive the experience of ``[start, end)`` under ``filter_version`` into the log; resumes
    a backfill of the same range and version that was stopped. Without ``end``, a stopped
    backfill of that version from ``start`` resumes, else the range ends where the log does."""
    builder = ExperienceBuilder(known_filter(filter_version), routing=False)
    if end is None:  # the stopped backfill from the same place, if any (the log has grown)
        with pool.connection() as conn:
            end = store.running_end(conn, filter_version, start or {})
    first, last = backfill_range(log, start, end)
    backfill_id = derived_id(
        "backfill", filter_version, sorted(first.items()), sorted(last.items())
    )
    name = f"backfill:{backfill_id}"
    with pool.connection() as conn, conn.transaction():
        row = store.begin_backfill(conn, backfill_id, filter_version, first, last)
        read = load_positions(conn, name)
        if row["status"] == "running":
            copy_tables(conn, row["schema_name"], builder.tables)
    outcome = Backfill(backfill_id, filter_version, first, last, row["records"], bool(read))
    if row["status"] == "done":
        return replace(outcome, already_done=True)
    total = sum(last.values()) - sum(read.get(p, 0) for p in last)
    done = 0
    for events in _batches(log.read(start=read, end=last), batch):
        with pool.connection() as conn, conn.transaction():
            search_first(conn, row["schema_name"])
            derived: list[NewEvent] = []
            for event in events:
                found = builder.handle(conn, event)
                if event.position.offset >= first.get(event.position.partition, 0):
                    derived += [_marked(e, backfill_id) for e in found]
                read[event.position.partition] = event.position.offset + 1
            appended = log.append(derived) if derived else []
            store.add_records(conn, backfill_id, sum(_ours(e, backfill_id) for e in appended))
            save_positions(conn, name, read)
        done += len(events)
        if progress is not None:
            progress(done, total)
    with pool.connection() as conn, conn.transaction():
        drop_schema(conn, row["schema_name"])
        forget_positions(conn, name)
        finished = store.finish_backfill(conn, backfill_id)
    return replace(outcome, records=finished["records"])


def _marked(event: NewEvent, backfill_id: UUID) -> NewEvent:
    """A record of the backfill, correlated with it (lineage finds it by that)."""
    assert isinstance(event.payload, ExperienceRecorded)
    return event.model_copy(update={"correlation_id": backfill_id})


def _ours(event: RecordedEvent, backfill_id: UUID) -> bool:
    """Whether this backfill appended ``event`` (else it was there already, under its id)."""
    return event.envelope.correlation_id == backfill_id


def _batches(events: Iterator[RecordedEvent], size: int) -> Iterator[list[RecordedEvent]]:
    while chunk := list(islice(events, size)):
        yield chunk


def describe(outcome: Backfill) -> dict[str, Any]:
    """The outcome as JSON values."""
    return {
        "backfill_id": str(outcome.backfill_id),
        "filter_version": outcome.filter_version,
        "from": {str(p): o for p, o in outcome.start.items()},
        "to": {str(p): o for p, o in outcome.end.items()},
        "records": outcome.records,
        "resumed": outcome.resumed,
        "already_done": outcome.already_done,
    }
