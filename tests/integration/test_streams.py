"""Stream processors: the same events through both hosts (the position-tracking runner over
the PostgreSQL log, and faust agents over the Kafka-protocol broker) give the same outputs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core.events import ExperienceRecorded, HarnessStamp, NewEvent, TurnReceived
from core.events.privacy import Cells
from core.harness.artifact import root_harness
from core.log import RecordedEvent
from core.mapper import Mapper
from core.settings import Settings
from engines.instant import InstantEngine
from infra.kafka.eventlog import KafkaEventLog
from infra.kafka.topics import create_topics, event_topics
from infra.local_stack import LocalStack
from infra.memory import InMemoryDataKeys
from infra.postgres.db import Pool, open_pool
from infra.postgres.eventlog import PostgresEventLog
from infra.postgres.experience_joins import (
    joined_turn,
    record_completion,
    record_response,
    record_route,
    record_turn,
)
from infra.postgres.positions import load_positions
from infra.postgres.registry import register_harness
from macaron import wiring
from server.router import RouterService
from streams.experience_rules import context_messages
from streams.processor import content_hash
from streams.runner import catch_up
from tests.conftest import fresh_database
from tests.integration.test_harness import script
from tests.serving import frames_until, send, serving

HIGH_THRESHOLD = 10_000  # no training runs here: the outputs are the processors' tables


@pytest.fixture(scope="module")
def conversation_events(
    stack: LocalStack,
    tiny_model: Path,
    router: RouterService,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[list[RecordedEvent]]:
    """Real turns over the WebSocket: chat with feedback, an agent with actions, GenUI."""
    with serving(
        stack,
        tmp_path_factory,
        engine=InstantEngine(script),
        router=router,
        model_dir=tiny_model,
        turns_per_minute=1000,
    ) as served:
        with served.connect(served.key("acme")) as ws:
            frames_until(ws, "ready")
            for content, hint, feedback in [
                ("hello", None, {"kind": "up"}),
                ("how are you", None, {"kind": "edit", "edited_text": "Very well!"}),
                ("remember milk and compute", "agent", {"kind": "up"}),
                ("show me a card", "genui", {"kind": "down"}),
                ("plan my day", "agent", None),
            ]:
                frame: dict[str, Any] = {"client_msg_id": str(uuid.uuid4()), "content": content}
                if hint:
                    frame["specialist_hint"] = hint
                send(ws, type="user_turn", **frame)
                turn_id = frames_until(ws, "turn_completed")[-1]["turn_id"]
                if feedback:
                    send(ws, type="feedback", turn_id=turn_id, **feedback)
            send(ws, type="ping")
            frames_until(ws, "pong")  # the feedback before it is stored
        yield served.events()


def copy(events: list[RecordedEvent]) -> list[NewEvent]:
    return [
        NewEvent(
            payload=e.payload,
            tenant_id=e.envelope.tenant_id,
            key=e.envelope.key,
            event_id=e.envelope.event_id,
            occurred_at=e.envelope.occurred_at,
            causation_id=e.envelope.causation_id,
            correlation_id=e.envelope.correlation_id,
            trace=e.envelope.trace,
        )
        for e in events
    ]


def settings_for(home: Path, url: str, **extra: Any) -> Settings:
    return Settings(home=home, database_url=url, train_threshold=HIGH_THRESHOLD, **extra)


def test_both_hosts_give_the_same_outputs(
    stack: LocalStack, conversation_events: list[RecordedEvent], tmp_path: Path
) -> None:
    with fresh_database(stack) as pg_url, fresh_database(stack) as kafka_url:
        # The position-tracking runner over the PostgreSQL log.
        pg_settings = settings_for(tmp_path / "pg", pg_url)
        with open_pool(pg_url) as pool:
            log = PostgresEventLog(pool, pg_url)
            log.append(copy(conversation_events))
            hosts = wiring.processor_hosts(pg_settings, log, pool)
            for _ in range(2):  # a second pass takes the derived events, then nothing
                for host in hosts:
                    catch_up(host)
            assert [catch_up(h) for h in hosts] == [0] * len(hosts)
            with pool.connection() as conn:
                by_runner = outputs(conn, hosts)
                keys = conn.execute("SELECT * FROM tenant_data_keys").fetchall()
            derived = [e for e in log.read() if isinstance(e.payload, ExperienceRecorded)]
        kinds = sorted(e.payload.kind for e in derived)  # type: ignore[attr-defined]
        assert kinds == ["preference", "sft", "sft", "sft", *["trajectory"] * 6]  # 2 ups rewarded

        # The faust agents over the Kafka-protocol broker, in their own process.
        topic = f"events-{uuid.uuid4().hex[:10]}"
        create_topics(stack.kafka.bootstrap(), event_topics(topic, 3, 1))
        with open_pool(kafka_url) as pool:
            kafka_log = KafkaEventLog(stack.kafka.bootstrap(), topic, pool)
            kafka_log.append(copy(conversation_events))
            with pool.connection() as conn:  # the same tenants' data keys, by the same master
                # key: the join state's sealed cells are equal under equal keys only
                for row in keys:
                    conn.execute(
                        "INSERT INTO tenant_data_keys VALUES (%(tenant_id)s, %(key_id)s, "
                        "%(master_key_id)s, %(wrapped)s, %(created_at)s, %(forgotten_at)s)",
                        row,
                    )
            env = {
                **{k: v for k, v in os.environ.items() if not k.startswith("MACARON_")},
                "MACARON_HOME": str(tmp_path / "pg"),
                "MACARON_DATABASE_URL": kafka_url,
                "MACARON_EVENT_LOG": "kafka",
                "MACARON_KAFKA_BOOTSTRAP": stack.kafka.bootstrap(),
                "MACARON_KAFKA_TOPIC": topic,
                "MACARON_KAFKA_PARTITIONS": "3",
                "MACARON_TRAIN_THRESHOLD": str(HIGH_THRESHOLD),
                "MACARON_REDIS_URL": stack.redis.url(),
            }
            worker = subprocess.Popen(
                [sys.executable, "-m", "macaron", "streams", "run", "--host", "faust"],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            try:
                caught_up(pool, kafka_log, [h.processor.name for h in hosts], worker)
            finally:
                worker.send_signal(signal.SIGTERM)
                output = worker.communicate(timeout=60)[0].decode(errors="replace")
            with pool.connection() as conn:
                by_faust = outputs(conn, hosts)
            kafka_log.close()
        assert by_faust == by_runner, output[-3000:]


def outputs(conn: Any, hosts: list[Any]) -> dict[str, Any]:
    """Each processor's content hash; the trigger's rows without their log positions, which
    are offsets in a different log here (same events, different places)."""
    found: dict[str, Any] = {
        h.processor.name: content_hash(conn, h.processor)
        for h in hosts
        if h.processor.name != "training-trigger-1"
    }
    found["training-trigger-1"] = conn.execute(
        "SELECT specialist, pending, running_hash FROM trigger_state ORDER BY specialist"
    ).fetchall()
    assert found["training-trigger-1"]  # the trigger saw experience
    return found


def caught_up(pool: Any, log: KafkaEventLog, names: list[str], worker: Any) -> None:
    """Wait until every processor has read to the end of the topic, twice in a row (the
    derived events it appends move the end)."""
    deadline, stable = time.monotonic() + 240, 0
    while stable < 2:
        if worker.poll() is not None:
            raise AssertionError(f"the faust host exited: {worker.stdout.read().decode()[-3000:]}")
        if time.monotonic() > deadline:
            raise AssertionError("the faust host did not catch up in time")
        end = {p: o for p, o in log.end_positions().items() if o}
        with pool.connection() as conn:
            done = all(
                all(load_positions(conn, name).get(p, 0) >= o for p, o in end.items())
                for name in names
            )
        stable = stable + 1 if done else 0
        time.sleep(1.0)


def test_experience_is_built_with_the_harness_the_turn_ran_under(pool: Pool) -> None:
    with pool.connection() as conn:
        root = register_harness(conn, root_harness(), parent=None)
        chat = root.spec.specialists["chat"].model_copy(update={"system_prompt": "Be brief."})
        spec = root.spec.model_copy(update={"specialists": {**root.spec.specialists, "chat": chat}})
        brief = register_harness(conn, spec, parent=root)
    turns = {name: uuid.uuid4() for name in ("brief", "unstamped")}
    cells = Cells(InMemoryDataKeys())
    with pool.connection() as conn, conn.transaction():
        for position, (name, turn_id) in enumerate(turns.items(), start=1):
            stamp = HarnessStamp(harness_version=brief.name, hcp_version="hcp-1")
            turn = TurnReceived(
                conversation_id=uuid.uuid4(),
                turn_id=turn_id,
                client_msg_id=name,
                content="hello",
                release_id=None,
                harness=stamp if name == "brief" else None,
            )
            event = NewEvent(payload=turn, tenant_id="acme", key=str(turn.conversation_id))
            record_turn(conn, cells, Mapper().seal(event, position, None).envelope, turn)
            record_route(conn, turn_id, "chat", "chat@0")
            record_response(conn, cells, "acme", turn_id, "Hi.", None)
            record_completion(conn, turn_id)
        joined = {name: joined_turn(conn, cells, turn_id, 8) for name, turn_id in turns.items()}
    assert joined["brief"] is not None and joined["brief"].harness == brief
    assert context_messages(joined["brief"])[0] == {"role": "system", "content": "Be brief."}
    assert joined["unstamped"] is not None and joined["unstamped"].harness.name == "harness@0"


def test_a_turn_whose_context_lost_its_words_to_migration_0022_is_not_joined(pool: Pool) -> None:
    """Migration 0022 dropped the join state's plaintext words: a turn recorded after it, in a
    conversation begun before it, has an earlier turn (or an opening history) without words.
    Its context is not the one the model saw, so it is not joined; a conversation begun after
    it joins whole."""
    cells = Cells(InMemoryDataKeys())
    before, after, fresh = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    old_conversation = uuid.uuid4()
    with pool.connection() as conn, conn.transaction():
        conn.execute(  # as 0022 left a row of an earlier turn: its words dropped
            "INSERT INTO experience_turns (turn_id, conversation_id, tenant_id, position, "
            "specialist, completed) VALUES (%s, %s, 'acme', 1, 'chat', true)",
            (before, old_conversation),
        )
        for position, (turn_id, conversation) in enumerate(
            [(after, old_conversation), (fresh, uuid.uuid4())], start=2
        ):
            turn = TurnReceived(
                conversation_id=conversation,
                turn_id=turn_id,
                client_msg_id=str(turn_id),
                content="hello again",
                release_id=None,
                harness=None,
            )
            event = NewEvent(payload=turn, tenant_id="acme", key=str(conversation))
            record_turn(conn, cells, Mapper().seal(event, position, None).envelope, turn)
            record_route(conn, turn_id, "chat", "chat@0")
            record_response(conn, cells, "acme", turn_id, "Hi.", None)
            record_completion(conn, turn_id)
        assert joined_turn(conn, cells, before, 8) is None
        assert joined_turn(conn, cells, after, 8) is None
        joined = joined_turn(conn, cells, fresh, 8)
    assert joined is not None and (joined.content, joined.response) == ("hello again", "Hi.")
