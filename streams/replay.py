"""Replay: rebuild a processor's output from the log into a fresh schema and hash it.

The processor runs over ``[start, end)`` with ``search_path`` set to a new schema holding empty
copies of its tables, so the live tables are untouched; the derived events it returns are
dropped (the live run appended them already, with the same ids), and nothing is enqueued. The
content hash equals the live one when the live processor has read to the same place.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping

from core.log import EventLog
from infra.postgres.db import Pool
from streams.processor import Processor, content_hash


def replay(
    processor: Processor,
    log: EventLog,
    pool: Pool,
    *,
    start: Mapping[int, int] | None = None,
    end: Mapping[int, int] | None = None,
) -> tuple[str, int]:
    """Rebuild ``processor``'s tables from the log range; returns (content hash, events)."""
    schema = f"replay_{uuid.uuid4().hex[:12]}"
    handled = 0
    with pool.connection() as conn:
        try:
            with conn.transaction():
                conn.execute(f'CREATE SCHEMA "{schema}"')
                for table in processor.tables:
                    conn.execute(
                        f'CREATE TABLE "{schema}"."{table}" (LIKE public."{table}" INCLUDING ALL)'
                    )
            with conn.transaction():
                conn.execute(f'SET LOCAL search_path TO "{schema}", public')
                for event in log.read(start=start, end=end):
                    processor.handle(conn, event)
                    handled += 1
            return content_hash(conn, processor, schema), handled
        finally:
            with conn.transaction():
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
