"""The ``macaron`` command and the embedded stack, as an operator uses them."""

from __future__ import annotations

import socket
import subprocess
import uuid
from pathlib import Path

import pytest

from core.errors import ConfigError
from core.settings import Settings
from infra.kafka.topics import create_topics, event_topics
from infra.local_stack import LocalStack
from infra.postgres.db import open_pool
from infra.postgres.eventlog import PostgresEventLog
from tests.conftest import stack_settings
from tests.factories import run_macaron, turn


def macaron(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return run_macaron(
        *args,
        MACARON_HOME=str(settings.home),
        MACARON_POSTGRES_PORT=str(settings.postgres_port),
        MACARON_REDIS_PORT=str(settings.redis_port),
        MACARON_KAFKA_PORT=str(settings.kafka_port),
    )


@pytest.fixture
def own_stack(tmp_path: Path) -> object:
    settings = stack_settings(tmp_path / "home")
    yield settings
    LocalStack(settings).down()


def test_up_status_down_up_keeps_events(own_stack: Settings) -> None:
    settings = own_stack
    up = macaron(settings, "up")
    assert up.returncode == 0, up.stderr
    assert "0001.event-log" in up.stdout
    status = macaron(settings, "status")
    assert status.returncode == 0, status.stdout
    assert "healthy" in status.stdout and f"127.0.0.1:{settings.postgres_port}" in status.stdout

    url = LocalStack(settings).postgres.url()
    key = f"conv-{uuid.uuid4()}"
    with open_pool(url) as pool:
        written = PostgresEventLog(pool, url).append([turn(key, n) for n in range(5)])

    down = macaron(settings, "down")
    assert down.returncode == 0 and "postgres" in down.stdout
    stopped = macaron(settings, "status")
    assert stopped.returncode == 1 and "stopped" in stopped.stdout

    again = macaron(settings, "up")
    assert again.returncode == 0, again.stderr
    assert "none pending" in again.stdout
    with open_pool(url) as pool:
        read = list(PostgresEventLog(pool, url).read(key=key))
    assert [r.envelope.hash for r in read] == [r.envelope.hash for r in written]
    verify = macaron(settings, "log", "verify")
    assert verify.returncode == 0 and "5 events checked, 0 violations" in verify.stdout


def test_port_in_use_is_a_clear_error(own_stack: Settings) -> None:
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", own_stack.postgres_port))
        blocker.listen()
        result = macaron(own_stack, "up")
    assert result.returncode != 0
    assert f"port {own_stack.postgres_port}" in result.stderr and "in use" in result.stderr
    assert "Traceback" not in result.stderr


def test_stale_pid_file_is_a_clear_error_and_down_clears_it(own_stack: Settings) -> None:
    pid_file = own_stack.home / "run" / "redis.pid"
    pid_file.parent.mkdir(parents=True)
    pid_file.write_text("999999\n")
    result = macaron(own_stack, "up")
    assert result.returncode != 0
    assert "stale PID file" in result.stderr and "Traceback" not in result.stderr
    assert macaron(own_stack, "down").returncode == 0
    assert not pid_file.exists()
    assert macaron(own_stack, "up").returncode == 0


def test_invalid_settings_are_a_clear_error(tmp_path: Path) -> None:
    result = run_macaron("status", MACARON_HOME=str(tmp_path), MACARON_EVENT_LOG="carrier-pigeon")
    assert result.returncode == 2
    assert "MACARON_EVENT_LOG" in result.stderr and "Traceback" not in result.stderr


def test_kafka_topics_are_created_explicitly(stack: LocalStack) -> None:
    topic = f"ops-{uuid.uuid4().hex[:8]}"
    bootstrap = stack.kafka.bootstrap()
    assert create_topics(bootstrap, event_topics(topic, 4, 1)) == [topic, f"{topic}.dlq"]
    assert create_topics(bootstrap, event_topics(topic, 4, 1)) == []
    with pytest.raises(ConfigError):
        create_topics(bootstrap, event_topics(topic, 8, 1))
