"""The stream processors: ``streams run`` follows the log, ``replay`` rebuilds one from it."""

from __future__ import annotations

import signal
import threading
from enum import StrEnum
from typing import Annotated

import typer

from core.errors import ConfigError
from infra.telemetry import configure_telemetry, serve_metrics
from learners.worker import configure as configure_celery
from macaron import wiring
from macaron.cli.common import console, settings
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
    """Run the stream processors (projections, experience, live scores, training trigger)
    from their saved positions; /metrics on MACARON_METRICS_PORT when set."""
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
            run_faust_worker(cfg, hosts, "macaron-streams")
            return
        if once:
            for item in hosts:
                handled = catch_up(item)
                console.print(f"{item.processor.name}: {handled} events")
            return
        stop = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        console.print("following the log (Ctrl-C stops)")
        try:
            follow(hosts, stop)
        except KeyboardInterrupt:
            stop.set()


def replay(
    ctx: typer.Context,
    processor: Annotated[str, typer.Argument(help="Processor name (macaron replay --list).")] = "",
    start: Annotated[int | None, typer.Option("--from", help="First position (one log).")] = None,
    end: Annotated[int | None, typer.Option("--to", help="Position to stop before.")] = None,
    list_: Annotated[bool, typer.Option("--list", help="List the processors.")] = False,
) -> None:
    """Rebuild a processor's output from the log into a fresh schema and print its content
    hash, beside the live one (equal when the live processor has read as far)."""
    cfg = settings(ctx)
    with wiring.pool(cfg) as pool:
        log = wiring.event_log(cfg, pool)
        hosts = {h.processor.name: h for h in wiring.processor_hosts(cfg, log, pool)}
        if list_ or not processor:
            console.print("\n".join(hosts))
            return
        if processor not in hosts:
            raise ConfigError(f"no processor {processor!r}; one of {', '.join(hosts)}")
        chosen = hosts[processor].processor
        partitions = list(log.end_positions())
        digest, handled = replay_processor(
            chosen,
            log,
            pool,
            start=None if start is None else dict.fromkeys(partitions, start),
            end=None if end is None else dict.fromkeys(partitions, end),
        )
        with pool.connection() as conn:
            live = content_hash(conn, chosen)
        log.close()
    console.print(f"{processor}: replayed {handled} events")
    console.print(f"replayed  {digest}\nlive      {live}")
