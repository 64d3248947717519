"""The learning loop: ``worker`` trains and evaluates, ``train`` queues a run by hand,
``simulate`` plays users against a server, ``demo`` runs the whole loop for a few generations.
The training code is imported by the commands that run it (``macaron.wiring`` says why)."""

from __future__ import annotations

import asyncio
import os
import time
from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from core.errors import TriggerBehind
from core.experience import known_filter
from core.log import Positions
from infra.postgres.db import Pool
from infra.postgres.keys import create_key
from infra.postgres.positions import load_positions
from infra.telemetry import configure_telemetry, serve_metrics
from learners.evaluation.contract_runner import load_training_bank
from learners.queue import configure as configure_celery
from learners.queue import enqueue_training
from learners.tasks import DEFAULT_BANK
from macaron import wiring
from macaron.cli.common import (
    console,
    err_console,
    progress_bar,
    settings,
    specialist_names,
    steps,
)
from macaron.simulator import (
    DEFAULT_SPECIALISTS,
    SIMULATOR_TENANT,
    bank_tasks,
    pick_tasks,
    report_table,
    run_simulation,
)
from streams.trigger import TrainingTrigger, train_now


def worker(
    ctx: typer.Context,
    queues: Annotated[
        str, typer.Option(help="Comma-separated: train, eval, default, rollout.")
    ] = "train,eval,default,rollout",
) -> None:
    """Run a Celery worker for the learning loop (one task at a time); /metrics on
    MACARON_METRICS_PORT when set."""
    cfg = settings(ctx)
    configure_telemetry(cfg, "macaron-worker")
    celery = configure_celery(cfg)
    pool = wiring.pool(cfg)
    if cfg.metrics_port is not None:
        serve_metrics(cfg, pool, cfg.metrics_port)
    from learners.worker import install_runtime  # the training code: torch, peft

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


def train(
    ctx: typer.Context,
    specialist: Annotated[str, typer.Argument(help="The specialist whose successor to train.")],
    filter_version: Annotated[
        str | None,
        typer.Option(help="Train on records of this filter version (default: the live one)."),
    ] = None,
    wait: Annotated[
        float, typer.Option(min=0, help="Seconds to wait for the trigger to read the log.")
    ] = 60.0,
) -> None:
    """Train a successor now on the specialist's records since its last snapshot (live ones,
    or those a backfill appended), without waiting for the threshold: once the training trigger
    (macaron streams run) has read the log as far as it goes now, records the snapshot, queues
    the run for the workers, and prints its ids. The run is evaluated and promoted (or refused)
    like any other."""
    cfg = settings(ctx)
    version = known_filter(filter_version or cfg.experience_filter)
    configure_celery(cfg)
    with wiring.pool(cfg) as pool:
        log = wiring.event_log(cfg, pool)
        _trigger_reads(pool, log.end_positions(), wait)
        with pool.connection() as conn, conn.transaction():
            request = train_now(conn, specialist, version)
            log.append([request.event])
        log.close()
    enqueue_training(request.run_id)
    snapshot = request.snapshot
    replayed = ", ".join(str(b) for b in snapshot.backfills) or "none"
    console.print(
        f"run {request.run_id} queued: {specialist} on snapshot {snapshot.snapshot_id} "
        f"({snapshot.record_count} records of {version}, offsets [{snapshot.start_offset}, "
        f"{snapshot.end_offset}) of partition {snapshot.partition}; backfills: {replayed})"
    )


def _trigger_reads(pool: Pool, end: Positions, wait: float) -> None:
    """Wait until the training trigger has read the log to ``end``."""
    deadline = time.monotonic() + wait
    while True:
        with pool.connection() as conn:
            read = load_positions(conn, TrainingTrigger.name)
        if all(read.get(p, 0) >= o for p, o in end.items() if o):
            return
        if time.monotonic() >= deadline:
            raise TriggerBehind(
                f"the training trigger has not read the log to {dict(end)} in {wait:g} s (it is "
                f"at {read}): is `macaron streams run` running?"
            )
        time.sleep(0.2)


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
    bank = load_training_bank(cfg.task_bank_path or DEFAULT_BANK).tasks
    plan = pick_tasks(bank_tasks(bank, specialist_names(specialists)), turns, seed)
    if key is None:
        with wiring.pool(cfg) as pool, pool.connection() as conn:
            key_id, key = create_key(conn, SIMULATOR_TENANT, {"chat"})
        err_console.print(f"made key {key_id} for tenant {SIMULATOR_TENANT}")
    target = url or f"ws://{cfg.bind_host}:{cfg.http_port}/v1/ws"
    with progress_bar() as progress:
        task = progress.add_task(f"simulating users against {target}", total=turns)
        report = asyncio.run(
            run_simulation(
                target, key, plan, concurrency=concurrency, on_turn=lambda _: progress.advance(task)
            )
        )
    console.print(report_table(report))


class DemoMode(StrEnum):
    oracle = "oracle"
    self_ = "self"


MODE_HELP = (
    "oracle: simulated users whose oracle corrects wrong answers with the reference; "
    "self: rollouts judged by verifiers, no reference answer ever taught."
)


class DemoHints(StrEnum):
    none = "none"
    tools = "tools"
    checker = "checker"


