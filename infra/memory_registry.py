"""``RunRegistry`` over plain Python objects, for unit tests of the learning loop: it passes the
same contract suite as the PostgreSQL registry. One lock makes each call one step; nothing
survives the process."""

from __future__ import annotations

import itertools
import threading
from dataclasses import replace
from datetime import UTC, datetime, timedelta
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


class InMemoryRunRegistry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._adapters: dict[int, AdapterVersion] = {}
        self._snapshots: dict[UUID, DatasetSnapshot] = {}
        self._runs: dict[UUID, TrainingRun] = {}
        self._leases: dict[UUID, datetime] = {}

    def register_adapter(self, adapter: NewAdapterVersion) -> AdapterRef:
        with self._lock:
            return self._register(adapter)

    def _register(self, adapter: NewAdapterVersion) -> AdapterRef:
        a = adapter
        if any(v.ref.name == f"{a.specialist}@{a.version}" for v in self._adapters.values()):
            raise ValueError(f"{a.specialist}@{a.version} is registered already")
        ref = AdapterRef(
            adapter_version_id=next(self._ids),
            specialist=a.specialist,
            version=a.version,
            sha256=a.sha256,
            path=a.path,
            rank=a.rank,
        )
        self._adapters[ref.adapter_version_id] = AdapterVersion(ref, a.parent_id, a.base_model)
        return ref

    def adapter(self, adapter_version_id: int) -> AdapterVersion | None:
        with self._lock:
            return self._adapters.get(adapter_version_id)

    def record_snapshot(self, snapshot: DatasetSnapshot) -> None:
        with self._lock:
            self._snapshots.setdefault(snapshot.snapshot_id, snapshot)

    def snapshot(self, snapshot_id: UUID) -> DatasetSnapshot | None:
        with self._lock:
            return self._snapshots.get(snapshot_id)

    def queue(self, run: QueuedRun) -> bool:
        with self._lock:
            in_flight = any(
                r.specialist == run.specialist and r.status in ("queued", "running")
                for r in self._runs.values()
            )
            if run.run_id in self._runs or in_flight:
                return False
            self._runs[run.run_id] = TrainingRun(
                run_id=run.run_id,
                specialist=run.specialist,
                parent_adapter_id=run.parent_adapter_id,
                snapshot_id=run.snapshot_id,
                kind=run.kind,
                recipe=run.recipe,
                status="queued",
                unlearning=run.unlearning,
                created_at=datetime.now(UTC),
            )
            return True

    def claim(self, run_id: UUID, lease_seconds: int) -> TrainingRun | None:
        with self._lock:
            run = self._runs.get(run_id)
            now = datetime.now(UTC)
            lapsed = run is not None and run.status == "running" and self._leases[run_id] < now
            if run is None or not (run.status == "queued" or lapsed):
                return None
            self._runs[run_id] = run = replace(run, status="running")
            self._leases[run_id] = now + timedelta(seconds=lease_seconds)
            return run

    def renew_lease(self, run_id: UUID, lease_seconds: int) -> None:
        with self._lock:
            if run_id in self._leases:
                self._leases[run_id] = datetime.now(UTC) + timedelta(seconds=lease_seconds)

    def run(self, run_id: UUID) -> TrainingRun | None:
        with self._lock:
            return self._runs.get(run_id)

    def result(self, run_id: UUID) -> RunResult | None:
        with self._lock:
            run = self._runs.get(run_id)
            if run is None:
                return None
            made = None if run.result_adapter_id is None else self._adapters[run.result_adapter_id]
            return RunResult(
                status=run.status,
                specialist=None if made is None else made.ref.specialist,
                version=None if made is None else made.ref.version,
                harness_version=run.result_harness_version,
            )

    def fail(self, run_id: UUID, error: str) -> None:
        with self._lock:
            run = self._runs[run_id]
            self._runs[run_id] = replace(run, status="failed", error=error)

    def record_candidate(self, run_id: UUID, candidate: Candidate, output: RunOutput) -> AdapterRef:
        c = candidate
        with self._lock:
            run = self._runs[run_id]
            versions = [
                v.ref.version for v in self._adapters.values() if v.ref.specialist == c.specialist
            ]
            adapter = self._register(
                NewAdapterVersion(
                    specialist=c.specialist,
                    version=max(versions, default=0) + 1,
                    parent_id=c.parent_id,
                    sha256=c.sha256,
                    path=c.path,
                    rank=c.rank,
                    base_model=c.base_model,
                )
            )
            self._leases.pop(run_id, None)
            self._runs[run_id] = replace(
                run,
                status="succeeded",
                result_adapter_id=adapter.adapter_version_id,
                result_harness_version=output.harness_version,
                metrics=dict(output.metrics),
                recipe=output.recipe or run.recipe,
            )
            return adapter
