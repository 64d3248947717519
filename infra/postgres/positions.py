"""Processor positions: where each stream processor has read to, per partition.

A processor saves its position with the same connection, in the same transaction, as the
outputs it derived from the events it read: both commit, or neither does (exactly-once effect
over at-least-once delivery).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row

from core.log import Positions


def load_positions(conn: psycopg.Connection[Any], processor: str) -> Positions:
    with conn.cursor(row_factory=tuple_row) as cur:
        cur.execute(
            "SELECT partition, next_offset FROM processor_positions WHERE processor = %s",
            (processor,),
        )
        return {int(partition): int(offset) for partition, offset in cur.fetchall()}


def save_positions(
    conn: psycopg.Connection[Any], processor: str, positions: Mapping[int, int]
) -> None:
    """Record ``positions`` for ``processor``; call inside the transaction that writes outputs."""
    if conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE:
        raise RuntimeError("save_positions must run inside the transaction that writes outputs")
    with conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO processor_positions (processor, partition, next_offset) "
            "VALUES (%s, %s, %s) ON CONFLICT (processor, partition) DO UPDATE "
            "SET next_offset = EXCLUDED.next_offset, updated_at = now()",
            [(processor, p, o) for p, o in sorted(positions.items())],
        )


def forget_positions(conn: psycopg.Connection[Any], processor: str) -> None:
    """Drop a finished processor's positions (a backfill's, once it is done)."""
    conn.execute("DELETE FROM processor_positions WHERE processor = %s", (processor,))
