"""The Kafka event log: one topic, key = aggregate key, so each key is totally ordered.

The producer uses ``acks=all`` with idempotence. Kafka cannot refuse a second event at a key's
sequence, so PostgreSQL keeps the log's sequencer and idempotency index (``kafka_appends``):
an append locks its keys there, seals the events on the chain heads, produces them, waits for
the broker's acknowledgement, and records where they landed, in one transaction. If the broker
fails, nothing is recorded; if PostgreSQL fails after the broker acknowledged, the event is in
the topic without its index row, and a retry with the same event id writes it again: readers
see a repeat of the same id at the same sequence, which chain verification skips.

End positions come from that index (and the broker, whichever is further): some
Kafka-protocol brokers report wrong end offsets after multi-record batches.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Generator, Iterator, Mapping, Sequence
from typing import Any
from uuid import UUID

from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.errors import KafkaError
from kafka.partitioner.default import murmur2

from core.errors import EventIdConflict, LogUnavailable
from core.events import Envelope, NewEvent
from core.events.privacy import Cipher
from core.log import DeadLetter, LogPosition, Positions, RecordedEvent, parse_envelope
from core.mapper import Mapper, Sealed
from infra.kafka.topics import dead_letter_topic
from infra.postgres.db import Pool, storage_errors, unavailable_as_typed

SEND_TIMEOUT = 30.0
POLL_MS = 500
STALL_MS = 15_000


def _headers(envelope: Envelope) -> list[tuple[str, bytes]]:
    headers = [
        ("type", envelope.type.encode()),
        ("schema_version", str(envelope.schema_version).encode()),
        ("event_id", str(envelope.event_id).encode()),
    ]
    headers.extend((name, value.encode()) for name, value in sorted(envelope.trace.items()))
    return headers


def _header(headers: Sequence[tuple[str, bytes]] | None, name: str) -> str | None:
    for key, value in headers or ():
        if key == name:
            return value.decode("utf-8", "replace")
    return None


class KafkaEventLog:
    """``EventLog`` over a Kafka topic, with PostgreSQL as sequencer and index."""

    def __init__(
        self, bootstrap: str, topic: str, pool: Pool, cipher: Cipher | None = None
    ) -> None:
        self._mapper = Mapper(cipher)
        self._bootstrap = bootstrap.split(",")
        self._topic = topic
        self._dlq = dead_letter_topic(topic)
        self._pool = pool
        try:
            self._producer = KafkaProducer(
                bootstrap_servers=self._bootstrap,
                acks="all",
                enable_idempotence=True,
                linger_ms=5,
                max_in_flight_requests_per_connection=5,
            )
        except KafkaError as exc:
            raise LogUnavailable(f"Kafka at {bootstrap} is unreachable: {exc}") from exc
        partitions = self._producer.partitions_for(topic)
        if not partitions:
            self._producer.close()
            raise LogUnavailable(f"topic {topic} does not exist: run `macaron kafka topics create`")
        self._partitions: list[int] = sorted(int(p) for p in partitions)

    # --- append -----------------------------------------------------------------------------

    def partition_for(self, key: str) -> int:
        index = int(murmur2(key.encode())) & 0x7FFFFFFF
        return self._partitions[index % len(self._partitions)]

    def append(self, events: Sequence[NewEvent]) -> list[RecordedEvent]:
        if not events:
            return []
        keys = sorted({e.key for e in events})
        self._mapper.warm_keys(events)  # before a connection is held: keys may need one
        with (
            unavailable_as_typed(),
            storage_errors("kafka_appends_key_sequence_key"),
            self._pool.connection() as conn,
            conn.pipeline(),
            conn.transaction(),
        ):
            conn.execute(
                "SELECT pg_advisory_xact_lock(hashtextextended(%s || k, 0)) "
                "FROM (SELECT k FROM unnest(%s::text[]) AS k ORDER BY k) AS sorted",
                (self._topic + "\x1f", keys),
            )
            stored_rows = conn.execute(
                'SELECT event_id, content_digest, partition, "offset" FROM kafka_appends '
                "WHERE event_id = ANY(%s)",
                ([e.event_id for e in events],),
            )
            head_rows = conn.execute(
                "SELECT k.key, h.sequence, h.hash FROM unnest(%s::text[]) AS k(key) "
                "CROSS JOIN LATERAL (SELECT sequence, hash FROM kafka_appends a "
                "WHERE a.topic = %s AND a.key = k.key ORDER BY sequence DESC LIMIT 1) AS h",
                (keys, self._topic),
            )
            stored = {row["event_id"]: row for row in stored_rows.fetchall()}
            heads = {row["key"]: (row["sequence"], row["hash"]) for row in head_rows.fetchall()}
            digests = {i: r["content_digest"] for i, r in stored.items()}
            fresh = self._mapper.seal_batch(events, digests, heads)
            landed = self._produce(fresh)
            if fresh:
                conn.execute(
                    "INSERT INTO kafka_appends (event_id, topic, key, sequence, hash, "
                    'content_digest, partition, "offset") SELECT * FROM unnest(%s::uuid[], '
                    "%s::text[], %s::text[], %s::bigint[], %s::text[], %s::text[], %s::int[], "
                    "%s::bigint[])",
                    [
                        [s.envelope.event_id for s in fresh],
                        [self._topic] * len(fresh),
                        [s.envelope.key for s in fresh],
                        [s.envelope.sequence for s in fresh],
                        [s.envelope.hash for s in fresh],
                        [s.content_digest for s in fresh],
                        [p.partition for p in landed],
                        [p.offset for p in landed],
                    ],
                )
        results: dict[UUID, RecordedEvent] = {
            s.envelope.event_id: RecordedEvent(pos, s.envelope, s.payload)
            for s, pos in zip(fresh, landed, strict=True)
        }
        for event_id, row in stored.items():
            results[event_id] = self._fetch(LogPosition(row["partition"], row["offset"]))
        return [results[e.event_id] for e in events]

    def _produce(self, fresh: list[Sealed]) -> list[LogPosition]:
        try:
            futures = [
                self._producer.send(
                    self._topic,
                    key=s.envelope.key.encode(),
                    value=s.envelope_json(),
                    headers=_headers(s.envelope),
                )
                for s in fresh
            ]
            if futures:
                self._producer.flush(timeout=SEND_TIMEOUT)
            metadata = [f.get(timeout=SEND_TIMEOUT) for f in futures]
        except KafkaError as exc:
            raise LogUnavailable(f"Kafka did not acknowledge the append: {exc}") from exc
        return [LogPosition(m.partition, m.offset) for m in metadata]

    def _fetch(self, position: LogPosition) -> RecordedEvent:
        for record in self._records(
            {position.partition: position.offset}, {position.partition: position.offset + 1}
        ):
            decoded = self._mapper.decode_stored(
                LogPosition(record.partition, record.offset), record.value
            )
            if isinstance(decoded, RecordedEvent):
                return decoded
        raise EventIdConflict(f"indexed event at {position} cannot be read back")

    # --- read -------------------------------------------------------------------------------

    def _consumer(self) -> KafkaConsumer:
        try:
            return KafkaConsumer(
                bootstrap_servers=self._bootstrap,
                group_id=None,
                enable_auto_commit=False,
                auto_offset_reset="earliest",
                consumer_timeout_ms=10_000,
            )
        except KafkaError as exc:
            raise LogUnavailable(f"Kafka is unreachable: {exc}") from exc

    def _records(
        self, start: Mapping[int, int], end: Mapping[int, int], topic: str | None = None
    ) -> Iterator[Any]:
        """Raw records, partition by partition (a deterministic order), in [start, end)."""
        consumer = self._consumer()
        try:
            for partition in sorted(end):
                first, stop = start.get(partition, 0), end[partition]
                if first >= stop:
                    continue
                tp = TopicPartition(topic or self._topic, partition)
                consumer.assign([tp])
                consumer.seek(tp, first)
                offset, idle = first, 0
                while offset < stop:
                    batch = consumer.poll(timeout_ms=POLL_MS).get(tp, [])
                    if not batch:
                        if consumer.position(tp) >= stop:
                            break
                        idle += 1
                        if idle * POLL_MS >= STALL_MS:
                            raise LogUnavailable(
                                f"{tp.topic}[{partition}] gave nothing at offset {offset} "
                                f"(expected up to {stop}) for {STALL_MS / 1000:.0f}s"
                            )
                        continue
                    idle = 0
                    for record in batch:
                        if record.offset >= stop:
                            break
                        yield record
                        offset = record.offset + 1
        except KafkaError as exc:
            raise LogUnavailable(f"Kafka read failed: {exc}") from exc
        finally:
            consumer.close()

    def read(
        self,
        *,
        start: Mapping[int, int] | None = None,
        end: Mapping[int, int] | None = None,
        key: str | None = None,
        types: Collection[str] | None = None,
    ) -> Iterator[RecordedEvent]:
        stop = dict(end or self.end_positions())
        if key is not None:
            only = self.partition_for(key)
            stop = {p: o for p, o in stop.items() if p == only}
        wanted = None if key is None else key.encode()
        for record in self._records(start or {}, stop):
            if wanted is not None and record.key != wanted:
                continue
            if types is not None and _header(record.headers, "type") not in types:
                continue
            yield from self._decoded(record)

    def _decoded(self, record: Any) -> Iterator[RecordedEvent]:
        decoded = self._mapper.decode_stored(
            LogPosition(record.partition, record.offset), record.value
        )
        if isinstance(decoded, DeadLetter):
            self._dead_letter(decoded)
        else:
            yield decoded

    def envelopes(self, *, key: str | None = None) -> Iterator[Envelope]:
        stop = self.end_positions()
        if key is not None:
            stop = {self.partition_for(key): stop[self.partition_for(key)]}
        for record in self._records({}, stop):
            if key is None or record.key == key.encode():
                yield parse_envelope(record.value)

    def tail(
        self, *, start: Mapping[int, int] | None = None, idle_timeout: float = 1.0
    ) -> Generator[RecordedEvent | None, None, None]:
        consumer = self._consumer()
        try:
            tps = [TopicPartition(self._topic, p) for p in self._partitions]
            consumer.assign(tps)
            for tp in tps:
                consumer.seek(tp, (start or {}).get(tp.partition, 0))
            while True:
                batches = consumer.poll(timeout_ms=int(idle_timeout * 1000))
                if not batches:
                    yield None
                    continue
                for tp in sorted(batches, key=lambda t: t.partition):
                    for record in batches[tp]:
                        yield from self._decoded(record)
        except KafkaError as exc:
            raise LogUnavailable(f"Kafka read failed: {exc}") from exc
        finally:
            consumer.close()

    def end_positions(self) -> Positions:
        with unavailable_as_typed(), self._pool.connection() as conn:
            rows = conn.execute(
                'SELECT partition, max("offset") + 1 AS next FROM kafka_appends '
                "WHERE topic = %s GROUP BY partition",
                (self._topic,),
            ).fetchall()
        indexed = {row["partition"]: int(row["next"]) for row in rows}
        broker = self._broker_ends(self._topic, self._partitions)
        return {p: max(indexed.get(p, 0), broker.get(p, 0)) for p in self._partitions}

    def _broker_ends(self, topic: str, partitions: list[int]) -> dict[int, int]:
        consumer = self._consumer()
        try:
            ends = consumer.end_offsets([TopicPartition(topic, p) for p in partitions])
            return {tp.partition: int(offset) for tp, offset in ends.items()}
        except KafkaError as exc:
            raise LogUnavailable(f"Kafka is unreachable: {exc}") from exc
        finally:
            consumer.close()

    # --- dead letters -----------------------------------------------------------------------

    def _dead_letter(self, letter: DeadLetter) -> None:
        """One record per flush: single-record batches keep the broker's end offsets exact."""
        value = json.dumps(
            {
                "partition": letter.position.partition,
                "offset": letter.position.offset,
                "code": letter.code,
                "reason": letter.reason,
                "raw": letter.raw,
            }
        ).encode()
        try:
            self._producer.send(
                self._dlq,
                key=f"{letter.position.partition}:{letter.position.offset}".encode(),
                value=value,
            ).get(timeout=SEND_TIMEOUT)
        except KafkaError as exc:
            raise LogUnavailable(f"dead-letter topic {self._dlq} is unavailable: {exc}") from exc

    def dead_letters(self) -> list[DeadLetter]:
        letters: dict[tuple[int, int], DeadLetter] = {}
        for record in self._records({}, self._broker_ends(self._dlq, [0]), topic=self._dlq):
            data = json.loads(record.value)
            position = LogPosition(data["partition"], data["offset"])
            letters.setdefault(
                (position.partition, position.offset),
                DeadLetter(position, data["code"], data["reason"], data["raw"]),
            )
        return [letters[k] for k in sorted(letters)]

    def close(self) -> None:
        self._producer.close(timeout=SEND_TIMEOUT)
