"""Soak: many WebSocket connections with steady turns for minutes, on loopback.

500 connections (by default) each send a turn, wait for it to complete, pause (``--think-ms``
on average) and go again, for ``--seconds``, against a server process with the PostgreSQL log
and the instant bench engine (``bench.ws``'s server: no model, so the server and the log are
what is loaded). Reported: turns/s, p50/p99 turn latency, errors by code, acknowledged turns
against ``TurnCompleted`` events in the log (they must match), and the server's RSS after the
warm-up and at the end.

    .venv/bin/python -m bench.soak [--sessions 500] [--seconds 300] [--think-ms 5000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from rich.progress import Progress
from websockets.asyncio.client import connect

from bench.report import Row, report, row
from bench.ws import ask, scratch_postgres
from core.settings import Settings
from infra.local_stack import LocalStack, free_port
from infra.models import make_tiny_model, tokenizer_for_tiny
from infra.postgres.db import open_pool
from infra.postgres.keys import create_key
from infra.postgres.migrate import migrate


@dataclass
class Tally:
    latencies_ms: list[float] = field(default_factory=list)
    acknowledged: set[str] = field(default_factory=set)
    errors: Counter[str] = field(default_factory=Counter)


async def session(url: str, key: str, deadline: float, think_s: float, tally: Tally) -> None:
    pause = random.Random(key)
    await asyncio.sleep(pause.uniform(0, think_s))  # connections arrive spread out
    try:
        async with connect(
            url,
            additional_headers={"Authorization": f"Bearer {key}"},
            open_timeout=60,
            max_queue=None,
        ) as ws:
            assert json.loads(await ws.recv())["type"] == "ready"
            conversation: str | None = None
            n = 0
            while time.monotonic() < deadline:
                n += 1
                started = time.perf_counter()
                final, conversation = await ask(ws, n, conversation)
                if final["type"] == "turn_completed":
                    tally.latencies_ms.append((time.perf_counter() - started) * 1000)
                    tally.acknowledged.add(final["turn_id"])
                else:
                    tally.errors[final["code"]] += 1
                await asyncio.sleep(think_s * pause.uniform(0.5, 1.5))
    except (OSError, TimeoutError) as exc:
        tally.errors[f"connection: {type(exc).__name__}"] += 1


async def soak(url: str, keys: list[str], seconds: float, think_s: float, tally: Tally) -> None:
    deadline = time.monotonic() + seconds
    with Progress(transient=True) as progress:
        task = progress.add_task(f"{len(keys)} connections for {seconds:.0f} s", total=seconds)

        async def tick() -> None:
            while (left := deadline - time.monotonic()) > 0:
                progress.update(
                    task, completed=seconds - left, description=f"{len(tally.acknowledged)} turns"
                )
                await asyncio.sleep(1)

        ticker = asyncio.create_task(tick())
        await asyncio.gather(*(session(url, k, deadline, think_s, tally) for k in keys))
        ticker.cancel()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=500)
    parser.add_argument("--seconds", type=float, default=300)
    parser.add_argument("--think-ms", type=float, default=5000, help="mean pause between turns")
    args = parser.parse_args()
    with scratch_postgres("soak") as (home, stack):
        rows = measure(home, stack, args.sessions, args.seconds, args.think_ms / 1000)
    report("soak", rows)


def measure(
    home: Path, stack: LocalStack, sessions: int, seconds: float, think_s: float
) -> list[Row]:
    url = stack.postgres.url()
    migrate(url)
    model = make_tiny_model(home / "tiny", tokenizer_for_tiny(home, lambda _: None), seed=0)
    with open_pool(url) as pool, pool.connection() as conn:
        keys = [create_key(conn, f"soak-{i % 10}", {"chat"})[1] for i in range(sessions)]
    settings = Settings(
        home=home,
        database_url=url,
        model_dir=model,
        turns_per_minute=100_000,
        max_connections_per_tenant=sessions,
    )
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.ws",
            "--serve",
            "on",
            "--port",
            str(port),
            "--settings",
            settings.model_dump_json(),
        ]
    )
    try:
        _await_port(port, server)
        ws_url = f"ws://127.0.0.1:{port}/v1/ws"
        asyncio.run(soak(ws_url, keys[:10], 5, 0.1, Tally()))  # warm-up
        rss_start = rss_mib(server.pid)
        tally = Tally()
        started = time.perf_counter()
        asyncio.run(soak(ws_url, keys, seconds, think_s, tally))
        wall = time.perf_counter() - started
        rss_end = rss_mib(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=60)
    with psycopg.connect(url) as conn:
        logged = {
            str(r[0])
            for r in conn.execute(
                "SELECT payload->>'turn_id' FROM events WHERE type = 'TurnCompleted'"
            ).fetchall()
        }
    in_log = len(tally.acknowledged & logged)
    turns = len(tally.latencies_ms)
    cuts = statistics.quantiles(tally.latencies_ms, n=100, method="inclusive")
    offered = sessions / think_s
    errors = sum(tally.errors.values())
    label = f"{sessions} connections, {seconds:.0f} s, {think_s:g} s mean pause"
    return [
        row(
            f"turns/s ({label}; baseline: the offered rate)",
            turns / wall,
            "turns/s",
            offered,
            "report",
        ),
        row("p50 turn latency (baseline: p99)", cuts[49], "ms", cuts[98], "report"),
        row("p99 turn latency (baseline: p50)", cuts[98], "ms", cuts[49], "report"),
        row(
            "errors (baseline: turns; "
            + (", ".join(f"{c} {n}" for c, n in tally.errors.items()) or "none")
            + ")",
            errors,
            "errors",
            turns,
            "<= 0 errors",
        ),
        row(
            "acknowledged turns in the log (baseline: acknowledged)",
            in_log,
            "turns",
            len(tally.acknowledged),
            ">= 1x",
        ),
        row("server RSS at the end (baseline: after warm-up)", rss_end, "MiB", rss_start, "report"),
    ]


def _await_port(port: int, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("the soak server did not start") from None
            time.sleep(0.2)


if __name__ == "__main__":
    main()
