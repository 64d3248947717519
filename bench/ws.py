"""Benchmark: the chat server and the event log alone, over real WebSockets.

200 concurrent sessions x 5 turns each, against ``InstantEngine`` (answers at once, no model)
and ``FixedRouter`` (no embedding model), so what is measured is the server (protocol, harness,
conversation state) and the log. The same load runs twice against a server process on
loopback: event logging **on** (the PostgreSQL log) and **off** (``MemoryLog``: events sealed
and hash-chained as always, then kept in memory instead of stored). Reported: turns/s and
p50/p99 turn latency (client send of ``user_turn`` to receipt of ``turn_completed``) for each;
target: logging adds at most 5 ms at p99.

    .venv/bin/python -m bench.ws [--sessions 200] [--turns 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Generator, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import uvicorn
from rich.progress import Progress
from websockets.asyncio.client import ClientConnection, connect

from bench.report import Row, report, row
from core.events import Envelope, NewEvent
from core.log import DeadLetter, LogPosition, Positions, RecordedEvent
from core.mapper import Mapper
from core.routing import RouterDecision, RouterModel
from core.settings import Settings
from engines.instant import InstantEngine, fixed_reply
from infra.local_stack import LocalStack, free_port
from infra.models import make_tiny_model, tokenizer_for_tiny
from infra.postgres.db import open_pool
from infra.postgres.keys import create_key
from infra.postgres.migrate import migrate
from macaron import wiring

WARM_UP_SESSIONS, WARM_UP_TURNS = 10, 2
REPLY = "Sure, here is a short answer of about a dozen words for you."


class FixedRouter:
    """Bench only: always the ``chat`` specialist, without an embedding model."""

    version = "router-fixed"
    specialists = ("chat", "agent", "coding", "genui")
    active = frozenset(specialists)

    def serve_model(self, model: RouterModel) -> None:
        raise NotImplementedError("a router without a classifier serves no other version")

    def route(
        self,
        text: str,
        hint: str | None = None,
        within: Collection[str] | None = None,
        tool_callers: Collection[str] = (),
        previous: str | None = None,
    ) -> RouterDecision:
        return RouterDecision(
            scores={"chat": 1.0},
            specialist="chat",
            reason="only_specialist",
            router_version=self.version,
        )


class MemoryLog:
    """Bench only: the event log with storage switched off. Events are validated, sealed and
    chained exactly as the real logs do, then kept in this process's memory."""

    def __init__(self) -> None:
        self._events: list[RecordedEvent] = []
        self._heads: dict[str, tuple[int, str]] = {}

    def append(self, events: Sequence[NewEvent]) -> list[RecordedEvent]:
        recorded = []
        for sealed in Mapper().seal_batch(events, {}, self._heads):
            position = LogPosition(0, len(self._events))
            recorded.append(RecordedEvent(position, sealed.envelope, sealed.payload))
        self._events.extend(recorded)
        return recorded

    def read(
        self,
        *,
        start: Mapping[int, int] | None = None,
        end: Mapping[int, int] | None = None,
        key: str | None = None,
        types: Collection[str] | None = None,
    ) -> Iterator[RecordedEvent]:
        return iter([e for e in self._events if key is None or e.envelope.key == key])

    def envelopes(self, *, key: str | None = None) -> Iterator[Envelope]:
        return (e.envelope for e in self.read(key=key))

    def tail(
        self, *, start: Mapping[int, int] | None = None, idle_timeout: float = 1.0
    ) -> Generator[RecordedEvent | None, None, None]:
        raise NotImplementedError("the bench log is never tailed")

    def end_positions(self) -> Positions:
        return {0: len(self._events)}

    def dead_letters(self) -> list[DeadLetter]:
        return []

    def close(self) -> None:
        self._events.clear()


def serve(mode: str, settings_json: str, port: int) -> None:
    """The server process: the app ``macaron serve`` wires, with the bench engine and router."""
    settings = Settings.model_validate_json(settings_json)
    log = MemoryLog() if mode == "off" else None
    server = wiring.chat_server(
        settings,
        lambda _: None,
        engine=InstantEngine(fixed_reply(REPLY)),
        router=FixedRouter(),
        log=log,
    )
    try:
        uvicorn.run(
            server.app,
            host="127.0.0.1",
            port=port,
            log_level="warning",
            ws_max_size=settings.max_frame_bytes,
        )
    finally:
        server.close()


async def ask(
    ws: ClientConnection, n: int, conversation: str | None
) -> tuple[dict[str, Any], str | None]:
    """Send turn ``n`` (in ``conversation`` once there is one) and read its frames: the last one
    (``turn_completed`` or ``error``) and the conversation the turn is in."""
    frame = {"type": "user_turn", "client_msg_id": f"m{n}", "content": f"question {n}"}
    if conversation:
        frame["conversation_id"] = conversation
    await ws.send(json.dumps(frame))
    while True:
        reply = json.loads(await ws.recv())
        if reply["type"] == "turn_started":
            conversation = reply["conversation_id"]
        elif reply["type"] in ("turn_completed", "error"):
            return reply, conversation


