"""What lineage needs to tell which adapters and releases learned from a tenant's records:
every adapter version with the snapshot its run trained on, and every release's adapters."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from infra.postgres.db import DictConnection


def trained_adapters(conn: DictConnection) -> list[dict[str, Any]]:
    """Every adapter version, parents before children, with the end of the snapshot its
    succeeded run trained on, the tenants that snapshot left out and when the run was queued
    (``None`` for a version-0 adapter or one registered by hand)."""
    return conn.execute(
        "SELECT a.adapter_version_id, a.specialist, a.version, a.parent_id, s.end_positions, "
        "s.left_out_tenants, r.created_at AS queued_at "
        "FROM adapter_versions a LEFT JOIN training_runs r "
        "ON r.result_adapter_id = a.adapter_version_id AND r.status = 'succeeded' "
        "LEFT JOIN dataset_snapshots s USING (snapshot_id) ORDER BY a.adapter_version_id"
    ).fetchall()


def release_adapters(conn: DictConnection) -> list[dict[str, Any]]:
    """Each release's adapter versions and router version, and whether it is active."""
    return conn.execute(
        "SELECT r.release_id, r.active, r.created_at, r.router_version, "
        "array_agg(ra.adapter_version_id) AS adapter_ids FROM releases r "
        "JOIN release_adapters ra USING (release_id) "
        "GROUP BY r.release_id, r.active, r.created_at, r.router_version ORDER BY r.created_at"
    ).fetchall()


def trained_routers(conn: DictConnection) -> list[dict[str, Any]]:
    """Every router version a run trained, with the end of the labels it was fitted on, the
    forgotten tenants whose labels it left out and when the run was queued."""
    return conn.execute(
        "SELECT router_version, labels_end, left_out_tenants, created_at AS queued_at "
        "FROM router_runs "
        "WHERE router_version IS NOT NULL "
        "ORDER BY created_at"
    ).fetchall()


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


def producing_run(conn: DictConnection, adapter_version_id: int) -> dict[str, Any] | None:
    """The succeeded run that trained an adapter version, with its snapshot's row."""
    row = conn.execute(
        "SELECT r.run_id, r.recipe, s.* FROM training_runs r "
        "JOIN dataset_snapshots s USING (snapshot_id) "
        "WHERE r.result_adapter_id = %s AND r.status = 'succeeded'",
        (adapter_version_id,),
    ).fetchone()
    return None if row is None else dict(row)
