"""Backfill: derive the experience of past events under a filter version and append it to the
experience stream (``macaron replay experience --filter-version N``).

An experience builder of that version (routing labels left out) reads the log from its start
to ``end``, so every turn it meets has its conversation and history joined, and appends the
records that events in ``[start, end)`` give. Its join state lives in a schema of its own and
its read position is saved with it, batch by batch, so a killed backfill resumes where it
stopped. Nothing old is rewritten: records carry the filter version, their source event as
causation and the backfill's id as correlation id; their ids derive from the filter version and
the source event, so a record already derived (live, or by an earlier backfill) is not appended
again, and a second run appends nothing. A tenant that does not teach now gives no record, even
from traffic of a time it did. One process runs a backfill at a time (a session lock).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from itertools import islice
from typing import Any
from uuid import UUID

from core.errors import RangeOutsideLog
from core.events import ExperienceRecorded, NewEvent
from core.events.privacy import DataKeys, Forgotten
from core.experience import known_filter
from core.ids import derived_id
from core.log import EventLog, Positions, RecordedEvent
from infra.postgres import backfills as store
from infra.postgres.db import Pool
from infra.postgres.experience_joins import teaches_now
from infra.postgres.positions import forget_positions, load_positions, save_positions
from infra.postgres.replay import copy_tables, drop_schema, search_first
from streams.experience_rules import ExperienceBuilder

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
    forgotten: int = 0
    """Events of forgotten tenants this call read (as markers, which give no record)."""


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


@dataclass(frozen=True)
class BackfillRequest:
    """What to backfill: the experience of ``[start, end)`` under ``filter_version``, derived
    ``batch`` events at a time. Without ``start``, from the log's beginning; without ``end``, a
    stopped backfill of that version from ``start`` resumes, else the range ends where the log
    does."""

    filter_version: str
    start: Mapping[int, int] | None = None
    end: Mapping[int, int] | None = None
    batch: int = BATCH


@dataclass(frozen=True)
class _Derivation:
    """One backfill's derivation: its builder, the outcome it fills and the schema of its
    join state."""

    builder: ExperienceBuilder
    outcome: Backfill
    schema: str


def backfill(
    log: EventLog,
    pool: Pool,
    keys: DataKeys,
    request: BackfillRequest,
    progress: Progress | None = None,
) -> Backfill:
    """Derive the request's experience into the log (its join state sealed with ``keys``, the
    tenants' data keys); resumes a backfill of the same range and version that was stopped."""
    filter_version, start, end = request.filter_version, request.start, request.end
    builder = ExperienceBuilder(keys, known_filter(filter_version), routing=False)
    if end is None:  # the stopped backfill from the same place, if any (the log has grown)
        with pool.connection() as conn:
            end = store.running_end(conn, filter_version, start or {})
    first, last = backfill_range(log, start, end)
    backfill_id = derived_id(
        "backfill", filter_version, sorted(first.items()), sorted(last.items())
    )
    with pool.connection() as lock, store.locked(lock, backfill_id):
        with pool.connection() as conn, conn.transaction():
            row = store.begin_backfill(conn, backfill_id, filter_version, first, last)
            read = load_positions(conn, _name(backfill_id))
            if row.status == "running":
                copy_tables(conn, row.schema_name, builder.tables)
        outcome = Backfill(backfill_id, filter_version, first, last, row.records, bool(read))
        if row.status == "done":
            return replace(outcome, already_done=True)
        derivation = _Derivation(builder, outcome, row.schema_name)
        forgotten = _derive(log, pool, derivation, read, request.batch, progress)
        records = sum(1 for _ in _appended(log, backfill_id))
        with pool.connection() as conn, conn.transaction():
            drop_schema(conn, row.schema_name)
            forget_positions(conn, _name(backfill_id))
            store.finish_backfill(conn, backfill_id, records)
    return replace(outcome, records=records, forgotten=forgotten)


def _derive(
    log: EventLog,
    pool: Pool,
    derivation: _Derivation,
    read: Positions,
    batch: int,
    progress: Progress | None,
) -> int:
    """Run the builder from ``read`` to the backfill's end, batch by batch, each batch's join
    state, appends and read position in one transaction; returns how many events of forgotten
    tenants it read. A record of a tenant that does not teach now (as the live builder has read
    it) is left out, whatever it said back then."""
    builder, outcome = derivation.builder, derivation.outcome
    first, last = outcome.start, outcome.end
    total = sum(max(0, last[p] - read.get(p, first.get(p, 0))) for p in last)
    done = forgotten = 0
    for events in _batches(log.read(start=read, end=last), batch):
        with pool.connection() as conn, conn.transaction():
            search_first(conn, derivation.schema)
            derived: list[NewEvent] = []
            for event in events:
                forgotten += isinstance(event.payload, Forgotten)
                found = builder.handle(conn, event)
                if event.position.offset >= first.get(event.position.partition, 0):
                    derived += [
                        _marked(e, outcome.backfill_id)
                        for e in found
                        if teaches_now(conn, e.tenant_id)
                    ]
                read[event.position.partition] = event.position.offset + 1
            if derived:
                log.append(derived)
            save_positions(conn, _name(outcome.backfill_id), read)
        done += len(events)
        if progress is not None:
            progress(min(done, total), total)
    return forgotten


def _marked(event: NewEvent, backfill_id: UUID) -> NewEvent:
    """A record of the backfill, correlated with it (lineage finds it by that)."""
    if not isinstance(event.payload, ExperienceRecorded):
        raise TypeError(f"a backfill appends experience, not {type(event.payload).__name__}")
    return event.model_copy(update={"correlation_id": backfill_id})


def _name(backfill_id: UUID) -> str:
    """The processor name its read position is saved under."""
    return f"backfill:{backfill_id}"


def _appended(log: EventLog, backfill_id: UUID) -> Iterator[RecordedEvent]:
    """The records this backfill appended (others, derived before under their ids, are not
    its): counted from the log, so a run killed between an append and its commit counts each
    record once."""
    for event in log.read(types=["ExperienceRecorded"]):
        if event.envelope.correlation_id == backfill_id:
            yield event


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
        "forgotten": outcome.forgotten,
    }
