"""Specialists at run time: ``specialist list``, ``add``, ``disable``, ``enable``. Each change
files one release (``learners.specialists``) and asks the running server to promote it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from core.events import SpecialistAdded
from core.release import Release
from core.routing import SPECIALISTS_KEY
from core.settings import Settings
from infra.postgres.registry import active_release
from infra.postgres.routers import router_model
from macaron import wiring
from macaron.cli.common import console, err_console, settings
from macaron.cli.releases import await_promotion

if TYPE_CHECKING:
    from learners.runtime import Runtime

specialist_app = typer.Typer(
    help="Specialists: list them, add one at run time, disable or enable one.",
    no_args_is_help=True,
)
Timeout = Annotated[float, typer.Option(help="Seconds to wait for the server's promotion.")]


@specialist_app.command("list")
def specialist_list(ctx: typer.Context) -> None:
    """Every specialist of the active release: enabled (its router may choose it) or not, its
    adapter, and where the router learns it from."""
    cfg = settings(ctx)
    with wiring.pool(cfg) as pool:
        with pool.connection() as conn:
            release = active_release(conn)
            router = router_model(conn, release.router_version)
        log = wiring.event_log(cfg, pool)
        events = log.read(key=SPECIALISTS_KEY, types=["SpecialistAdded"])
        added = {
            e.payload.specialist: e.payload
            for e in events
            if isinstance(e.payload, SpecialistAdded)
        }
        log.close()
    table = Table(title=f"specialists of {release.release_id} (router {router.version[:12]})")
    for column in ("specialist", "enabled", "adapter", "learned from"):
        table.add_column(column)
    for name, adapter in release.adapters.items():
        found = added.get(name)
        source = (
            "seed examples"
            if found is None
            else f"{len(found.examples)} examples: {found.description}"
        )
        table.add_row(name, "yes" if name in router.specialists else "no", adapter.name, source)
    console.print(table)


@specialist_app.command("add")
def specialist_add(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="The new specialist: lower-case, e.g. legal.")],
    description: Annotated[str, typer.Option(help="What it answers (its harness prompt).")],
    examples: Annotated[
        Path,
        typer.Option(help='JSON lines of {"text": ...}: user turns it should answer (8 or more).'),
    ],
    timeout: Timeout = 300.0,
) -> None:
    """Add a specialist: a version-0 adapter, a harness entry, and a router that learns it from
    EXAMPLES, in one release the running server promotes. The learning loop then trains it like
    the others."""
    from learners.specialists import add_specialist, read_examples

    texts = read_examples(examples)
    _change(
        settings(ctx),
        timeout,
        f"adding {name}",
        lambda rt: add_specialist(rt, name, description, texts),
    )


@specialist_app.command("disable")
def specialist_disable(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="The specialist the router stops choosing.")],
    timeout: Timeout = 300.0,
) -> None:
    """Stop routing turns to a specialist (a release whose router leaves it out)."""
    from learners.specialists import set_enabled

    _change(settings(ctx), timeout, f"disabling {name}", lambda rt: set_enabled(rt, name, False))


@specialist_app.command("enable")
def specialist_enable(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="A disabled specialist the router may choose again.")],
    timeout: Timeout = 300.0,
) -> None:
    """Route turns to a disabled specialist again (a release whose router knows it)."""
    from learners.specialists import set_enabled

    _change(settings(ctx), timeout, f"enabling {name}", lambda rt: set_enabled(rt, name, True))


def _change(cfg: Settings, timeout: float, what: str, change: Callable[[Runtime], Release]) -> None:
    """Fit the router and file the release (``change``), then have the server promote it."""
    with wiring.pool(cfg) as pool:
        rt = wiring.learning_runtime(cfg, pool)
        try:
            err_console.print(f"{what}: fitting the router and filing the release")
            release = change(rt)
        finally:
            rt.log.close()
    err_console.print(f"release {release.release_id} filed; waiting for the server to promote it")
    await_promotion(cfg, release.release_id, "promote", timeout)
