"""What lineage needs to tell which adapters and releases learned from a tenant's records:
every adapter version with the snapshot its run trained on, and every release's adapters."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from core.log import Positions
from core.registry import ProducingRun, ReleaseParts, TrainedAdapter, TrainedRouter
from infra.postgres.db import DictConnection
from infra.postgres.runs import snapshot_of


def trained_adapters(conn: DictConnection) -> list[TrainedAdapter]:
    """Every adapter version, parents before children, with the end of the snapshot its
    succeeded run trained on, the tenants that snapshot left out and when the run was queued
    (``None`` for a version-0 adapter or one registered by hand)."""
    rows = conn.execute(
        "SELECT a.adapter_version_id, a.specialist, a.version, a.parent_id, s.end_positions, "
        "s.left_out_tenants, r.created_at AS queued_at "
        "FROM adapter_versions a LEFT JOIN training_runs r "
        "ON r.result_adapter_id = a.adapter_version_id AND r.status = 'succeeded' "
        "LEFT JOIN dataset_snapshots s USING (snapshot_id) ORDER BY a.adapter_version_id"
    ).fetchall()
    return [
        TrainedAdapter(
            adapter_version_id=row["adapter_version_id"],
            specialist=row["specialist"],
            version=row["version"],
            parent_id=row["parent_id"],
            trained_to=None if row["end_positions"] is None else _positions(row["end_positions"]),
            left_out_tenants=tuple(row["left_out_tenants"] or ()),
            queued_at=row["queued_at"],
        )
        for row in rows
    ]


def _positions(stored: Mapping[str, int]) -> Positions:
    return {int(p): o for p, o in stored.items()}


def release_adapters(conn: DictConnection) -> list[ReleaseParts]:
    """Each release's adapter versions and router version, and whether it is active, oldest
    release first."""
    rows = conn.execute(
        "SELECT r.release_id, r.active, r.router_version, "
        "array_agg(ra.adapter_version_id) AS adapter_ids FROM releases r "
        "JOIN release_adapters ra USING (release_id) "
        "GROUP BY r.release_id, r.active, r.created_at, r.router_version ORDER BY r.created_at"
    ).fetchall()
    return [
        ReleaseParts(
            release_id=row["release_id"],
            active=row["active"],
            router_version=row["router_version"],
            adapter_ids=tuple(row["adapter_ids"]),
        )
        for row in rows
    ]


def trained_routers(conn: DictConnection) -> list[TrainedRouter]:
    """Every router version a run trained, with the end of the labels it was fitted on, the
    forgotten tenants whose labels it left out and when the run was queued."""
    rows = conn.execute(
        "SELECT router_version, labels_end, left_out_tenants, created_at AS queued_at "
        "FROM router_runs "
        "WHERE router_version IS NOT NULL "
        "ORDER BY created_at"
    ).fetchall()
    return [
        TrainedRouter(
            router_version=row["router_version"],
            labels_end=_positions(row["labels_end"]),
            left_out_tenants=tuple(row["left_out_tenants"] or ()),
            queued_at=row["queued_at"],
        )
        for row in rows
    ]


def forgotten_times(conn: DictConnection) -> dict[str, datetime]:
    """When each forgotten tenant was forgotten."""
    rows = conn.execute(
        "SELECT tenant_id, forgotten_at FROM tenant_data_keys WHERE forgotten_at IS NOT NULL"
    ).fetchall()
    return {str(r["tenant_id"]): r["forgotten_at"] for r in rows}


def forgotten_tenants(conn: DictConnection) -> list[str]:
    rows = conn.execute(
        "SELECT tenant_id FROM tenant_data_keys WHERE forgotten_at IS NOT NULL ORDER BY tenant_id"
    ).fetchall()
    return [str(r["tenant_id"]) for r in rows]


def producing_run(conn: DictConnection, adapter_version_id: int) -> ProducingRun | None:
    """The succeeded run that trained an adapter version, with its snapshot."""
    row = conn.execute(
        "SELECT r.run_id, r.recipe, s.* FROM training_runs r "
        "JOIN dataset_snapshots s USING (snapshot_id) "
        "WHERE r.result_adapter_id = %s AND r.status = 'succeeded'",
        (adapter_version_id,),
    ).fetchone()
    return None if row is None else ProducingRun(row["run_id"], row["recipe"], snapshot_of(row))
