"""``macaron``: the one command that reads settings and wires the parts together."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterable, Iterator
from enum import StrEnum
from pathlib import Path
from typing import Annotated
from uuid import UUID

import typer
import uvicorn
from pydantic import ValidationError
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from core.chain import verify_chain
from core.errors import ConfigError, MacaronError, PromotionFailed, ReleaseNotFound
from core.events import Envelope
from core.settings import Settings
from infra.kafka.topics import create_topics, event_topics
from infra.local_stack import LocalStack
from infra.models import make_tiny_model, pull_model, tokenizer_for_tiny, verify_model
from infra.postgres.keys import create_key, list_keys, revoke_key
from infra.postgres.migrate import migrate
from infra.postgres.registry import active_release
from learners.loop import request_promotion, wait_for_request
from learners.worker import configure as configure_celery
from learners.worker import install_runtime, make_runtime
from macaron import wiring
from server.schemas import export as export_schemas
from streams.faust_app import run_worker as run_faust_worker
from streams.runner import catch_up, follow

console = Console()
err_console = Console(stderr=True)

app = typer.Typer(
    help="Macaron server: event-sourced continual-learning LLM server.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
db_app = typer.Typer(help="PostgreSQL registry and event store.", no_args_is_help=True)
kafka_app = typer.Typer(help="Kafka event log administration.", no_args_is_help=True)
topics_app = typer.Typer(help="Kafka topics.", no_args_is_help=True)
log_app = typer.Typer(help="Inspect the event log.", no_args_is_help=True)
keys_app = typer.Typer(help="API keys: create, list, revoke.", no_args_is_help=True)
model_app = typer.Typer(help="Base models: pull, make a tiny test model.", no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(kafka_app, name="kafka")
kafka_app.add_typer(topics_app, name="topics")
app.add_typer(log_app, name="log")
app.add_typer(model_app, name="model")
app.add_typer(keys_app, name="keys")
streams_app = typer.Typer(help="Stream processors.", no_args_is_help=True)
app.add_typer(streams_app, name="streams")


def settings(ctx: typer.Context) -> Settings:
    value = ctx.obj
    if not isinstance(value, Settings):
        raise ConfigError("settings were not loaded")
    return value


@app.callback()
def load_settings(ctx: typer.Context) -> None:
    """Read settings (environment variables prefixed MACARON_) once, for every command."""
    try:
        ctx.obj = Settings()
    except ValidationError as exc:
        problems = "; ".join(
            f"MACARON_{'_'.join(str(p) for p in e['loc']).upper()}: {e['msg']}"
            for e in exc.errors()
        )
        raise ConfigError(f"invalid settings: {problems}") from exc


def _print_status(stack: LocalStack) -> bool:
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


@app.command()
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


@app.command()
def down(ctx: typer.Context) -> None:
    """Stop the embedded servers by PID. Data stays under MACARON_HOME."""
    stopped = LocalStack(settings(ctx)).down()
    console.print(f"stopped: {', '.join(stopped) or 'nothing was running'}")


@app.command()
def status(ctx: typer.Context) -> None:
    """Show each embedded server with its address and health; exit 1 if PostgreSQL or Redis
    is not healthy."""
    if not _print_status(LocalStack(settings(ctx))):
        raise typer.Exit(1)


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


class _Counter:
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


@app.command()
def serve(
    ctx: typer.Context,
    port: Annotated[int | None, typer.Option(help="Port (default MACARON_HTTP_PORT).")] = None,
) -> None:
    """Serve chat: the WebSocket protocol at /v1/ws, the OpenAI-compatible API at /v1 and the
    web UI at /, on MACARON_BIND_HOST (127.0.0.1 unless configured)."""
    cfg = settings(ctx)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=err_console) as progress:  # fmt: skip
        task = progress.add_task("starting")
        server = wiring.chat_server(cfg, lambda s: progress.update(task, description=s))
    chosen = port or cfg.http_port
    console.print(f"serving on http://{cfg.bind_host}:{chosen}/ (Ctrl-C stops)")
    try:
        uvicorn.run(server.app, host=cfg.bind_host, port=chosen, ws_max_size=cfg.max_frame_bytes,
                    log_level="warning")  # fmt: skip
    finally:
        server.close()


@app.command("schema")
def schema_export(
    folder: Annotated[Path, typer.Argument(help="Where to write them.")] = Path("docs/schema"),
) -> None:
    """Write the JSON Schemas of protocol v1, HCP v1 and the GenUI catalogue."""
    for path in export_schemas(folder):
        console.print(f"wrote {path}")


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
    from their saved positions."""
    cfg = settings(ctx)
    configure_celery(cfg)
    with wiring.pool(cfg) as pool:
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


