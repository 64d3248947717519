"""The unlearning dispatcher: hands to the workers the runs a server queued to unlearn
forgotten tenants (``UnlearningRequested``), as the serving process does not import the queue.
After the commit it enqueues those of them still queued: a redelivery enqueues nothing a
worker took up, and a replay (which never commits through the host) nothing at all; a run
enqueued twice is claimed once (the worker's lease). It owns no table and derives no
event."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from uuid import UUID

from core.events import NewEvent, UnlearningRequested
from core.log import RecordedEvent
from infra.postgres.db import DictConnection
from infra.postgres.routers import queued_router_run_ids
from infra.postgres.runs import queued_run_ids

Enqueue = Callable[[UUID, Mapping[str, str]], None]


class UnlearningDispatcher:
    name = "unlearning-dispatch-1"
    tables: tuple[str, ...] = ()

    def __init__(self, enqueue_run: Enqueue, enqueue_router_run: Enqueue) -> None:
        self.enqueue_run = enqueue_run
        self.enqueue_router_run = enqueue_router_run
        self._due: dict[UUID, tuple[Enqueue, Mapping[str, str]]] = {}
        """What the batch being handled asked for, by run (kept across a batch that rolled
        back and is handled again: enqueueing a queued run twice is harmless)."""

    def handle(self, conn: DictConnection, event: RecordedEvent) -> list[NewEvent]:
        asked = event.payload
        if not isinstance(asked, UnlearningRequested):
            return []
        runs = set(queued_run_ids(conn))
        trace = event.envelope.trace
        self._due |= {r: (self.enqueue_run, trace) for r in asked.runs if r in runs}
        if asked.router_run is not None and asked.router_run in queued_router_run_ids(conn):
            self._due[asked.router_run] = (self.enqueue_router_run, trace)
        return []

    def after_commit(self, derived: Sequence[NewEvent]) -> None:
        due, self._due = self._due, {}
        for run_id, (enqueue, trace) in due.items():
            enqueue(run_id, trace)
