"""API keys in PostgreSQL (``tenants`` and ``api_keys``, migration 0002): only hashes stored."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from uuid import UUID

import psycopg

from core.auth import Principal, Scope, key_hash, new_key
from core.errors import ConfigError, InvalidApiKey, TenantForgotten
from infra.postgres.db import DictConnection
from infra.postgres.erasure import forgotten


@dataclass(frozen=True)
class KeyRecord:
    key_id: UUID
    tenant_id: str
    scopes: tuple[str, ...]
    created_at: datetime
    revoked_at: datetime | None


def create_key(conn: DictConnection, tenant_id: str, scopes: set[Scope]) -> tuple[UUID, str]:
    """Make a key for ``tenant_id`` (the tenant is created if new); returns (key id, the key).
    The key itself is not stored and cannot be shown again."""
    if not scopes:
        raise ConfigError("a key needs at least one scope (chat, admin)")
    if forgotten(conn, tenant_id):
        raise TenantForgotten(f"tenant {tenant_id!r} was forgotten: its id takes no new key")
    key, key_id = new_key(), uuid.uuid4()
    try:
        with conn.transaction():
            conn.execute(
                "INSERT INTO tenants (tenant_id, name) VALUES (%s, %s) ON CONFLICT DO NOTHING",
                (tenant_id, tenant_id),
            )
            conn.execute(
                "INSERT INTO api_keys (key_id, tenant_id, key_hash, scopes) "
                "VALUES (%s, %s, %s, %s)",
                (key_id, tenant_id, key_hash(key), sorted(scopes)),
            )
    except psycopg.errors.CheckViolation as exc:
        raise ConfigError(f"invalid tenant or scopes: {exc.diag.message_primary}") from exc
    return key_id, key


def authenticate(conn: DictConnection, key: str) -> Principal:
    """The principal a live key stands for; ``InvalidApiKey`` for anything else."""
    row = conn.execute(
        "SELECT key_id, tenant_id, scopes FROM api_keys WHERE key_hash = %s AND revoked_at IS NULL",
        (key_hash(key),),
    ).fetchone()
    if row is None:
        raise InvalidApiKey("the API key is unknown or revoked")
    return Principal(
        tenant_id=row["tenant_id"], key_id=row["key_id"], scopes=frozenset(row["scopes"])
    )


def revoke_key(conn: DictConnection, key_id: UUID) -> bool:
    """Revoke a key; returns whether a live key was revoked."""
    with conn.transaction():
        done = conn.execute(
            "UPDATE api_keys SET revoked_at = now() WHERE key_id = %s AND revoked_at IS NULL",
            (key_id,),
        ).rowcount
    return done == 1


def list_keys(conn: DictConnection, tenant_id: str | None = None) -> list[KeyRecord]:
    rows = conn.execute(
        "SELECT key_id, tenant_id, scopes, created_at, revoked_at FROM api_keys "
        "WHERE %(tenant)s::text IS NULL OR tenant_id = %(tenant)s ORDER BY created_at",
        {"tenant": tenant_id},
    ).fetchall()
    return [
        KeyRecord(r["key_id"], r["tenant_id"], tuple(r["scopes"]), r["created_at"], r["revoked_at"])
        for r in rows
    ]
