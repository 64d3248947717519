"""Projections: conversations and turns as tables, for history and tenant queries."""

from __future__ import annotations

from collections.abc import Sequence

from core.events import (
    ConversationStarted,
    FeedbackGiven,
    GenUIRendered,
    HarnessActionExecuted,
    ModelResponded,
    NewEvent,
    RouterDecided,
    TurnCompleted,
    TurnReceived,
)
from core.log import RecordedEvent
from infra.postgres.db import DictConnection


class Projections:
    name = "projections-1"
    tables: tuple[str, ...] = ("conversations", "turns")

    def handle(self, conn: DictConnection, event: RecordedEvent) -> list[NewEvent]:
        p, env = event.payload, event.envelope
        match p:
            case ConversationStarted():
                conn.execute(
                    "INSERT INTO conversations (conversation_id, tenant_id, release_id, "
                    "started_at) VALUES (%s, %s, %s, %s) ON CONFLICT DO NOTHING",
                    (p.conversation_id, env.tenant_id, p.release_id, env.occurred_at),
                )
            case TurnReceived():
                inserted = conn.execute(
                    "INSERT INTO turns (turn_id, conversation_id, tenant_id, received_at, "
                    "content, input_kind, release_id) VALUES (%s, %s, %s, %s, %s, %s, %s) "
                    "ON CONFLICT DO NOTHING",
                    (
                        p.turn_id,
                        p.conversation_id,
                        env.tenant_id,
                        env.occurred_at,
                        p.content,
                        p.input_kind,
                        p.release_id,
                    ),
                )
                if inserted.rowcount:
                    conn.execute(
                        "UPDATE conversations SET turns = turns + 1 WHERE conversation_id = %s",
                        (p.conversation_id,),
                    )
            case RouterDecided():
                self._set(
                    conn, p.turn_id, specialist=p.specialist, adapter_version=p.adapter_version
                )
            case HarnessActionExecuted():
                conn.execute(
                    "UPDATE turns SET actions = actions + 1 WHERE turn_id = %s", (p.turn_id,)
                )
            case GenUIRendered():
                self._set(conn, p.turn_id, genui_valid=p.valid)
            case ModelResponded():
                self._set(
                    conn,
                    p.turn_id,
                    answer=p.text,
                    finish_reason=p.finish_reason,
                    release_id=p.release_id,
                )
            case TurnCompleted():
                self._set(conn, p.turn_id, completed=True, latency_ms=p.latency_ms)
            case FeedbackGiven():
                conn.execute(
                    "UPDATE turns SET feedback = feedback || %s::text, "
                    "answer = COALESCE(%s, answer) WHERE turn_id = %s",
                    (p.kind, p.edited_text, p.turn_id),
                )
        return []

    @staticmethod
    def _set(conn: DictConnection, turn_id: object, **values: object) -> None:
        columns = ", ".join(f"{name} = %({name})s" for name in values)
        conn.execute(
            f"UPDATE turns SET {columns} WHERE turn_id = %(turn_id)s",
            {**values, "turn_id": turn_id},
        )

    def after_commit(self, derived: Sequence[NewEvent]) -> None:
        return None
