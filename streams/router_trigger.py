"""The router trigger: when ``threshold`` routing labels (``RoutingLabelled``) came since the
last router run and none is in flight, it queues a router run over every label of the log up to
the one that made it due, records ``RouterTrainingRequested`` and, after the commit, enqueues
the run (task id = run id). Ids derive from the label's position, so a redelivery queues
nothing new. The count lives in PostgreSQL (``infra.postgres.routers``)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from uuid import UUID

from core.events import NewEvent, RouterTrainingRequested, RoutingLabelled
from core.ids import derived_id
from core.log import RecordedEvent
from core.routing import ROUTER_RUNS_KEY
from infra.postgres.db import DictConnection
from infra.postgres.routers import add_pending_label, queue_router_run, router_run_in_flight


class RouterTrigger:
    name = "router-trigger-1"
    tables: tuple[str, ...] = ("router_trigger_state",)

    def __init__(self, threshold: int, enqueue: Callable[[UUID, Mapping[str, str]], None]) -> None:
        self.threshold = threshold
        self.enqueue = enqueue

    def handle(self, conn: DictConnection, event: RecordedEvent) -> list[NewEvent]:
        if not isinstance(event.payload, RoutingLabelled):
            return []
        pending = add_pending_label(conn)
        if pending < self.threshold or router_run_in_flight(conn):
            return []
        where = event.position
        end = {where.partition: where.offset + 1}
        run_id = derived_id("router-run", where.partition, where.offset + 1)
        if not queue_router_run(conn, run_id, end, pending):
            return []
        requested = RouterTrainingRequested(
            run_id=run_id, labels=pending, labels_end={str(p): o for p, o in end.items()}
        )
        return [
            NewEvent(
                payload=requested,
                tenant_id="system",
                key=ROUTER_RUNS_KEY,
                event_id=run_id,
                causation_id=event.envelope.event_id,
            )
        ]

    def after_commit(self, derived: Sequence[NewEvent]) -> None:
        for event in derived:
            if isinstance(event.payload, RouterTrainingRequested):
                self.enqueue(event.payload.run_id, event.trace)
