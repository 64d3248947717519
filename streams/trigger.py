"""The training trigger: when a specialist has ``threshold`` new experience records since its
last snapshot and no run in flight, it defines a dataset snapshot (the log range of those
records, the filter version, their content hash), records a queued training run and a
``TrainingRequested`` event, and, after the commit, enqueues the run (task id = run id).

A specialist's records are the events of one key, so one partition in order: the snapshot is
``[start_offset, end_offset)`` there, and its hash chains the records' payload hashes in log
order, which is exactly what replaying that range gives back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from uuid import UUID

from psycopg.types.json import Jsonb

from core.events import ExperienceRecorded, NewEvent, TrainingRequested
from core.experience import EMPTY_CHAIN, FILTER_VERSION, chain_record
from core.ids import derived_id
from core.log import RecordedEvent
from infra.postgres.db import DictConnection

RECIPE = "lora-sft-dpo-1"


class TrainingTrigger:
    name = "training-trigger-1"
    tables: tuple[str, ...] = ("trigger_state",)

    def __init__(self, threshold: int, enqueue: Callable[[UUID, Mapping[str, str]], None]) -> None:
        self.threshold = threshold
        self.enqueue = enqueue

    def handle(self, conn: DictConnection, event: RecordedEvent) -> list[NewEvent]:
        record = event.payload
        if not isinstance(record, ExperienceRecorded) or record.kind == "trajectory":
            return []
        position = event.position
        state = conn.execute(
            "INSERT INTO trigger_state (specialist, partition, start_offset, pending, "
            "running_hash) VALUES (%s, %s, %s, 0, %s) ON CONFLICT (specialist) DO UPDATE "
            "SET specialist = EXCLUDED.specialist RETURNING *",
            (record.specialist, position.partition, position.offset, EMPTY_CHAIN),
        ).fetchone()
        assert state is not None  # RETURNING gives the row
        running = chain_record(state["running_hash"], record)
        pending = state["pending"] + 1
        conn.execute(
            "UPDATE trigger_state SET pending = %s, running_hash = %s WHERE specialist = %s",
            (pending, running, record.specialist),
        )
        if pending < self.threshold or self._in_flight(conn, record.specialist):
            return []
        return self._request(conn, event, record, state["start_offset"], pending, running)

    @staticmethod
    def _in_flight(conn: DictConnection, specialist: str) -> bool:
        row = conn.execute(
            "SELECT 1 FROM training_runs WHERE specialist = %s AND status IN ('queued', 'running')",
            (specialist,),
        ).fetchone()
        return row is not None

    def _request(
        self,
        conn: DictConnection,
        event: RecordedEvent,
        record: ExperienceRecorded,
        start: int,
        count: int,
        content_hash: str,
    ) -> list[NewEvent]:
        partition, end = event.position.partition, event.position.offset + 1
        specialist = record.specialist
        snapshot_id = derived_id("snapshot", specialist, partition, start, end, FILTER_VERSION)
        run_id = derived_id("run", snapshot_id)
        parent = conn.execute(
            "SELECT a.adapter_version_id, a.specialist, a.version FROM releases r "
            "JOIN release_adapters ra USING (release_id) "
            "JOIN adapter_versions a USING (adapter_version_id) "
            "WHERE r.active AND ra.specialist = %s",
            (specialist,),
        ).fetchone()
        # The next record starts the next range (also when there is nothing to improve: the
        # serving release has no adapter for this specialist).
        conn.execute("DELETE FROM trigger_state WHERE specialist = %s", (specialist,))
        if parent is None:
            return []
        conn.execute(
            "INSERT INTO dataset_snapshots (snapshot_id, specialist, start_positions, "
            "end_positions, filter_version, content_hash, record_count) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
            (
                snapshot_id,
                specialist,
                Jsonb({str(partition): start}),
                Jsonb({str(partition): end}),
                FILTER_VERSION,
                content_hash,
                count,
            ),
        )
        conn.execute(
            "INSERT INTO training_runs (run_id, specialist, parent_adapter_id, snapshot_id, "
            "recipe, status) VALUES (%s, %s, %s, %s, %s, 'queued') ON CONFLICT DO NOTHING",
            (run_id, specialist, parent["adapter_version_id"], snapshot_id, RECIPE),
        )
        payload = TrainingRequested(
            run_id=run_id,
            specialist=specialist,
            parent_adapter_version=f"{parent['specialist']}@{parent['version']}",
            snapshot_id=snapshot_id,
            recipe=RECIPE,
        )
        return [
            NewEvent(
                payload=payload,
                tenant_id="system",
                key=f"training.{specialist}",
                event_id=run_id,
                causation_id=event.envelope.event_id,
            )
        ]

    def after_commit(self, derived: Sequence[NewEvent]) -> None:
        for event in derived:
            if isinstance(event.payload, TrainingRequested):
                self.enqueue(event.payload.run_id, event.trace)
