"""``migrations/0014.run-kinds``: runs stored before a run's kind was a column get theirs from
the recipe prefix it used to be read from (``harness.<change>`` proposed a harness)."""

from __future__ import annotations

import uuid

import psycopg
from yoyo import get_backend, read_migrations

from infra.local_stack import LocalStack
from infra.postgres.db import open_pool
from infra.postgres.migrate import MIGRATIONS_DIR, migrate
from infra.postgres.runs import runs_of_kind, training_run

KINDS = "0014.run-kinds"


def test_runs_before_the_kind_column_get_their_kind_from_the_recipe(stack: LocalStack) -> None:
    name = f"t_{uuid.uuid4().hex[:16]}"
    admin = stack.postgres.url("postgres")
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = stack.postgres.url(name)
    try:
        backend = get_backend(url.replace("postgresql://", "postgresql+psycopg://", 1))
        try:
            earlier = read_migrations(str(MIGRATIONS_DIR)).filter(lambda m: m.id != KINDS)
            with backend.lock():
                backend.apply_migrations(backend.to_apply(earlier))
        finally:
            backend.connection.close()
        runs = {
            "adapter": uuid.uuid4(),
            "harness": uuid.uuid4(),
            "failed harness": uuid.uuid4(),
        }
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("INSERT INTO specialists (name) VALUES ('genui')")
            conn.execute(
                "INSERT INTO adapter_versions (specialist, version, sha256, path, rank, "
                "base_model) VALUES ('genui', 0, %s, 'adapters/genui/0', 16, 'smollm2')",
                ("0" * 64,),
            )
            snapshot = uuid.uuid4()
            conn.execute(
                "INSERT INTO dataset_snapshots (snapshot_id, specialist, start_positions, "
                "end_positions, filter_version, content_hash, record_count) VALUES "
                "(%s, 'genui', '{\"0\": 0}', '{\"0\": 4}', 'experience-2', %s, 4)",
                (snapshot, "1" * 64),
            )
            for run_id, recipe, status in zip(
                runs.values(),
                ("lora-sft-dpo", "harness.grammar", "harness.exemplars"),
                ("succeeded", "succeeded", "failed"),
                strict=True,
            ):
                conn.execute(
                    "INSERT INTO training_runs (run_id, specialist, parent_adapter_id, "
                    "snapshot_id, recipe, status) VALUES (%s, 'genui', 1, %s, %s, %s)",
                    (run_id, snapshot, recipe, status),
                )
        assert migrate(url) == [KINDS]
        with open_pool(url) as pool, pool.connection() as conn:
            kinds = {label: training_run(conn, run_id) for label, run_id in runs.items()}
            assert {label: run.kind for label, run in kinds.items() if run} == {
                "adapter": "adapter",
                "harness": "harness",
                "failed harness": "harness",
            }
            assert kinds["harness"] is not None and kinds["harness"].recipe == "harness.grammar"
            assert runs_of_kind(conn, "genui", "harness") == 2
            assert runs_of_kind(conn, "genui", "adapter") == 1
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
