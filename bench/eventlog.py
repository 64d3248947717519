"""Event-log throughput: our PostgreSQL and Kafka logs against raw drivers on the same rows.

Starts its own embedded stack (PostgreSQL and Tansu) in a temporary folder, so it needs nothing
running. Baselines, measured in the same run:
- PostgreSQL: raw psycopg ``executemany`` (single: one row per transaction) and ``COPY``
  (batched) into a table with the same columns and constraints; raw ``SELECT`` for replay.
- Kafka: a raw kafka-python producer (same acks and idempotence) and consumer, same payloads.
- Sealing: the PostgreSQL log storing tenants' words sealed with their data keys, against the
  same log storing them in plaintext.

Usage: python -m bench.eventlog [--events N] [--batch B] [--single S]
"""

from __future__ import annotations

import argparse
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psycopg
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from rich.progress import Progress

from bench.report import Row, report, row
from core.events import HarnessStamp, NewEvent, TurnReceived
from core.events.privacy import Cipher
from core.mapper import Mapper
from core.settings import Settings
from infra.kafka.eventlog import KafkaEventLog
from infra.kafka.topics import create_topics, event_topics
from infra.local_stack import LocalStack, free_port
from infra.master_key import new_master_key_line, parse_master_keys
from infra.postgres.data_keys import PostgresDataKeys
from infra.postgres.db import Pool, open_pool
from infra.postgres.eventlog import PostgresEventLog
from infra.postgres.migrate import migrate

PARTITIONS = 3
STAMP = HarnessStamp(harness_version="bench", hcp_version="bench")
KEYS = 100


def make_events(n: int, tag: str) -> list[NewEvent]:
    keys = [f"conv-{tag}-{i}" for i in range(KEYS)]
    return [
        NewEvent(
            payload=TurnReceived(
                conversation_id=uuid.uuid5(uuid.NAMESPACE_URL, keys[i % KEYS]),
                turn_id=uuid.uuid4(),
                client_msg_id=f"m-{i}",
                content=f"user message number {i}: " + "lorem ipsum " * 8,
                release_id="bench",
                harness=STAMP,
            ),
            tenant_id="bench",
            key=keys[i % KEYS],
        )
        for i in range(n)
    ]


