"""The event-log contract against PostgreSQL, plus what only PostgreSQL promises."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Json

from core.errors import SequenceConflict
from core.events.chain import verify_chain
from core.events.privacy import Cipher
from core.log import EventLog, RecordedEvent
from infra.postgres.db import Pool
from infra.postgres.eventlog import PostgresEventLog
from tests.contract.eventlog_contract import EventLogContract
from tests.factories import data_keys_for, inject_postgres, turn


class TestPostgresEventLog(EventLogContract):
    @pytest.fixture
    def log(self, pool: Pool, database_url: str) -> Iterator[PostgresEventLog]:
        self.keys = data_keys_for(pool)
        log = PostgresEventLog(pool, database_url, Cipher(self.keys))
        yield log
        log.close()

    @pytest.fixture(autouse=True)
    def _url(self, database_url: str) -> None:
        self.database_url = database_url

    def inject(self, log: EventLog, envelope: dict[str, Any]) -> None:
        inject_postgres(self.database_url, envelope)

    def tamper(self, log: EventLog, record: RecordedEvent, payload: dict[str, Any]) -> None:
        """Storage-level access: bypass the append-only trigger, as a superuser could."""
        with psycopg.connect(self.database_url) as conn:
            conn.execute("SET session_replication_role = replica")
            conn.execute(
                "UPDATE events SET payload = %s WHERE event_id = %s",
                (Json(payload), record.envelope.event_id),
            )

    def test_stored_events_are_append_only(self, log: PostgresEventLog) -> None:
        [record] = log.append([turn(f"conv-{uuid.uuid4()}")])
        with psycopg.connect(self.database_url) as conn:
            with pytest.raises(psycopg.errors.RestrictViolation):
                conn.execute(
                    "UPDATE events SET payload = '{}' WHERE event_id = %s",
                    (record.envelope.event_id,),
                )
            conn.rollback()
            with pytest.raises(psycopg.errors.RestrictViolation):
                conn.execute("DELETE FROM events")
            conn.rollback()
            with pytest.raises(psycopg.errors.RestrictViolation):
                conn.execute("TRUNCATE events")

    def test_tailer_never_skips_with_concurrent_appenders(self, log: PostgresEventLog) -> None:
        """Appenders on many keys race; a tailer must see every event exactly once, in
        position order (the gap a later-committing lower position would leave)."""
        per_writer, writers = 40, 4
        errors: list[BaseException] = []

        def writer(w: int) -> None:
            try:
                for n in range(per_writer):
                    log.append([turn(f"conv-{w}-{n % 3}", n)])
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
        seen: list[RecordedEvent] = []
        tail = log.tail(idle_timeout=0.2)
        for t in threads:
            t.start()
        idle = 0
        for item in tail:
            if item is None:
                idle += 1
            else:
                seen.append(item)
            if len(seen) == per_writer * writers or idle > 100:
                break
        tail.close()
        for t in threads:
            t.join()
        assert errors == []
        positions = [r.position.offset for r in seen]
        assert len(seen) == per_writer * writers
        assert positions == sorted(positions)
        assert len(set(positions)) == len(positions)
        assert {r.envelope.event_id for r in seen} == {r.envelope.event_id for r in log.read()}

    def test_two_writers_with_their_own_head_caches_stay_chained(
        self, log: PostgresEventLog, pool: Pool, database_url: str
    ) -> None:
        """Each log instance remembers the heads it wrote; when the other writer moved a head,
        the optimistic insert is refused by the unique constraint and the checked path runs."""
        other = PostgresEventLog(pool, database_url, Cipher(self.keys))
        key = f"conv-{uuid.uuid4()}"
        for n in range(6):
            (log if n % 2 else other).append([turn(key, n)])
        repeat = turn(key, 99)
        log.append([repeat])
        other.append([repeat])  # a repeat through the writer that never saw it: idempotent
        records = list(log.read(key=key))
        assert [r.envelope.sequence for r in records] == list(range(1, 8))
        assert verify_chain(r.envelope for r in records) == []
        with pytest.raises(SequenceConflict):
            other.append([turn(key, 100, sequence=3)])
