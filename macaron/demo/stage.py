"""The running loop of a demo: the chat server (uvicorn on a free port of 127.0.0.1, in a
thread), the stream processors (in a thread) and a Celery worker (a ``macaron worker``
subprocess given the same settings as ``MACARON_*`` variables, in a process group of its own
that the demo stops by its PID when it ends, SIGINT and SIGTERM included). Rollout jobs run in
the worker, in turn with training and evaluation, or (``rollouts="server"``) in the chat
server's rollout lane, on its engine, beside them."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Literal

import uvicorn

from core.settings import Settings
from infra.local_stack import free_port
from learners.queue import DEFAULT, EVAL, ROLLOUT, TRAIN
from learners.queue import app as celery_app
from learners.queue import configure as configure_celery
from macaron import wiring
from macaron.demo.records import DemoFailed
from server.turns.request import Router
from streams.runner import follow

SERVER_START_S = 60.0
WORKER_STOP_S = 3.0
"""How long the worker's warm shutdown may take before it is killed: a task cut short is given
to the next worker (acks late) and repeats nothing (every task is idempotent by its id)."""
RolloutPlace = Literal["worker", "server"]

Step = Callable[[str], None]


class _Background:
    """A daemon thread whose failure is kept, so the demo can say what stopped."""

    def __init__(self, name: str, target: Callable[[], None]) -> None:
        self.name = name
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(target,), name=name, daemon=True)
        self.thread.start()

    def _run(self, target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as exc:  # SystemExit from uvicorn included: reported by check()
            self.error = exc

    def check(self) -> None:
        if self.error is not None or not self.thread.is_alive():
            raise DemoFailed(f"the {self.name} stopped: {self.error!r}")


@dataclass
class Stage:
    """The loop's parts, running: the chat server, its address, the processors, the worker."""

    server: wiring.Server
    url: str
    worker: subprocess.Popen[bytes]
    worker_log: Path
    threads: list[_Background]

    def check(self) -> None:
        """Raise ``DemoFailed`` if any part has stopped."""
        code = self.worker.poll()
        if code is not None:
            tail = self.worker_log.read_text(errors="replace")[-2000:]
            raise DemoFailed(
                f"the Celery worker exited with {code} (log {self.worker_log}):\n{tail}"
            )
        for thread in self.threads:
            thread.check()


def worker_environment(settings: Settings) -> dict[str, str]:
    """This process's environment with the settings as ``MACARON_*`` (and no other)."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("MACARON_")}
    for name, value in settings.model_dump(exclude_none=True).items():
        env[f"MACARON_{name.upper()}"] = str(value)
    return env


@contextmanager
def running_loop(
    settings: Settings,
    out_dir: Path,
    step: Step,
    *,
    router: Router | None = None,
    rollouts: RolloutPlace = "worker",
) -> Iterator[Stage]:
    """Start the chat server, the stream processors and a Celery worker (and the server's
    rollout lane, where ``rollouts`` says); stop them after."""
    configure_celery(settings)
    _check_broker(settings)
    with ExitStack() as parts:
        server = wiring.chat_server(settings, step, router=router)
        parts.callback(server.close)
        step("starting the chat server")
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
        serving = _Background("chat server", uv.run)
        parts.callback(_stop_server, uv, serving)
        _await_start(uv, serving)
        if rollouts == "server":
            step("starting the rollout lane on the chat server's engine")
            server.serve_rollouts(settings)
        step("starting the stream processors")
        hosts = wiring.processor_hosts(settings, server.log, server.pool)
        wiring.enqueue_queued_runs(server.pool)
        stop = threading.Event()
        processors = _Background("stream processors", lambda: follow(hosts, stop))
        parts.callback(_stop_processors, stop, processors)
        log_path = out_dir / "worker.log"
        log = parts.enter_context(log_path.open("wb"))
        queues = (TRAIN, EVAL, DEFAULT) if rollouts == "server" else (TRAIN, EVAL, DEFAULT, ROLLOUT)
        worker = _start_worker(settings, log, queues)
        parts.callback(_stop_worker, worker)
        step(f"starting a Celery worker (pid {worker.pid})")
        yield Stage(server, f"ws://127.0.0.1:{port}/v1/ws", worker, log_path, [serving, processors])


def _check_broker(settings: Settings) -> None:
    try:
        with celery_app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=2)
    except Exception as exc:  # kombu raises its transport's errors
        raise DemoFailed(
            f"cannot reach Redis for Celery: {exc} (is `macaron up` running, "
            f"or MACARON_REDIS_URL set?)"
        ) from exc


def _await_start(uv: uvicorn.Server, serving: _Background) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while not uv.started:
        serving.check()
        if time.monotonic() > deadline:
            raise DemoFailed(f"the chat server did not start in {SERVER_START_S:.0f} s")
        time.sleep(0.05)


def _stop_server(uv: uvicorn.Server, serving: _Background) -> None:
    uv.should_exit = True
    serving.thread.join(timeout=30)


def _stop_processors(stop: threading.Event, processors: _Background) -> None:
    stop.set()
    processors.thread.join(timeout=30)


def _start_worker(
    settings: Settings, log: IO[bytes], queues: tuple[str, ...]
) -> subprocess.Popen[bytes]:
    """``macaron worker`` on ``queues``, in a session of its own: Ctrl-C on the demo's terminal
    reaches the demo only, and the demo stops the worker's whole process group."""
    return subprocess.Popen(
        [sys.executable, "-m", "macaron", "worker", "--queues", ",".join(queues)],
        env=worker_environment(settings),
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _stop_worker(worker: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the worker's group (Celery's warm shutdown finishes the task at hand), then,
    after ``WORKER_STOP_S`` or at a second signal to the demo, SIGKILL to what is left of it."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(worker.pid, signal.SIGTERM)
    try:
        with contextlib.suppress(subprocess.TimeoutExpired):
            worker.wait(timeout=WORKER_STOP_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