async def session(url: str, key: str, turns: int, think_s: float, latencies: list[float]) -> None:
    async with connect(
        url, additional_headers={"Authorization": f"Bearer {key}"}, open_timeout=60, max_queue=None
    ) as ws:
        assert json.loads(await ws.recv())["type"] == "ready"
        conversation: str | None = None
        pause = random.Random(key)
        for n in range(turns):
            if think_s:
                await asyncio.sleep(think_s * pause.uniform(0.5, 1.5))
            started = time.perf_counter()
            final, conversation = await ask(ws, n, conversation)
            if final["type"] == "error":
                raise RuntimeError(f"turn failed: {final}")
            latencies.append((time.perf_counter() - started) * 1000)


async def load(
    url: str, keys: list[str], turns: int, think_s: float = 0.0
) -> tuple[float, list[float]]:
    latencies: list[float] = []
    started = time.perf_counter()
    await asyncio.gather(*(session(url, key, turns, think_s, latencies) for key in keys))
    return time.perf_counter() - started, latencies


Measured = tuple[float, float, float, int]
"""turns/s, p50 ms, p99 ms, turns."""


def run_mode(
    mode: str, settings: Settings, keys: list[str], turns: int, think_s: float
) -> dict[str, Measured]:
    """Both loads against one server process: ``burst`` (every session sends its next turn as
    soon as the last is answered: the server saturated) and ``paced`` (users pause
    ``think_s`` on average between turns: latency without queueing)."""
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "bench.ws",
        "--serve",
        mode,
        "--port",
        str(port),
        "--settings",
        settings.model_dump_json(),
    ]
    server = subprocess.Popen(command, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with psycopg.connect(settings.database_url or "", connect_timeout=2):
                    pass
                with socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError(f"the {mode} server did not start") from None
                time.sleep(0.2)
        url = f"ws://127.0.0.1:{port}/v1/ws"
        asyncio.run(load(url, keys[:WARM_UP_SESSIONS], WARM_UP_TURNS))
        measured = {
            "burst": asyncio.run(load(url, keys, turns)),
            "paced": asyncio.run(load(url, keys, turns, think_s)),
        }
    finally:
        server.terminate()
        server.wait(timeout=30)
    return {name: summary(wall, latencies) for name, (wall, latencies) in measured.items()}


def summary(wall: float, latencies: list[float]) -> Measured:
    cuts = statistics.quantiles(latencies, n=100, method="inclusive")
    return len(latencies) / wall, cuts[49], cuts[98], len(latencies)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--think-ms", type=float, default=1000, help="paced load's mean pause")
    parser.add_argument("--serve", choices=["on", "off"], help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.settings, args.port)
        return
    with scratch_postgres("ws") as (home, stack):
        rows = measure(home, stack, args.sessions, args.turns, args.think_ms / 1000)
    report("ws", rows)


@contextmanager
def scratch_postgres(bench: str) -> Iterator[tuple[Path, LocalStack]]:
    """A temporary state folder with the embedded PostgreSQL running in it, for one benchmark."""
    with tempfile.TemporaryDirectory(prefix=f"macaron-bench-{bench}-") as scratch:
        home = Path(scratch)
        stack = LocalStack(
            Settings(
                home=home, postgres_port=free_port(), redis_port=free_port(), kafka_port=free_port()
            )
        )
        stack.postgres.start()
        try:
            yield home, stack
        finally:
            stack.postgres.stop()


def measure(home: Path, stack: LocalStack, sessions: int, turns: int, think_s: float) -> list[Row]:
    url = stack.postgres.url()
    migrate(url)
    model = make_tiny_model(home / "tiny", tokenizer_for_tiny(home, lambda _: None), seed=0)
    with open_pool(url) as pool, pool.connection() as conn:
        keys = [create_key(conn, f"bench-{i % 10}", {"chat"})[1] for i in range(sessions)]
    results = {}
    with Progress() as progress:
        task = progress.add_task("logging on / off", total=2)
        for mode in ("on", "off"):
            settings = Settings(
                home=home,
                database_url=url,
                model_dir=model,
                turns_per_minute=100_000,
                max_connections_per_tenant=sessions,
            )
            results[mode] = run_mode(mode, settings, keys, turns, think_s)
            progress.advance(task)
    with psycopg.connect(url) as conn:
        stored = conn.execute("SELECT count(*) FROM events WHERE type = 'TurnCompleted'")
        completed = float((stored.fetchone() or (0,))[0])
    on, off = results["on"], results["off"]
    warm_up = min(WARM_UP_SESSIONS, sessions) * WARM_UP_TURNS
    acknowledged = sum(float(m[3]) for m in on.values()) + warm_up
    label = f"{sessions} sessions x {turns} turns"
    rows = []
    for load_name, note in (("burst", "no pause"), ("paced", f"{think_s:g} s mean pause")):
        a, b = on[load_name], off[load_name]
        rows += [
            row(
                f"{load_name} ({label}, {note}): turns/s, logging on",
                a[0],
                "turns/s",
                b[0],
                "report",
            ),
            row(f"{load_name}: p50 turn latency, logging on", a[1], "ms", b[1], "report"),
            row(f"{load_name}: p99 turn latency, logging on", a[2], "ms", b[2], "report"),
            row(
                f"{load_name}: p99 added by logging (on - off)", a[2] - b[2], "ms", b[2], "<= 5 ms"
            ),
        ]
    rows.append(
        row(
            "turns in the log / turns acknowledged (logging on)",
            completed,
            "turns",
            acknowledged,
            ">= 1x",
        )
    )
    return rows


if __name__ == "__main__":
    main()
