"""Promotion requests: the serving process carries them out (``server.promotion``); anyone
may ask (the learning loop's ``promote`` task, ``macaron promote`` and ``rollback``, the admin
API) and wait for the outcome."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any
from uuid import UUID

import psycopg

from core.errors import PromotionFailed, PromotionInProgress, ReleaseNotFound
from core.ids import uuid7
from core.registry import Promotion, PromotionRequest
from infra.postgres.db import DictConnection, Pool


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


def wait_for_request(pool: Pool, request_id: UUID, timeout: float) -> PromotionRequest:
    """The request's final state, or its pending state after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        with pool.connection() as conn:
            row = conn.execute(
                "SELECT * FROM promotion_requests WHERE request_id = %s", (request_id,)
            ).fetchone()
        if row is None:
            raise PromotionFailed(f"no promotion request {request_id}")
        if row["status"] != "pending" or time.monotonic() > deadline:
            return _request(row)
        time.sleep(0.2)


_CLAIM_LOCK = 0x6D6163_70726F6D  # "macprom": the advisory lock of promotion requests


def _pending_request(conn: DictConnection) -> PromotionRequest | None:
    """The request waiting to be carried out, if any (at most one is pending at a time)."""
    row = conn.execute("SELECT * FROM promotion_requests WHERE status = 'pending'").fetchone()
    return None if row is None else _request(row)


def _request(row: Mapping[str, Any]) -> PromotionRequest:
    return PromotionRequest(
        request_id=row["request_id"],
        kind=row["kind"],
        release_id=row["release_id"],
        run_id=row["run_id"],
        requested_by=row["requested_by"],
        status=row["status"],
        reason=row["reason"],
    )


class RequestClaim:
    """The right to carry out promotion requests, held by one server at a time: a session
    advisory lock on a connection of its own, so a server that dies lets go with its session."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self._conn: DictConnection | None = None

    def acquire(self) -> PromotionRequest | None:
        """The pending request, held until ``release``; None when there is none or another
        server is carrying one out."""
        conn = self._pool.getconn()
        request = None
        try:
            row = conn.execute("SELECT pg_try_advisory_lock(%s) AS got", (_CLAIM_LOCK,)).fetchone()
            if row is not None and row["got"]:
                request = _pending_request(conn)
                if request is None:
                    conn.execute("SELECT pg_advisory_unlock(%s)", (_CLAIM_LOCK,))
            conn.commit()
        except BaseException:
            conn.close()  # ends the session, and any lock it took with it
            self._pool.putconn(conn)
            raise
        if request is None:
            self._pool.putconn(conn)
        else:
            self._conn = conn
        return request

    def release(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            conn.execute("SELECT pg_advisory_unlock(%s)", (_CLAIM_LOCK,))
            conn.commit()
        except BaseException:
            conn.close()  # ends the session, and the lock with it
            raise
        finally:
            self._pool.putconn(conn)


def last_request_of_run(conn: DictConnection, run_id: UUID) -> PromotionRequest | None:
    """The newest request made for ``run_id``, if any."""
    row = conn.execute(
        "SELECT * FROM promotion_requests WHERE run_id = %s ORDER BY requested_at DESC LIMIT 1",
        (run_id,),
    ).fetchone()
    return None if row is None else _request(row)


def record_promotion(conn: DictConnection, promotion: Promotion) -> None:
    """What happened to a request (``promoted``, ``rolled_back`` or ``rejected``), for lineage."""
    p = promotion
    conn.execute(
        "INSERT INTO promotions (promotion_id, kind, from_release_id, to_release_id, "
        "run_id, reason) VALUES (%s, %s, %s, %s, %s, %s)",
        (p.promotion_id, p.kind, p.from_release_id, p.to_release_id, p.run_id, p.reason),
    )


def finish_request(conn: DictConnection, request_id: UUID, *, note: str | None = None) -> None:
    """Mark the request done; ``note`` says how, when the release made active is not the one
    asked for (``rebased onto X as Y``)."""
    conn.execute(
        "UPDATE promotion_requests SET status = 'done', reason = %s, finished_at = now() "
        "WHERE request_id = %s",
        (note, request_id),
    )


def promoted_once(conn: DictConnection, release_id: str) -> bool:
    """Whether a request to promote ``release_id`` was ever carried out (a rollback since
    does not undo that it was)."""
    row = conn.execute(
        "SELECT 1 FROM promotion_requests WHERE release_id = %s AND kind = 'promote' "
        "AND status = 'done' LIMIT 1",
        (release_id,),
    ).fetchone()
    return row is not None


def fail_request(conn: DictConnection, request_id: UUID, reason: str) -> None:
    conn.execute(
        "UPDATE promotion_requests SET status = 'failed', reason = %s, "
        "finished_at = now() WHERE request_id = %s",
        (reason, request_id),
    )
