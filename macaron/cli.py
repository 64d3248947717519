"""``macaron``: the one command that reads settings and wires the parts together."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
from collections.abc import Iterable, Iterator
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any
from uuid import UUID

import typer
import uvicorn
from pydantic import ValidationError
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table
from rich.text import Text

from core.chain import verify_chain
from core.errors import (
    ConfigError,
    MacaronError,
    PromotionFailed,
    ReleaseNotFound,
    TurnNotFound,
)
from core.events import Envelope, TurnReceived
from core.settings import Settings
from infra.artifacts import ArtifactStore
from infra.kafka.topics import create_topics, event_topics
from infra.local_stack import LocalStack
from infra.models import make_tiny_model, pull_model, tokenizer_for_tiny, verify_model
from infra.postgres.keys import create_key, list_keys, revoke_key
from infra.postgres.lineage import audit, lineage, to_dot
from infra.postgres.migrate import migrate
from infra.postgres.promotions import request_promotion, wait_for_request
from infra.postgres.registry import active_release, release_by_id
from infra.telemetry import configure_telemetry, serve_metrics
from learners.contract import CONTRACT_V1, load_contract, run_contract
from learners.tasks import load_bank
from learners.worker import configure as configure_celery
from learners.worker import install_runtime
from macaron import wiring
from macaron.demo import demo_table, generation_table, run_demo
from macaron.simulator import (
    DEFAULT_SPECIALISTS,
    SIMULATOR_TENANT,
    bank_tasks,
    pick_tasks,
    report_table,
    run_simulation,
)
from server.engines.local import LocalEngine
from server.schemas import export as export_schemas
from streams.faust_app import run_worker as run_faust_worker
from streams.processor import content_hash
from streams.replay import replay
from streams.runner import catch_up, follow

console = Console()
err_console = Console(stderr=True)

app = typer.Typer(
    help="Macaron server: event-sourced continual-learning LLM server.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # docstrings are plain text: their single line breaks are wraps
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
    web UI at /, on MACARON_BIND_HOST (127.0.0.1 unless configured), and Prometheus metrics at
    /metrics (a key with the metrics scope). Answers with the model in this process, or through
    the vLLM replicas of MACARON_VLLM_URLS when MACARON_ENGINE=vllm."""
    cfg = settings(ctx)
    configure_telemetry(cfg, "macaron-server")
    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err_console
    ) as progress:
        task = progress.add_task("starting")
        server = wiring.chat_server(cfg, lambda s: progress.update(task, description=s))
    chosen = port or cfg.http_port
    console.print(f"serving on http://{cfg.bind_host}:{chosen}/ (Ctrl-C stops)")
    try:
        uvicorn.run(
            server.app,
            host=cfg.bind_host,
            port=chosen,
            ws_max_size=cfg.max_frame_bytes,
            log_level="warning",
        )
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


@app.command()
def worker(
    ctx: typer.Context,
    queues: Annotated[str, typer.Option(help="Comma-separated: train, eval, default.")] = (
        "train,eval,default"
    ),
) -> None:
    """Run a Celery worker for the learning loop (one task at a time); /metrics on
    MACARON_METRICS_PORT when set."""
    cfg = settings(ctx)
    configure_telemetry(cfg, "macaron-worker")
    celery = configure_celery(cfg)
    pool = wiring.pool(cfg)
    if cfg.metrics_port is not None:
        serve_metrics(cfg, pool, cfg.metrics_port)
    install_runtime(wiring.learning_runtime(cfg, pool))
    celery.worker_main(
        [
            "worker",
            "--queues",
            queues,
            "--pool",
            "solo",
            "--loglevel",
            "INFO",
            "--hostname",
            f"macaron-{os.getpid()}@%h",
            "--without-gossip",
            "--without-mingle",
        ]
    )


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


contract_app = typer.Typer(help="The external contract.", no_args_is_help=True)
app.add_typer(contract_app, name="contract")


