"""What replay needs of PostgreSQL: a scratch schema with empty copies of a processor's
tables, and a content hash over tables that does not depend on which schema holds them."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from core.canonical import canonical_json, sha256_hex
from infra.postgres.db import DictConnection


def tables_hash(conn: DictConnection, tables: Sequence[str], schema: str = "public") -> str:
    """sha256 over ``tables``, rows in primary-key order, each table hashed on its own."""
    digest = []
    for table in tables:
        rows = conn.execute(
            f'SELECT to_jsonb(t) AS row FROM "{schema}"."{table}" AS t ORDER BY 1'
        ).fetchall()
        digest.append(sha256_hex(canonical_json([r["row"] for r in rows])))
    return sha256_hex(canonical_json(dict(zip(tables, digest, strict=True))))


@contextmanager
def scratch_schema(conn: DictConnection, tables: Sequence[str]) -> Iterator[str]:
    """A new schema holding empty copies of ``tables`` (indexes and defaults included), dropped
    on the way out; yields its name."""
    schema = f"replay_{uuid.uuid4().hex[:12]}"
    try:
        with conn.transaction():
            copy_tables(conn, schema, tables)
        yield schema
    finally:
        with conn.transaction():
            drop_schema(conn, schema)


def copy_tables(conn: DictConnection, schema: str, tables: Sequence[str]) -> None:
    """Make ``schema`` hold empty copies of ``tables`` (kept where they are already)."""
    conn.execute(f'CREATE SCHEMA IF NOT EXISTS "{schema}"')
    for table in tables:
        conn.execute(
            f'CREATE TABLE IF NOT EXISTS "{schema}"."{table}" (LIKE public."{table}" INCLUDING ALL)'
        )


def drop_schema(conn: DictConnection, schema: str) -> None:
    conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def search_first(conn: DictConnection, schema: str) -> None:
    """Resolve unqualified table names in ``schema`` first, until the transaction ends."""
    conn.execute(f'SET LOCAL search_path TO "{schema}", public')
