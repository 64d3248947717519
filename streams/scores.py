"""Live contract scores per release and specialist: thumbs-up, edit and regenerate rates,
action success, GenUI validity and latency, as counters per turn (rates are ratios of their
sums). A forgotten tenant's turns leave the scores."""

from __future__ import annotations

from collections.abc import Sequence

from core.events import (
    FeedbackGiven,
    GenUIRendered,
    HarnessActionExecuted,
    NewEvent,
    RouterDecided,
    TenantForgotten,
    TurnCompleted,
    TurnReceived,
)
from core.log import RecordedEvent
from infra.postgres import scores
from infra.postgres.db import DictConnection
from infra.postgres.erasure import erase_score_rows

_FEEDBACK_COUNTER = {"up": "ups", "down": "downs", "edit": "edits", "regenerate": "regenerates"}


class LiveScores:
    name = "live-scores-2"
    tables: tuple[str, ...] = ("score_turns",)

    def handle(self, conn: DictConnection, event: RecordedEvent) -> list[NewEvent]:
        """A turn's release (from ``TurnReceived``) and specialist (from ``RouterDecided``) are
        seen before anything else of it; later events add to their counters."""
        p = event.payload
        match p:
            case TurnReceived() if p.release_id is not None:
                scores.record_scored_turn(conn, p.turn_id, event.envelope.tenant_id, p.release_id)
            case RouterDecided():
                scores.record_scored_specialist(conn, p.turn_id, p.specialist)
            case TurnCompleted():
                scores.add_to_scores(conn, p.turn_id, {"turns": 1, "latency_ms": p.latency_ms})
            case HarnessActionExecuted():
                scores.add_to_scores(conn, p.turn_id, {"actions": 1, "actions_ok": int(p.ok)})
            case GenUIRendered():
                scores.add_to_scores(conn, p.turn_id, {"genui": 1, "genui_valid": int(p.valid)})
            case FeedbackGiven():
                scores.add_to_scores(conn, p.turn_id, {_FEEDBACK_COUNTER[p.kind]: 1})
            case TenantForgotten():
                erase_score_rows(conn, p.tenant)
        return []

    def after_commit(self, derived: Sequence[NewEvent]) -> None:
        return None