@contract_app.command("run")
def contract_run(
    ctx: typer.Context,
    release_id: Annotated[
        str, typer.Argument(help="The release to evaluate ('active' for the active one).")
    ] = "active",
    seed: Annotated[int, typer.Option(help="Sampling seed (greedy decoding either way).")] = 0,
) -> None:
    """Run the contract (MACARON_CONTRACT_PATH, default contract v1) on a release's adapters
    and print each suite's score."""
    cfg = settings(ctx)
    contract = load_contract(cfg.contract_path or CONTRACT_V1)
    store = ArtifactStore(cfg.home / "adapters")
    with wiring.pool(cfg) as pool, pool.connection() as conn:
        release = (
            active_release(conn) if release_id == "active" else release_by_id(conn, release_id)
        )
    engine = LocalEngine(wiring.model_dir(cfg))
    try:
        with console.status(f"running {contract.version} on {release.release_id}..."):
            for ref in release.adapters.values():
                engine.load_adapter(ref.name, str(store.verified_path(ref.sha256, ref.path)))
            adapters = {name: ref.name for name, ref in release.adapters.items()}
            outcomes = asyncio.run(run_contract(engine, adapters, contract, seed=seed))
    finally:
        engine.close()
    table = Table(title=f"{contract.version} on {release.release_id}")
    for column in ("suite", "tasks", "passed", "score"):
        table.add_column(column, justify="left" if column == "suite" else "right")
    for suite, done in outcomes.items():
        table.add_row(suite, str(len(done)), str(sum(done)), f"{sum(done) / len(done):.1%}")
    console.print(table)


@app.command("trace")
def trace_command(
    ctx: typer.Context,
    turn_id: Annotated[UUID, typer.Argument(help="The turn (turn_started.turn_id).")],
) -> None:
    """Print a turn's trace id (from its TurnReceived event), to find the trace in Jaeger:
    the turn's spans, the processors' spans, and the training runs its feedback fed."""
    cfg = settings(ctx)
    with wiring.pool(cfg) as pool:
        with pool.connection() as conn:
            row = conn.execute(
                "SELECT conversation_id FROM turns WHERE turn_id = %s", (turn_id,)
            ).fetchone()
        if row is None:
            raise TurnNotFound(
                f"no turn {turn_id} in the projections (are the stream processors running?)"
            )
        log = wiring.event_log(cfg, pool)
        try:
            received = [
                e
                for e in log.read(key=str(row["conversation_id"]))
                if isinstance(e.payload, TurnReceived) and e.payload.turn_id == turn_id
            ]
        finally:
            log.close()
    if not received or "traceparent" not in received[0].envelope.trace:
        raise TurnNotFound(f"turn {turn_id} was recorded without a trace context")
    traceparent = received[0].envelope.trace["traceparent"]
    console.print(f"trace_id {traceparent.split('-')[1]}")
    console.print(f"traceparent {traceparent}")


class LineageFormat(StrEnum):
    table = "table"
    json = "json"
    dot = "dot"


@app.command("lineage")
def lineage_command(
    ctx: typer.Context,
    ref: Annotated[str, typer.Argument(help="A release id, or an adapter version: genui@3.")],
    output: Annotated[LineageFormat, typer.Option("--format", help="Output format.")] = (
        LineageFormat.table
    ),
) -> None:
    """Walk a release or adapter version back to the root: parents, training runs, dataset
    snapshots (log range and hash), evaluations, promotions."""
    with wiring.pool(settings(ctx)) as pool, pool.connection() as conn:
        steps = lineage(conn, ref)
    if output is LineageFormat.json:
        console.print_json(json.dumps([s.model_dump() for s in steps]))
    elif output is LineageFormat.dot:
        sys.stdout.write(to_dot(steps))
    else:
        table = Table(title=f"lineage of {ref}")
        for column in ("kind", "id", "parent", "created", "run", "snapshot", "evaluation"):
            table.add_column(column)
        for step in steps:
            run: Any = step.detail.get("run") or {}
            snapshot = run.get("snapshot") or {}
            evaluation = (run.get("evaluations") or [{}])[-1]
            table.add_row(
                step.kind,
                step.id,
                step.parent or "(root)",
                step.created_at[:19],
                f"{run.get('run_id', '')[:8]} {run.get('status', '')}",
                f"{snapshot.get('records', '')} records {snapshot.get('start', '')}->"
                f"{snapshot.get('end', '')} {str(snapshot.get('content_hash', ''))[:12]}"
                if snapshot
                else "",
                f"passed={evaluation.get('passed')} {evaluation.get('candidate', '')}"
                if evaluation
                else "",
            )
        console.print(table)


audit_app = typer.Typer(help="Audit the stored record.", no_args_is_help=True)
app.add_typer(audit_app, name="audit")


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


