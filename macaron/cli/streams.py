"""The stream processors: ``streams run`` follows the log, ``replay`` rebuilds one from it."""

from __future__ import annotations

import json
import threading
from enum import StrEnum
from typing import Annotated

import typer

from core.errors import ConfigError
from core.events.privacy import DataKeys
from core.log import EventLog
from infra.postgres.db import Pool
from infra.telemetry import configure_telemetry, serve_metrics
from learners.queue import configure as configure_celery
from macaron import wiring
from macaron.cli.common import console, progress_bar, settings
from streams.backfill import BackfillRequest, backfill, describe
from streams.experience_rules import ExperienceBuilder
from streams.faust_app import run_worker as run_faust_worker
from streams.processor import content_hash
from streams.replay import replay as replay_processor
from streams.runner import catch_up, follow

streams_app = typer.Typer(help="Stream processors.", no_args_is_help=True)


class StreamHost(StrEnum):
    log = "log"
    faust = "faust"


@streams_app.command("run")
def streams_run(
    ctx: typer.Context,
    host: Annotated[StreamHost, typer.Option(help="log: any event log; faust: Kafka agents.")] = (
        StreamHost.log
    ),
    once: Annotated[bool, typer.Option(help="Catch up, then stop (log host).")] = False,
) -> None:
    """Run the stream processors (projections, experience, live scores, training trigger,
    unlearning dispatch) from their saved positions; /metrics on MACARON_METRICS_PORT when set."""
    cfg = settings(ctx)
    configure_telemetry(cfg, "macaron-streams")
    configure_celery(cfg)
    with wiring.pool(cfg) as pool:
        if cfg.metrics_port is not None:
            serve_metrics(cfg, pool, cfg.metrics_port)
        log = wiring.event_log(cfg, pool)
        hosts = wiring.processor_hosts(cfg, log, pool)
        wiring.enqueue_queued_runs(pool)
        if host is StreamHost.faust:
            run_faust_worker(cfg, hosts, "macaron-streams", wiring.cipher(cfg, pool))
            return
        if once:
            for item in hosts:
                handled = catch_up(item)
                console.print(f"{item.processor.name}: {handled} events")
            return
        console.print("following the log (Ctrl-C stops)")
        # Until SIGINT or SIGTERM (macaron.cli.Stopped): a batch cut short is not committed,
        # and the next start does it again from the saved positions, as after a crash.
        follow(hosts, threading.Event())


def replay(
    ctx: typer.Context,
    processor: Annotated[str, typer.Argument(help="Processor name (macaron replay --list).")] = "",
    start: Annotated[int | None, typer.Option("--from", help="First position (one log).")] = None,
    end: Annotated[int | None, typer.Option("--to", help="Position to stop before.")] = None,
    filter_version: Annotated[
        str | None,
        typer.Option(
            help="With processor experience: backfill, deriving the experience of [--from, --to) "
            "under this filter version into the log (experience-1, experience-2)."
        ),
    ] = None,
    output_json: Annotated[bool, typer.Option("--json", help="A backfill's outcome as JSON.")] = (
        False
    ),
    list_: Annotated[bool, typer.Option("--list", help="List the processors.")] = False,
) -> None:
    """Rebuild a processor's output from the log into a fresh schema and print its content
    hash, beside the live one (equal when the live processor has read as far); or, with
    --filter-version, backfill the experience of past events under that filter version
    (idempotent: a second run appends nothing; a stopped one resumes)."""
    cfg = settings(ctx)
    with wiring.pool(cfg) as pool:
        keys = wiring.data_keys(cfg, pool)
        log = wiring.event_log(cfg, pool, keys)
        hosts = {h.processor.name: h for h in wiring.processor_hosts(cfg, log, pool)}
        if list_ or not processor:
            console.print("\n".join(hosts))
            return
        if processor not in hosts:
            raise ConfigError(f"no processor {processor!r}; one of {', '.join(hosts)}")
        partitions = list(log.end_positions())
        first = None if start is None else dict.fromkeys(partitions, start)
        last = None if end is None else dict.fromkeys(partitions, end)
        if filter_version is not None:
            if processor != ExperienceBuilder.name:
                raise ConfigError(f"--filter-version backfills {ExperienceBuilder.name!r} only")
            request = BackfillRequest(filter_version, start=first, end=last)
            _backfill(log, pool, keys, request, output_json)
            return
        chosen = hosts[processor].processor
        rebuilt = replay_processor(chosen, log, pool, start=first, end=last)
        with pool.connection() as conn:
            live = content_hash(conn, chosen)
        log.close()
    skipped = f" ({rebuilt.forgotten} of forgotten tenants, skipped)" if rebuilt.forgotten else ""
    console.print(f"{processor}: replayed {rebuilt.handled} events{skipped}")
    console.print(f"replayed  {rebuilt.digest}\nlive      {live}")


def _backfill(
    log: EventLog, pool: Pool, keys: DataKeys, request: BackfillRequest, output_json: bool
) -> None:
    filter_version = request.filter_version
    with progress_bar() as bar:
        task = bar.add_task(f"backfilling {filter_version}", total=None)
        outcome = backfill(
            log,
            pool,
            keys,
            request,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
        )
    log.close()
    shown = describe(outcome)
    if output_json:
        console.print_json(json.dumps(shown))
        return
    state = "already done" if outcome.already_done else "resumed" if outcome.resumed else "done"
    console.print(
        f"backfill {shown['backfill_id']} ({state}): {filter_version} over "
        f"[{shown['from']}, {shown['to']}): {outcome.records} records appended in all"
        + (
            f"; {outcome.forgotten} events of forgotten tenants skipped"
            if outcome.forgotten
            else ""
        )
    )
