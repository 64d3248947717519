"""Projections: conversations and turns as tables, for tenant queries: each turn's facts, never
its words (``infra.postgres.projections``)."""

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
    TenantForgotten,
    TurnCompleted,
    TurnReceived,
)
from core.log import RecordedEvent
from infra.postgres import projections as tables
from infra.postgres.db import DictConnection
from infra.postgres.erasure import erase_projection_rows


class Projections:
    name = "projections-1"
    tables: tuple[str, ...] = ("conversations", "turns")

    def handle(self, conn: DictConnection, event: RecordedEvent) -> list[NewEvent]:
        p, env = event.payload, event.envelope
        match p:
            case ConversationStarted():
                tables.record_conversation(
                    conn, p.conversation_id, env.tenant_id, p.release_id, env.occurred_at
                )
            case TurnReceived():
                tables.record_turn(conn, env, p)
            case RouterDecided():
                tables.set_turn(
                    conn, p.turn_id, specialist=p.specialist, adapter_version=p.adapter_version
                )
            case HarnessActionExecuted():
                tables.count_action(conn, p.turn_id)
            case GenUIRendered():
                tables.set_turn(conn, p.turn_id, genui_valid=p.valid)
            case ModelResponded():
                tables.set_turn(
                    conn, p.turn_id, finish_reason=p.finish_reason, release_id=p.release_id
                )
            case TurnCompleted():
                tables.set_turn(conn, p.turn_id, completed=True, latency_ms=p.latency_ms)
            case FeedbackGiven():
                tables.record_feedback(conn, p.turn_id, p.kind)
            case TenantForgotten():
                erase_projection_rows(conn, p.tenant)
        return []

    def after_commit(self, derived: Sequence[NewEvent]) -> None:
        return None
