"""The rollout lane: the serving process samples rollout jobs on its own engine, in the capacity
chat leaves idle, while the Celery workers train and evaluate.

A Celery consumer of the ``rollout`` queue runs in a thread of the serving process, one job at a
time (as a solo worker would). Its runtime's engine is a background view of the serving engine
(``engines.shared``, wired by ``macaron.wiring``): a job loads no second model, samples with the
adapters chat serves, and yields to chat turns. ``macaron worker`` processes may consume the
same queue: whichever is free takes the next job.

Stopping closes the view: the job at hand fails its next request with ``EngineWithdrawn`` and
goes back to the queue (``learners.worker`` rejects it with requeue; acks are late), and the
groups it recorded stay recorded (a job is idempotent by its id). A request still running when
the server then shuts its engine down is withdrawn too.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import replace

from celery.result import _set_task_join_will_block
from celery.worker import state

from core.engine import Engine
from core.errors import EngineWithdrawn, MacaronError
from learners.queue import ROLLOUT, app
from learners.runtime import Runtime
from learners.worker import install_runtime

START_S = 30.0
STOP_S = 30.0
_log = logging.getLogger(__name__)
_running = threading.Lock()
"""Held by the process's one running lane: its runtime and Celery's shutdown flag are the
process's."""


class LaneUnavailable(MacaronError):
    """The rollout lane's consumer did not become ready (Redis unreachable)."""

    code = "rollout_lane_unavailable"


class RolloutLane:
    """A consumer of the rollout queue in this process, sampling on the views ``views`` makes
    (one per job: a job closes its engine when it is done)."""

    def __init__(self, runtime: Runtime, views: Callable[[], Engine]) -> None:
        self.runtime, self.views = runtime, views
        self._lock = threading.Lock()
        self._view: Engine | None = None
        self._stopping = False
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._holds = False

    def _next_view(self) -> Engine:
        with self._lock:
            if self._stopping:
                raise EngineWithdrawn("the rollout lane is stopping")
            self._view = self.views()
            return self._view

    def start(self) -> None:
        """Start consuming; ``LaneUnavailable`` if the consumer is not ready in ``START_S`` or
        another lane runs in this process."""
        if not _running.acquire(blocking=False):
            raise LaneUnavailable("a rollout lane already runs in this process")
        self._holds = True
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        install_runtime(replace(self.runtime, contract_engine=self._next_view))
        controller = app.WorkController(
            hostname=f"macaron-lane-{os.getpid()}@{socket.gethostname()}",
            pool="solo",
            concurrency=1,
            queues=[ROLLOUT],
            ready_callback=lambda _consumer: self._ready.set(),
            without_heartbeat=True,
            without_mingle=True,
            without_gossip=True,
        )

        def consume() -> None:
            app.set_current()  # a thread's own: its tasks find their backend through it
            controller.start()

        self._thread = threading.Thread(target=consume, name="rollout-lane", daemon=True)
        self._thread.start()
        if not self._ready.wait(START_S):
            raise LaneUnavailable(
                f"the rollout lane's consumer was not ready in {START_S:.0f} s: is Redis up "
                "(`macaron up`, or MACARON_REDIS_URL)?"
            )
        # A worker marks its process as one where waiting on a task's result would deadlock
        # it; the lane's tasks wait on none, and the rest of this process may wait on results.
        _set_task_join_will_block(False)
        _log.info("the rollout lane consumes the %r queue", ROLLOUT)

    def stop(self, wait_s: float = STOP_S) -> bool:
        """Withdraw the engine from the job at hand and stop consuming (Celery's warm shutdown:
        the flag its signal handler would set; left set if the consumer outlives ``wait_s``,
        so it stops after its job). Whether it stopped; if not, the server shuts its engine
        down under the job's request (withdrawn: the job goes back to the queue) and calls
        this again, so the rejection reaches the broker before the process ends."""
        with self._lock:
            self._stopping = True
            if self._view is not None:
                self._view.close()
        if self._thread is not None:
            state.should_stop = 0
            self._thread.join(wait_s)
            if self._thread.is_alive():
                _log.warning("the rollout lane did not stop in %.0f s", wait_s)
                return False
            state.should_stop = None
        _set_task_join_will_block(False)
        if self._holds:
            self._holds = False
            _running.release()
        return True
