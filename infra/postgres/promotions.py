"""Promotion requests: the serving process carries them out (``server.promotion``); anyone
may ask (the learning loop's ``promote`` task, ``macaron promote`` and ``rollback``, the admin
API) and wait for the outcome."""

from __future__ import annotations

import time
from typing import Any
from uuid import UUID

import psycopg

from core.errors import PromotionInProgress, ReleaseNotFound
from core.ids import uuid7
from infra.postgres.db import Pool


def request_promotion(
    pool: Pool,
    release_id: str,
    *,
    kind: str = "promote",
    run_id: UUID | None = None,
    requested_by: str,
) -> UUID:
    """Ask the serving process to make ``release_id`` active (it loads the adapters, sends a
    canary request and flips, or refuses with the reason). Returns the request id."""
    request_id = uuid7()
    try:
        with pool.connection() as conn, conn.transaction():
            conn.execute(
                "INSERT INTO promotion_requests (request_id, kind, release_id, run_id, "
                "requested_by) VALUES (%s, %s, %s, %s, %s)",
                (request_id, kind, release_id, run_id, requested_by),
            )
    except psycopg.errors.UniqueViolation:
        raise PromotionInProgress("another promotion is being carried out; retry") from None
    except psycopg.errors.ForeignKeyViolation:
        raise ReleaseNotFound(f"no release {release_id}") from None
    return request_id


def wait_for_request(pool: Pool, request_id: UUID, timeout: float) -> dict[str, Any]:
    """The request's final state, or its pending state after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        with pool.connection() as conn:
            row = conn.execute(
                "SELECT * FROM promotion_requests WHERE request_id = %s", (request_id,)
            ).fetchone()
        assert row is not None
        if row["status"] != "pending" or time.monotonic() > deadline:
            return dict(row)
        time.sleep(0.2)
