"""Erasing a forgotten tenant's rows: from each processor's tables (called by the processor when
it meets ``TenantForgotten``, and at once by ``forget``), and its API keys revoked. Each call is
idempotent; each returns the rows it removed, by table."""

from __future__ import annotations

from infra.postgres.db import DictConnection


def _delete(conn: DictConnection, sql: str, tenant_id: str) -> int:
    return conn.execute(sql, (tenant_id,)).rowcount


def erase_projection_rows(conn: DictConnection, tenant_id: str) -> dict[str, int]:
    """The tenant's conversations and turns (``streams.projections``)."""
    turns = _delete(conn, "DELETE FROM turns WHERE tenant_id = %s", tenant_id)
    conversations = _delete(conn, "DELETE FROM conversations WHERE tenant_id = %s", tenant_id)
    return {"turns": turns, "conversations": conversations}


def erase_experience_rows(conn: DictConnection, tenant_id: str) -> dict[str, int]:
    """What the experience builder joined of the tenant's turns and conversations, its rollouts
    and its training switch (``streams.experience_rules``)."""
    return {
        "experience_conversations": _erase_conversations(conn, tenant_id),
        "experience_turns": _delete(
            conn, "DELETE FROM experience_turns WHERE tenant_id = %s", tenant_id
        ),
        "experience_rollouts": _delete(
            conn, "DELETE FROM experience_rollouts WHERE tenant_id = %s", tenant_id
        ),
        "experience_tenants": _delete(
            conn, "DELETE FROM experience_tenants WHERE tenant_id = %s", tenant_id
        ),
    }


def _erase_conversations(conn: DictConnection, tenant_id: str) -> int:
    return conn.execute(
        "DELETE FROM experience_conversations WHERE tenant_id = %(t)s OR conversation_id IN "
        "(SELECT conversation_id FROM experience_turns WHERE tenant_id = %(t)s)",
        {"t": tenant_id},
    ).rowcount


def erase_score_rows(conn: DictConnection, tenant_id: str) -> dict[str, int]:
    """The tenant's scored turns (``streams.scores``): they leave the live scores' sums."""
    return {"score_turns": _delete(conn, "DELETE FROM score_turns WHERE tenant_id = %s", tenant_id)}


def revoke_tenant_keys(conn: DictConnection, tenant_id: str) -> int:
    """Revoke the tenant's live API keys; returns how many."""
    return _delete(
        conn,
        "UPDATE api_keys SET revoked_at = now() WHERE tenant_id = %s AND revoked_at IS NULL",
        tenant_id,
    )


def forgotten(conn: DictConnection, tenant_id: str) -> bool:
    """Whether the tenant's data key is destroyed (as ``tenant_data_keys`` says now)."""
    row = conn.execute(
        "SELECT 1 FROM tenant_data_keys WHERE tenant_id = %s AND forgotten_at IS NOT NULL",
        (tenant_id,),
    ).fetchone()
    return row is not None
