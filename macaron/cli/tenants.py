"""Tenants' data controls: ``tenants set TENANT --training on|off``, ``tenants list``,
``tenants forget TENANT``, ``tenants exposure [TENANT]``, ``tenants rewrap``."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import typer
from rich.table import Table

from core.errors import ConfigError, PromotionInProgress
from core.events import NewEvent, TenantTrainingSet
from core.log import EventLog
from core.settings import Settings
from infra.postgres.db import Pool
from infra.postgres.experience_joins import tenant_exists, training_consent
from infra.postgres.exposure import forgotten_tenants
from learners.queue import configure as configure_celery
from learners.queue import enqueue_router_training, enqueue_training
from macaron import wiring
from macaron.cli.common import console, settings
from server.exposure import exposure
from server.forgetting import forget_tenant
from server.unlearning import Unlearning, promote_fallback, retrain_forgotten

TENANTS_KEY = "tenants"

tenants_app = typer.Typer(
    help="Tenants' data controls: whether their traffic trains the shared adapters and router "
    "(on by default).",
    no_args_is_help=True,
)


class Switch(StrEnum):
    on = "on"
    off = "off"


@tenants_app.command("set")
def tenants_set(
    ctx: typer.Context,
    tenant: Annotated[str, typer.Argument(help="A tenant with API keys.")],
    training: Annotated[
        Switch, typer.Option(help="on: its feedback and turns teach; off: from now on, nothing.")
    ],
) -> None:
    """Record whether a tenant's traffic may teach (a ``TenantTrainingSet`` event: records
    already derived stay; none is derived from the tenant's traffic while it is off)."""
    cfg = settings(ctx)
    with wiring.pool(cfg) as pool:
        with pool.connection() as conn:
            if not tenant_exists(conn, tenant):
                raise ConfigError(f"no tenant {tenant!r}: tenants come with their API keys")
        log = wiring.event_log(cfg, pool)
        try:
            log.append(
                [
                    NewEvent(
                        payload=TenantTrainingSet(training=training is Switch.on),
                        tenant_id=tenant,
                        key=TENANTS_KEY,
                    )
                ]
            )
        finally:
            log.close()
    console.print(f"tenant {tenant}: training {training.value}")


@tenants_app.command("list")
def tenants_list(ctx: typer.Context) -> None:
    """Tenants and whether their traffic teaches (as the experience builder has read the log)."""
    cfg = settings(ctx)
    with wiring.pool(cfg) as pool, pool.connection() as conn:
        consent = training_consent(conn)
    table = Table(title="tenants")
    table.add_column("tenant")
    table.add_column("training")
    for tenant, teaches in consent:
        table.add_row(tenant, "on" if teaches else "off")
    console.print(table)


