"""Inspect the stored record: ``log verify``, ``log dead-letters``, ``audit verify`` and
``trace``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Annotated
from uuid import UUID

import typer
from rich.table import Table

from core.chain import verify_chain
from core.errors import TurnNotFound
from core.events import Envelope, TurnReceived
from infra.artifacts import ArtifactStore
from infra.postgres.lineage import audit
from infra.postgres.lookups import conversation_of_turn
from macaron import wiring
from macaron.cli.common import console, err_console, settings

log_app = typer.Typer(help="Inspect the event log.", no_args_is_help=True)
audit_app = typer.Typer(help="Audit the stored record.", no_args_is_help=True)


class _Counter:
    """Counts the envelopes that pass through it."""

    def __init__(self) -> None:
        self.seen = 0

    def count(self, items: Iterable[Envelope]) -> Iterator[Envelope]:
        for item in items:
            self.seen += 1
            yield item


@log_app.command("verify")
def log_verify(
    ctx: typer.Context,
    key: Annotated[str | None, typer.Option(help="Only this aggregate key.")] = None,
) -> None:
    """Verify the hash chain of every stored event (or one key's); exit 1 on any violation."""
    cfg = settings(ctx)
    counter = _Counter()
    with wiring.pool(cfg) as pool:
        log = wiring.event_log(cfg, pool)
        try:
            violations = verify_chain(counter.count(log.envelopes(key=key)))
        finally:
            log.close()
    for violation in violations:
        err_console.print(f"[red]{violation}[/]")
    console.print(f"{counter.seen} events checked, {len(violations)} violations")
    if violations:
        raise typer.Exit(1)


@log_app.command("dead-letters")
def log_dead_letters(ctx: typer.Context) -> None:
    """List events set aside because they could not be decoded."""
    cfg = settings(ctx)
    with wiring.pool(cfg) as pool:
        log = wiring.event_log(cfg, pool)
        try:
            letters = log.dead_letters()
        finally:
            log.close()
    table = Table(title="dead letters")
    for column in ("partition", "offset", "code", "reason"):
        table.add_column(column)
    for letter in letters:
        table.add_row(
            str(letter.position.partition),
            str(letter.position.offset),
            letter.code,
            letter.reason[:120],
        )
    console.print(table)


@audit_app.command("verify")
def audit_verify(ctx: typer.Context) -> None:
    """Check every key's hash chain and every adapter file's sha256; exit 1 on any failure."""
    cfg = settings(ctx)
    with wiring.pool(cfg) as pool, pool.connection() as conn:
        log = wiring.event_log(cfg, pool)
        try:
            report = audit(conn, log, ArtifactStore(cfg.home / "adapters"))
        finally:
            log.close()
    for problem in [*report.chain_violations, *report.adapter_failures]:
        err_console.print(f"[red]{problem}[/]")
    console.print(
        f"{report.events} events on {report.keys} keys, {report.adapters} adapters: "
        f"{len(report.chain_violations)} chain violations, "
        f"{len(report.adapter_failures)} adapter failures"
    )
    if not report.ok:
        raise typer.Exit(1)


def trace(
    ctx: typer.Context,
    turn_id: Annotated[UUID, typer.Argument(help="The turn (turn_started.turn_id).")],
) -> None:
    """Print a turn's trace id (from its TurnReceived event), to find the trace in Jaeger:
    the turn's spans, the processors' spans, and the training runs its feedback fed."""
    cfg = settings(ctx)
    with wiring.pool(cfg) as pool:
        with pool.connection() as conn:
            conversation_id = conversation_of_turn(conn, turn_id)
        if conversation_id is None:
            raise TurnNotFound(
                f"no turn {turn_id} in the projections (are the stream processors running?)"
            )
        log = wiring.event_log(cfg, pool)
        try:
            received = [
                e
                for e in log.read(key=str(conversation_id))
                if isinstance(e.payload, TurnReceived) and e.payload.turn_id == turn_id
            ]
        finally:
            log.close()
    if not received or "traceparent" not in received[0].envelope.trace:
        raise TurnNotFound(f"turn {turn_id} was recorded without a trace context")
    traceparent = received[0].envelope.trace["traceparent"]
    console.print(f"trace_id {traceparent.split('-')[1]}")
    console.print(f"traceparent {traceparent}")