def rate(n: int, fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return n / (time.perf_counter() - start)


def raw_rows(events: list[NewEvent]) -> list[tuple[object, ...]]:
    """The rows a raw writer would store: same columns and serialised JSON, sealed untimed."""
    rows = []
    for seq, event in enumerate(events, start=1):
        sealed = Mapper().seal(event, seq, None)
        e = sealed.envelope
        rows.append(
            (
                e.event_id,
                e.type,
                e.schema_version,
                e.occurred_at,
                e.tenant_id,
                f"{e.key}-{seq}",
                1,
                None,
                None,
                "{}",
                None,
                e.hash,
                sealed.payload_json,
            )
        )
    return rows


RAW_COLUMNS = (
    "event_id, type, schema_version, occurred_at, tenant_id, key, sequence, "
    "causation_id, correlation_id, trace, prev_hash, hash, payload"
)


def bench_postgres(url: str, pool: Pool, n: int, batch: int, single: int) -> list[Row]:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("CREATE TABLE raw_events (LIKE events INCLUDING ALL)")
    log = PostgresEventLog(pool, url)

    singles = make_events(single, "single")
    ours_single = rate(single, lambda: [log.append([e]) for e in singles])
    raw_single_rows = raw_rows(make_events(single, "raw-single"))

    def raw_single() -> None:
        with psycopg.connect(url) as conn:
            for r in raw_single_rows:
                conn.execute(
                    f"INSERT INTO raw_events ({RAW_COLUMNS}) VALUES "
                    "(%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s)",
                    r,
                )
                conn.commit()

    base_single = rate(single, raw_single)

    events = make_events(n, "batch")
    chunks = [events[i : i + batch] for i in range(0, n, batch)]
    ours_batch = rate(n, lambda: [log.append(c) for c in chunks])
    raw_batch_rows = raw_rows(make_events(n, "raw-batch"))

    def raw_copy() -> None:
        with psycopg.connect(url) as conn:
            for i in range(0, n, batch):
                with conn.cursor().copy(f"COPY raw_events ({RAW_COLUMNS}) FROM STDIN") as copy:
                    for r in raw_batch_rows[i : i + batch]:
                        copy.write_row(r)
                conn.commit()

    base_batch = rate(n, raw_copy)

    total = single + n
    ours_replay = rate(total, lambda: sum(1 for _ in log.read()))

    def raw_read() -> None:
        with psycopg.connect(url) as conn:
            conn.execute(f"SELECT position, {RAW_COLUMNS} FROM events ORDER BY position").fetchall()

    base_replay = rate(total, raw_read)
    return [
        row("postgres append, one event per call", ours_single, "events/s", base_single, ">= 0.5x"),
        row(f"postgres append, batches of {batch}", ours_batch, "events/s", base_batch, ">= 0.5x"),
        row("postgres replay from position 0", ours_replay, "events/s", base_replay, ">= 0.7x"),
    ]


def bench_sealing(url: str, pool: Pool, n: int, batch: int) -> list[Row]:
    """Tenants' words sealed with their data keys (as every wired log stores them) against the
    same events in plaintext, appended in batches and replayed, in the same database."""
    keys = PostgresDataKeys(pool, parse_master_keys(new_master_key_line("bench"), "bench"))
    plain, sealed = PostgresEventLog(pool, url), PostgresEventLog(pool, url, Cipher(keys))

    def appended(log: PostgresEventLog, tag: str) -> tuple[float, dict[int, int], dict[int, int]]:
        events = make_events(n, tag)
        start = log.end_positions()
        speed = rate(n, lambda: [log.append(events[i : i + batch]) for i in range(0, n, batch)])
        return speed, start, log.end_positions()

    plain_append, plain_start, plain_end = appended(plain, "plain")
    sealed_append, sealed_start, sealed_end = appended(sealed, "sealed")
    plain_replay = rate(n, lambda: sum(1 for _ in plain.read(start=plain_start, end=plain_end)))
    sealed_replay = rate(n, lambda: sum(1 for _ in sealed.read(start=sealed_start, end=sealed_end)))
    return [
        row(
            f"postgres append sealed, batches of {batch}",
            sealed_append,
            "events/s",
            plain_append,
            ">= 0.8x",
        ),
        row("postgres replay sealed", sealed_replay, "events/s", plain_replay, ">= 0.8x"),
    ]


def bench_kafka(bootstrap: str, pool: Pool, n: int, batch: int, single: int) -> list[Row]:
    topic, raw_topic = "bench.events", "bench.raw"
    create_topics(bootstrap, event_topics(topic, PARTITIONS, 1))
    create_topics(bootstrap, event_topics(raw_topic, PARTITIONS, 1))
    log = KafkaEventLog(bootstrap, topic, pool)
    producer = KafkaProducer(
        bootstrap_servers=bootstrap, acks="all", enable_idempotence=True, linger_ms=5
    )

    def raw_values(events: list[NewEvent]) -> list[tuple[bytes, bytes]]:
        sealed = (Mapper().seal(e, i, None) for i, e in enumerate(events, start=1))
        return [(s.envelope.key.encode(), s.envelope_json()) for s in sealed]

    singles = make_events(single, "single")
    ours_single = rate(single, lambda: [log.append([e]) for e in singles])
    raw_single_values = raw_values(make_events(single, "raw-single"))

    def raw_single() -> None:
        for key, value in raw_single_values:
            producer.send(raw_topic, key=key, value=value)
            producer.flush()

    base_single = rate(single, raw_single)

    events = make_events(n, "batch")
    ours_batch = rate(n, lambda: [log.append(events[i : i + batch]) for i in range(0, n, batch)])
    raw_batch_values = raw_values(make_events(n, "raw-batch"))

    def raw_batch() -> None:
        for i in range(0, n, batch):
            futures = [
                producer.send(raw_topic, key=k, value=v) for k, v in raw_batch_values[i : i + batch]
            ]
            producer.flush()
            for f in futures:
                f.get()

    base_batch = rate(n, raw_batch)
    total = single + n
    ours_replay = rate(total, lambda: sum(1 for _ in log.read()))
    ends = log.end_positions()

    def raw_read() -> None:
        consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
        for partition, stop in sorted(ends.items()):
            tp = TopicPartition(topic, partition)
            consumer.assign([tp])
            consumer.seek(tp, 0)
            seen = 0
            while seen < stop:
                for records in consumer.poll(timeout_ms=500).values():
                    seen += len(records)
        consumer.close()

    base_replay = rate(total, raw_read)
    producer.close()
    log.close()
    return [
        row("kafka append, one event per call", ours_single, "events/s", base_single, ">= 0.8x"),
        row(f"kafka append, batches of {batch}", ours_batch, "events/s", base_batch, ">= 0.8x"),
        row("kafka replay from offset 0", ours_replay, "events/s", base_replay, ">= 0.7x"),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=10_000, help="events for batch and replay")
    parser.add_argument("--batch", type=int, default=500, help="events per batched append")
    parser.add_argument("--single", type=int, default=500, help="events appended one by one")
    args = parser.parse_args()
    if min(args.events, args.batch, args.single) < 1:
        parser.error("--events, --batch and --single must be positive")

    with tempfile.TemporaryDirectory(prefix="macaron-bench-") as home:
        stack = LocalStack(
            Settings(
                home=Path(home),
                postgres_port=free_port(),
                redis_port=free_port(),
                kafka_port=free_port(),
            )
        )
        rows: list[Row] = []
        try:
            with Progress(transient=True) as progress:
                task = progress.add_task("starting the stack", total=3)
                stack.up(kafka=True)
                url = stack.postgres.url()
                migrate(url)
                progress.update(task, advance=1, description="PostgreSQL log")
                with open_pool(url) as pool:
                    rows += bench_postgres(url, pool, args.events, args.batch, args.single)
                    rows += bench_sealing(url, pool, args.events, args.batch)
                    progress.update(task, advance=1, description="Kafka log")
                    with psycopg.connect(url, autocommit=True) as conn:
                        conn.execute("TRUNCATE kafka_appends")
                    rows += bench_kafka(
                        stack.kafka.bootstrap(), pool, args.events, args.batch, args.single
                    )
                    progress.update(task, advance=1)
        finally:
            stack.down()
    path = report("eventlog", rows)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
