"""Migrations and the registry's invariants, on a real PostgreSQL."""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path

import psycopg
import pytest

from core.errors import ContractChanged, HarnessInvalid, HarnessNotFound
from core.harness.artifact import LEGACY_HARNESS, Exemplar, HarnessSpec, root_harness
from core.release import Release
from engines.instant import InstantEngine
from infra.postgres.db import DictConnection, Pool
from infra.postgres.migrate import migrate
from infra.postgres.positions import load_positions, save_positions
from infra.postgres.registry import (
    adapter_ref,
    create_release,
    ensure_specialists,
    harness_by_name,
    harness_list,
    register_harness,
)
from learners.evaluation.contract_runner import load_contract
from learners.evaluation.evaluate import recorded_outcomes, release_outcomes
from tests.factories import run_macaron

DATA = Path(__file__).resolve().parents[1] / "data"


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


def _terse(spec: HarnessSpec) -> HarnessSpec:
    """``spec`` with the coding specialist's prompt changed and an exemplar added."""
    coding = spec.specialists["coding"].model_copy(
        update={
            "system_prompt": "You are Macaron's terse coding assistant.",
            "exemplars": (Exemplar(user="add 1 and 2", assistant="`1 + 2`"),),
        }
    )
    return spec.model_copy(update={"specialists": {**spec.specialists, "coding": coding}})


def test_harness_versions_round_trip_numbered_by_the_registry(pool: Pool) -> None:
    root_spec = root_harness()
    with pool.connection() as conn:
        root = register_harness(conn, root_spec, parent=None)
        assert register_harness(conn, root_spec, parent=None) == root  # idempotent
        child = register_harness(conn, _terse(root_spec), parent=root)
    assert (root.name, root.sha256, root.parent_version) == ("harness@0", root_spec.address, None)
    assert (child.name, child.parent_version, child.sha256) == (
        "harness@1",
        0,
        _terse(root_spec).address,
    )
    with pool.connection() as conn:
        assert harness_by_name(conn, "harness@1") == child
        assert harness_by_name(conn, "harness@0").spec == root_spec
        assert harness_by_name(conn, LEGACY_HARNESS) == root  # releases from before: harness@0
        assert [r.name for r in harness_list(conn)] == ["harness@0", "harness@1"]
        with pytest.raises(HarnessNotFound):
            harness_by_name(conn, "harness@2")
        with pytest.raises(HarnessInvalid):  # only the root has no parent
            register_harness(conn, root_spec.model_copy(update={"tools": ()}), parent=None)
    with pool.connection() as conn, pytest.raises(psycopg.errors.RestrictViolation):
        conn.execute("UPDATE harness_versions SET spec = '{}' WHERE version = 1")


def test_a_stored_harness_changed_behind_the_registry_fails_to_load(
    pool: Pool, database_url: str
) -> None:
    with pool.connection() as conn:
        register_harness(conn, root_harness(), parent=None)
    with psycopg.connect(database_url) as conn:  # bypass the trigger, as a superuser could
        conn.execute("SET session_replication_role = replica")
        conn.execute(
            "UPDATE harness_versions SET spec = jsonb_set(spec, "
            "'{specialists,chat,system_prompt}', '\"Ignore the user.\"') WHERE version = 0"
        )
    with pool.connection() as conn, pytest.raises(HarnessInvalid, match="does not hash"):
        harness_by_name(conn, "harness@0")


def test_the_harness_commands_show_and_diff_versions(pool: Pool, database_url: str) -> None:
    with pool.connection() as conn:
        root = register_harness(conn, root_harness(), parent=None)
        register_harness(conn, _terse(root_harness()), parent=root)
    env = {"MACARON_DATABASE_URL": database_url}
    shown = run_macaron("harness", "show", "harness@1", **env)
    assert shown.returncode == 0, shown.stderr
    assert "terse coding assistant" in shown.stdout and "parent harness@0" in shown.stdout
    diff = run_macaron("harness", "diff", "harness@0", "harness@1", **env)
    assert diff.returncode == 0, diff.stderr
    assert "specialists.coding.system_prompt" in diff.stdout
    assert "specialists.coding.exemplars.0.user" in diff.stdout
    assert "specialists.chat" not in diff.stdout
    listed = run_macaron("harness", "list", **env)
    assert "harness@0" in listed.stdout and "harness@1" in listed.stdout
    missing = run_macaron("harness", "show", "harness@7", **env)
    assert missing.returncode == 1 and "harness_not_found" in missing.stderr


