"""The release registry in PostgreSQL: specialists, adapter versions, releases."""

from __future__ import annotations

from collections.abc import Mapping

from core.errors import NoActiveRelease, ReleaseNotFound
from core.release import AdapterRef, Release
from infra.postgres.db import DictConnection


def ensure_specialists(conn: DictConnection, names: list[str]) -> None:
    conn.cursor().executemany(
        "INSERT INTO specialists (name) VALUES (%s) ON CONFLICT DO NOTHING", [(n,) for n in names]
    )


def register_adapter(
    conn: DictConnection,
    *,
    specialist: str,
    version: int,
    parent_id: int | None,
    sha256: str,
    path: str,
    rank: int,
    base_model: str,
) -> AdapterRef:
    row = conn.execute(
        "INSERT INTO adapter_versions (specialist, version, parent_id, sha256, path, rank, "
        "base_model) VALUES (%s, %s, %s, %s, %s, %s, %s) RETURNING adapter_version_id",
        (specialist, version, parent_id, sha256, path, rank, base_model),
    ).fetchone()
    assert row is not None  # RETURNING always yields the row
    return AdapterRef(
        adapter_version_id=row["adapter_version_id"],
        specialist=specialist,
        version=version,
        sha256=sha256,
        path=path,
        rank=rank,
    )


def create_release(conn: DictConnection, release: Release, *, active: bool) -> None:
    """Record a release and its adapters; ``active`` makes it the one served (the caller's
    transaction flips the previous one off first)."""
    if active:
        conn.execute("UPDATE releases SET active = false WHERE active")
    conn.execute(
        "INSERT INTO releases (release_id, parent_release_id, base_model, router_version, "
        "harness_version, hcp_version, active) VALUES (%s, %s, %s, %s, %s, %s, %s)",
        (
            release.release_id,
            release.parent_release_id,
            release.base_model,
            release.router_version,
            release.harness_version,
            release.hcp_version,
            active,
        ),
    )
    conn.cursor().executemany(
        "INSERT INTO release_adapters (release_id, specialist, adapter_version_id) "
        "VALUES (%s, %s, %s)",
        [(release.release_id, s, a.adapter_version_id) for s, a in release.adapters.items()],
    )


def active_release(conn: DictConnection) -> Release:
    row = conn.execute("SELECT * FROM releases WHERE active").fetchone()
    if row is None:
        raise NoActiveRelease("no release is active: `macaron serve` creates the root release")
    return _release(conn, row)


def release_by_id(conn: DictConnection, release_id: str) -> Release:
    row = conn.execute("SELECT * FROM releases WHERE release_id = %s", (release_id,)).fetchone()
    if row is None:
        raise ReleaseNotFound(f"no release {release_id}")
    return _release(conn, row)


def _release(conn: DictConnection, row: Mapping[str, object]) -> Release:
    adapters = conn.execute(
        "SELECT a.* FROM release_adapters r JOIN adapter_versions a USING (adapter_version_id) "
        "WHERE r.release_id = %s ORDER BY a.specialist",
        (row["release_id"],),
    ).fetchall()
    return Release(
        release_id=str(row["release_id"]),
        parent_release_id=None
        if row["parent_release_id"] is None
        else str(row["parent_release_id"]),
        base_model=str(row["base_model"]),
        router_version=str(row["router_version"]),
        harness_version=str(row["harness_version"]),
        hcp_version=str(row["hcp_version"]),
        adapters={
            a["specialist"]: AdapterRef(
                adapter_version_id=a["adapter_version_id"],
                specialist=a["specialist"],
                version=a["version"],
                sha256=a["sha256"],
                path=a["path"],
                rank=a["rank"],
            )
            for a in adapters
        },
    )
