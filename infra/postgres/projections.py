"""The projection tables ``conversations`` and ``turns``: per tenant, its conversations and
each turn's facts (times, route, release, finish, latency, actions, feedback kinds), never
what was said: the log holds that, sealed under the tenant's data key."""

from __future__ import annotations

from datetime import datetime
from uuid import UUID

from core.events import Envelope, TurnReceived
from infra.postgres.db import DictConnection

TURN_COLUMNS = frozenset(
    {
        "specialist",
        "adapter_version",
        "genui_valid",
        "finish_reason",
        "release_id",
        "completed",
        "latency_ms",
    }
)
"""The columns of ``turns`` that ``set_turn`` may write."""


def record_conversation(
    conn: DictConnection,
    conversation_id: UUID,
    tenant_id: str,
    release_id: str,
    started_at: datetime,
) -> None:
    conn.execute(
        "INSERT INTO conversations (conversation_id, tenant_id, release_id, "
        "started_at) VALUES (%s, %s, %s, %s) ON CONFLICT DO NOTHING",
        (conversation_id, tenant_id, release_id, started_at),
    )


def record_turn(conn: DictConnection, envelope: Envelope, turn: TurnReceived) -> None:
    """The turn ``envelope`` holds (its payload, ``turn``), counted in its conversation once (a
    redelivered turn changes nothing)."""
    inserted = conn.execute(
        "INSERT INTO turns (turn_id, conversation_id, tenant_id, received_at, "
        "input_kind, release_id) VALUES (%s, %s, %s, %s, %s, %s) "
        "ON CONFLICT DO NOTHING",
        (
            turn.turn_id,
            turn.conversation_id,
            envelope.tenant_id,
            envelope.occurred_at,
            turn.input_kind,
            turn.release_id,
        ),
    )
    if inserted.rowcount:
        conn.execute(
            "UPDATE conversations SET turns = turns + 1 WHERE conversation_id = %s",
            (turn.conversation_id,),
        )


def set_turn(conn: DictConnection, turn_id: UUID, **values: object) -> None:
    """Set columns of a turn (names from ``TURN_COLUMNS``)."""
    unknown = set(values) - TURN_COLUMNS
    if unknown:
        raise ValueError(f"not a column set_turn writes: {sorted(unknown)}")
    columns = ", ".join(f"{name} = %({name})s" for name in values)
    conn.execute(
        f"UPDATE turns SET {columns} WHERE turn_id = %(turn_id)s",
        {**values, "turn_id": turn_id},
    )


def count_action(conn: DictConnection, turn_id: UUID) -> None:
    conn.execute("UPDATE turns SET actions = actions + 1 WHERE turn_id = %s", (turn_id,))


def record_feedback(conn: DictConnection, turn_id: UUID, kind: str) -> None:
    """Append the feedback kind."""
    conn.execute(
        "UPDATE turns SET feedback = feedback || %s::text WHERE turn_id = %s", (kind, turn_id)
    )