@tenants_app.command("forget")
def tenants_forget(
    ctx: typer.Context,
    tenant: Annotated[str, typer.Argument(help="The tenant to forget.")],
    yes: Annotated[bool, typer.Option("--yes", help="Do not ask for confirmation.")] = False,
    retrain: Annotated[
        bool,
        typer.Option(
            "--retrain",
            help="Also queue, for each specialist whose active adapter learned from a forgotten "
            "tenant, a successor trained from its newest unexposed ancestor without them (or, "
            "when they were all it learned from, ask the server to serve that ancestor).",
        ),
    ] = False,
) -> None:
    """Forget a tenant for good: record ``TenantForgotten``, destroy its data key (its words in
    the log can never be read again), revoke its API keys, erase its rows. Safe to run again."""
    cfg = settings(ctx)
    if not yes:
        typer.confirm(f"Forget tenant {tenant} for good? This cannot be undone.", abort=True)
    with wiring.pool(cfg) as pool:
        keys = wiring.data_keys(cfg, pool)
        log = wiring.event_log(cfg, pool, keys)
        try:
            done = forget_tenant(pool, log, keys, tenant)
            unlearning, pending = (
                _retrain(cfg, pool, log) if retrain else (Unlearning([], None), None)
            )
        finally:
            log.close()
    erased = ", ".join(f"{n} {table}" for table, n in done.rows_erased.items() if n) or "none"
    if done.already:
        console.print(f"tenant {tenant} was already forgotten; rows erased now: {erased}")
    else:
        console.print(
            f"tenant {tenant} forgotten (event {done.event_id}): data key destroyed, "
            f"{done.keys_revoked} API key(s) revoked, rows erased: {erased}"
        )
    for run in unlearning.runs:
        console.print(
            f"queued run {run.run_id}: {run.specialist} from {run.parent} on {run.records} "
            "record(s) without the forgotten tenants"
        )
    if unlearning.router_run is not None:
        console.print(f"queued router run {unlearning.router_run.event_id}: refitted without them")
    if pending is not None:
        console.print(pending)
    elif unlearning.fallback is not None:
        console.print(
            f"asked the server to promote {unlearning.fallback.release_id}: "
            f"{', '.join(unlearning.restored)} back in place (they learned from no one else)"
        )
    if retrain and not (unlearning.runs or unlearning.fallback or unlearning.router_run):
        console.print("nothing the active release serves learned from forgotten tenants")


def _retrain(cfg: Settings, pool: Pool, log: EventLog) -> tuple[Unlearning, str | None]:
    """Queue the successors that unlearn every forgotten tenant and append their requests,
    then hand them to the workers; ask the server to promote the fallback release, if any
    (what to do instead, when another promotion is pending)."""
    unlearning = retrain_forgotten(pool, log)
    configure_celery(cfg)
    for run in unlearning.runs:
        enqueue_training(run.run_id)
    if unlearning.router_run is not None:
        enqueue_router_training(unlearning.router_run.event_id)
    if unlearning.fallback is not None:
        try:
            by = "tenants forget --retrain"
            promote_fallback(pool, unlearning.fallback, unlearning.restored, by)
        except PromotionInProgress as exc:
            release = unlearning.fallback.release_id
            return unlearning, f"{exc.message}: once it is done, run `macaron promote {release}`"
    return unlearning, None


@tenants_app.command("exposure")
def tenants_exposure(
    ctx: typer.Context,
    tenant: Annotated[
        str | None, typer.Argument(help="A tenant (default: every forgotten tenant).")
    ] = None,
) -> None:
    """Which adapter versions, router versions and releases learned from a tenant's records
    (they stay countable by their envelopes after it is forgotten; their content is gone)."""
    cfg = settings(ctx)
    with wiring.pool(cfg) as pool:
        log = wiring.event_log(cfg, pool)
        try:
            with pool.connection() as conn:
                tenants = [tenant] if tenant else forgotten_tenants(conn)
                found = exposure(conn, log, tenants)
        finally:
            log.close()
    who = tenant or f"{len(tenants)} forgotten tenant(s)"
    console.print(f"{who}: {found.records} experience record(s) and routing label(s) in the log")
    adapters = [f"{a} (weights erased)" if a in found.erased else a for a in found.adapters]
    routers = [f"{r} (weights erased)" if r in found.erased else r for r in found.routers]
    console.print(f"adapters that learned from them: {', '.join(adapters) or 'none'}")
    console.print(f"routers fitted on them: {', '.join(routers) or 'none'}")
    active = " (the active release among them)" if found.active else ""
    console.print(f"releases with those adapters: {', '.join(found.releases) or 'none'}{active}")


@tenants_app.command("rewrap")
def tenants_rewrap(ctx: typer.Context) -> None:
    """Wrap every tenant's data key with the first key of the master key file (after adding a
    new first line); the old lines can then be removed."""
    cfg = settings(ctx)
    with wiring.pool(cfg) as pool:
        changed = wiring.data_keys(cfg, pool).rewrap()
    console.print(f"{changed} data key(s) rewrapped with the current master key")
