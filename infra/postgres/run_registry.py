"""``RunRegistry`` on PostgreSQL: each call one transaction on a pooled connection, over the
``training_runs``, ``dataset_snapshots`` and ``adapter_versions`` tables."""

from __future__ import annotations

from dataclasses import replace
from uuid import UUID

from core.registry import (
    AdapterVersion,
    DatasetSnapshot,
    NewAdapterVersion,
    QueuedRun,
    RunOutput,
    RunResult,
    TrainingRun,
)
from core.release import AdapterRef
from core.run_registry import Candidate
from infra.postgres import registry, runs
from infra.postgres.db import Pool


class PostgresRunRegistry:
    def __init__(self, pool: Pool) -> None:
        self._pool = pool

    def register_adapter(self, adapter: NewAdapterVersion) -> AdapterRef:
        with self._pool.connection() as conn, conn.transaction():
            return registry.register_adapter(conn, adapter)

    def adapter(self, adapter_version_id: int) -> AdapterVersion | None:
        with self._pool.connection() as conn:
            return registry.adapter_version(conn, adapter_version_id)

    def record_snapshot(self, snapshot: DatasetSnapshot) -> None:
        with self._pool.connection() as conn, conn.transaction():
            runs.record_snapshot(conn, snapshot)

    def snapshot(self, snapshot_id: UUID) -> DatasetSnapshot | None:
        with self._pool.connection() as conn:
            return runs.dataset_snapshot(conn, snapshot_id)

    def queue(self, run: QueuedRun) -> bool:
        with self._pool.connection() as conn, conn.transaction():
            return runs.queue_run(conn, run)

    def claim(self, run_id: UUID, lease_seconds: int) -> TrainingRun | None:
        with self._pool.connection() as conn, conn.transaction():
            return runs.claim_run(conn, run_id, lease_seconds)

    def renew_lease(self, run_id: UUID, lease_seconds: int) -> None:
        with self._pool.connection() as conn, conn.transaction():
            runs.renew_lease(conn, run_id, lease_seconds)

    def run(self, run_id: UUID) -> TrainingRun | None:
        with self._pool.connection() as conn:
            return runs.training_run(conn, run_id)

    def result(self, run_id: UUID) -> RunResult | None:
        with self._pool.connection() as conn:
            return runs.run_result(conn, run_id)

    def fail(self, run_id: UUID, error: str) -> None:
        with self._pool.connection() as conn, conn.transaction():
            runs.fail_run(conn, run_id, error)

    def record_candidate(self, run_id: UUID, candidate: Candidate, output: RunOutput) -> AdapterRef:
        c = candidate
        with self._pool.connection() as conn, conn.transaction():
            adapter = registry.register_adapter(
                conn,
                NewAdapterVersion(
                    specialist=c.specialist,
                    version=registry.next_adapter_version(conn, c.specialist),
                    parent_id=c.parent_id,
                    sha256=c.sha256,
                    path=c.path,
                    rank=c.rank,
                    base_model=c.base_model,
                ),
            )
            made = replace(output, adapter_version_id=adapter.adapter_version_id)
            runs.finish_run(conn, run_id, made)
        return adapter
