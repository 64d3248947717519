"""The local stack and its stores: ``up``, ``down``, ``status``, ``db migrate`` and
``kafka topics create``."""

from __future__ import annotations

from typing import Annotated

import psycopg
import typer
from rich.table import Table

from core.settings import Settings
from infra.kafka.topics import create_topics, event_topics
from infra.local_stack import LocalStack
from infra.postgres.exposure import forgotten_tenants
from infra.postgres.migrate import migrate
from macaron import wiring
from macaron.cli.common import console, settings
from server.exposure import exposure

db_app = typer.Typer(help="PostgreSQL registry and event store.", no_args_is_help=True)
kafka_app = typer.Typer(help="Kafka event log administration.", no_args_is_help=True)
topics_app = typer.Typer(help="Kafka topics.", no_args_is_help=True)
kafka_app.add_typer(topics_app, name="topics")


def up(
    ctx: typer.Context,
    kafka: Annotated[
        bool, typer.Option("--kafka", help="Also start a Kafka-protocol broker (memory only).")
    ] = False,
) -> None:
    """Start the embedded PostgreSQL and Redis (and Kafka with --kafka), then migrate."""
    cfg = settings(ctx)
    stack = LocalStack(cfg)
    with console.status("starting the local stack..."):
        stack.up(kafka=kafka)
        applied = migrate(wiring.database_url(cfg))
        if kafka:
            create_topics(
                stack.kafka.bootstrap(),
                event_topics(cfg.kafka_topic, cfg.kafka_partitions, cfg.kafka_replication),
            )
    console.print(f"migrations applied: {', '.join(applied) or 'none pending'}")
    _print_status(stack)


def down(ctx: typer.Context) -> None:
    """Stop the embedded servers by PID. Data stays under MACARON_HOME."""
    stopped = LocalStack(settings(ctx)).down()
    console.print(f"stopped: {', '.join(stopped) or 'nothing was running'}")


def status(ctx: typer.Context) -> None:
    """Show each embedded server with its address and health; exit 1 if PostgreSQL or Redis
    is not healthy."""
    cfg = settings(ctx)
    if not _print_status(LocalStack(cfg)):
        raise typer.Exit(1)
    _print_exposure(cfg)


def _print_exposure(cfg: Settings) -> None:
    """Name the releases that learned from forgotten tenants' records, if any (nothing on a
    database not migrated yet)."""
    with wiring.pool(cfg) as pool:
        try:
            with pool.connection() as conn:
                tenants = forgotten_tenants(conn)
        except psycopg.errors.UndefinedTable:
            return
        if not tenants:
            return
        log = wiring.event_log(cfg, pool)
        try:
            with pool.connection() as conn:
                found = exposure(conn, log, tenants)
        finally:
            log.close()
    if found.releases:
        active = "; the active release is one of them" if found.active else ""
        console.print(
            f"[yellow]releases that learned from {len(tenants)} forgotten tenant(s): "
            f"{', '.join(found.releases)}{active}[/] (`macaron tenants exposure`)"
        )


def _print_status(stack: LocalStack) -> bool:
    """Print the stack's table; whether PostgreSQL and Redis are healthy."""
    table = Table(title=f"Macaron local stack ({stack.home})")
    for column in ("part", "address", "pid", "health", "detail"):
        table.add_column(column)
    core_healthy = True
    for row in stack.status():
        health = (
            "[green]healthy[/]"
            if row.healthy
            else ("[yellow]stopped[/]" if row.pid is None else "[red]unhealthy[/]")
        )
        if row.name in {"postgres", "redis"} and not row.healthy:
            core_healthy = False
        table.add_row(row.name, row.address, str(row.pid or "-"), health, row.detail)
    console.print(table)
    return core_healthy


@db_app.command("migrate")
def db_migrate(ctx: typer.Context) -> None:
    """Apply pending migrations (idempotent)."""
    applied = migrate(wiring.database_url(settings(ctx)))
    console.print(f"migrations applied: {', '.join(applied) or 'none pending'}")


@topics_app.command("create")
def topics_create(ctx: typer.Context) -> None:
    """Create the event topic and its dead-letter topic with the configured partitions."""
    cfg = settings(ctx)
    specs = event_topics(cfg.kafka_topic, cfg.kafka_partitions, cfg.kafka_replication)
    created = create_topics(cfg.kafka_servers, specs)
    for spec in specs:
        state = "created" if spec.name in created else "exists"
        console.print(f"{spec.name}: {spec.partitions} partitions ({state})")