HINTS_HELP = (
    "Self mode: none (the default) resamples no group; tools decodes each tool-call group "
    "with no passing sample again, greedily, once per kind of call of the harness's tools (a "
    "tool, or one of its ops) forced as its first step; "
    "checker, an ablation, resamples each group with no passing sample with what its checker "
    "expects (the tool, the words) as a hint."
)


BUDGET_HELP = (
    "Self mode: samples per prompt at most (adaptive sampling; default --samples, off). A "
    "prompt whose samples all scored alike and none passed is sampled again, --samples more at "
    "a time, until its rewards differ or the budget is spent (measured in docs/learning.md: "
    "it found little on tool-call prompts for its cost)."
)


TURNS_HELP = (
    "Most simulated turns (oracle) per generation, or rolled-out prompts of each specialist (self)."
)
OUT_HELP = "Folder for demo.json, demo.png and worker.log (default MACARON_HOME/demo)."
OUTSIDE_HELP = (
    "Measure each generation's release on the outside measure too: 148 BFCL requests no tool "
    "serves (its no-call rate; about a minute more per generation)."
)
WRITE_HELP = (
    "Self mode: tasks the loop writes itself per rollout job of genui or agent: the model "
    "proposes new prompts of the bank's checkable families (GenUI requests that quote what to "
    "show, two-number sums), kept only when a rule derives their checker from the prompt and "
    "they are new (no contract task, no bank prompt); 0 writes none."
)


class DemoRollouts(StrEnum):
    worker = "worker"
    server = "server"


ROLLOUTS_HELP = (
    "Self mode: where rollout jobs are sampled: worker (the default) in the Celery worker, in "
    "turn with training and evaluation; server in the chat server's rollout lane, on its "
    "engine, beside them (on a CPU with few cores the two then compete, and both slow down)."
)


def demo(
    ctx: typer.Context,
    generations: Annotated[int, typer.Option(min=1, help="Generations after the base.")] = 3,
    turns_per_generation: Annotated[int, typer.Option(min=1, help=TURNS_HELP)] = 120,
    concurrency: Annotated[int, typer.Option(min=1, help="Simulated users at once.")] = 8,
    out: Annotated[Path | None, typer.Option(help=OUT_HELP)] = None,
    specialists: Annotated[
        str, typer.Option(help="Comma-separated specialists the simulated users ask.")
    ] = ",".join(DEFAULT_SPECIALISTS),
    seed: Annotated[int, typer.Option(help="Seed of the play order and of the rollouts.")] = 0,
    mode: Annotated[DemoMode, typer.Option(help=MODE_HELP)] = DemoMode.oracle,
    samples: Annotated[int, typer.Option(min=1, max=16, help="Self mode: samples per prompt.")] = 8,
    budget: Annotated[int | None, typer.Option(min=1, max=64, help=BUDGET_HELP)] = None,
    write: Annotated[int, typer.Option(min=0, max=32, help=WRITE_HELP)] = 2,
    outside: Annotated[bool, typer.Option(help=OUTSIDE_HELP)] = True,
    hints: Annotated[DemoHints, typer.Option(help=HINTS_HELP)] = DemoHints.none,
    rollouts: Annotated[DemoRollouts, typer.Option(help=ROLLOUTS_HELP)] = DemoRollouts.worker,
) -> None:
    """Run the whole learning loop for --generations generations; write demo.json and demo.png.

    Starts the chat server, the stream processors and a Celery worker on the configured model
    (PostgreSQL and Redis must be up: `macaron up`). Scores the contract on the active release
    first (generation 0); each generation sends traffic until the trigger queues a run (simulated
    users in --mode oracle; in --mode self, rollout jobs of --samples samples per bank prompt (up
    to --budget for a prompt whose samples all scored alike), at most --turns-per-generation
    prompts of each specialist, each until a run of its own is queued, kept when the verifier
    passes them), waits for its training, evaluation and promotion or rejection, and scores the
    contract again. Unless set, MACARON_MAX_NEW_TOKENS is 96, MACARON_TURNS_PER_MINUTE does not
    limit the simulated users (their answers only need to be long enough to be judged) and
    MACARON_TRAINING_CONFIG is the CPU recipe learners/recipes/lora-cpu.yaml (lora-rloo.yaml in
    --mode self)."""
    from macaron.demo import DemoOptions, demo_table, generation_table, run_demo  # torch, peft

    cfg = settings(ctx)
    configure_telemetry(cfg, "macaron-demo")
    options = DemoOptions(
        generations=generations,
        turns_per_generation=turns_per_generation,
        concurrency=concurrency,
        out_dir=out or cfg.home / "demo",
        specialists=specialist_names(specialists),
        seed=seed,
        mode="self" if mode is DemoMode.self_ else "oracle",
        samples=samples,
        budget=budget,
        written=write,
        outside=outside,
        hints=hints.value,
        rollouts=rollouts.value,
    )
    with steps("starting") as step:
        report = run_demo(cfg, options, step, lambda g: console.print(generation_table(g)))
    console.print(demo_table(report))
    console.print(f"wrote {options.out_dir / 'demo.json'} and {options.out_dir / 'demo.png'}")
