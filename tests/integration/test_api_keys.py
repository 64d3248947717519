"""API keys: made once, stored only as hashes, scoped per tenant, revocable."""

from __future__ import annotations

import uuid

import psycopg
import pytest

from core.auth import key_hash
from core.errors import ConfigError, InvalidApiKey
from infra.local_stack import LocalStack
from infra.postgres.db import Pool
from infra.postgres.keys import authenticate, create_key, list_keys, revoke_key
from tests.factories import run_macaron


def test_a_key_authenticates_its_tenant_with_its_scopes(pool: Pool) -> None:
    with pool.connection() as conn:
        key_id, key = create_key(conn, "acme", {"chat"})
        admin_id, admin_key = create_key(conn, "acme", {"chat", "admin"})
        principal = authenticate(conn, key)
        assert (principal.tenant_id, principal.key_id) == ("acme", key_id)
        assert principal.allows("chat") and not principal.allows("admin")
        assert authenticate(conn, admin_key).allows("admin")
        other_key = create_key(conn, "globex", {"chat"})[1]
        assert authenticate(conn, other_key).tenant_id == "globex"
        assert {r.key_id for r in list_keys(conn, "acme")} == {key_id, admin_id}


def test_only_hashes_are_stored(pool: Pool, database_url: str) -> None:
    with pool.connection() as conn:
        _, key = create_key(conn, "acme", {"chat"})
    with psycopg.connect(database_url) as conn:
        dump = "".join(str(row) for row in conn.execute("SELECT * FROM api_keys").fetchall())
    assert key not in dump and key_hash(key) in dump


def test_revoked_unknown_and_malformed_keys_are_refused(pool: Pool) -> None:
    with pool.connection() as conn:
        key_id, key = create_key(conn, "acme", {"chat"})
        assert revoke_key(conn, key_id)
        assert not revoke_key(conn, key_id)
        for bad in (key, "mk_" + "A" * 43, "not-a-key", "", key + "\n"):
            with pytest.raises(InvalidApiKey) as caught:
                authenticate(conn, bad)
            assert caught.value.code == "unauthenticated"


def test_bad_tenant_names_and_empty_scopes_are_refused(pool: Pool) -> None:
    with pool.connection() as conn:
        with pytest.raises(ConfigError):
            create_key(conn, "bad tenant; drop table", {"chat"})
        with pytest.raises(ConfigError):
            create_key(conn, "acme", set())
        assert list_keys(conn) == []


def test_cli_prints_the_key_once_and_never_lists_it(stack: LocalStack, database_url: str) -> None:
    env = {"MACARON_HOME": str(stack.home), "MACARON_DATABASE_URL": database_url}
    made = run_macaron("keys", "create", "--tenant", "acme", "--scope", "chat", **env)
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    assert key.startswith("mk_") and "not shown again" in made.stderr
    listed = run_macaron("keys", "list", **env)
    assert listed.returncode == 0 and "acme" in listed.stdout and key not in listed.stdout
    key_id = next(line.split()[1] for line in listed.stdout.splitlines() if "acme" in line)
    assert run_macaron("keys", "revoke", key_id, **env).returncode == 0
    again = run_macaron("keys", "revoke", key_id, **env)
    assert again.returncode == 2 and "no live key" in again.stderr
    bad = run_macaron("keys", "create", "--tenant", "acme", "--scope", "root", **env)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert uuid.UUID(key_id)
