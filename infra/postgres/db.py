"""Connection pools and the mapping of driver errors to typed errors."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg.rows import DictRow, dict_row
from psycopg_pool import ConnectionPool

from core.errors import EventIdConflict, InvalidEvent, LogUnavailable, SequenceConflict

DictConnection = psycopg.Connection[DictRow]
Pool = ConnectionPool[DictConnection]


POOL_WAIT_S = 5.0


def open_pool(url: str, *, min_size: int = 1, max_size: int = 8) -> Pool:
    """A pool of autocommit-off connections that return rows as dicts."""
    pool: Pool = ConnectionPool(
        url,
        connection_class=DictConnection,
        min_size=min_size,
        max_size=max_size,
        kwargs={"row_factory": dict_row, "options": "-c TimeZone=UTC"},
        # A connection that died while idle (a database restart) is replaced, not handed out;
        # while the database is away a caller waits at most POOL_WAIT_S, then gets the
        # retryable ``unavailable`` (PoolTimeout is an OperationalError).
        check=ConnectionPool.check_connection,
        timeout=POOL_WAIT_S,
        open=False,
        name="macaron",
    )
    try:
        pool.open(wait=True, timeout=10.0)
    except psycopg.OperationalError as exc:
        pool.close()
        raise LogUnavailable(f"PostgreSQL is unreachable: {exc}") from exc
    except Exception:
        pool.close()
        raise
    return pool


@contextmanager
def unavailable_as_typed() -> Iterator[None]:
    """Turn lost or refused connections into the retryable ``LogUnavailable``."""
    try:
        yield
    except (psycopg.OperationalError, psycopg.errors.AdminShutdown) as exc:
        raise LogUnavailable(f"PostgreSQL is unavailable: {exc}") from exc


@contextmanager
def storage_errors(sequence_constraint: str) -> Iterator[None]:
    """Map what PostgreSQL refuses on an append to typed errors (by SQLSTATE and constraint)."""
    try:
        yield
    except psycopg.errors.UniqueViolation as exc:
        if exc.diag.constraint_name == sequence_constraint:
            raise SequenceConflict("another writer appended to the same key first") from exc
        raise EventIdConflict("an event id was appended concurrently") from exc
    except (psycopg.errors.UntranslatableCharacter, psycopg.errors.CheckViolation) as exc:
        raise InvalidEvent(f"event cannot be stored: {exc.diag.message_primary}") from exc