@app.command()
def worker(
    ctx: typer.Context,
    queues: Annotated[str, typer.Option(help="Comma-separated: train, eval, default.")] = (
        "train,eval,default"
    ),
) -> None:
    """Run a Celery worker for the learning loop (one task at a time)."""
    cfg = settings(ctx)
    celery = configure_celery(cfg)
    pool = wiring.pool(cfg)
    install_runtime(make_runtime(cfg, wiring.model_dir(cfg), pool, wiring.event_log(cfg, pool)))
    celery.worker_main(["worker", "--queues", queues, "--pool", "solo", "--loglevel", "INFO",
                        "--hostname", f"macaron-{os.getpid()}@%h", "--without-gossip",
                        "--without-mingle"])  # fmt: skip


@app.command("promote")
def promote_release(
    ctx: typer.Context,
    release_id: Annotated[str, typer.Argument(help="The release to make active.")],
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the server.")] = 120.0,
) -> None:
    """Promote a release by hand: the running server loads it, checks it and flips to it."""
    _promotion(settings(ctx), release_id, "promote", timeout)


@app.command()
def rollback(
    ctx: typer.Context,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the server.")] = 120.0,
) -> None:
    """Make the active release's parent active again."""
    cfg = settings(ctx)
    with wiring.pool(cfg) as pool, pool.connection() as conn:
        parent = active_release(conn).parent_release_id
    if parent is None:
        raise ReleaseNotFound("the active release is the root: there is nothing to roll back to")
    _promotion(cfg, parent, "rollback", timeout)


def _promotion(cfg: Settings, release_id: str, kind: str, timeout: float) -> None:
    with wiring.pool(cfg) as pool:
        request = request_promotion(pool, release_id, kind=kind, requested_by="operator (cli)")
        final = wait_for_request(pool, request, timeout)
    if final["status"] == "pending":
        raise PromotionFailed(f"no server took the request in {timeout:.0f} s; is one running?")
    if final["status"] == "failed":
        raise PromotionFailed(f"{kind} of {release_id} refused: {final['reason']}")
    console.print(f"{release_id} is active ({kind})")


@model_app.command("pull")
def model_pull(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Model to fetch.")] = "smollm2-135m-instruct",
) -> None:
    """Fetch and convert a base model once into MACARON_HOME/models (idempotent)."""
    cfg = settings(ctx)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=err_console) as progress:  # fmt: skip
        task = progress.add_task(f"{name}: starting")
        folder, changed = pull_model(
            cfg.home, name, lambda step: progress.update(task, description=f"{name}: {step}")
        )
    manifest = verify_model(folder)
    state = "pulled" if changed else "already pulled"
    console.print(f"{name} {state}: {folder} (licence {manifest['licence']})")


@model_app.command("tiny")
def model_tiny(
    ctx: typer.Context,
    path: Annotated[Path, typer.Argument(help="Folder to write the tiny model into.")],
    seed: Annotated[int, typer.Option(help="Random seed for the weights.")] = 0,
) -> None:
    """Make a tiny random Llama with SmolLM2's tokenizer, in seconds, for tests."""
    cfg = settings(ctx)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), console=err_console) as bar:
        task = bar.add_task("tokenizer")
        tokenizer = tokenizer_for_tiny(cfg.home, lambda s: bar.update(task, description=s))
        bar.update(task, description="writing the model")
        make_tiny_model(path, tokenizer, seed=seed)
    console.print(f"tiny model written to {path}")


class ScopeName(StrEnum):
    chat = "chat"
    admin = "admin"


@keys_app.command("create")
def keys_create(
    ctx: typer.Context,
    tenant: Annotated[str, typer.Option(help="Tenant that owns the key (created if new).")],
    scope: Annotated[list[ScopeName], typer.Option(help="chat and/or admin; repeatable.")],
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
        table.add_row(str(r.key_id), r.tenant_id, ",".join(r.scopes),
                      f"{r.created_at:%Y-%m-%d %H:%M}", f"{r.revoked_at:%Y-%m-%d %H:%M}"
                      if r.revoked_at else "-")  # fmt: skip
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


def main() -> None:
    try:
        app()
    except MacaronError as exc:
        message = Text.assemble(("error", "bold red"), f"[{exc.code}]: {exc.message}")
        err_console.print(message, soft_wrap=True)
        sys.exit(2 if isinstance(exc, ConfigError) else 1)
