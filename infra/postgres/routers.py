"""Router versions in the registry (``router_versions``): each classifier a release can name,
stored whole (``core.routing.RouterModel``) under its content hash, with the version it was
retrained from, until its weights are erased (migration 0023); router runs (``router_runs``)
and the router trigger's count of new labels."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any
from uuid import UUID

from psycopg.types.json import Jsonb
from pydantic import ValidationError

from core.errors import RouterErased
from core.registry import RouterRun, RouterRunEnd
from core.routing import RouterInvalid, RouterModel, RouterNotFound
from infra.postgres.db import DictConnection


def register_router(conn: DictConnection, model: RouterModel, *, parent: str | None) -> None:
    """Store ``model`` under its version (idempotent: a version is its content)."""
    conn.execute(
        "INSERT INTO router_versions (router_version, parent_version, model) "
        "VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
        (model.version, parent, Jsonb(model.model_dump(mode="json"))),
    )


def router_parent(conn: DictConnection, version: str) -> str | None:
    """The router version ``version`` was refitted from (``None``: a seed router, or unknown)."""
    row = conn.execute(
        "SELECT parent_version FROM router_versions WHERE router_version = %s", (version,)
    ).fetchone()
    return None if row is None else row["parent_version"]


def router_model(conn: DictConnection, version: str) -> RouterModel:
    """The stored classifier of ``version``, checked against its content hash; ``RouterErased``
    once its weights were erased."""
    row = conn.execute(
        "SELECT model, erased_reason FROM router_versions WHERE router_version = %s", (version,)
    ).fetchone()
    if row is None:
        raise RouterNotFound(f"no router version {version!r} in the registry")
    if row["model"] is None:
        raise RouterErased(f"router version {version!r} was erased: {row['erased_reason']}")
    try:
        model = RouterModel.model_validate(row["model"])
    except ValidationError as exc:
        raise RouterInvalid(f"router version {version!r} does not match its content") from exc
    if model.version != version:
        raise RouterInvalid(f"the model stored as {version!r} is {model.version!r}")
    return model


def erase_routers(conn: DictConnection, versions: Collection[str], reason: str) -> list[str]:
    """Erase the weights of ``versions`` (their rows stay); returns those erased now."""
    rows = conn.execute(
        "UPDATE router_versions SET model = NULL, erased_at = now(), erased_reason = %s "
        "WHERE router_version = ANY(%s) AND model IS NOT NULL RETURNING router_version",
        (reason, list(versions)),
    ).fetchall()
    return sorted(row["router_version"] for row in rows)


def erased_routers(conn: DictConnection) -> dict[str, str]:
    """Every router version whose weights were erased, with why."""
    rows = conn.execute(
        "SELECT router_version, erased_reason FROM router_versions WHERE model IS NULL"
    ).fetchall()
    return {row["router_version"]: row["erased_reason"] for row in rows}


def add_pending_label(conn: DictConnection) -> int:
    """Count one more routing label since the last router run; returns the count."""
    row = conn.execute(
        "INSERT INTO router_trigger_state (key, pending) VALUES ('routing', 1) "
        "ON CONFLICT (key) DO UPDATE SET pending = router_trigger_state.pending + 1 "
        "RETURNING pending"
    ).fetchone()
    if row is None:
        raise RuntimeError("INSERT ... RETURNING gave no row")
    return int(row["pending"])


def queue_router_run(
    conn: DictConnection,
    run_id: UUID,
    labels_end: Mapping[int, int],
    label_count: int,
    left_out_tenants: Sequence[str] = (),
    judged_against: str | None = None,
) -> bool:
    """Queue a router run and start counting labels again; ``False`` (nothing changed) when a
    router run is in flight or this one exists. ``left_out_tenants``: the forgotten tenants
    whose labels it unlearns; ``judged_against``: the router it is then judged against."""
    row = conn.execute(
        "INSERT INTO router_runs (run_id, labels_end, label_count, status, left_out_tenants, "
        "judged_against) VALUES (%s, %s, %s, 'queued', %s, %s) "
        "ON CONFLICT DO NOTHING RETURNING run_id",
        (
            run_id,
            Jsonb({str(p): o for p, o in labels_end.items()}),
            label_count,
            list(left_out_tenants),
            judged_against,
        ),
    ).fetchone()
    if row is not None:
        conn.execute("UPDATE router_trigger_state SET pending = 0 WHERE key = 'routing'")
    return row is not None


def router_run_in_flight(conn: DictConnection) -> bool:
    row = conn.execute("SELECT 1 FROM router_runs WHERE status IN ('queued', 'running')").fetchone()
    return row is not None


def claim_router_run(conn: DictConnection, run_id: UUID, lease_seconds: int) -> RouterRun | None:
    """The run, now running under a lease, if it is queued or its last worker's lease ran out;
    ``None`` otherwise (done, or a live worker has it)."""
    row = conn.execute(
        "UPDATE router_runs SET status = 'running', lease_until = now() + %s * interval '1 s' "
        "WHERE run_id = %s AND (status = 'queued' OR (status = 'running' AND lease_until < now())) "
        "RETURNING *",
        (lease_seconds, run_id),
    ).fetchone()
    return None if row is None else _router_run(row)


def finish_router_run(conn: DictConnection, run_id: UUID, end: RouterRunEnd) -> None:
    """Record how a running run ended (nothing changes for a run no longer running)."""
    conn.execute(
        "UPDATE router_runs SET status = %s, parent_router_version = %s, router_version = %s, "
        "release_id = %s, evaluation = %s, error = %s, finished_at = now() "
        "WHERE run_id = %s AND status = 'running'",
        (
            end.status,
            end.parent,
            end.router_version,
            end.release_id,
            None if end.evaluation is None else Jsonb(dict(end.evaluation)),
            end.error,
            run_id,
        ),
    )


def router_run(conn: DictConnection, run_id: UUID) -> RouterRun | None:
    row = conn.execute("SELECT * FROM router_runs WHERE run_id = %s", (run_id,)).fetchone()
    return None if row is None else _router_run(row)


def _router_run(row: Mapping[str, Any]) -> RouterRun:
    return RouterRun(
        run_id=row["run_id"],
        labels_end={int(p): o for p, o in row["labels_end"].items()},
        label_count=row["label_count"],
        status=row["status"],
        left_out_tenants=tuple(row["left_out_tenants"]),
        judged_against=row["judged_against"],
        parent_router_version=row["parent_router_version"],
        router_version=row["router_version"],
        release_id=row["release_id"],
        evaluation=row["evaluation"],
        error=row["error"],
    )


def queued_router_run_ids(conn: DictConnection) -> list[UUID]:
    rows = conn.execute("SELECT run_id FROM router_runs WHERE status = 'queued'").fetchall()
    return [r["run_id"] for r in rows]
