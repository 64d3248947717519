"""Ctrl-C (SIGINT) and SIGTERM stop a command within seconds, and with it every process it
started: the demo with its chat server (a thread of its own process) and its Celery worker in
the middle of a training run; the server with a client connected; the stream processors.

Each command starts as a shell starts a job in the background (``macaron demo &``), where
SIGINT is ignored unless the program asks for it (POSIX), and is signalled by its PID, as an
operator does with ``kill``.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from core.settings import Settings
from infra.local_stack import LocalStack, free_port
from infra.postgres.db import open_pool
from infra.postgres.keys import create_key
from macaron.demo import worker_environment
from tests.serving import frames_until, ws_connect

DATA = Path(__file__).resolve().parents[1] / "data"
IN_BACKGROUND = (
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    "os.execv(sys.executable, [sys.executable, '-m', 'macaron', *sys.argv[1:]])"
)
STOP_S = 20.0
"""Time from the signal to the command's exit, its worker stopped: a few seconds of warm
shutdown for the worker, then the rest of the demo."""


def start_in_background(
    args: list[str], settings: Settings, output: Path
) -> subprocess.Popen[bytes]:
    """``macaron ARGS`` given ``settings`` as ``MACARON_*``, SIGINT ignored as for ``&``;
    its stdout and stderr in ``output``."""
    with output.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-c", IN_BACKGROUND, *args],
            env=worker_environment(settings),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def wait_for_line(process: subprocess.Popen[bytes], output: Path, pattern: str) -> re.Match[str]:
    """The first match of ``pattern`` in ``output`` (written by the command), once it is there."""
    deadline = time.monotonic() + 180
    while (found := re.search(pattern, output.read_text(errors="replace"))) is None:
        if process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"no {pattern!r}:\n{output.read_text()[-3000:]}")
        time.sleep(0.2)
    return found


def process_group(pgid: int) -> set[int]:
    """The processes of group ``pgid`` now."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited meanwhile
        if int(fields[2]) == pgid:
            found.add(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    """The process runs (it exists and is not a zombie waiting to be reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def stop(process: subprocess.Popen[bytes], signum: signal.Signals, output: Path) -> None:
    """Send ``signum``: the command exits within ``STOP_S`` with 128 + its number, having said
    so in one line and with no traceback."""
    process.send_signal(signum)
    try:
        code = process.wait(timeout=STOP_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise AssertionError(f"still running {STOP_S:.0f} s after {signum.name}") from None
    said = output.read_text(errors="replace")
    assert code == 128 + signum.value, said[-3000:]
    assert f"stopped by {signum.name}" in said.splitlines()
    assert "Traceback" not in said


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_stops_the_demo_and_its_worker_in_the_middle_of_a_run(
    signum: signal.Signals,
    database_url: str,
    stack: LocalStack,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    # The training task cut short stays queued for the next worker: on a Redis database of
    # this test's own, emptied after it, so no later test's worker takes it.
    queue = stack.redis.url().rsplit("/", 1)[0] + "/6"
    settings = Settings(
        home=tmp_path / "home",
        database_url=database_url,
        model_dir=tiny_model,
        redis_url=queue,
        train_threshold=4,
        contract_path=DATA / "contract-e2e.yaml",
        training_config=DATA / "training-e2e.yaml",
        task_visibility_timeout=120,
        max_new_tokens=24,
    )
    args = ["demo", "--generations", "1", "--specialists", "genui", "--no-outside"]
    args += ["--out", str(tmp_path)]
    output = tmp_path / "demo.out"
    demo = start_in_background(args, settings, output)
    worker: set[int] = set()
    try:
        leader = int(wait_for_line(demo, output, r"Celery worker \(pid (\d+)\)")[1])
        worker = {leader}
        wait_for_line(demo, tmp_path / "worker.log", r"train_successor\[\S+\] received")
        worker |= process_group(leader)  # the worker leads a group: it and what it started
        assert leader in process_group(leader)
        stop(demo, signum, output)
        assert [pid for pid in worker if alive(pid)] == []
        assert not alive(demo.pid)  # and with it the chat server, a thread of the demo
    finally:  # what a failed test left running
        if demo.poll() is None:
            demo.kill()
            demo.wait()
        for pid in worker:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        redis.Redis.from_url(queue).flushdb()


def test_sigterm_stops_the_server_with_a_client_connected(
    database_url: str, tiny_model: Path, tmp_path: Path
) -> None:
    with open_pool(database_url) as pool, pool.connection() as conn:
        _, key = create_key(conn, "acme", {"chat"})
    settings = Settings(home=tmp_path / "home", database_url=database_url, model_dir=tiny_model)
    port, output = free_port(), tmp_path / "serve.out"
    server = start_in_background(["serve", "--port", str(port)], settings, output)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                ws = ws_connect(f"ws://127.0.0.1:{port}/v1/ws", key)
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        with ws:
            frames_until(ws, "ready")
            stop(server, signal.SIGTERM, output)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_sigint_stops_the_stream_processors(
    database_url: str, celery_redis_url: str, tmp_path: Path
) -> None:
    settings = Settings(
        home=tmp_path / "home", database_url=database_url, redis_url=celery_redis_url
    )
    output = tmp_path / "streams.out"
    processors = start_in_background(["streams", "run"], settings, output)
    try:
        wait_for_line(processors, output, "following the log")
        stop(processors, signal.SIGINT, output)
    finally:
        if processors.poll() is None:
            processors.kill()
            processors.wait()
