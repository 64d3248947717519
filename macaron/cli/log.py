"""Inspect the stored record: ``log verify``, ``log dead-letters``, ``audit verify``,
``audit turn`` and ``trace``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Annotated, Any
from uuid import UUID

import typer
from rich.table import Table

from core.errors import TurnNotFound
from core.events import Envelope, TurnReceived
from core.events.chain import verify_chain
from infra.artifacts import ArtifactStore
from infra.postgres.lineage import audit
from infra.postgres.lookups import conversation_of_turn
from infra.postgres.turn_audit import Shown, TurnAudit, audit_turn
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
        f"{report.events} events on {report.keys} keys, {report.adapters} adapters "
        f"({report.erased} erased): "
        f"{len(report.chain_violations)} chain violations, "
        f"{len(report.adapter_failures)} adapter failures"
    )
    if not report.ok:
        raise typer.Exit(1)


@audit_app.command("turn")
def audit_turn_command(
    ctx: typer.Context,
    turn_id: Annotated[UUID, typer.Argument(help="The turn (turn_started.turn_id).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the audit as JSON.")] = False,
    content: Annotated[
        bool, typer.Option(help="Include the training records' content (other users' words).")
    ] = False,
) -> None:
    """Everything behind one answer: its events and chain, the release, adapter, router and
    harness that served it, the run and snapshot that trained the adapter and the events that
    taught it, and the trace id. Exit 1 when the conversation's chain does not verify."""
    cfg = settings(ctx)
    with wiring.pool(cfg) as pool, pool.connection() as conn:
        log = wiring.event_log(cfg, pool)
        try:
            shown: Shown = "content" if content else "ids"
            report = audit_turn(conn, log, turn_id, tenant_id=None, records=shown)
        finally:
            log.close()
    if as_json:
        console.print_json(report.model_dump_json())
    else:
        _print_audit(report)
    if not report.chain_ok:
        raise typer.Exit(1)


def _print_audit(report: TurnAudit) -> None:
    served = report.served_by
    console.print(
        f"turn {report.turn_id} (tenant {report.tenant_id}, conversation "
        f"{report.conversation_id}), trace_id {report.trace_id or '-'}"
    )
    console.print(
        f"served by release {served.release_id} "
        f"({'active' if served.release_active_now else 'not active'} now): "
        f"{served.adapter_version}, router {served.router_version}, "
        f"{served.harness_version} (hcp {served.hcp_version})"
    )
    events = Table(title=f"events of the turn (chain: {report.chain_events} events checked)")
    for column in ("#", "type", "event id", "hash"):
        events.add_column(column)
    for event in report.events:
        events.add_row(str(event.sequence), event.type, event.event_id, event.hash[:16])
    console.print(events)
    for violation in report.chain_violations:
        err_console.print(f"[red]{violation}[/]")
    if report.training is None:
        console.print("the adapter was not trained (a root version): no events taught it")
        return
    run: Any = report.training.run
    console.print(
        f"trained by run {run['run_id']} ({run['recipe']}) on snapshot "
        f"{run['snapshot']['id']}: log range {run['snapshot']['start']} .. "
        f"{run['snapshot']['end']}, {run['snapshot']['filter_version']}"
    )
    taught = Table(
        title="what taught it ("
        + ", ".join(f"{n} {what}" for what, n in report.training.counts.items())
        + ")"
    )
    for column in ("source", "kind", "from event", "turn / rollout group"):
        taught.add_column(column)
    for record in report.training.records:
        taught.add_row(
            record.source,
            record.kind,
            record.cause_event_id or "-",
            record.turn_id or record.rollout_group_id or "-",
        )
    console.print(taught)


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