@app.command("replay")
def replay_command(
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
        digest, handled = replay(
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


def _specialist_names(listed: str) -> list[str]:
    names = [name.strip() for name in listed.split(",") if name.strip()]
    if not names:
        raise ConfigError("--specialists names no specialist (for example genui,agent)")
    return names


@app.command()
def simulate(
    ctx: typer.Context,
    turns: Annotated[int, typer.Option(min=1, help="Turns to play in all.")] = 100,
    concurrency: Annotated[int, typer.Option(min=1, help="Users playing at once.")] = 4,
    url: Annotated[
        str | None, typer.Option(help="WebSocket URL (default the local `macaron serve`).")
    ] = None,
    key: Annotated[
        str | None,
        typer.Option(help=f"Chat key (default: a new key of tenant {SIMULATOR_TENANT!r})."),
    ] = None,
    specialists: Annotated[
        str, typer.Option(help="Comma-separated specialists whose bank tasks are played.")
    ] = ",".join(DEFAULT_SPECIALISTS),
    seed: Annotated[int, typer.Option(help="Seed of the play order.")] = 0,
) -> None:
    """Play simulated users against a running server and print a table per specialist.

    Each user asks task-bank prompts over the WebSocket; the oracle checks every answer and
    sends feedback: up when it is right, else an edit with the task's reference."""
    cfg = settings(ctx)
    plan = pick_tasks(bank_tasks(load_bank(), _specialist_names(specialists)), turns, seed)
    if key is None:
        with wiring.pool(cfg) as pool, pool.connection() as conn:
            key_id, key = create_key(conn, SIMULATOR_TENANT, {"chat"})
        err_console.print(f"made key {key_id} for tenant {SIMULATOR_TENANT}")
    target = url or f"ws://{cfg.bind_host}:{cfg.http_port}/v1/ws"
    columns = (
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=err_console) as progress:
        task = progress.add_task(f"simulating users against {target}", total=turns)
        report = asyncio.run(
            run_simulation(
                target, key, plan, concurrency=concurrency, on_turn=lambda _: progress.advance(task)
            )
        )
    console.print(report_table(report))


@app.command()
def demo(
    ctx: typer.Context,
    generations: Annotated[int, typer.Option(min=1, help="Generations after the base.")] = 3,
    turns_per_generation: Annotated[
        int, typer.Option(min=1, help="Most simulated turns per generation.")
    ] = 120,
    concurrency: Annotated[int, typer.Option(min=1, help="Simulated users at once.")] = 8,
    out: Annotated[
        Path | None,
        typer.Option(
            help="Folder for demo.json, demo.png and worker.log (default MACARON_HOME/demo)."
        ),
    ] = None,
    specialists: Annotated[
        str, typer.Option(help="Comma-separated specialists the simulated users ask.")
    ] = ",".join(DEFAULT_SPECIALISTS),
    seed: Annotated[int, typer.Option(help="Seed of the play order.")] = 0,
) -> None:
    """Run the whole learning loop for --generations generations with simulated users, and
    write demo.json and demo.png.

    Starts the chat server, the stream processors and a Celery worker on the configured model
    (PostgreSQL and Redis must be up: `macaron up`). Scores the contract on the active release
    first (generation 0); each generation plays users until the trigger queues a run, waits for
    its training, evaluation and promotion or rejection, and scores the contract again. Unless
    set, MACARON_MAX_NEW_TOKENS is 96, MACARON_TURNS_PER_MINUTE does not limit the simulated
    users (their answers only need to be long enough to be judged) and MACARON_TRAINING_CONFIG
    is the CPU recipe learners/recipes/lora-cpu.yaml."""
    cfg = settings(ctx)
    configure_telemetry(cfg, "macaron-demo")
    folder = out or cfg.home / "demo"
    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err_console
    ) as progress:
        task = progress.add_task("starting")
        report = run_demo(
            cfg,
            generations=generations,
            turns_per_generation=turns_per_generation,
            concurrency=concurrency,
            out_dir=folder,
            specialists=_specialist_names(specialists),
            seed=seed,
            step=lambda s: progress.update(task, description=s),
            on_generation=lambda record: console.print(generation_table(record)),
        )
    console.print(demo_table(report))
    console.print(f"wrote {folder / 'demo.json'} and {folder / 'demo.png'}")


@model_app.command("pull")
def model_pull(
    ctx: typer.Context,
    name: Annotated[str, typer.Argument(help="Model to fetch.")] = "smollm2-135m-instruct",
) -> None:
    """Fetch and convert a base model once into MACARON_HOME/models (idempotent)."""
    cfg = settings(ctx)
    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=err_console
    ) as progress:
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


def main() -> None:
    try:
        app()
    except MacaronError as exc:
        message = Text.assemble(("error", "bold red"), f"[{exc.code}]: {exc.message}")
        err_console.print(message, soft_wrap=True)
        sys.exit(2 if isinstance(exc, ConfigError) else 1)
