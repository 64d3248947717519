"""The experience builder's rollout join state (``experience_rollouts``): each sampled episode
of a group as it arrives, its verdict once scored, and the whole group once every sample is."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import UUID

from psycopg.types.json import Jsonb

from core.events import ChatMessage
from infra.postgres.db import DictConnection


@dataclass(frozen=True)
class ScoredSample:
    """One sample of a completely scored rollout group."""

    rollout_id: UUID
    group_id: UUID
    sample: int
    tenant_id: str
    specialist: str
    release_id: str
    adapter_version: str | None
    messages: tuple[ChatMessage, ...]
    answer: str
    hinted: bool
    reward: float | None
    passed: bool
    failure: str | None


def record_sample(conn: DictConnection, row: dict[str, Any]) -> None:
    """Store a sampled episode (``row``: the table's columns up to ``hinted``)."""
    conn.execute(
        "INSERT INTO experience_rollouts (rollout_id, group_id, sample, group_size, tenant_id, "
        "specialist, release_id, adapter_version, messages, answer, hinted) VALUES "
        "(%(rollout_id)s, %(group_id)s, %(sample)s, %(group_size)s, %(tenant_id)s, "
        "%(specialist)s, %(release_id)s, %(adapter_version)s, %(messages)s, %(answer)s, "
        "%(hinted)s) ON CONFLICT DO NOTHING",
        {**row, "messages": Jsonb(row["messages"])},
    )


def record_score(
    conn: DictConnection,
    rollout_id: UUID,
    reward: float | None,
    passed: bool,
    failure: str | None,
) -> bool:
    """Store a sample's verdict; ``False`` when the sample is unknown or already scored."""
    updated = conn.execute(
        "UPDATE experience_rollouts SET scored = true, reward = %s, passed = %s, failure = %s "
        "WHERE rollout_id = %s AND NOT scored RETURNING rollout_id",
        (reward, passed, failure, rollout_id),
    ).fetchone()
    return updated is not None


def scored_group(conn: DictConnection, group_id: UUID) -> list[ScoredSample] | None:
    """Every sample of the group in sample order once all ``group_size`` are scored, else
    ``None``."""
    rows = conn.execute(
        "SELECT * FROM experience_rollouts WHERE group_id = %s ORDER BY sample", (group_id,)
    ).fetchall()
    if not rows or len(rows) < rows[0]["group_size"] or not all(r["scored"] for r in rows):
        return None
    return [
        ScoredSample(
            rollout_id=r["rollout_id"],
            group_id=r["group_id"],
            sample=r["sample"],
            tenant_id=r["tenant_id"],
            specialist=r["specialist"],
            release_id=r["release_id"],
            adapter_version=r["adapter_version"],
            messages=tuple(ChatMessage.model_validate(m) for m in r["messages"]),
            answer=r["answer"],
            hinted=r["hinted"],
            reward=r["reward"],
            passed=r["passed"],
            failure=r["failure"],
        )
        for r in rows
    ]
