"""The run-registry contract against PostgreSQL."""

from __future__ import annotations

import pytest

from core.run_registry import RunRegistry
from infra.postgres.db import Pool
from infra.postgres.registry import ensure_specialists
from infra.postgres.run_registry import PostgresRunRegistry
from tests.contract.run_registry_contract import RunRegistryContract


class TestPostgresRunRegistry(RunRegistryContract):
    @pytest.fixture
    def registry(self, pool: Pool) -> RunRegistry:
        with pool.connection() as conn, conn.transaction():
            ensure_specialists(conn, ["coding", "agent"])
        return PostgresRunRegistry(pool)
