"""Read-only lookups the operator's commands make: which conversation a turn belongs to (for
``macaron trace``), and the training runs a demo waits on with what became of each."""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime
from uuid import UUID

from core.registry import RunVerdicts
from infra.postgres.db import DictConnection
from infra.postgres.runs import run_of


def conversation_of_turn(conn: DictConnection, turn_id: UUID) -> UUID | None:
    """The conversation of a projected turn, or ``None`` while no processor has projected it."""
    row = conn.execute(
        "SELECT conversation_id FROM turns WHERE turn_id = %s", (turn_id,)
    ).fetchone()
    if row is None:
        return None
    conversation_id: UUID = row["conversation_id"]
    return conversation_id


def run_ids_oldest_first(conn: DictConnection) -> list[UUID]:
    """Every training run, in the order it was queued."""
    rows = conn.execute("SELECT run_id FROM training_runs ORDER BY created_at").fetchall()
    return [row["run_id"] for row in rows]


def run_specialists(conn: DictConnection, run_ids: Collection[UUID]) -> set[str]:
    """The specialists the training runs ``run_ids`` train."""
    rows = conn.execute(
        "SELECT DISTINCT specialist FROM training_runs WHERE run_id = ANY(%s)", (list(run_ids),)
    ).fetchall()
    return {row["specialist"] for row in rows}


def run_verdicts(conn: DictConnection, run_id: UUID) -> RunVerdicts | None:
    """A run with its evaluation and its latest promotion decision."""
    row = conn.execute(
        "SELECT r.*, e.scores, e.passed, "
        "p.kind AS promotion, p.reason AS promotion_reason FROM training_runs r "
        "LEFT JOIN evaluations e ON e.run_id = r.run_id "
        "LEFT JOIN LATERAL (SELECT kind, reason FROM promotions WHERE run_id = r.run_id "
        "ORDER BY created_at DESC LIMIT 1) p ON true WHERE r.run_id = %s",
        (run_id,),
    ).fetchone()
    if row is None:
        return None
    return RunVerdicts(
        run_of(row), row["scores"], row["passed"], row["promotion"], row["promotion_reason"]
    )


def run_times(conn: DictConnection, run_ids: list[UUID]) -> dict[UUID, tuple[datetime, datetime]]:
    """When each run was queued and when its last step so far happened (trained or proposed,
    evaluated, promoted or refused), as the registry recorded them."""
    rows = conn.execute(
        "SELECT r.run_id, r.created_at AS queued, "
        "GREATEST(r.created_at, r.finished_at, MAX(e.created_at), MAX(p.created_at)) AS last "
        "FROM training_runs r LEFT JOIN evaluations e ON e.run_id = r.run_id "
        "LEFT JOIN promotions p ON p.run_id = r.run_id WHERE r.run_id = ANY(%s) "
        "GROUP BY r.run_id",
        (run_ids,),
    ).fetchall()
    return {row["run_id"]: (row["queued"], row["last"]) for row in rows}
