"""Backfills (``experience_backfills``): the experience of a past log range derived under one
filter version (``streams.backfill``): which range, where its join state lives, how many
records it appended, whether it is done."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from uuid import UUID

from psycopg.types.json import Jsonb
from pydantic import JsonValue

from core.errors import BackfillRunning
from core.registry import BackfillState
from infra.postgres.db import DictConnection


def begin_backfill(
    conn: DictConnection,
    backfill_id: UUID,
    filter_version: str,
    start: Mapping[int, int],
    end: Mapping[int, int],
) -> BackfillState:
    """Where the backfill stands, added as ``running`` if it is new."""
    conn.execute(
        "INSERT INTO experience_backfills (backfill_id, filter_version, start_positions, "
        "end_positions, schema_name, status, records) VALUES (%s, %s, %s, %s, %s, 'running', 0) "
        "ON CONFLICT DO NOTHING",
        (
            backfill_id,
            filter_version,
            Jsonb({str(p): o for p, o in start.items()}),
            Jsonb({str(p): o for p, o in end.items()}),
            f"backfill_{backfill_id.hex[:16]}",
        ),
    )
    row = conn.execute(
        "SELECT status, records, schema_name FROM experience_backfills WHERE backfill_id = %s",
        (backfill_id,),
    ).fetchone()
    if row is None:
        raise RuntimeError("a backfill inserted or there is no row")
    return BackfillState(**row)


def running_end(
    conn: DictConnection, filter_version: str, start: Mapping[int, int]
) -> dict[int, int] | None:
    """Where the stopped backfill of ``filter_version`` from ``start`` (empty: from the
    beginning) ends, if there is one."""
    for row in conn.execute(
        "SELECT start_positions, end_positions FROM experience_backfills "
        "WHERE filter_version = %s AND status = 'running' ORDER BY started_at DESC",
        (filter_version,),
    ).fetchall():
        begins = {int(p): o for p, o in row["start_positions"].items()}
        if begins == dict(start) or (not start and not any(begins.values())):
            return {int(p): o for p, o in row["end_positions"].items()}
    return None


def finish_backfill(conn: DictConnection, backfill_id: UUID, records: int) -> None:
    """Mark it done, with the records it appended in all."""
    row = conn.execute(
        "UPDATE experience_backfills SET status = 'done', records = %s, finished_at = now() "
        "WHERE backfill_id = %s RETURNING backfill_id",
        (records, backfill_id),
    ).fetchone()
    if row is None:
        raise RuntimeError(f"no backfill {backfill_id}")


@contextmanager
def locked(conn: DictConnection, backfill_id: UUID) -> Iterator[None]:
    """Hold the backfill's session lock on ``conn`` (one run at a time) while the block runs,
    and release it after: a pooled connection outlives the block, and a lock it kept would
    refuse the next run of the same backfill on another connection. ``BackfillRunning`` if
    another session holds it."""
    key = f"backfill:{backfill_id}"
    row = conn.execute("SELECT pg_try_advisory_lock(hashtext(%s)) AS locked", (key,)).fetchone()
    if row is None or not row["locked"]:
        raise BackfillRunning(f"backfill {backfill_id} is running in another process")
    try:
        yield
    finally:
        conn.execute("SELECT pg_advisory_unlock(hashtext(%s))", (key,))


def is_backfill(conn: DictConnection, backfill_id: UUID) -> bool:
    row = conn.execute(
        "SELECT 1 FROM experience_backfills WHERE backfill_id = %s", (backfill_id,)
    ).fetchone()
    return row is not None


def replayed_by(conn: DictConnection, ids: Sequence[UUID]) -> list[dict[str, JsonValue]]:
    """The backfills of ``ids``, oldest first, as lineage shows them (JSON)."""
    rows = conn.execute(
        "SELECT backfill_id, filter_version, start_positions, end_positions, records, "
        "finished_at FROM experience_backfills WHERE backfill_id = ANY(%s) ORDER BY started_at",
        (list(ids),),
    ).fetchall()
    return [
        {
            "backfill_id": str(b["backfill_id"]),
            "filter_version": b["filter_version"],
            "from": b["start_positions"],
            "to": b["end_positions"],
            "records": b["records"],
            "finished_at": None if b["finished_at"] is None else str(b["finished_at"]),
        }
        for b in rows
    ]
