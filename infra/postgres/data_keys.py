"""Tenants' data keys in PostgreSQL (``tenant_data_keys``, migration 0016), wrapped by the
master keys: the ``DataKeys`` port of ``core.events.privacy``.

Unwrapped keys are cached in the process. Which tenants are forgotten is read again at most
every ``FORGOTTEN_TTL`` seconds, so a tenant forgotten by another process stops opening here
within that time; the processors also erase its rows when they meet ``TenantForgotten``.
"""

from __future__ import annotations

import threading
import time
import uuid
from uuid import UUID

from psycopg.rows import DictRow

from core.errors import InvalidEvent, TenantForgotten
from core.events.privacy import DataKey
from infra.master_key import MasterKeys
from infra.postgres.db import DictConnection, Pool, unavailable_as_typed

FORGOTTEN_TTL = 1.0


def _context(tenant_id: str, key_id: UUID) -> bytes:
    return f"{tenant_id}\x1f{key_id}".encode()


def wrapping_master_ids(pool: Pool) -> frozenset[str]:
    """The ids of the master keys that wrap the stored data keys."""
    with unavailable_as_typed(), pool.connection() as conn:
        rows = conn.execute(
            "SELECT DISTINCT master_key_id FROM tenant_data_keys WHERE wrapped IS NOT NULL"
        ).fetchall()
    return frozenset(str(r["master_key_id"]) for r in rows)


class PostgresDataKeys:
    def __init__(self, pool: Pool, master: MasterKeys) -> None:
        self._pool = pool
        self._master = master
        self._keys: dict[str, DataKey] = {}
        self._forgotten: frozenset[str] = frozenset()
        self._read_at = float("-inf")
        self._lock = threading.Lock()

    def check_master(self) -> None:
        """Unwrap one stored data key of each master key that wraps any: a master key file
        that lacks one of them, or is not the one they were wrapped with, refuses start-up
        here (``master_key_invalid``), before anything is read or written."""
        with unavailable_as_typed(), self._pool.connection() as conn:
            rows = conn.execute(
                "SELECT DISTINCT ON (master_key_id) tenant_id, key_id, master_key_id, wrapped "
                "FROM tenant_data_keys WHERE wrapped IS NOT NULL ORDER BY master_key_id, created_at"
            ).fetchall()
        for row in rows:
            self._unwrap(row)

    def writing_key(self, tenant_id: str) -> DataKey:
        if self.is_forgotten(tenant_id):
            raise TenantForgotten(f"tenant {tenant_id!r} was forgotten: nothing more is stored")
        key = self._keys.get(tenant_id)
        if key is not None:
            return key
        fresh = DataKey.new(uuid.uuid4())
        master_id, wrapped = self._master.wrap(fresh.secret, _context(tenant_id, fresh.key_id))
        with unavailable_as_typed(), self._pool.connection() as conn:
            conn.execute(
                "INSERT INTO tenant_data_keys (tenant_id, key_id, master_key_id, wrapped) "
                "VALUES (%s, %s, %s, %s) ON CONFLICT (tenant_id) DO NOTHING",
                (tenant_id, fresh.key_id, master_id, wrapped),
            )
            row = self._row(conn, tenant_id)
        if row is None or row["wrapped"] is None:
            raise TenantForgotten(f"tenant {tenant_id!r} was forgotten: nothing more is stored")
        return self._unwrap(row)

    def reading_key(self, tenant_id: str, key_id: UUID) -> DataKey | None:
        key = self._keys.get(tenant_id)
        if key is not None and key.key_id == key_id and not self.is_forgotten(tenant_id):
            return key
        with unavailable_as_typed(), self._pool.connection() as conn:
            row = self._row(conn, tenant_id)
        if row is not None and row["wrapped"] is None:
            return None  # forgotten
        if row is None or row["key_id"] != key_id:
            raise InvalidEvent(
                f"no data key {key_id} for tenant {tenant_id!r} here: is this the database the "
                "log was written with?"
            )
        return self._unwrap(row)

    def is_forgotten(self, tenant_id: str) -> bool:
        if time.monotonic() - self._read_at > FORGOTTEN_TTL:
            self._read_forgotten()
        return tenant_id in self._forgotten

    def forget(self, tenant_id: str) -> bool:
        """Destroy the tenant's data key, keeping its row so the id is never keyed again;
        ``False`` if it was forgotten already."""
        with unavailable_as_typed(), self._pool.connection() as conn:
            row = conn.execute(
                "SELECT forgotten_at FROM tenant_data_keys WHERE tenant_id = %s FOR UPDATE",
                (tenant_id,),
            ).fetchone()
            if row is not None and row["forgotten_at"] is not None:
                return False
            conn.execute(
                "INSERT INTO tenant_data_keys (tenant_id, key_id, forgotten_at) "
                "VALUES (%s, %s, now()) ON CONFLICT (tenant_id) DO UPDATE SET wrapped = NULL, "
                "master_key_id = NULL, forgotten_at = now()",
                (tenant_id, uuid.uuid4()),
            )
        self._read_forgotten()
        return True

    def rewrap(self) -> int:
        """Wrap every live data key with the current master key; returns how many changed."""
        changed = 0
        with unavailable_as_typed(), self._pool.connection() as conn:
            rows = conn.execute(
                "SELECT tenant_id, key_id, master_key_id, wrapped FROM tenant_data_keys "
                "WHERE wrapped IS NOT NULL AND master_key_id <> %s",
                (self._master.current,),
            ).fetchall()
            for row in rows:
                key = self._unwrap(row)
                context = _context(row["tenant_id"], key.key_id)
                master_id, wrapped = self._master.wrap(key.secret, context)
                changed += conn.execute(
                    "UPDATE tenant_data_keys SET master_key_id = %s, wrapped = %s "
                    "WHERE tenant_id = %s AND wrapped IS NOT NULL",
                    (master_id, wrapped, row["tenant_id"]),
                ).rowcount
        return changed

    # --- inside -----------------------------------------------------------------------------

    @staticmethod
    def _row(conn: DictConnection, tenant_id: str) -> DictRow | None:
        return conn.execute(
            "SELECT tenant_id, key_id, master_key_id, wrapped FROM tenant_data_keys "
            "WHERE tenant_id = %s",
            (tenant_id,),
        ).fetchone()

    def _unwrap(self, row: DictRow) -> DataKey:
        tenant_id, key_id = str(row["tenant_id"]), row["key_id"]
        assert isinstance(key_id, UUID)
        wrapped = row["wrapped"]
        assert isinstance(wrapped, bytes)
        secret = self._master.unwrap(
            str(row["master_key_id"]), wrapped, _context(tenant_id, key_id)
        )
        key = DataKey(key_id, secret)
        with self._lock:
            self._keys[tenant_id] = key
        return key

    def _read_forgotten(self) -> None:
        with unavailable_as_typed(), self._pool.connection() as conn:
            rows = conn.execute(
                "SELECT tenant_id FROM tenant_data_keys WHERE forgotten_at IS NOT NULL"
            ).fetchall()
        forgotten = frozenset(str(r["tenant_id"]) for r in rows)
        with self._lock:
            self._forgotten = forgotten
            for tenant_id in forgotten:
                self._keys.pop(tenant_id, None)
            self._read_at = time.monotonic()
