"""The PostgreSQL event log: the embedded default.

Appends are serialised by a transaction-level advisory lock, so positions become visible in
commit order and a tailing reader can never pass over an event that commits later. The
``(key, sequence)`` and ``event_id`` unique constraints back that up.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Collection, Generator, Iterator, Mapping, Sequence
from dataclasses import fields
from typing import Any

import psycopg
from psycopg.rows import DictRow, dict_row, tuple_row

from core.canonical import canonical_json
from core.errors import EventIdConflict, SequenceConflict
from core.events import Envelope, NewEvent
from core.events.privacy import Cipher
from core.log import DeadLetter, LogPosition, Positions, RecordedEvent
from core.mapper import Mapper, Sealed
from infra.postgres.db import DictConnection, Pool, storage_errors, unavailable_as_typed

APPEND_LOCK = 0x6D6163_61726F6E  # "macaron": the one lock every append takes
NOTIFY_CHANNEL = "macaron_events"
PARTITION = 0
READ_BATCH = 2000
HEAD_CACHE_SIZE = 65_536
SOURCE = "postgres"

_COLUMNS = (
    "position, event_id, type, schema_version, occurred_at, tenant_id, key, sequence, "
    "causation_id, correlation_id, trace, prev_hash, hash, payload"
)


Row = tuple[Any, ...]  # position, then the envelope's fields in declaration order
if _COLUMNS.split(", ")[1:] != [f.name for f in fields(Envelope)]:
    raise RuntimeError("events columns and Envelope fields must be listed in the same order")


def _envelope(row: Row) -> Envelope:
    """Rows come from a table whose types and checks match the envelope's (migrations/0001),
    so the envelope is built without validating it again; the payload is validated on decode."""
    return Envelope(*row[1:])


class PostgresEventLog:
    """``EventLog`` over the ``events`` table (see migrations/0001)."""

    def __init__(self, pool: Pool, conninfo: str, cipher: Cipher | None = None) -> None:
        self._pool = pool
        self._mapper = Mapper(cipher)
        self._conninfo = conninfo
        self._heads: OrderedDict[str, tuple[int, str]] = OrderedDict()  # least recent first
        self._heads_lock = threading.Lock()

    # --- append -----------------------------------------------------------------------------

    def append(self, events: Sequence[NewEvent]) -> list[RecordedEvent]:
        if not events:
            return []
        self._mapper.warm_keys(events)  # before a connection is held: keys may need one
        with (
            unavailable_as_typed(),
            storage_errors("events_key_sequence_key"),
            self._pool.connection() as conn,
        ):
            recorded = self._append_optimistic(conn, events)
            if recorded is None:
                recorded = self._append_checked(conn, events)
        self._remember(recorded)
        return recorded

    def _append_optimistic(
        self, conn: DictConnection, events: Sequence[NewEvent]
    ) -> list[RecordedEvent] | None:
        """One round trip (lock, insert, NOTIFY, commit), chaining onto the heads this process
        last saw (a key it has not seen starts at 1). If another writer moved a head, or an id
        is a repeat, a unique constraint refuses the insert and ``None`` sends the append down
        the checked path."""
        with self._heads_lock:
            heads = {e.key: self._heads[e.key] for e in events if e.key in self._heads}
        try:
            fresh = self._mapper.seal_batch(events, {}, heads)
        except SequenceConflict:  # the remembered head may be stale: let the log decide
            return None
        try:
            with conn.pipeline(), conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (APPEND_LOCK,))
                inserted = self._insert(conn, fresh)
        except psycopg.errors.UniqueViolation:
            return None
        positions = {row["event_id"]: row["position"] for row in inserted.fetchall()}
        recorded = {
            s.envelope.event_id: RecordedEvent(
                LogPosition(PARTITION, positions[s.envelope.event_id]), s.envelope, s.payload
            )
            for s in fresh
        }
        return [recorded[e.event_id] for e in events]

    def _append_checked(
        self, conn: DictConnection, events: Sequence[NewEvent]
    ) -> list[RecordedEvent]:
        """Look up stored ids and chain heads under the lock, then insert: two round trips."""
        keys = sorted({e.key for e in events})
        with conn.pipeline():
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (APPEND_LOCK,))
                stored_rows = conn.cursor(row_factory=tuple_row).execute(
                    f"SELECT {_COLUMNS} FROM events WHERE event_id = ANY(%s)",
                    ([e.event_id for e in events],),
                )
                head_rows = conn.execute(
                    "SELECT k.key, h.sequence, h.hash FROM unnest(%s::text[]) AS k(key) "
                    "CROSS JOIN LATERAL (SELECT sequence, hash FROM events e "
                    "WHERE e.key = k.key ORDER BY sequence DESC LIMIT 1) AS h",
                    (keys,),
                )
                stored = {row[1]: self._stored(row) for row in stored_rows.fetchall()}
                heads = {r["key"]: (r["sequence"], r["hash"]) for r in head_rows.fetchall()}
                digests = {i: self._mapper.content_digest(r.envelope) for i, r in stored.items()}
                fresh = self._mapper.seal_batch(events, digests, heads)
                inserted = self._insert(conn, fresh) if fresh else None
            positions = (
                {}
                if inserted is None
                else {row["event_id"]: row["position"] for row in inserted.fetchall()}
            )
        for sealed in fresh:
            event_id = sealed.envelope.event_id
            position = LogPosition(PARTITION, positions[event_id])
            stored[event_id] = RecordedEvent(position, sealed.envelope, sealed.payload)
        return [stored[event.event_id] for event in events]

    def _remember(self, recorded: list[RecordedEvent]) -> None:
        """Keep the newest head of each key this process appended to (bounded, LRU)."""
        with self._heads_lock:
            for record in recorded:
                env = record.envelope
                if self._heads.get(env.key, (0, ""))[0] <= env.sequence:
                    self._heads[env.key] = (env.sequence, env.hash)
                    self._heads.move_to_end(env.key)
            while len(self._heads) > HEAD_CACHE_SIZE:
                self._heads.popitem(last=False)

    def _decode_row(self, row: Row) -> RecordedEvent | DeadLetter:
        return self._mapper.decode(LogPosition(PARTITION, row[0]), _envelope(row))

    def _stored(self, row: Row) -> RecordedEvent:
        record = self._decode_row(row)
        if isinstance(record, DeadLetter):
            raise EventIdConflict(
                f"event {row[1]} is stored but cannot be decoded: {record.reason}"
            )
        return record

    @staticmethod
    def _insert(conn: DictConnection, fresh: list[Sealed]) -> psycopg.Cursor[DictRow]:
        """Queue the insert (column arrays in binary) and the NOTIFY; results come at commit."""
        columns: list[list[Any]] = [[] for _ in range(13)]
        for sealed in fresh:
            e = sealed.envelope
            values = (
                e.event_id,
                e.type,
                e.schema_version,
                e.occurred_at,
                e.tenant_id,
                e.key,
                e.sequence,
                e.causation_id,
                e.correlation_id,
                canonical_json(e.trace).decode(),
                e.prev_hash,
                e.hash,
                sealed.payload_json,
            )
            for column, value in zip(columns, values, strict=True):
                column.append(value)
        inserted = conn.execute(
            "INSERT INTO events (event_id, type, schema_version, occurred_at, tenant_id, key, "
            "sequence, causation_id, correlation_id, trace, prev_hash, hash, payload) "
            "SELECT u.event_id, u.type, u.schema_version, u.occurred_at, u.tenant_id, u.key, "
            "u.sequence, u.causation_id, u.correlation_id, u.trace::json, u.prev_hash, "
            "u.hash, u.payload::json FROM unnest(%b::uuid[], %b::text[], %b::int[], "
            "%b::timestamptz[], %b::text[], %b::text[], %b::bigint[], %b::uuid[], "
            "%b::uuid[], %b::text[], %b::text[], %b::text[], %b::text[]) AS u(event_id, "
            "type, schema_version, occurred_at, tenant_id, key, sequence, causation_id, "
            "correlation_id, trace, prev_hash, hash, payload) RETURNING event_id, position",
            columns,
        )
        conn.execute(f"NOTIFY {NOTIFY_CHANNEL}")
        return inserted

    # --- read -------------------------------------------------------------------------------

    def _scan(
        self,
        start: int,
        end: int | None,
        key: str | None,
        types: Collection[str] | None,
    ) -> Iterator[Row]:
        where = ["position >= %(cursor)s"]
        if end is not None:
            where.append("position < %(end)s")
        if key is not None:
            where.append("key = %(key)s")
        if types is not None:
            where.append("type = ANY(%(types)s)")
        sql = (
            f"SELECT {_COLUMNS} FROM events WHERE {' AND '.join(where)} "
            f"ORDER BY position LIMIT {READ_BATCH}"
        )
        params: dict[str, Any] = {
            "cursor": start,
            "end": end,
            "key": key,
            "types": list(types or ()),
        }
        while True:
            with unavailable_as_typed(), self._pool.connection() as conn:
                rows = conn.cursor(row_factory=tuple_row).execute(sql, params).fetchall()
            yield from rows
            if len(rows) < READ_BATCH:
                return
            params["cursor"] = rows[-1][0] + 1

    def read(
        self,
        *,
        start: Mapping[int, int] | None = None,
        end: Mapping[int, int] | None = None,
        key: str | None = None,
        types: Collection[str] | None = None,
    ) -> Iterator[RecordedEvent]:
        first = (start or {}).get(PARTITION, 1)
        stop = (end or self.end_positions())[PARTITION]
        for row in self._scan(first, stop, key, types):
            record = self._decode_row(row)
            if isinstance(record, DeadLetter):
                self._dead_letter(record)
                continue
            yield record

    def envelopes(self, *, key: str | None = None) -> Iterator[Envelope]:
        for row in self._scan(1, None, key, None):
            yield _envelope(row)

    def tail(
        self, *, start: Mapping[int, int] | None = None, idle_timeout: float = 1.0
    ) -> Generator[RecordedEvent | None, None, None]:
        cursor = (start or {}).get(PARTITION, 1)
        with (
            unavailable_as_typed(),
            psycopg.connect(self._conninfo, autocommit=True, row_factory=dict_row) as listener,
        ):
            listener.execute(f"LISTEN {NOTIFY_CHANNEL}")
            while True:
                progressed = False
                for row in self._scan(cursor, None, None, None):
                    cursor = row[0] + 1
                    progressed = True
                    record = self._decode_row(row)
                    if isinstance(record, DeadLetter):
                        self._dead_letter(record)
                        continue
                    yield record
                if progressed:
                    continue
                with unavailable_as_typed():
                    woken = any(True for _ in listener.notifies(timeout=idle_timeout, stop_after=1))
                if not woken:
                    yield None

    def end_positions(self) -> Positions:
        with unavailable_as_typed(), self._pool.connection() as conn:
            row = conn.execute(
                "SELECT coalesce(max(position), 0) + 1 AS next FROM events"
            ).fetchone()
        assert row is not None
        return {PARTITION: int(row["next"])}

    # --- dead letters -----------------------------------------------------------------------

    def _dead_letter(self, letter: DeadLetter) -> None:
        with unavailable_as_typed(), self._pool.connection() as conn:
            conn.execute(
                'INSERT INTO dead_letters (source, partition, "offset", code, reason, raw) '
                "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
                (
                    SOURCE,
                    letter.position.partition,
                    letter.position.offset,
                    letter.code,
                    letter.reason,
                    letter.raw,
                ),
            )

    def dead_letters(self) -> list[DeadLetter]:
        with unavailable_as_typed(), self._pool.connection() as conn:
            rows = conn.execute(
                'SELECT partition, "offset", code, reason, raw FROM dead_letters '
                'WHERE source = %s ORDER BY partition, "offset"',
                (SOURCE,),
            ).fetchall()
        return [
            DeadLetter(LogPosition(r["partition"], r["offset"]), r["code"], r["reason"], r["raw"])
            for r in rows
        ]

    def close(self) -> None:
        """The pool belongs to the caller; nothing of the log's own to release."""
