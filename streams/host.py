"""What both hosts do with events: apply a batch to a processor in one transaction.

For a batch the host opens one transaction, lets the processor handle each event (writing its
tables), appends the derived events to the log (idempotent by their deterministic ids, so an
append that happened before a crash is a no-op when the batch is redelivered), saves the read
positions, and commits; then it runs the processor's ``after_commit``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from core.errors import TenantForgotten
from core.events import NewEvent
from core.log import DeadLetter, EventLog, Positions, RecordedEvent
from infra import observe
from infra.postgres.db import DictConnection, Pool
from infra.postgres.positions import load_positions, save_positions
from streams.processor import Processor


class ProcessorHost:
    def __init__(self, processor: Processor, log: EventLog, pool: Pool) -> None:
        self.processor = processor
        self.log = log
        self.pool = pool
        observe.watch_lag(self)

    @property
    def name(self) -> str:
        return self.processor.name

    def positions(self) -> Positions:
        with self.pool.connection() as conn:
            return load_positions(conn, self.processor.name)

    def lag(self) -> int:
        """Events stored in the log that this processor has not handled yet."""
        done = self.positions()
        return sum(max(0, end - done.get(p, 0)) for p, end in self.log.end_positions().items())

    def apply(self, events: Sequence[RecordedEvent]) -> list[NewEvent]:
        """Handle ``events`` (in log order) in one transaction; returns the derived events.
        Events below the saved positions (a redelivery) are skipped."""
        if not events:
            return []
        derived: list[NewEvent] = []
        with self.pool.connection() as conn, conn.transaction():
            positions = load_positions(conn, self.processor.name)
            for event in events:
                where = event.position
                if where.offset < positions.get(where.partition, 0):
                    continue
                derived += self._handle(conn, event)
                positions[where.partition] = where.offset + 1
            if derived:
                self._append(derived)
            save_positions(conn, self.processor.name, positions)
        self.processor.after_commit(derived)
        observe.processor_events.add(len(events), {"processor": self.processor.name})
        return derived

    def _append(self, derived: list[NewEvent]) -> None:
        """Append what was derived; what a tenant forgotten meanwhile would have written is
        dropped (its turn was read before its key was destroyed), and the rest goes on."""
        try:
            self.log.append(derived)
        except TenantForgotten:
            for event in derived:
                with contextlib.suppress(TenantForgotten):
                    self.log.append([event])

    def _handle(self, conn: DictConnection, event: RecordedEvent) -> list[NewEvent]:
        """One event, in a span that continues the event's trace; what it derives carries the
        span's context on."""
        envelope = event.envelope
        with observe.tracer.start_as_current_span(
            f"processor.{self.processor.name}",
            context=observe.context_of(envelope.trace),
            attributes={
                "macaron.event_type": envelope.type,
                "macaron.event_id": str(envelope.event_id),
            },
        ):
            derived = self.processor.handle(conn, event)
            headers = observe.carrier()
        return [e.model_copy(update={"trace": headers}) for e in derived]

    def skip(self, letter: DeadLetter) -> None:
        """Move past an event that cannot be decoded (the log's readers keep it as a dead
        letter); the processor never sees it."""
        with self.pool.connection() as conn, conn.transaction():
            positions = load_positions(conn, self.processor.name)
            where = letter.position
            if where.offset >= positions.get(where.partition, 0):
                positions[where.partition] = where.offset + 1
                save_positions(conn, self.processor.name, positions)
