"""Live contract scores per release and specialist: thumbs-up, edit and regenerate rates,
action success, GenUI validity and latency, as counters (rates are ratios of them)."""

from __future__ import annotations

from collections.abc import Sequence

from core.events import (
    FeedbackGiven,
    GenUIRendered,
    HarnessActionExecuted,
    NewEvent,
    RouterDecided,
    TurnCompleted,
    TurnReceived,
)
from core.log import RecordedEvent
from infra.postgres.db import DictConnection

_FEEDBACK_COLUMN = {"up": "ups", "down": "downs", "edit": "edits", "regenerate": "regenerates"}


class LiveScores:
    name = "live-scores-1"
    tables: tuple[str, ...] = ("score_turns", "live_scores")

    def handle(self, conn: DictConnection, event: RecordedEvent) -> list[NewEvent]:
        p = event.payload
        match p:
            case TurnReceived() if p.release_id is not None:
                conn.execute(
                    "INSERT INTO score_turns (turn_id, release_id) VALUES (%s, %s) "
                    "ON CONFLICT DO NOTHING",
                    (p.turn_id, p.release_id),
                )
            case RouterDecided():
                conn.execute(
                    "UPDATE score_turns SET specialist = %s WHERE turn_id = %s",
                    (p.specialist, p.turn_id),
                )
            case TurnCompleted():
                self._add(conn, p.turn_id, turns=1, latency_ms=p.latency_ms)
            case HarnessActionExecuted():
                self._add(conn, p.turn_id, actions=1, actions_ok=int(p.ok))
            case GenUIRendered():
                self._add(conn, p.turn_id, genui=1, genui_valid=int(p.valid))
            case FeedbackGiven():
                self._add(conn, p.turn_id, **{_FEEDBACK_COLUMN[p.kind]: 1})
        return []

    @staticmethod
    def _add(conn: DictConnection, turn_id: object, **amounts: float) -> None:
        """Add to the counters of the turn's release (from ``TurnReceived``) and specialist
        (from ``RouterDecided``), both seen before anything else of the turn."""
        columns = ", ".join(amounts)
        values = ", ".join(f"%({c})s" for c in amounts)
        updates = ", ".join(f"{c} = live_scores.{c} + EXCLUDED.{c}" for c in amounts)
        conn.execute(
            f"INSERT INTO live_scores (release_id, specialist, {columns}) "
            f"SELECT release_id, specialist, {values} FROM score_turns WHERE turn_id = %(turn)s "
            "AND specialist IS NOT NULL "
            f"ON CONFLICT (release_id, specialist) DO UPDATE SET {updates}",
            {**amounts, "turn": turn_id},
        )

    def after_commit(self, derived: Sequence[NewEvent]) -> None:
        return None
