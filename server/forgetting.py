"""Forgetting a tenant (``macaron tenants forget``, ``DELETE /admin/tenants/{id}``).

The tenant's words in the log are sealed with its data key (``core.events.privacy``).
Forgetting does four things, in an order that a process killed half-way can run again:
1. It appends ``TenantForgotten``. Its event id is derived from the tenant, so a rerun appends
   nothing new.
2. It destroys the data key. From then on every event of the tenant reads as ``Forgotten``,
   and nothing more of it can be written.
3. It revokes the tenant's API keys.
4. It erases the tenant's rows from the projections, the experience tables and the live
   scores. The
   processors erase them again when they meet the event, so rows from events they were still
   handling do not outlive it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from uuid import UUID

from core.errors import ConfigError, TenantNotFound
from core.events import NewEvent, TenantForgotten
from core.events.tenants import SYSTEM_TENANT
from core.ids import derived_id
from core.log import EventLog
from infra.postgres.data_keys import PostgresDataKeys
from infra.postgres.db import Pool
from infra.postgres.erasure import (
    erase_experience_rows,
    erase_projection_rows,
    erase_score_rows,
    forgotten,
    revoke_tenant_keys,
)
from infra.postgres.experience_joins import tenant_exists

FORGOTTEN_KEY = "tenants:forgotten"


@dataclass(frozen=True)
class ForgetOutcome:
    tenant_id: str
    event_id: UUID
    already: bool
    """The tenant was forgotten before this call: nothing was destroyed now."""
    keys_revoked: int
    rows_erased: dict[str, int] = field(default_factory=dict)


def forget_tenant(
    pool: Pool, log: EventLog, keys: PostgresDataKeys, tenant_id: str
) -> ForgetOutcome:
    """Forget ``tenant_id`` (``TenantNotFound`` for a tenant that never had a key)."""
    if tenant_id == SYSTEM_TENANT:
        raise ConfigError("the system tenant holds the releases' history: it is never forgotten")
    with pool.connection() as conn:
        if not (tenant_exists(conn, tenant_id) or forgotten(conn, tenant_id)):
            raise TenantNotFound(f"no tenant {tenant_id!r}: tenants come with their API keys")
    event_id = derived_id("tenant-forgotten", tenant_id)
    log.append(
        [
            NewEvent(
                payload=TenantForgotten(tenant=tenant_id),
                tenant_id=SYSTEM_TENANT,
                key=FORGOTTEN_KEY,
                event_id=event_id,
            )
        ]
    )
    destroyed = keys.forget(tenant_id)
    with pool.connection() as conn:
        revoked = revoke_tenant_keys(conn, tenant_id)
        erased = {
            **erase_projection_rows(conn, tenant_id),
            **erase_experience_rows(conn, tenant_id),
            **erase_score_rows(conn, tenant_id),
        }
    return ForgetOutcome(tenant_id, event_id, not destroyed, revoked, erased)
