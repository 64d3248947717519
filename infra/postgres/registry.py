"""The release registry in PostgreSQL: specialists, adapter versions, harness versions,
releases."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from uuid import UUID

from psycopg.types.json import Jsonb

from core.canonical import canonical_json, sha256_hex
from core.errors import HarnessInvalid, HarnessNotFound, NoActiveRelease, ReleaseNotFound
from core.harness.artifact import HarnessSpec, HarnessVersion, harness_from, harness_number
from core.registry import AdapterVersion, HarnessEntry, NewAdapterVersion
from core.release import AdapterRef, Release
from infra.postgres.db import DictConnection


def ensure_specialists(conn: DictConnection, names: list[str]) -> None:
    conn.cursor().executemany(
        "INSERT INTO specialists (name) VALUES (%s) ON CONFLICT DO NOTHING", [(n,) for n in names]
    )


def register_adapter(conn: DictConnection, adapter: NewAdapterVersion) -> AdapterRef:
    a = adapter
    row = conn.execute(
        "INSERT INTO adapter_versions (specialist, version, parent_id, sha256, path, rank, "
        "base_model) VALUES (%s, %s, %s, %s, %s, %s, %s) RETURNING adapter_version_id",
        (a.specialist, a.version, a.parent_id, a.sha256, a.path, a.rank, a.base_model),
    ).fetchone()
    assert row is not None  # RETURNING always yields the row
    return AdapterRef(
        adapter_version_id=row["adapter_version_id"],
        specialist=a.specialist,
        version=a.version,
        sha256=a.sha256,
        path=a.path,
        rank=a.rank,
    )


def register_harness(
    conn: DictConnection, spec: HarnessSpec, *, parent: HarnessVersion | None
) -> HarnessVersion:
    """Store ``spec`` under the next version number, or return the version already stored at
    its address (registering is idempotent). Only ``harness@0`` has no parent."""
    address = spec.address
    with conn.transaction():
        conn.execute("LOCK TABLE harness_versions IN SHARE ROW EXCLUSIVE MODE")
        row = conn.execute(
            "SELECT * FROM harness_versions WHERE sha256 = %s", (address,)
        ).fetchone()
        if row is not None:
            return _harness(row)
        top = conn.execute("SELECT max(version) AS v FROM harness_versions").fetchone()
        version = 0 if top is None or top["v"] is None else int(top["v"]) + 1
        if (version == 0) != (parent is None):
            raise HarnessInvalid(
                "the first harness registered is harness@0, the root: it has no parent"
                if version == 0
                else f"a harness with address {address} has no parent, but harness@0 is "
                "registered with another address: a new harness names its parent"
            )
        row = conn.execute(
            "INSERT INTO harness_versions (version, name, sha256, parent_version, spec) "
            "VALUES (%s, %s, %s, %s, %s) RETURNING *",
            (
                version,
                f"harness@{version}",
                address,
                None if parent is None else parent.version,
                Jsonb(spec.model_dump(mode="json")),
            ),
        ).fetchone()
    assert row is not None  # RETURNING always yields the row
    return _harness(row)


def harness_by_name(conn: DictConnection, ref: str) -> HarnessVersion:
    """The registered harness ``ref`` names (``harness@N``; the legacy ``harness-1`` is
    ``harness@0``), checked against its address and against what this server can serve."""
    version = harness_number(ref)
    row = conn.execute("SELECT * FROM harness_versions WHERE version = %s", (version,)).fetchone()
    if row is None:
        raise HarnessNotFound(f"no harness version harness@{version}")
    return _harness(row)


def harness_list(conn: DictConnection) -> list[HarnessEntry]:
    """Every registered harness version, oldest first: name, address, parent, when."""
    rows = conn.execute(
        "SELECT name, sha256, parent_version, created_at FROM harness_versions ORDER BY version"
    ).fetchall()
    return [HarnessEntry(**row) for row in rows]


def _harness(row: Mapping[str, Any]) -> HarnessVersion:
    """A stored harness, its content checked against its address before it is trusted."""
    if sha256_hex(canonical_json(row["spec"])) != row["sha256"]:
        raise HarnessInvalid(f"stored {row['name']} does not hash to its address {row['sha256']}")
    spec = harness_from(row["spec"])
    return HarnessVersion(
        version=row["version"],
        sha256=row["sha256"],
        parent_version=row["parent_version"],
        spec=spec,
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


def file_release(conn: DictConnection, release: Release) -> None:
    """Record ``release`` (not active) unless it is recorded already: a release id is its
    content and its parent, so filing the same change again names the same release."""
    found = conn.execute(
        "SELECT 1 FROM releases WHERE release_id = %s", (release.release_id,)
    ).fetchone()
    if found is None:
        create_release(conn, release, active=False)


def file_rebased_release(conn: DictConnection, release: Release, source_release_id: str) -> None:
    """Record ``release``, the change of ``source_release_id`` rebased onto a newer parent,
    with the run that judged the source (once)."""
    file_release(conn, release)
    conn.execute(
        "UPDATE releases SET run_id = (SELECT run_id FROM releases WHERE release_id = %s) "
        "WHERE release_id = %s AND run_id IS NULL",
        (source_release_id, release.release_id),
    )


def adapter_at(conn: DictConnection, specialist: str, version: int) -> AdapterRef | None:
    """The registered adapter ``specialist@version``, or ``None``."""
    row = conn.execute(
        "SELECT * FROM adapter_versions WHERE specialist = %s AND version = %s",
        (specialist, version),
    ).fetchone()
    return None if row is None else adapter_ref(row)


def next_adapter_version(conn: DictConnection, specialist: str) -> int:
    """The version number the specialist's next adapter gets."""
    row = conn.execute(
        "SELECT max(version) + 1 AS v FROM adapter_versions WHERE specialist = %s",
        (specialist,),
    ).fetchone()
    return 1 if row is None or row["v"] is None else int(row["v"])


def adapter_version(conn: DictConnection, adapter_version_id: int) -> AdapterVersion | None:
    """An adapter version (with its base model and parent), or ``None``."""
    row = conn.execute(
        "SELECT * FROM adapter_versions WHERE adapter_version_id = %s", (adapter_version_id,)
    ).fetchone()
    if row is None:
        return None
    return AdapterVersion(adapter_ref(row), row["parent_id"], row["base_model"])


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
