"""Backfills on a real PostgreSQL log: real turns served under filter ``experience-1`` are
derived again under ``experience-2``; the new records land in the experience stream beside the
old ones, a second run appends nothing, a stopped run resumes, and bad requests write
nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from uuid import UUID

import pytest

from core.errors import RangeOutsideLog, UnknownFilterVersion
from core.events import ExperienceRecorded, FeedbackGiven, NewEvent, TenantTrainingSet
from core.log import RecordedEvent
from core.settings import Settings
from infra.artifacts import ArtifactStore
from infra.local_stack import LocalStack
from infra.postgres.db import Pool, open_pool
from infra.postgres.eventlog import PostgresEventLog
from infra.postgres.runs import dataset_snapshot
from learners.runtime import SnapshotMismatch
from learners.training.snapshots import materialize
from macaron import wiring
from server.releases import ensure_root_release
from streams.backfill import Backfill, BackfillRequest, Progress, backfill
from streams.host import ProcessorHost
from streams.runner import catch_up
from streams.trigger import train_now
from tests.conftest import fresh_database
from tests.factories import run_macaron
from tests.integration.test_streams import HIGH_THRESHOLD, conversation_events, copy

__all__ = ["conversation_events"]  # the module fixture: real turns over the WebSocket


@dataclass
class Served:
    """The turns of ``conversation_events`` in a fresh database, derived live under
    ``experience-1``."""

    settings: Settings
    pool: Pool
    log: PostgresEventLog
    hosts: list[ProcessorHost]

    def backfill(self, request: BackfillRequest, progress: Progress | None = None) -> Backfill:
        keys = wiring.data_keys(self.settings, self.pool)
        return backfill(self.log, self.pool, keys, request, progress)

    def catch_up(self) -> None:
        for _ in range(2):  # a second pass takes the derived events
            for host in self.hosts:
                catch_up(host)

    def records(self, version: str) -> list[RecordedEvent]:
        return [
            e
            for e in self.log.read(types=["ExperienceRecorded"])
            if isinstance(e.payload, ExperienceRecorded) and e.payload.filter_version == version
        ]

    def env(self) -> dict[str, str]:
        dumped = self.settings.model_dump(exclude_none=True)
        return {f"MACARON_{k.upper()}": str(v) for k, v in dumped.items()}


@contextmanager
def served_v1(
    stack: LocalStack, events: list[RecordedEvent], home: Path, model: Path
) -> Iterator[Served]:
    """The turns, copied into a fresh database with a root release (its own adapters), and
    derived live under ``experience-1``."""
    with fresh_database(stack) as url, open_pool(url) as pool:
        settings = Settings(
            home=home,
            database_url=url,
            train_threshold=HIGH_THRESHOLD,
            experience_filter="experience-1",
        )
        log = PostgresEventLog(pool, url)
        log.append(copy(events))
        ensure_root_release(
            pool,
            log,
            ArtifactStore(home / "adapters"),
            model,
            "router-test",
            ("chat", "coding", "agent", "genui"),
        )
        served = Served(settings, pool, log, wiring.processor_hosts(settings, log, pool))
        served.catch_up()
        yield served


@pytest.fixture
def served(
    stack: LocalStack,
    conversation_events: list[RecordedEvent],
    tiny_model: Path,
    tmp_path: Path,
) -> Iterator[Served]:
    """The turns in a fresh database, derived live under ``experience-1``."""
    with served_v1(stack, conversation_events, tmp_path, tiny_model) as found:
        yield found


def test_a_backfill_derives_past_traffic_under_a_new_filter(served: Served) -> None:
    v1 = served.records("experience-1")
    ups = {
        e.envelope.event_id
        for e in served.log.read(types=["FeedbackGiven"])
        if isinstance(e.payload, FeedbackGiven) and e.payload.kind == "up"
    }
    assert v1 and ups
    rewarded_v1 = {cause for kind, cause, _ in facts(v1) if kind == "trajectory"}
    assert not rewarded_v1 & ups  # under experience-1 a thumbs up rewards nothing
    end = served.log.end_positions()

    outcome = served.backfill(BackfillRequest("experience-2"))

    v2 = served.records("experience-2")
    assert outcome.records == len(v2) > len(v1)
    assert all(e.envelope.correlation_id == outcome.backfill_id for e in v2)
    assert all(e.position.offset >= end[e.position.partition] for e in v2)  # appended
    rewarded = {cause for kind, cause, _ in facts(v2) if kind == "trajectory"}
    assert ups <= rewarded  # records for events that gave none before
    new = [r for k, cause, r in facts(v2) if cause in ups and k == "trajectory"]
    assert {json.loads(r)["reward"] for r in new} == {1.0}
    assert set(facts(v1)) < set(facts(v2))  # experience-1's records, derived again
    assert served.records("experience-1") == v1  # nothing old rewritten

    served.catch_up()  # the trigger counts the new version's records apart
    with served.pool.connection() as conn:
        pending = conn.execute(
            "SELECT specialist, filter_version, backfills FROM trigger_state "
            "WHERE filter_version = 'experience-2'"
        ).fetchall()
        assert pending and all(r["backfills"] == [outcome.backfill_id] for r in pending)

    later = served.log.end_positions()
    assert served.backfill(BackfillRequest("experience-2", end=end)).already_done
    overlapping = served.backfill(BackfillRequest("experience-2", start={0: 5}, end=end))
    assert overlapping.records == 0 and not overlapping.already_done
    assert served.log.end_positions() == later  # idempotent: nothing appended

    assert_trained_on_the_backfill(served, outcome.backfill_id)


def assert_trained_on_the_backfill(served: Served, backfill_id: Any) -> None:
    """``train_now`` snapshots the chat records the backfill appended, naming it; the snapshot
    replays to its hash, and not once its hash is tampered with."""
    with served.pool.connection() as conn, conn.transaction():
        request = train_now(conn, "chat", "experience-2")
    snapshot = request.snapshot
    assert snapshot.filter_version == "experience-2" and snapshot.backfills == (backfill_id,)
    with served.pool.connection() as conn:
        stored = dataset_snapshot(conn, snapshot.snapshot_id)
    assert stored is not None
    replayed = materialize(served.log, stored)
    assert len(replayed.records) >= snapshot.record_count > 0
    assert {r.filter_version for r in replayed.records} == {"experience-2"}
    with pytest.raises(SnapshotMismatch) as caught:
        materialize(served.log, replace(stored, content_hash="0" * 64))
    assert caught.value.code == "snapshot_mismatch"


def test_a_stopped_backfill_resumes_without_duplicates(
    stack: LocalStack,
    conversation_events: list[RecordedEvent],
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    with served_v1(stack, conversation_events, tmp_path / "clean", tiny_model) as clean:
        whole = clean.backfill(BackfillRequest("experience-2"))
        expected = [e.payload.experience_id for e in clean.records("experience-2")]  # type: ignore[attr-defined]
    with served_v1(stack, conversation_events, tmp_path / "stopped", tiny_model) as served:
        batches = 0

        def stop_after_two(done: int, total: int) -> None:
            nonlocal batches
            batches += 1
            if batches == 2:
                raise KeyboardInterrupt  # a kill between two batches

        with pytest.raises(KeyboardInterrupt):
            served.backfill(
                BackfillRequest("experience-2", batch=7),
                progress=stop_after_two,
            )
        partial = served.records("experience-2")
        with served.pool.connection() as conn:
            [row] = conn.execute("SELECT status, schema_name FROM experience_backfills").fetchall()
        assert row["status"] == "running"

        resumed = served.backfill(BackfillRequest("experience-2", batch=7))
        assert resumed.resumed and resumed.backfill_id == whole.backfill_id
        found = [e.payload.experience_id for e in served.records("experience-2")]  # type: ignore[attr-defined]
        assert sorted(found) == sorted(expected) and len(set(found)) == len(found)
        assert resumed.records == whole.records == len(found) > len(partial)
        with served.pool.connection() as conn:
            left = conn.execute(
                "SELECT 1 FROM information_schema.schemata WHERE schema_name = %s",
                (row["schema_name"],),
            ).fetchall()
            positions = conn.execute(
                "SELECT 1 FROM processor_positions WHERE processor LIKE 'backfill:%'"
            ).fetchall()
        assert left == [] and positions == []  # its join state goes when it is done


def test_a_tenant_that_does_not_teach_now_gives_no_backfilled_record(served: Served) -> None:
    """Its traffic taught back then (experience-1 has records of it); set not to teach since,
    none of it is derived again."""
    [tenant] = {e.envelope.tenant_id for e in served.records("experience-1")}
    served.log.append(
        [NewEvent(payload=TenantTrainingSet(training=False), tenant_id=tenant, key="tenants")]
    )
    served.catch_up()
    outcome = served.backfill(BackfillRequest("experience-2"))
    assert outcome.records == 0 and served.records("experience-2") == []


def test_bad_backfills_write_nothing(served: Served) -> None:
    end = served.log.end_positions()
    with pytest.raises(UnknownFilterVersion):
        served.backfill(BackfillRequest("experience-9"))
    with pytest.raises(RangeOutsideLog):
        served.backfill(
            BackfillRequest("experience-2", end={0: end[0] + 1}),
        )
    with pytest.raises(RangeOutsideLog):
        served.backfill(
            BackfillRequest("experience-2", start={0: 9}, end={0: 3}),
        )
    env = served.env()  # the command line: typed errors, exit status 1
    for args, code in [
        (["--filter-version", "experience-9"], "unknown_filter_version"),
        (["--filter-version", "experience-2", "--to", str(end[0] + 5)], "range_outside_log"),
    ]:
        refused = run_macaron("replay", "experience", *args, **env)
        assert refused.returncode == 1 and code in refused.stderr, refused.stderr
    untrained = run_macaron("train", "chat", "--filter-version", "experience-2", **env)
    assert untrained.returncode == 1 and "nothing_to_train" in untrained.stderr
    assert served.log.end_positions() == end
    with served.pool.connection() as conn:
        assert conn.execute("SELECT * FROM experience_backfills").fetchall() == []
        assert conn.execute("SELECT * FROM dataset_snapshots").fetchall() == []

    done = run_macaron("replay", "experience", "--filter-version", "experience-2", "--json", **env)
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert shown["filter_version"] == "experience-2" and shown["records"] > 0
    assert shown["from"] == {"0": 0} and shown["to"] == {"0": end[0]}


def facts(events: list[RecordedEvent]) -> list[tuple[str, UUID | None, str]]:
    """Each record's kind, source event and content (as canonical JSON)."""
    found: list[tuple[str, UUID | None, str]] = []
    for event in events:
        assert isinstance(event.payload, ExperienceRecorded)
        record = json.dumps(event.payload.record, sort_keys=True)
        found.append((event.payload.kind, event.envelope.causation_id, record))
    return found
