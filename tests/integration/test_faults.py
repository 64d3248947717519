"""Fault injection with real processes: killed by SIGKILL, or stopped and started again.

What must hold each time: nothing acknowledged is lost, nothing happens twice, and the system
comes back without a restart of what was not killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from core.events import TurnCompleted, TurnReceived
from core.settings import Settings
from engines.instant import InstantEngine, fixed_reply
from infra.local_stack import LocalStack, free_port
from infra.postgres.db import open_pool
from infra.postgres.keys import create_key
from infra.postgres.registry import active_release
from learners.queue import app as celery_app
from learners.queue import configure as configure_celery
from macaron import wiring
from macaron.demo import worker_environment
from server.router import RouterService
from streams.processor import content_hash
from streams.replay import replay
from tests.serving import following, frames_until, running_server, send, serving, start_server

pytestmark = pytest.mark.fault
DATA = Path(__file__).resolve().parents[1] / "data"
ANSWER = '{"type": "Text", "text": "green"}'


def turns_in_log(events: list[Any]) -> dict[str, list[str]]:
    """client_msg_id -> the turn ids received under it; and the completed turn ids."""
    received: dict[str, list[str]] = {}
    for event in events:
        if isinstance(event.payload, TurnReceived):
            received.setdefault(event.payload.client_msg_id, []).append(str(event.payload.turn_id))
    return received


def completed_in_log(events: list[Any]) -> set[str]:
    return {str(e.payload.turn_id) for e in events if isinstance(e.payload, TurnCompleted)}


# --- the server killed mid-turn ------------------------------------------------------------


@pytest.fixture
def fault_settings(database_url: str, tiny_model: Path, tmp_path: Path) -> Settings:
    return Settings(
        home=tmp_path / "home",
        database_url=database_url,
        model_dir=tiny_model,
        max_new_tokens=400,
        turns_per_minute=10_000,
        log_format="text",
    )


def kill(process: subprocess.Popen[bytes]) -> None:
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)


def test_a_server_killed_mid_turn_loses_nothing_and_the_resend_makes_one_turn(
    fault_settings: Settings, tmp_path: Path
) -> None:
    pool = open_pool(fault_settings.database_url or "")
    with pool.connection() as conn:
        _, key = create_key(conn, "acme", {"chat"})
    port, log = free_port(), tmp_path / "server.log"
    url, auth = f"ws://127.0.0.1:{port}/v1/ws", {"Authorization": f"Bearer {key}"}
    server = start_server(fault_settings, port, log)
    try:
        with connect(url, additional_headers=auth) as ws:
            frames_until(ws, "ready")
            send(ws, type="user_turn", client_msg_id="first", content="hello")
            first = frames_until(ws, "turn_completed")  # acknowledged
            conversation_id = first[0]["conversation_id"]
            send(ws, type="user_turn", client_msg_id="second", content="tell me a long story")
            frames_until(ws, "token")  # mid-stream ...
            kill(server)  # ... SIGKILL
            with pytest.raises((ConnectionClosed, OSError, TimeoutError)):
                frames_until(ws, "turn_completed", timeout=10)
        server = start_server(fault_settings, port, log)
        with connect(url, additional_headers=auth) as ws:  # the client reconnects and resends
            frames_until(ws, "ready")
            send(ws, type="hello", conversation_id=conversation_id)
            frames_until(ws, "ready")
            send(ws, type="user_turn", client_msg_id="second", content="tell me a long story")
            resent = frames_until(ws, "turn_completed", timeout=120)
            send(ws, type="user_turn", client_msg_id="third", content="and then?")
            frames_until(ws, "turn_completed", timeout=120)  # the conversation goes on
    finally:
        kill(server)
    log_events = list(wiring.event_log(fault_settings, pool).read(key=conversation_id))
    pool.close()
    received = turns_in_log(log_events)
    assert len(received["second"]) == 1  # exactly one turn for the resent message
    assert resent[0]["turn_id"] == received["second"][0]
    assert {first[0]["turn_id"], resent[0]["turn_id"]} <= completed_in_log(log_events)
    assert set(received) == {"first", "second", "third"}


# --- PostgreSQL stopped and started under traffic -------------------------------------------


class Traffic:
    """One client sending turns back to back; what was acknowledged and what failed."""

    def __init__(self, ws: ClientConnection) -> None:
        self.ws = ws
        self.acknowledged: list[str] = []
        self.errors: list[dict[str, Any]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1
            send(self.ws, type="user_turn", client_msg_id=f"t{n}", content=f"turn {n}")
            while True:
                frame = json.loads(self.ws.recv(timeout=60))
                if frame["type"] == "turn_completed":
                    self.acknowledged.append(frame["turn_id"])
                    break
                if frame["type"] == "error":
                    self.errors.append(frame)
                    time.sleep(0.2)
                    break

    def wait_for_success(self, after: int, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while len(self.acknowledged) <= after:
            assert time.monotonic() < deadline, f"no turn succeeded; errors {self.errors[-3:]}"
            time.sleep(0.2)

    def finish(self) -> None:
        self.stop.set()
        self.thread.join(timeout=90)


@pytest.fixture
def instant_server(
    stack: LocalStack,
    router: RouterService,
    tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Any]:
    engine = InstantEngine(fixed_reply("fine, thanks"))
    with serving(
        stack,
        tmp_path_factory,
        engine=engine,
        router=router,
        model_dir=tiny_model,
        turns_per_minute=100_000,
    ) as running:
        yield running


def test_postgres_stopped_under_traffic_gives_retryable_errors_and_loses_nothing(
    stack: LocalStack, instant_server: Any
) -> None:
    with instant_server.connect(instant_server.key("acme")) as ws:
        frames_until(ws, "ready")
        traffic = Traffic(ws)
        traffic.wait_for_success(after=5)
        stack.postgres.stop()
        try:
            time.sleep(4)  # turns keep coming while the database is away
        finally:
            stack.postgres.start()
        during = len(traffic.acknowledged)
        traffic.wait_for_success(after=during + 5)  # back, without restarting the server
        traffic.finish()
    assert traffic.errors, "the outage was not noticed"
    assert {(e["code"], e["retryable"]) for e in traffic.errors} == {("unavailable", True)}
    completed = completed_in_log(instant_server.events())
    assert set(traffic.acknowledged) <= completed  # no acknowledged turn is lost


# --- the Kafka-protocol broker stopped under traffic ------------------------------------------


@pytest.mark.kafka
def test_the_broker_stopped_under_traffic_gives_retryable_errors_and_loses_nothing(
    stack: LocalStack,
    router: RouterService,
    tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """Tansu here keeps its data in memory, so the broker is frozen (SIGSTOP) and thawed
    (SIGCONT), not killed: a restart would lose every record by design of that storage."""
    topic = f"faults.{uuid.uuid4().hex[:8]}"
    with serving(
        stack,
        tmp_path_factory,
        engine=InstantEngine(fixed_reply("fine")),
        router=router,
        model_dir=tiny_model,
        turns_per_minute=100_000,
        event_log="kafka",
        kafka_bootstrap=stack.kafka.bootstrap(),
        kafka_topic=topic,
        kafka_partitions=2,
    ) as served:
        broker = stack.kafka.pid()
        assert broker is not None
        with served.connect(served.key("acme")) as ws:
            frames_until(ws, "ready")
            traffic = Traffic(ws)
            traffic.wait_for_success(after=5)
            os.kill(broker, signal.SIGSTOP)
            frozen_at = len(traffic.acknowledged)
            try:
                time.sleep(6)
                while_frozen = len(traffic.acknowledged) - frozen_at
            finally:
                os.kill(broker, signal.SIGCONT)
            during = len(traffic.acknowledged)
            traffic.wait_for_success(after=during + 5, timeout=120)
            traffic.finish()
        assert while_frozen <= 1  # the frozen broker held the appends back (one was in flight)
        assert {(e["code"], e["retryable"]) for e in traffic.errors} <= {("unavailable", True)}
        completed = completed_in_log(served.events())
    assert set(traffic.acknowledged) <= completed  # every acknowledged event is readable


# --- a stream processor killed mid-batch --------------------------------------------------------


def test_a_processor_killed_mid_batch_ends_identical_to_a_clean_replay(
    instant_server: Any, celery_redis_url: str, tmp_path: Path
) -> None:
    key = instant_server.key("acme")
    for c in range(6):  # a few hundred events: several batches
        with instant_server.connect(key) as ws:
            frames_until(ws, "ready")
            for n in range(12):
                send(ws, type="user_turn", client_msg_id=f"c{c}-{n}", content=f"hello {n}")
                turn_id = frames_until(ws, "turn_completed")[-1]["turn_id"]
                send(ws, type="feedback", turn_id=turn_id, kind="edit", edited_text=f"edit {n}")
            send(ws, type="ping")
            frames_until(ws, "pong")
    settings: Settings = instant_server.settings
    env = worker_environment(
        settings.model_copy(
            update={
                "log_format": "text",
                "redis_url": celery_redis_url,
                "train_threshold": 1_000_000,
            }
        )
    )
    log = tmp_path / "streams.log"
    with log.open("wb") as out:
        streams = subprocess.Popen(
            [sys.executable, "-m", "macaron", "streams", "run"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    pool = instant_server.server.pool
    deadline = time.monotonic() + 120
    while not _positions_saved(pool):  # killed once the first batch is committed
        assert time.monotonic() < deadline and streams.poll() is None, log.read_text()[-3000:]
        time.sleep(0.05)
    kill(streams)
    again = subprocess.run(
        [sys.executable, "-m", "macaron", "streams", "run", "--once"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    hosts = wiring.processor_hosts(settings, instant_server.server.log, pool)
    for host in hosts[:3]:  # the trigger's registry rows are not replayed (see replay)
        with pool.connection() as conn:
            live = content_hash(conn, host.processor)
        rebuilt = replay(host.processor, instant_server.server.log, pool, end=host.positions())
        assert rebuilt.handled > 0 and rebuilt.digest == live, host.processor.name


def _positions_saved(pool: Any) -> bool:
    with pool.connection() as conn:
        return conn.execute("SELECT 1 FROM processor_positions LIMIT 1").fetchone() is not None


# --- a Celery worker killed mid-training ------------------------------------------------------


def test_a_worker_killed_mid_training_is_redelivered_and_trains_once(
    database_url: str,
    celery_redis_url: str,
    tiny_model: Path,
    router: RouterService,
    tmp_path: Path,
) -> None:
    recipe = tmp_path / "training.yaml"  # long enough to be killed in the middle
    recipe.write_text((DATA / "training-e2e.yaml").read_text().replace("steps: 40", "steps: 30"))
    settings = Settings(
        home=tmp_path / "home",
        database_url=database_url,
        model_dir=tiny_model,
        redis_url=celery_redis_url,
        train_threshold=2,
        training_config=recipe,
        contract_path=DATA / "contract-e2e.yaml",
        task_visibility_timeout=5,
        training_lease_seconds=6,
        max_new_tokens=8,
        turns_per_minute=1000,
        log_format="text",
    )
    configure_celery(settings)
    with running_server(settings, router=router) as served:
        first = start_worker(settings, tmp_path / "worker-1.log")
        second = None
        try:
            with following(served), served.connect(served.key("acme")) as ws:
                frames_until(ws, "ready")
                for n in range(2):
                    send(
                        ws,
                        type="user_turn",
                        client_msg_id=f"g{n}",
                        content="Show the status.",
                        specialist_hint="genui",
                    )
                    turn_id = frames_until(ws, "turn_completed")[-1]["turn_id"]
                    send(ws, type="feedback", turn_id=turn_id, kind="edit", edited_text=ANSWER)
                run_id = wait_for(
                    lambda: run_in(served, "running", progressed=True),
                    180,
                    tmp_path / "worker-1.log",
                    served,
                )
                kill(first)  # SIGKILL in the middle of training
                second = start_worker(settings, tmp_path / "worker-2.log")
                wait_for(
                    lambda: run_in(served, "succeeded"), 300, tmp_path / "worker-2.log", served
                )
        finally:
            for worker in (first, second):
                if worker is not None and worker.poll() is None:
                    worker.terminate()
                    worker.wait(timeout=60)
            with celery_app.connection_for_write() as conn:  # the evaluation nobody took
                conn.default_channel.queue_purge("eval")
        with served.server.pool.connection() as conn:
            runs = conn.execute("SELECT run_id, status FROM training_runs").fetchall()
            versions = conn.execute(
                "SELECT version FROM adapter_versions WHERE specialist = 'genui' ORDER BY 1"
            ).fetchall()
            active = active_release(conn)
    assert [(str(r["run_id"]), r["status"]) for r in runs] == [(run_id, "succeeded")]
    redelivered = (tmp_path / "worker-2.log").read_text(errors="replace")
    assert f"macaron.train_successor[{run_id}] succeeded" in redelivered
    assert [v["version"] for v in versions] == [0, 1]  # one adapter, trained once
    assert active.adapters["genui"].version == 0  # nothing half-trained is promoted


def start_worker(settings: Settings, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "macaron", "worker", "--queues", "train"],
            env=worker_environment(settings),
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def run_in(served: Any, status: str, *, progressed: bool = False) -> str | None:
    """The id of the one training run, once it is in ``status`` (and has trained a step)."""
    with served.server.pool.connection() as conn:
        row = conn.execute("SELECT run_id, status FROM training_runs").fetchone()
    if row is None or row["status"] != status:
        return None
    run_id = str(row["run_id"])
    if progressed:
        info = celery_app.AsyncResult(run_id).info
        if not (isinstance(info, dict) and int(info.get("step", 0)) >= 2):
            return None
    return run_id


def wait_for(probe: Any, timeout: float, log: Path, served: Any) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = probe()
        if found is not None:
            return str(found)
        time.sleep(0.2)
    with served.server.pool.connection() as conn:
        runs = conn.execute("SELECT run_id, status, error FROM training_runs").fetchall()
    states = [
        (
            celery_app.AsyncResult(str(r["run_id"])).state,
            celery_app.AsyncResult(str(r["run_id"])).info,
        )
        for r in runs
    ]
    raise AssertionError(
        f"timed out; runs {runs} {states}; worker log:\n{log.read_text(errors='replace')[-3000:]}"
    )
