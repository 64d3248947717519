"""Erasing a forgotten tenant's rows: from each processor's tables (called by the processor when
it meets ``TenantForgotten``, and at once by ``forget``), and its API keys revoked. Each call is
idempotent; each returns the rows it removed, by table. And the record of adapter versions whose
weights were erased (``adapter_erasures``; ``server.erasure.erase_replaced``)."""

from __future__ import annotations

from collections.abc import Collection

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


def record_erasures(conn: DictConnection, adapter_version_ids: Collection[int], reason: str) -> int:
    """Say that these adapter versions' weights are erased (idempotent); returns how many were
    not said to be before."""
    return sum(
        conn.execute(
            "INSERT INTO adapter_erasures (adapter_version_id, reason) VALUES (%s, %s) "
            "ON CONFLICT (adapter_version_id) DO NOTHING",
            (adapter_version_id, reason),
        ).rowcount
        for adapter_version_id in sorted(adapter_version_ids)
    )


def erased_adapters(conn: DictConnection) -> dict[int, str]:
    """The erased adapter versions: id -> why."""
    rows = conn.execute("SELECT adapter_version_id, reason FROM adapter_erasures").fetchall()
    return {int(r["adapter_version_id"]): str(r["reason"]) for r in rows}


def erased_lines(conn: DictConnection, adapter_version_ids: Collection[int]) -> dict[str, str]:
    """Of these adapter versions, those that are erased or descend from an erased version
    (trained from it: they learned what it learned): ``specialist@version`` -> the nearest
    erased one and why."""
    rows = conn.execute(
        "WITH RECURSIVE line (start_id, adapter_version_id, depth) AS ("
        " SELECT adapter_version_id, adapter_version_id, 0 FROM adapter_versions"
        " WHERE adapter_version_id = ANY(%s)"
        " UNION SELECT l.start_id, a.parent_id, l.depth + 1 FROM line l JOIN adapter_versions a"
        " ON a.adapter_version_id = l.adapter_version_id WHERE a.parent_id IS NOT NULL) "
        "SELECT s.specialist || '@' || s.version AS name, "
        "g.specialist || '@' || g.version AS gone, e.reason FROM line l "
        "JOIN adapter_erasures e ON e.adapter_version_id = l.adapter_version_id "
        "JOIN adapter_versions g ON g.adapter_version_id = l.adapter_version_id "
        "JOIN adapter_versions s ON s.adapter_version_id = l.start_id ORDER BY name, l.depth",
        (list(adapter_version_ids),),
    ).fetchall()
    found: dict[str, str] = {}
    for r in rows:
        erased = "erased" if r["name"] == r["gone"] else f"trained from {r['gone']}, erased"
        found.setdefault(str(r["name"]), f"{erased}: {r['reason']}")
    return found


def erased_digests(conn: DictConnection) -> dict[str, list[str]]:
    """The content addresses of erased adapter versions that no other version shares (their
    files may leave the artifact store), each with the names of those versions."""
    rows = conn.execute(
        "SELECT a.sha256, a.specialist || '@' || a.version AS name FROM adapter_versions a "
        "JOIN adapter_erasures e USING (adapter_version_id) WHERE NOT EXISTS (SELECT 1 FROM "
        "adapter_versions o WHERE o.sha256 = a.sha256 AND o.adapter_version_id NOT IN "
        "(SELECT adapter_version_id FROM adapter_erasures)) ORDER BY a.sha256, name"
    ).fetchall()
    found: dict[str, list[str]] = {}
    for r in rows:
        found.setdefault(str(r["sha256"]), []).append(str(r["name"]))
    return found


def leased_adapters(conn: DictConnection) -> set[str]:
    """Adapters a server sharing the vLLM fleet holds a live lease on (``adapter_leases``)."""
    rows = conn.execute("SELECT adapter FROM adapter_leases WHERE expires_at > now()").fetchall()
    return {str(r["adapter"]) for r in rows}
