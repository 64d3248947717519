"""Migrations and the registry's invariants, on a real PostgreSQL."""

from __future__ import annotations

import hashlib
import uuid

import psycopg
import pytest

from infra.postgres.db import DictConnection, Pool
from infra.postgres.migrate import migrate
from infra.postgres.positions import load_positions, save_positions


def test_migrate_is_idempotent(database_url: str) -> None:
    assert migrate(database_url) == []  # the template was migrated already


def _adapter(conn: DictConnection, specialist: str, version: int, parent: int | None) -> int:
    row = conn.execute(
        "INSERT INTO adapter_versions (specialist, version, parent_id, sha256, path, rank, "
        "base_model) VALUES (%s, %s, %s, %s, %s, 16, 'smollm2') RETURNING adapter_version_id",
        (
            specialist,
            version,
            parent,
            hashlib.sha256(f"{specialist}{version}".encode()).hexdigest(),
            f"adapters/{specialist}/{version}",
        ),
    ).fetchone()
    assert row is not None
    return int(row["adapter_version_id"])


def test_exactly_one_active_release(pool: Pool) -> None:
    with pool.connection() as conn:
        for rid in ("r0", "r1"):
            conn.execute(
                "INSERT INTO releases (release_id, base_model, router_version, harness_version, "
                "hcp_version, active) VALUES (%s, 'smollm2', 'router-1', 'h1', 'hcp-1', %s)",
                (rid, rid == "r0"),
            )
    with pool.connection() as conn, pytest.raises(psycopg.errors.UniqueViolation):
        conn.execute("UPDATE releases SET active = true WHERE release_id = 'r1'")
    # Flipping in one transaction works and leaves exactly one active.
    with pool.connection() as conn, conn.transaction():
        conn.execute("UPDATE releases SET active = false WHERE active")
        conn.execute("UPDATE releases SET active = true WHERE release_id = 'r1'")
    with pool.connection() as conn:
        rows = conn.execute("SELECT release_id FROM releases WHERE active").fetchall()
    assert [r["release_id"] for r in rows] == ["r1"]


def test_adapter_versions_are_immutable_and_rooted(pool: Pool) -> None:
    with pool.connection() as conn:
        conn.execute("INSERT INTO specialists (name) VALUES ('coding')")
        root = _adapter(conn, "coding", 0, None)
        _adapter(conn, "coding", 1, root)
    with pool.connection() as conn, pytest.raises(psycopg.errors.CheckViolation):
        _adapter(conn, "coding", 2, None)  # only version 0 has no parent
    with pool.connection() as conn, pytest.raises(psycopg.errors.UniqueViolation):
        _adapter(conn, "coding", 1, root)
    with pool.connection() as conn, pytest.raises(psycopg.errors.RestrictViolation):
        conn.execute("UPDATE adapter_versions SET path = 'elsewhere'")


INSERT_KEY = (
    "INSERT INTO api_keys (key_id, tenant_id, key_hash, scopes) VALUES (%s, 'acme', %s, %s)"
)


def test_api_keys_store_only_hashes(pool: Pool) -> None:
    with pool.connection() as conn:
        conn.execute("INSERT INTO tenants (tenant_id, name) VALUES ('acme', 'Acme')")
        conn.execute(
            INSERT_KEY,
            (uuid.uuid4(), hashlib.sha256(b"mk_secret").hexdigest(), ["chat"]),
        )
    with pool.connection() as conn, pytest.raises(psycopg.errors.CheckViolation):
        conn.execute(
            INSERT_KEY,
            (uuid.uuid4(), "mk_plaintext_key", ["chat"]),
        )
    with pool.connection() as conn, pytest.raises(psycopg.errors.CheckViolation):
        conn.execute(
            INSERT_KEY,
            (uuid.uuid4(), "0" * 64, ["root"]),
        )


def test_outputs_and_position_commit_together(pool: Pool) -> None:
    with pool.connection() as conn:
        conn.execute("CREATE TABLE projection_demo (event_offset BIGINT PRIMARY KEY)")
    with pool.connection() as conn:
        with pytest.raises(RuntimeError), conn.transaction():
            conn.execute("INSERT INTO projection_demo VALUES (1)")
            save_positions(conn, "demo", {0: 2})
            raise RuntimeError("processor crashed before commit")
        assert load_positions(conn, "demo") == {}
        assert conn.execute("SELECT count(*) AS n FROM projection_demo").fetchone() == {"n": 0}
        with conn.transaction():
            conn.execute("INSERT INTO projection_demo VALUES (1)")
            save_positions(conn, "demo", {0: 2, 3: 10})
        assert load_positions(conn, "demo") == {0: 2, 3: 10}
        with conn.transaction():
            save_positions(conn, "demo", {0: 5})
        assert load_positions(conn, "demo") == {0: 5, 3: 10}


def test_save_positions_refuses_to_run_outside_a_transaction(database_url: str) -> None:
    with psycopg.connect(database_url, autocommit=True) as conn, pytest.raises(RuntimeError):
        save_positions(conn, "demo", {0: 1})
