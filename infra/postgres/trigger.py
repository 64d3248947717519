"""The training trigger's state (``trigger_state``): per specialist and filter version, the
experience records counted since its last snapshot, where they start and end, their running
hash, the backfills that appended any of them and the forgotten tenants whose records in the
range it left out."""

from __future__ import annotations

from dataclasses import dataclass
from uuid import UUID

from psycopg.rows import DictRow

from core.experience import EMPTY_CHAIN
from infra.postgres.db import DictConnection


@dataclass(frozen=True)
class PendingRecords:
    """A specialist's records of one filter version since its last snapshot: they start at
    ``start_offset`` of ``partition`` and the last one is before ``end_offset``;
    ``running_hash`` chains them all in log order, ``count`` is how many of them teach (live
    rewards are not counted)."""

    specialist: str
    filter_version: str
    partition: int
    start_offset: int
    count: int
    running_hash: str
    rewards_hashed: bool = True
    """Whether live rewards are chained (a range begun before they were is hashed without)."""
    end_offset: int | None = None
    backfills: tuple[UUID, ...] = ()
    """The backfills (``streams.backfill``) whose records are among them."""
    left_out_tenants: tuple[str, ...] = ()
    """Forgotten tenants whose records lie in the range, unreadable: neither counted nor
    chained."""


def pending_records(
    conn: DictConnection, specialist: str, filter_version: str, partition: int, offset: int
) -> PendingRecords:
    """The specialist's pending records of ``filter_version``; none yet starts a range at
    ``offset``."""
    row = conn.execute(
        "INSERT INTO trigger_state (specialist, filter_version, partition, start_offset, "
        "pending, running_hash) VALUES (%s, %s, %s, %s, 0, %s) "
        "ON CONFLICT (specialist, filter_version) DO UPDATE "
        "SET specialist = EXCLUDED.specialist RETURNING *",
        (specialist, filter_version, partition, offset, EMPTY_CHAIN),
    ).fetchone()
    if row is None:
        raise RuntimeError("INSERT ... RETURNING gave no row")
    return _pending(row)


def locked_pending(
    conn: DictConnection, specialist: str, filter_version: str
) -> PendingRecords | None:
    """The pending records, locked until the transaction ends (the trigger waits)."""
    row = conn.execute(
        "SELECT * FROM trigger_state WHERE specialist = %s AND filter_version = %s FOR UPDATE",
        (specialist, filter_version),
    ).fetchone()
    return None if row is None else _pending(row)


def every_pending(conn: DictConnection) -> list[PendingRecords]:
    """Every specialist's pending records, locked until the transaction ends."""
    rows = conn.execute(
        "SELECT * FROM trigger_state ORDER BY specialist, filter_version FOR UPDATE"
    ).fetchall()
    return [_pending(row) for row in rows]


def _pending(row: DictRow) -> PendingRecords:
    return PendingRecords(
        specialist=row["specialist"],
        filter_version=row["filter_version"],
        partition=row["partition"],
        start_offset=row["start_offset"],
        count=row["pending"],
        running_hash=row["running_hash"],
        rewards_hashed=row["rewards_hashed"],
        end_offset=row["end_offset"],
        backfills=tuple(row["backfills"]),
        left_out_tenants=tuple(row["left_out_tenants"]),
    )


def save_pending(conn: DictConnection, pending: PendingRecords) -> None:
    conn.execute(
        "UPDATE trigger_state SET pending = %s, running_hash = %s, end_offset = %s, "
        "backfills = %s, left_out_tenants = %s WHERE specialist = %s AND filter_version = %s",
        (
            pending.count,
            pending.running_hash,
            pending.end_offset,
            list(pending.backfills),
            list(pending.left_out_tenants),
            pending.specialist,
            pending.filter_version,
        ),
    )


def clear_pending(conn: DictConnection, specialist: str, filter_version: str) -> None:
    """The specialist's next record of ``filter_version`` starts the next range."""
    conn.execute(
        "DELETE FROM trigger_state WHERE specialist = %s AND filter_version = %s",
        (specialist, filter_version),
    )
