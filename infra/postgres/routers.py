"""Router versions in the registry (``router_versions``): each classifier a release can name,
stored whole (``core.routing.RouterModel``) under its content hash, with the version it was
retrained from."""

from __future__ import annotations

from psycopg.types.json import Jsonb
from pydantic import ValidationError

from core.errors import RouterInvalid, RouterNotFound
from core.routing import RouterModel
from infra.postgres.db import DictConnection


def register_router(conn: DictConnection, model: RouterModel, *, parent: str | None) -> None:
    """Store ``model`` under its version (idempotent: a version is its content)."""
    conn.execute(
        "INSERT INTO router_versions (router_version, parent_version, model) "
        "VALUES (%s, %s, %s) ON CONFLICT DO NOTHING",
        (model.version, parent, Jsonb(model.model_dump(mode="json"))),
    )


def router_model(conn: DictConnection, version: str) -> RouterModel:
    """The stored classifier of ``version``, checked against its content hash."""
    row = conn.execute(
        "SELECT model FROM router_versions WHERE router_version = %s", (version,)
    ).fetchone()
    if row is None:
        raise RouterNotFound(f"no router version {version!r} in the registry")
    try:
        model = RouterModel.model_validate(row["model"])
    except ValidationError as exc:
        raise RouterInvalid(f"router version {version!r} does not match its content") from exc
    if model.version != version:
        raise RouterInvalid(f"the model stored as {version!r} is {model.version!r}")
    return model
