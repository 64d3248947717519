"""Live contract scores: counters per scored turn (``score_turns``), summed per release and
specialist by the ``live_scores`` view (migration 0017); rates are ratios of them."""

from __future__ import annotations

from uuid import UUID

from core.registry import LiveScore
from infra.postgres.db import DictConnection

COUNTERS = frozenset(
    {
        "turns",
        "latency_ms",
        "actions",
        "actions_ok",
        "genui",
        "genui_valid",
        "ups",
        "downs",
        "edits",
        "regenerates",
    }
)
"""The counter columns of ``score_turns`` and ``live_scores``."""


def record_scored_turn(
    conn: DictConnection, turn_id: UUID, tenant_id: str, release_id: str
) -> None:
    conn.execute(
        "INSERT INTO score_turns (turn_id, tenant_id, release_id) VALUES (%s, %s, %s) "
        "ON CONFLICT DO NOTHING",
        (turn_id, tenant_id, release_id),
    )


def record_scored_specialist(conn: DictConnection, turn_id: UUID, specialist: str) -> None:
    conn.execute("UPDATE score_turns SET specialist = %s WHERE turn_id = %s", (specialist, turn_id))


def add_to_scores(conn: DictConnection, turn_id: UUID, amounts: dict[str, float]) -> None:
    """Add to the turn's counters; a turn not yet routed (or never received) counts nowhere."""
    unknown = set(amounts) - COUNTERS
    if unknown:
        raise ValueError(f"not a live_scores counter: {sorted(unknown)}")
    updates = ", ".join(f"{c} = {c} + %({c})s" for c in amounts)
    conn.execute(
        f"UPDATE score_turns SET {updates} WHERE turn_id = %(turn)s AND specialist IS NOT NULL",
        {**amounts, "turn": turn_id},
    )


def live_scores(conn: DictConnection) -> list[LiveScore]:
    """Every release's and specialist's counters."""
    rows = conn.execute("SELECT * FROM live_scores ORDER BY release_id, specialist").fetchall()
    return [LiveScore(**r) for r in rows]
