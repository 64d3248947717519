"""Forward-only SQL migrations from ``migrations/``, applied with yoyo-migrations."""

from __future__ import annotations

from pathlib import Path

from yoyo import get_backend, read_migrations

from infra.postgres.db import unavailable_as_typed

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


def _yoyo_url(database_url: str) -> str:
    scheme, sep, rest = database_url.partition("://")
    if not sep or scheme not in {"postgres", "postgresql", "postgresql+psycopg"}:
        raise ValueError(f"not a PostgreSQL URL: {scheme}://...")
    return f"postgresql+psycopg://{rest}"


def migrate(database_url: str) -> list[str]:
    """Apply every migration not yet applied; returns the ids applied now (idempotent)."""
    with unavailable_as_typed():
        backend = get_backend(_yoyo_url(database_url))
    migrations = read_migrations(str(MIGRATIONS_DIR))
    try:
        with unavailable_as_typed(), backend.lock():
            pending = backend.to_apply(migrations)
            backend.apply_migrations(pending)
    finally:
        backend.connection.close()
    return [m.id for m in pending]