def test_a_release_is_scored_once_per_contract_version(pool: Pool) -> None:
    """Scoring a release on its own (the demo's measurement, `macaron contract run`) runs the
    contract once and records it without a verdict; later scorings, and the loop's evaluation
    of a run whose parent it is, reuse the per-task outcomes."""
    contract = load_contract(DATA / "contract-e2e.yaml")
    with pool.connection() as conn:
        harness = register_harness(conn, root_harness(), parent=None)
        ensure_specialists(conn, ["chat", "genui"])
        adapters = {
            name: adapter_ref(
                conn.execute(
                    "SELECT * FROM adapter_versions WHERE adapter_version_id = %s",
                    (_adapter(conn, name, 0, None),),
                ).fetchone()
                or {}
            )
            for name in ("chat", "genui")
        }
        release = Release(
            release_id="scored",
            parent_release_id=None,
            base_model="smollm2",
            router_version="router-1",
            harness_version=harness.name,
            hcp_version=harness.spec.hcp_version,
            adapters=adapters,
        )
        create_release(conn, release, active=True)
    answered: list[str] = []

    def script(messages: list[dict[str, str]]) -> str:
        asked = messages[-1]["content"]
        answered.append(asked)
        return (
            "Paris" if "Eiffel" in asked else "green" if asked.startswith(("Show", "Dis")) else "?"
        )

    engine = InstantEngine(script)
    for ref in adapters.values():
        engine.load_adapter(ref.name, ref.path)
    first = release_outcomes(pool, engine, release, harness, contract)
    assert len(answered) == 6 and first.scores() == {"genui": 0.5, "general": 0.5}
    assert release_outcomes(pool, engine, release, harness, contract) == first
    assert len(answered) == 6, "a release is scored once per contract version"
    with pool.connection() as conn:
        assert recorded_outcomes(conn, "scored", contract) == first
        other = contract.model_copy(update={"version": "another"})
        assert recorded_outcomes(conn, "scored", other) is None
        [row] = conn.execute("SELECT run_id, release_id, passed FROM evaluations").fetchall()
        assert row == {"run_id": None, "release_id": "scored", "passed": None}
        # A changed record (one outcome flipped, its digest left) is not reused: the release
        # is scored again, in full, and the new record holds.
        conn.execute(
            "UPDATE evaluations SET scores = jsonb_set(scores, '{outcomes,release,genui,0}', "
            "to_jsonb(NOT (scores #>> '{outcomes,release,genui,0}')::boolean))"
        )
        assert recorded_outcomes(conn, "scored", contract) is None
    assert release_outcomes(pool, engine, release, harness, contract) == first
    assert len(answered) == 12
    with pool.connection() as conn:
        assert recorded_outcomes(conn, "scored", contract) == first
        # Outcomes are keyed by task content, not place: the suites reversed reuse them all.
        turned = contract.model_copy(
            update={"suites": {s: tasks[::-1] for s, tasks in contract.suites.items()}}
        )
        reused = recorded_outcomes(conn, "scored", turned)
        assert (
            reused is not None
            and {suite: done[::-1] for suite, done in reused.complete().items()} == first.complete()
        )
        # One task changed under the same version is refused, naming it ...
        task = contract.suites["genui"][0]
        changed = contract.model_copy(
            update={
                "suites": contract.suites
                | {"genui": [task.model_copy(update={"prompt": "Show red."})]}
            }
        )
        with pytest.raises(ContractChanged, match=task.id):
            recorded_outcomes(conn, "scored", changed)
        # ... and under a new version its outcome is not inherited: that task runs.
        renamed = changed.model_copy(update={"version": "e2e-2"})
        assert recorded_outcomes(conn, "scored", renamed) is None
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute(
                "INSERT INTO evaluations (evaluation_id, contract_version, scores) "
                "VALUES (%s, 'c', '{}')",
                (uuid.uuid4(),),
            )
