"""A demo's generations: measure the active release, then for each generation play simulated
users until a run is queued, wait until every new run is decided, and measure again."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any
from uuid import UUID

from core.contract import Contract, Task
from core.errors import ConfigError
from core.settings import Settings
from infra.postgres.keys import create_key
from infra.postgres.lookups import run_ids_oldest_first
from infra.postgres.registry import active_release
from learners.contract import DEFAULT_CONTRACT, load_contract
from learners.loop import release_outcomes
from learners.recipes.lora import CPU_CONFIG
from learners.tasks import load_bank
from macaron.demo.outcomes import run_outcome, run_progress
from macaron.demo.output import write_outputs
from macaron.demo.records import DemoFailed, DemoReport, GenerationRecord, RunRecord
from macaron.demo.stage import SERVER_START_S, Stage, Step, running_loop
from macaron.simulator import (
    DEFAULT_SPECIALISTS,
    SIMULATOR_TENANT,
    PlayedTurn,
    SimulationReport,
    bank_tasks,
    run_simulation,
    task_stream,
)
from server.turns.request import Router

DEMO_MAX_NEW_TOKENS = 96
DEMO_TURNS_PER_MINUTE = 100_000
RUN_TIMEOUT_S = 3 * 3600.0
"""Longest wait for the runs of one generation to be trained, evaluated and decided."""
TRIGGER_LAG_S = 30.0
"""How long the processors may take, after the last simulated turn, to queue a run."""
POLL_S = 1.0


def demo_settings(settings: Settings) -> Settings:
    """Short answers, no rate limit for the simulated users and the CPU recipe, unless the
    settings chose."""
    chosen = settings.model_fields_set
    update: dict[str, Any] = {}
    if "training_config" not in chosen:
        update["training_config"] = CPU_CONFIG
    if "max_new_tokens" not in chosen:
        update["max_new_tokens"] = DEMO_MAX_NEW_TOKENS
    if "turns_per_minute" not in chosen:
        update["turns_per_minute"] = DEMO_TURNS_PER_MINUTE
    return settings.model_copy(update=update)


def run_demo(
    settings: Settings,
    *,
    generations: int,
    turns_per_generation: int,
    concurrency: int,
    out_dir: Path,
    specialists: Sequence[str] = DEFAULT_SPECIALISTS,
    seed: int = 0,
    step: Step = lambda _: None,
    on_generation: Callable[[GenerationRecord], None] | None = None,
    router: Router | None = None,
    run_timeout_s: float = RUN_TIMEOUT_S,
) -> DemoReport:
    """Measure the active release, then run ``generations`` generations of the loop; writes
    ``demo.json`` and ``demo.png`` into ``out_dir`` after each generation."""
    if min(generations, turns_per_generation, concurrency) < 1:
        raise ConfigError("generations, turns per generation and concurrency must be at least 1")
    settings = demo_settings(settings)
    contract = load_contract(settings.contract_path or DEFAULT_CONTRACT)
    unscored = sorted(set(specialists) - contract.suites.keys())
    if unscored:
        raise ConfigError(
            f"contract {contract.version} has no suite for {', '.join(unscored)}: "
            "their training runs could not be evaluated"
        )
    plays = task_stream(bank_tasks(load_bank(), specialists), seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = DemoReport(contract.version, [])

    def keep(record: GenerationRecord) -> None:
        report.generations.append(record)
        write_outputs(report, out_dir)
        if on_generation is not None:
            on_generation(record)

    with running_loop(settings, out_dir, step, router=router) as stage:
        demo = _Demo(stage, contract, plays, step, settings.train_threshold)
        step("generation 0: measuring the contract on the active release")
        keep(demo.measure())
        for n in range(1, generations + 1):
            keep(demo.generation(n, turns_per_generation, concurrency, run_timeout_s))
    return report


class _Demo:
    """One demo's running state: the runs already accounted for and the play order."""

    def __init__(
        self, stage: Stage, contract: Contract, plays: Iterator[Task], step: Step, threshold: int
    ) -> None:
        self.stage = stage
        self.contract = contract
        self.plays = plays
        self.step = step
        self.threshold = threshold
        with stage.server.pool.connection() as conn:
            _, self.key = create_key(conn, SIMULATOR_TENANT, {"chat"})
        self.seen = set(self._run_ids())
        """Runs of earlier generations (or from before the demo), never waited for again."""

    def generation(
        self, n: int, turns: int, concurrency: int, run_timeout_s: float
    ) -> GenerationRecord:
        report = self.simulate(n, turns, concurrency)
        runs = self.settle(n, run_timeout_s)
        self.step(f"generation {n}: measuring the contract on the active release")
        measured = self.measure()
        rates = {name: s.pass_rate for name, s in report.by_specialist().items()}
        return replace(
            measured, generation=n, turns=len(report.turns), simulated_pass_rate=rates, runs=runs
        )

    def simulate(self, n: int, turns: int, concurrency: int) -> SimulationReport:
        """Play until the trigger has queued a run (checked after every few turns), at most
        ``turns`` turns; then give the processors time to catch up."""
        played: list[PlayedTurn] = []
        started = time.monotonic()
        while len(played) < turns and not self._new_runs():
            plan = [next(self.plays) for _ in range(min(2 * concurrency, turns - len(played)))]
            chunk = asyncio.run(
                run_simulation(self.stage.url, self.key, plan, concurrency=concurrency)
            )
            played += chunk.turns
            self.step(f"generation {n}: {len(played)} simulated turns")
            self.stage.check()
        deadline = time.monotonic() + TRIGGER_LAG_S
        while not self._new_runs():
            self.stage.check()
            if time.monotonic() > deadline:
                raise DemoFailed(
                    f"{len(played)} simulated turns queued no training run (the trigger needs "
                    f"{self.threshold} new experience records of one specialist): raise "
                    "--turns-per-generation or lower MACARON_TRAIN_THRESHOLD"
                )
            time.sleep(POLL_S)
        return SimulationReport(played, time.monotonic() - started)

    def settle(self, n: int, timeout_s: float) -> list[RunRecord]:
        """Wait until every new run is decided; runs queued meanwhile are waited for too."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.stage.check()
            runs = self._new_runs()
            outcomes = {run_id: run_outcome(self.stage.server.pool, run_id) for run_id in runs}
            pending = [run_id for run_id, outcome in outcomes.items() if outcome is None]
            if not pending:
                self.seen.update(runs)
                return [outcome for outcome in outcomes.values() if outcome is not None]
            if time.monotonic() > deadline:
                raise DemoFailed(
                    f"run {pending[0]} was not decided in {timeout_s:.0f} s "
                    f"(worker log: {self.stage.worker_log})"
                )
            progress = run_progress(self.stage.server.pool, pending[0])
            self.step(f"generation {n}: run {pending[0]} {progress}")
            time.sleep(POLL_S)

    def measure(self) -> GenerationRecord:
        """Generation 0's record: the contract's score and share of well-formed answers per
        suite on the active release, once the server serves it (as recorded, or else run on
        the serving engine and recorded for the loop to reuse)."""
        server = self.stage.server
        deadline = time.monotonic() + SERVER_START_S
        while True:
            with server.pool.connection() as conn:
                active = active_release(conn).release_id
            serving = server.chat.release
            if serving.release_id == active:
                break
            if time.monotonic() > deadline:
                raise DemoFailed(
                    f"the server serves {serving.release_id}, not the active release {active}"
                )
            time.sleep(0.2)
        try:
            outcomes = release_outcomes(
                server.pool, server.chat.engine, serving, server.chat.harness, self.contract
            )
        except ValueError as exc:  # the release lacks a specialist the contract names
            raise DemoFailed(f"release {serving.release_id}: {exc}") from exc
        return GenerationRecord(
            0,
            serving.release_id,
            serving.harness_version,
            outcomes.scores(),
            outcomes.format_scores(),
        )

    def _run_ids(self) -> list[UUID]:
        with self.stage.server.pool.connection() as conn:
            return run_ids_oldest_first(conn)

    def _new_runs(self) -> list[UUID]:
        return [run_id for run_id in self._run_ids() if run_id not in self.seen]
