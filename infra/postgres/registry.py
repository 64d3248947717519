"""The release registry in PostgreSQL: specialists, adapter versions, releases."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from uuid import UUID

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


def next_adapter_version(conn: DictConnection, specialist: str) -> int:
    """The version number the specialist's next adapter gets."""
    row = conn.execute(
        "SELECT max(version) + 1 AS v FROM adapter_versions WHERE specialist = %s",
        (specialist,),
    ).fetchone()
    return 1 if row is None or row["v"] is None else int(row["v"])


def adapter_version(conn: DictConnection, adapter_version_id: int) -> dict[str, Any] | None:
    """An adapter version's row (with its base model and parent), or ``None``."""
    row = conn.execute(
        "SELECT * FROM adapter_versions WHERE adapter_version_id = %s", (adapter_version_id,)
    ).fetchone()
    return None if row is None else dict(row)


def active_adapter(conn: DictConnection, specialist: str) -> AdapterRef | None:
    """The adapter the active release serves ``specialist`` with, or ``None``."""
    row = conn.execute(
        "SELECT a.* FROM releases r JOIN release_adapters ra USING (release_id) "
        "JOIN adapter_versions a USING (adapter_version_id) "
        "WHERE r.active AND ra.specialist = %s",
        (specialist,),
    ).fetchone()
    return None if row is None else adapter_ref(row)


def record_successor(conn: DictConnection, release: Release, run_id: UUID) -> None:
    """Record a release that ``run_id``'s evaluation defined (not active), once."""
    conn.execute("SELECT 1 FROM releases WHERE release_id = %s FOR UPDATE", (release.release_id,))
    exists = conn.execute(
        "SELECT 1 FROM releases WHERE release_id = %s", (release.release_id,)
    ).fetchone()
    if exists is None:
        create_release(conn, release, active=False)
        conn.execute(
            "UPDATE releases SET run_id = %s WHERE release_id = %s", (run_id, release.release_id)
        )


def lock_releases(conn: DictConnection) -> None:
    """Hold off every other writer of releases until the transaction ends (two servers
    starting at once make one root release)."""
    conn.execute("LOCK TABLE releases IN EXCLUSIVE MODE")


def activate_release(conn: DictConnection, release_id: str, promoted_by: str) -> None:
    """Make ``release_id`` the one served; call inside the transaction that records why."""
    conn.execute("UPDATE releases SET active = false WHERE active")
    conn.execute(
        "UPDATE releases SET active = true, promoted_by = %s WHERE release_id = %s",
        (promoted_by, release_id),
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
        adapters={a["specialist"]: adapter_ref(a) for a in adapters},
    )


def adapter_ref(row: Mapping[str, Any]) -> AdapterRef:
    """An ``adapter_versions`` row as the reference releases and engines use."""
    return AdapterRef(
        adapter_version_id=row["adapter_version_id"],
        specialist=row["specialist"],
        version=row["version"],
        sha256=row["sha256"],
        path=row["path"],
        rank=row["rank"],
    )
