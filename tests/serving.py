"""A real chat server for tests: the app ``macaron serve`` wires, on uvicorn, on a free port."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from websockets.sync.client import ClientConnection, connect

from core.engine import Engine
from core.events import PromotionRejected, ReleasePromoted
from core.harness.artifact import HarnessSpec
from core.registry import NewAdapterVersion
from core.release import AdapterRef, Release
from core.settings import Settings
from infra.artifacts import ArtifactStore
from infra.local_stack import LocalStack, free_port
from infra.postgres.db import Pool
from infra.postgres.keys import create_key
from infra.postgres.registry import (
    active_release,
    create_release,
    register_adapter,
    register_harness,
)
from macaron import wiring
from macaron.demo import worker_environment
from server.turns.request import Router
from streams.host import ProcessorHost
from streams.runner import follow
from tests.conftest import fresh_database


@dataclass
class Running:
    server: wiring.Server
    settings: Settings
    port: int

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/ws"

    def key(self, tenant: str, *scopes: str) -> str:
        with self.server.pool.connection() as conn:
            return create_key(conn, tenant, set(scopes or ("chat",)))[1]  # type: ignore[arg-type]

    def connect(self, key: str | None = None, **kw: Any) -> ClientConnection:
        return ws_connect(self.ws_url, key, **kw)

    def events(self, key: str | None = None) -> list[Any]:
        return list(self.server.log.read(key=key))


def ws_connect(url: str, key: str | None = None, **kw: Any) -> ClientConnection:
    """A WebSocket to ``url``, with ``key`` as its bearer token."""
    headers = {"Authorization": f"Bearer {key}"} if key is not None else None
    ws: ClientConnection = connect(url, additional_headers=headers, open_timeout=10, **kw)
    return ws


@dataclass(frozen=True)
class ServerProcess:
    """A ``macaron serve`` in a process of its own."""

    process: subprocess.Popen[bytes]
    port: int

    def connect(self, key: str | None = None, **kw: Any) -> ClientConnection:
        return ws_connect(f"ws://127.0.0.1:{self.port}/v1/ws", key, **kw)


def start_server(settings: Settings, port: int, log: Path) -> subprocess.Popen[bytes]:
    """``macaron serve`` on ``port`` given ``settings`` as ``MACARON_*``, its output in ``log``;
    returns once it accepts WebSocket connections."""
    env = worker_environment(settings)
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "macaron", "serve", "--port", str(port)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise AssertionError(f"the server exited:\n{log.read_text()[-3000:]}")
            try:
                with connect(f"ws://127.0.0.1:{port}/v1/ws", open_timeout=2):
                    return process
            except OSError:
                time.sleep(0.5)
        raise AssertionError("the server did not start")
    except BaseException:
        process.kill()
        process.wait(timeout=30)
        raise


@contextmanager
def serving(
    stack: LocalStack,
    tmp_path_factory: pytest.TempPathFactory,
    *,
    engine: Engine | None = None,
    router: Router | None = None,
    **settings: Any,
) -> Iterator[Running]:
    """A server on a fresh database of the run's stack, with ``settings`` on top."""
    with fresh_database(stack) as url:
        config = Settings(home=tmp_path_factory.mktemp("serve-home"), database_url=url, **settings)
        with running_server(config, engine=engine, router=router) as running:
            yield running


@contextmanager
def running_server(
    settings: Settings, *, engine: Engine | None = None, router: Router | None = None
) -> Iterator[Running]:
    server = wiring.chat_server(settings, lambda _: None, engine=engine, router=router)
    port = free_port()
    config = uvicorn.Config(
        server.app,
        host="127.0.0.1",
        port=port,
        lifespan="on",
        ws_max_size=settings.max_frame_bytes,
        log_level="warning",
    )
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield Running(server, settings, port)
    finally:
        uv.should_exit = True
        thread.join(timeout=15)
        server.close()


@contextmanager
def following(served: Running) -> Iterator[list[ProcessorHost]]:
    """The stream processors following the server's log in a thread, as ``macaron streams
    run`` does; stopped on exit."""
    hosts = wiring.processor_hosts(served.settings, served.server.log, served.server.pool)
    stop = threading.Event()
    thread = threading.Thread(target=follow, args=(hosts, stop), name="processors", daemon=True)
    thread.start()
    try:
        yield hosts
    finally:
        stop.set()
        thread.join(timeout=30)


