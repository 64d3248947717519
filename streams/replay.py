"""Replay: rebuild a processor's output from the log into a fresh schema and hash it.

The processor runs over ``[start, end)`` with ``search_path`` set to a new schema holding empty
copies of its tables, so the live tables are untouched; the derived events it returns are
dropped (the live run appended them already, with the same ids), and nothing is enqueued. The
content hash equals the live one when the live processor has read to the same place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from core.events.privacy import Forgotten
from core.log import EventLog
from infra.postgres.db import Pool
from infra.postgres.replay import scratch_schema, search_first
from streams.processor import Processor, content_hash


@dataclass(frozen=True)
class Replayed:
    digest: str
    """The content hash of the rebuilt tables."""
    handled: int
    """Events read, forgotten ones included."""
    forgotten: int
    """Events of forgotten tenants among them: read as markers, which no rule learns from (the
    training trigger only leaves their tenants out of its ranges)."""


def replay(
    processor: Processor,
    log: EventLog,
    pool: Pool,
    *,
    start: Mapping[int, int] | None = None,
    end: Mapping[int, int] | None = None,
) -> Replayed:
    """Rebuild ``processor``'s tables from the log range."""
    handled = forgotten = 0
    with pool.connection() as conn, scratch_schema(conn, processor.tables) as schema:
        with conn.transaction():
            search_first(conn, schema)
            for event in log.read(start=start, end=end):
                processor.handle(conn, event)
                handled += 1
                forgotten += isinstance(event.payload, Forgotten)
        return Replayed(content_hash(conn, processor, schema), handled, forgotten)
