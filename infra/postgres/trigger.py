"""The training trigger's state (``trigger_state``): per specialist, the experience records
counted since its last snapshot, where they start and their running hash."""

from __future__ import annotations

from dataclasses import dataclass

from core.experience import EMPTY_CHAIN
from infra.postgres.db import DictConnection


@dataclass(frozen=True)
class PendingRecords:
    """A specialist's records since its last snapshot: they start at ``start_offset`` of
    ``partition``; ``running_hash`` chains them all in log order, ``count`` is how many of
    them teach (live rewards are not counted)."""

    specialist: str
    partition: int
    start_offset: int
    count: int
    running_hash: str
    rewards_hashed: bool = True
    """Whether live rewards are chained (a range begun before they were is hashed without)."""


def pending_records(
    conn: DictConnection, specialist: str, partition: int, offset: int
) -> PendingRecords:
    """The specialist's pending records; none yet starts a range at ``offset``."""
    row = conn.execute(
        "INSERT INTO trigger_state (specialist, partition, start_offset, pending, "
        "running_hash) VALUES (%s, %s, %s, 0, %s) ON CONFLICT (specialist) DO UPDATE "
        "SET specialist = EXCLUDED.specialist RETURNING *",
        (specialist, partition, offset, EMPTY_CHAIN),
    ).fetchone()
    if row is None:
        raise RuntimeError("INSERT ... RETURNING gave no row")
    return PendingRecords(
        specialist=row["specialist"],
        partition=row["partition"],
        start_offset=row["start_offset"],
        count=row["pending"],
        running_hash=row["running_hash"],
        rewards_hashed=row["rewards_hashed"],
    )


def save_pending(conn: DictConnection, pending: PendingRecords) -> None:
    conn.execute(
        "UPDATE trigger_state SET pending = %s, running_hash = %s WHERE specialist = %s",
        (pending.count, pending.running_hash, pending.specialist),
    )


def clear_pending(conn: DictConnection, specialist: str) -> None:
    """The specialist's next record starts the next range."""
    conn.execute("DELETE FROM trigger_state WHERE specialist = %s", (specialist,))
