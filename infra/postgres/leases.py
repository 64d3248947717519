"""Leases on adapter versions for servers sharing one vLLM fleet (``adapter_leases``): a row per
(adapter, server), live until it expires. Holding and letting go of one adapter take the same
transaction-scoped advisory lock, so a server never starts holding an adapter while another
is unloading it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from infra.postgres.db import DictConnection, Pool, unavailable_as_typed

LEASE_TTL_S = 30.0  # a server renews every health check (2 s); one that died lets go after this


def _lock(conn: DictConnection, adapter: str) -> None:
    conn.execute("SELECT pg_advisory_xact_lock(hashtext(%s))", (f"adapter-lease:{adapter}",))


class PostgresAdapterLeases:
    """This server's leases (``holder``: unique per server process)."""

    def __init__(self, pool: Pool, holder: str, ttl_s: float = LEASE_TTL_S) -> None:
        self._pool = pool
        self.holder = holder
        self._ttl_s = ttl_s

    def hold(self, adapters: Iterable[str]) -> None:
        """Hold, or renew, a lease on each of ``adapters``."""
        names = sorted(set(adapters))  # one lock order for every server: no deadlock
        if not names:
            return
        with unavailable_as_typed(), self._pool.connection() as conn:
            for name in names:
                _lock(conn, name)
            conn.cursor().executemany(
                "INSERT INTO adapter_leases (adapter, holder, expires_at) "
                "VALUES (%s, %s, now() + make_interval(secs => %s)) "
                "ON CONFLICT (adapter, holder) DO UPDATE SET expires_at = EXCLUDED.expires_at",
                [(name, self.holder, self._ttl_s) for name in names],
            )

    @contextmanager
    def release(self, adapter: str) -> Iterator[bool]:
        """Let go of ``adapter``; yields True when no other server holds a live lease on it,
        and keeps every server from taking one until the block ends (the unload)."""
        with unavailable_as_typed(), self._pool.connection() as conn:
            _lock(conn, adapter)
            conn.execute(
                "DELETE FROM adapter_leases "
                "WHERE adapter = %s AND (holder = %s OR expires_at <= now())",
                (adapter, self.holder),
            )
            row = conn.execute(
                "SELECT count(*) AS n FROM adapter_leases WHERE adapter = %s", (adapter,)
            ).fetchone()
            yield row is not None and row["n"] == 0
