"""The event-log contract against a real Kafka-protocol broker (Tansu)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kafka import KafkaProducer

from core.canonical import canonical_json
from core.events.privacy import Cipher
from core.log import EventLog, RecordedEvent
from infra.kafka.eventlog import KafkaEventLog
from infra.kafka.topics import create_topics, event_topics
from infra.local_stack import LocalStack
from infra.postgres.db import Pool
from tests.contract.eventlog_contract import EventLogContract
from tests.factories import data_keys_for


class TestKafkaEventLog(EventLogContract):
    @pytest.fixture
    def log(self, stack: LocalStack, pool: Pool) -> Iterator[KafkaEventLog]:
        topic = f"events-{uuid.uuid4().hex[:12]}"
        create_topics(stack.kafka.bootstrap(), event_topics(topic, 3, 1))
        self.keys = data_keys_for(pool)
        log = KafkaEventLog(stack.kafka.bootstrap(), topic, pool, Cipher(self.keys))
        self.topic = topic
        self.pool = pool
        self.producer = KafkaProducer(bootstrap_servers=stack.kafka.bootstrap())
        yield log
        self.producer.close()
        log.close()

    def _send(self, envelope: dict[str, Any]) -> tuple[int, int]:
        meta = self.producer.send(
            self.topic, key=envelope["key"].encode(), value=canonical_json(envelope)
        ).get(timeout=30)
        return meta.partition, meta.offset

    def inject(self, log: EventLog, envelope: dict[str, Any]) -> None:
        """As a writer of another code version would: the record and its index row."""
        partition, offset = self._send(envelope)
        with self.pool.connection() as conn:
            conn.execute(
                "INSERT INTO kafka_appends (event_id, topic, key, sequence, hash, content_digest, "
                'partition, "offset") VALUES (%s, %s, %s, %s, %s, %s, %s, %s)',
                (
                    envelope["event_id"],
                    self.topic,
                    envelope["key"],
                    envelope["sequence"],
                    envelope["hash"],
                    "0" * 64,
                    partition,
                    offset,
                ),
            )

    def tamper(self, log: EventLog, record: RecordedEvent, payload: dict[str, Any]) -> None:
        """A Kafka record cannot be changed in place; the attacker writes a forged copy."""
        self._send({**record.envelope.to_json(), "payload": payload})
