"""Who may come in: API keys checked against the registry, scopes, and open connections per
tenant."""

from __future__ import annotations

import asyncio
from collections import Counter

from core.auth import Principal, Scope
from core.errors import TooManyConnections
from infra.postgres.db import Pool
from infra.postgres.keys import authenticate


class Gate:
    def __init__(self, pool: Pool, *, max_connections_per_tenant: int = 100) -> None:
        self.pool = pool
        self.max_connections_per_tenant = max_connections_per_tenant
        self._open: Counter[str] = Counter()

    async def authenticate(self, key: str, scope: Scope) -> Principal:
        """The principal behind a live key that grants ``scope``."""
        principal = await self.identify(key)
        return principal.require(scope)

    async def identify(self, key: str) -> Principal:
        """The principal behind a live key, whatever it grants."""

        def lookup() -> Principal:
            with self.pool.connection() as conn:
                return authenticate(conn, key)

        return await asyncio.to_thread(lookup)

    def enter(self, principal: Principal) -> None:
        if self._open[principal.tenant_id] >= self.max_connections_per_tenant:
            raise TooManyConnections(
                f"tenant {principal.tenant_id} has {self.max_connections_per_tenant} open "
                "connections already"
            )
        self._open[principal.tenant_id] += 1

    def leave(self, principal: Principal) -> None:
        self._open[principal.tenant_id] -= 1
        if self._open[principal.tenant_id] <= 0:
            del self._open[principal.tenant_id]
