"""Stream processors: handlers that turn events into rows and derived events.

A processor is hosted by either host (``streams.runner`` over any ``EventLog``; the faust app
over Kafka) with the same code. For each event the host opens one PostgreSQL transaction, calls
``handle`` (which writes the processor's own tables with that connection), appends the derived
events it returns, saves the read position, and commits. Derived events have deterministic ids,
so the appends of a redelivered event are no-ops: exactly-once effect over at-least-once
delivery, without broker transactions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from core.events import NewEvent
from core.log import RecordedEvent
from infra.postgres.db import DictConnection
from infra.postgres.replay import tables_hash


class Processor(Protocol):
    name: str
    """Also the key of its read positions; a new version of its rules is a new name."""
    tables: tuple[str, ...]
    """The tables it owns, in a fixed order (content hash, replay)."""

    def handle(self, conn: DictConnection, event: RecordedEvent) -> list[NewEvent]:
        """Apply one event inside the host's transaction; return derived events."""
        ...

    def after_commit(self, derived: Sequence[NewEvent]) -> None:
        """Side effects outside PostgreSQL (enqueueing a task), after the commit; must be
        idempotent, as a crash between commit and this call repeats nothing by itself."""
        ...


def content_hash(conn: DictConnection, processor: Processor, schema: str = "public") -> str:
    """sha256 over the processor's tables, rows in primary-key order: the same events give the
    same hash whichever host or replay produced them."""
    return tables_hash(conn, processor.tables, schema)