def frames_until(ws: ClientConnection, kind: str, timeout: float = 60) -> list[dict[str, Any]]:
    """Frames received up to and including the first of type ``kind``."""
    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while True:
        frame = json.loads(ws.recv(timeout=max(0.1, deadline - time.monotonic())))
        got.append(frame)
        if frame["type"] == kind:
            return got


def turn_frames(ws: ClientConnection, timeout: float = 60) -> list[dict[str, Any]]:
    """The frames of the turn just sent, up to its ``turn_completed`` or ``error``."""
    frames: list[dict[str, Any]] = []
    while not frames or frames[-1]["type"] not in ("turn_completed", "error"):
        frames.append(json.loads(ws.recv(timeout=timeout)))
    return frames


def send(ws: ClientConnection, **frame: Any) -> None:
    ws.send(json.dumps(frame))


def successor(served: Running, folder: Path, rank: int, specialist: str = "coding") -> Release:
    """A child of the active release with a new adapter for ``specialist``, recorded, not
    active."""
    return registered_successor(served.server.pool, served.settings.home, folder, rank, specialist)


def registered_successor(
    pool: Pool, home: Path, folder: Path, rank: int, specialist: str = "coding"
) -> Release:
    """``successor`` for servers of another process: the registry's active release, the
    adapter stored under ``home``."""
    store = ArtifactStore(home / "adapters")
    sha, path = store.put(folder)
    with pool.connection() as conn, conn.transaction():
        release = active_release(conn)
        parent = release.adapters[specialist]
        ref: AdapterRef = register_adapter(
            conn,
            NewAdapterVersion(
                specialist=specialist,
                version=parent.version + 1,
                parent_id=parent.adapter_version_id,
                sha256=sha,
                path=str(path),
                rank=rank,
                base_model=release.base_model,
            ),
        )
        child = release.successor(adapters={specialist: ref})
        create_release(conn, child, active=False)
    return child


def harness_successor(served: Running, spec: HarnessSpec) -> Release:
    """A child of the active release with only its harness changed to ``spec`` (registered as
    the next harness version), recorded, not active."""
    release = served.server.chat.release
    with served.server.pool.connection() as conn, conn.transaction():
        harness = register_harness(conn, spec, parent=served.server.chat.harness)
        child = release.successor(harness=harness)
        create_release(conn, child, active=False)
    return child


@contextmanager
def celery_worker(settings: Settings, log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """``macaron worker`` (every queue) in a subprocess given ``settings`` as ``MACARON_*``
    variables, its output in ``log_path``; terminated on exit (killed if a task it is in the
    middle of keeps it past 30 s: Celery's warm shutdown waits for the task, and the test's
    database may be gone by then)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MACARON_")}
    for name, value in settings.model_dump(exclude_none=True).items():
        env[f"MACARON_{name.upper()}"] = str(value)
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "macaron", "worker"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            yield process
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=30)


def wait_for_promotion(
    served: Running,
    log_path: Path,
    worker: subprocess.Popen[bytes],
    timeout_s: float = 600,
    parent: str | None = None,
) -> ReleasePromoted:
    """The latest promotion of a child release (of ``parent`` when given) but a harness
    proposal's; fails on a rejection but a harness proposal's (judging a proposal is the
    contract's job, and any verdict is fine here), a dead worker or the timeout, with the runs,
    the evaluations and the end of the worker's log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with served.server.pool.connection() as conn:
            proposals = {
                row["run_id"]
                for row in conn.execute("SELECT run_id FROM training_runs WHERE kind = 'harness'")
            }
        found = [
            e.payload
            for e in served.events("releases")
            if isinstance(e.payload, ReleasePromoted)
            and e.payload.run_id not in proposals
            and e.payload.parent_release_id is not None
            and parent in (None, e.payload.parent_release_id)
        ]
        if found:
            return found[-1]
        rejected = [
            e
            for e in served.events()
            if isinstance(e.payload, PromotionRejected) and e.payload.run_id not in proposals
        ]
        if rejected or worker.poll() is not None:
            break
        time.sleep(1)
    with served.server.pool.connection() as conn:
        runs = conn.execute("SELECT status, error FROM training_runs").fetchall()
        evaluations = conn.execute("SELECT passed, scores FROM evaluations").fetchall()
    raise AssertionError(
        f"no promotion: runs {runs}, evaluations {evaluations}\n" + log_path.read_text()[-4000:]
    )
