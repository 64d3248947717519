"""Live contract scores (``score_turns``, ``live_scores``): counters per release and
specialist, which rates are ratios of."""

from __future__ import annotations

from typing import Any
from uuid import UUID

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
"""The counter columns of ``live_scores``."""


def record_scored_turn(conn: DictConnection, turn_id: UUID, release_id: str) -> None:
    conn.execute(
        "INSERT INTO score_turns (turn_id, release_id) VALUES (%s, %s) ON CONFLICT DO NOTHING",
        (turn_id, release_id),
    )


def record_scored_specialist(conn: DictConnection, turn_id: UUID, specialist: str) -> None:
    conn.execute("UPDATE score_turns SET specialist = %s WHERE turn_id = %s", (specialist, turn_id))


def add_to_scores(conn: DictConnection, turn_id: UUID, amounts: dict[str, float]) -> None:
    """Add to the counters of the turn's release and specialist; a turn not yet routed (or
    never received) counts nowhere."""
    unknown = set(amounts) - COUNTERS
    if unknown:
        raise ValueError(f"not a live_scores counter: {sorted(unknown)}")
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


def live_scores(conn: DictConnection) -> list[dict[str, Any]]:
    """Every release's and specialist's counters."""
    rows = conn.execute("SELECT * FROM live_scores ORDER BY release_id, specialist").fetchall()
    return [dict(r) for r in rows]
