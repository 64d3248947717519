"""API keys: ``keys create``, ``keys list``, ``keys revoke``."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated
from uuid import UUID

import typer
from rich.table import Table

from core.errors import ConfigError
from infra.postgres.keys import create_key, list_keys, revoke_key
from macaron import wiring
from macaron.cli.common import console, err_console, settings

keys_app = typer.Typer(help="API keys: create, list, revoke.", no_args_is_help=True)


class ScopeName(StrEnum):
    chat = "chat"
    admin = "admin"
    metrics = "metrics"


@keys_app.command("create")
def keys_create(
    ctx: typer.Context,
    tenant: Annotated[str, typer.Option(help="Tenant that owns the key (created if new).")],
    scope: Annotated[
        list[ScopeName],
        typer.Option(help="chat, admin and/or metrics (for a Prometheus scraper); repeatable."),
    ],
) -> None:
    """Make an API key. It is printed once, here; only its hash is stored."""
    cfg = settings(ctx)
    with wiring.pool(cfg) as pool, pool.connection() as conn:
        key_id, key = create_key(conn, tenant, {s.value for s in scope})
    err_console.print(f"key {key_id} for tenant {tenant}: store it now, it is not shown again")
    print(key)


@keys_app.command("list")
def keys_list(
    ctx: typer.Context,
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's keys.")] = None,
) -> None:
    """List keys (ids, tenants, scopes; never the keys themselves)."""
    cfg = settings(ctx)
    with wiring.pool(cfg) as pool, pool.connection() as conn:
        records = list_keys(conn, tenant)
    table = Table(title="API keys")
    for column in ("key id", "tenant", "scopes", "created", "revoked"):
        table.add_column(column)
    for r in records:
        table.add_row(
            str(r.key_id),
            r.tenant_id,
            ",".join(r.scopes),
            f"{r.created_at:%Y-%m-%d %H:%M}",
            f"{r.revoked_at:%Y-%m-%d %H:%M}" if r.revoked_at else "-",
        )
    console.print(table)


@keys_app.command("revoke")
def keys_revoke(
    ctx: typer.Context, key_id: Annotated[UUID, typer.Argument(help="The key's id.")]
) -> None:
    """Revoke a key: it stops working at once."""
    cfg = settings(ctx)
    with wiring.pool(cfg) as pool, pool.connection() as conn:
        revoked = revoke_key(conn, key_id)
    if not revoked:
        raise ConfigError(f"no live key {key_id}")
    console.print(f"revoked {key_id}")
