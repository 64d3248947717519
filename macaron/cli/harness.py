"""Harness versions: ``harness list``, ``harness show harness@N``, ``harness diff A B``."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from core.harness.artifact import harness_diff, harness_fields
from infra.postgres.registry import harness_by_name, harness_list
from macaron import wiring
from macaron.cli.common import console, settings

harness_app = typer.Typer(
    help="Harness versions: the prompt, exemplar, output and decoding half of a release.",
    no_args_is_help=True,
)


@harness_app.command("list")
def harness_list_command(ctx: typer.Context) -> None:
    """Every registered harness version, its address and its parent."""
    with wiring.pool(settings(ctx)) as pool, pool.connection() as conn:
        rows = harness_list(conn)
    table = Table(title="harness versions")
    for column in ("name", "sha256", "parent", "created"):
        table.add_column(column)
    for row in rows:
        parent = row.parent_version
        table.add_row(
            row.name,
            row.sha256,
            "(root)" if parent is None else f"harness@{parent}",
            row.created_at.isoformat()[:19],
        )
    console.print(table)


@harness_app.command("show")
def harness_show(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="A harness version: harness@3.")],
) -> None:
    """Print a harness version field by field (checked against its address first)."""
    with wiring.pool(settings(ctx)) as pool, pool.connection() as conn:
        harness = harness_by_name(conn, ref)
    parent = "(root)" if harness.parent_version is None else f"harness@{harness.parent_version}"
    table = Table(title=f"{harness.name} sha256:{harness.sha256} parent {parent}")
    table.add_column("field")
    table.add_column("value", overflow="fold")
    for path, value in harness_fields(harness.spec).items():
        table.add_row(path, value)
    console.print(table)


@harness_app.command("diff")
def harness_diff_command(
    ctx: typer.Context,
    old: Annotated[str, typer.Argument(help="The harness version to compare from.")],
    new: Annotated[str, typer.Argument(help="The harness version to compare to.")],
) -> None:
    """Print what changed from OLD to NEW, per specialist and field."""
    with wiring.pool(settings(ctx)) as pool, pool.connection() as conn:
        before, after = harness_by_name(conn, old), harness_by_name(conn, new)
    changes = harness_diff(before.spec, after.spec)
    if not changes:
        console.print(f"{before.name} and {after.name} are the same harness")
        return
    table = Table(title=f"{before.name} -> {after.name}")
    for column in ("field", before.name, after.name):
        table.add_column(column, overflow="fold")
    for path, was, now in changes:
        table.add_row(path, "(none)" if was is None else was, "(none)" if now is None else now)
    console.print(table)
