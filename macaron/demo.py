"""The learning-loop demo (``macaron demo``): the whole loop, generation after generation, on the
model and stack the settings name, with simulated users as the traffic.

It composes what ``macaron serve``, ``macaron streams run`` and ``macaron worker`` run: the chat
server (uvicorn on a free port of 127.0.0.1, in a thread), the stream processors (in a thread)
and a Celery worker (a ``macaron worker`` subprocess given the same settings as ``MACARON_*``
variables). Generation 0 is the contract score of the release active at the start. Each
generation then plays simulated users until the training trigger queues a run, waits until
every queued run is trained, evaluated under the contract and promoted or rejected, and
scores the release now active: as its evaluation recorded it, or else exactly as for generation
0 (the serving engine, greedy decoding, the contract's answer budgets). ``demo.json`` and
``demo.png`` in the output folder record every generation.

Simulated turns only need answers long enough to be judged (a GenUI tree or a tool call fits in
96 tokens; the oracle's edits do the teaching), so unless the settings say otherwise the demo
serves at most ``DEMO_MAX_NEW_TOKENS`` new tokens per step (``MACARON_MAX_NEW_TOKENS``), does
not rate-limit its own simulated users (``MACARON_TURNS_PER_MINUTE``: its server is private),
and trains with the CPU recipe ``learners/recipes/lora-cpu.yaml`` (``MACARON_TRAINING_CONFIG``).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any
from uuid import UUID

import uvicorn
from matplotlib.figure import Figure
from rich.table import Table

from core.contract import Contract, Task
from core.errors import ConfigError, MacaronError
from core.settings import Settings
from infra.local_stack import free_port
from infra.postgres.keys import create_key
from infra.postgres.registry import active_release
from learners.contract import CONTRACT_V1, load_contract, run_contract
from learners.loop import recorded_outcomes
from learners.recipes.lora import CPU_CONFIG
from learners.tasks import load_bank
from learners.worker import app as celery_app
from learners.worker import configure as configure_celery
from macaron import wiring
from macaron.simulator import (
    DEFAULT_SPECIALISTS,
    SIMULATOR_TENANT,
    PlayedTurn,
    SimulationReport,
    bank_tasks,
    run_simulation,
    task_stream,
)
from server.chat import Router
from streams.runner import follow

DEMO_MAX_NEW_TOKENS = 96
DEMO_TURNS_PER_MINUTE = 100_000
RUN_TIMEOUT_S = 3 * 3600.0
"""Longest wait for the runs of one generation to be trained, evaluated and decided."""
TRIGGER_LAG_S = 30.0
"""How long the processors may take, after the last simulated turn, to queue a run."""
SERVER_START_S = 60.0
POLL_S = 1.0

Step = Callable[[str], None]


class DemoFailed(MacaronError):
    """A part of the loop stopped, or a generation could not finish; the message says which."""

    code = "demo_failed"


# --- what a demo records ------------------------------------------------------------------------


@dataclass(frozen=True)
class RunRecord:
    """One training run and what became of it. ``outcome`` is ``promoted``, ``rejected`` (by the
    contract), ``promotion refused`` (by the server's canary), or ``training failed``,
    ``evaluation failed``, ``promotion failed`` (the worker's task raised)."""

    run_id: str
    specialist: str
    outcome: str
    passed: bool
    training_seconds: float | None
    candidate: dict[str, float]
    parent: dict[str, float]
    reasons: list[str]


@dataclass(frozen=True)
class GenerationRecord:
    """``scores`` are the contract scores per suite of ``release_id``, active after the
    generation; ``simulated_pass_rate`` is the oracle's verdict on the simulated turns."""

    generation: int
    release_id: str
    scores: dict[str, float]
    turns: int = 0
    simulated_pass_rate: dict[str, float] = field(default_factory=dict)
    runs: list[RunRecord] = field(default_factory=list)


@dataclass(frozen=True)
class DemoReport:
    contract_version: str
    generations: list[GenerationRecord]

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


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


# --- the running loop ------------------------------------------------------------------------


class _Background:
    """A daemon thread whose failure is kept, so the demo can say what stopped."""

    def __init__(self, name: str, target: Callable[[], None]) -> None:
        self.name = name
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(target,), name=name, daemon=True)
        self.thread.start()

    def _run(self, target: Callable[[], None]) -> None:
        try:
            target()
        except BaseException as exc:  # SystemExit from uvicorn included: reported by check()
            self.error = exc

    def check(self) -> None:
        if self.error is not None or not self.thread.is_alive():
            raise DemoFailed(f"the {self.name} stopped: {self.error!r}")


@dataclass
class Stage:
    """The loop's parts, running: the chat server, its address, the processors, the worker."""

    server: wiring.Server
    url: str
    worker: subprocess.Popen[bytes]
    worker_log: Path
    threads: list[_Background]

    def check(self) -> None:
        """Raise ``DemoFailed`` if any part has stopped."""
        code = self.worker.poll()
        if code is not None:
            tail = self.worker_log.read_text(errors="replace")[-2000:]
            raise DemoFailed(
                f"the Celery worker exited with {code} (log {self.worker_log}):\n{tail}"
            )
        for thread in self.threads:
            thread.check()


def worker_environment(settings: Settings) -> dict[str, str]:
    """This process's environment with the settings as ``MACARON_*`` (and no other)."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("MACARON_")}
    for name, value in settings.model_dump(exclude_none=True).items():
        env[f"MACARON_{name.upper()}"] = str(value)
    return env


@contextmanager
def running_loop(
    settings: Settings, out_dir: Path, step: Step, *, router: Router | None = None
) -> Iterator[Stage]:
    """Start the chat server, the stream processors and a Celery worker; stop them after."""
    configure_celery(settings)
    _check_broker(settings)
    with ExitStack() as parts:
        server = wiring.chat_server(settings, step, router=router)
        parts.callback(server.close)
        step("starting the chat server")
        port = free_port()
        config = uvicorn.Config(
            server.app,
            host="127.0.0.1",
            port=port,
            lifespan="on",
            ws_max_size=settings.max_frame_bytes,
            log_level="warning",
        )
        uv = uvicorn.Server(config)
        serving = _Background("chat server", uv.run)
        parts.callback(_stop_server, uv, serving)
        _await_start(uv, serving)
        step("starting the stream processors")
        hosts = wiring.processor_hosts(settings, server.log, server.pool)
        wiring.enqueue_queued_runs(server.pool)
        stop = threading.Event()
        processors = _Background("stream processors", lambda: follow(hosts, stop))
        parts.callback(_stop_processors, stop, processors)
        step("starting a Celery worker")
        log_path = out_dir / "worker.log"
        log = parts.enter_context(log_path.open("wb"))
        worker = _start_worker(settings, log)
        parts.callback(_stop_worker, worker)
        yield Stage(server, f"ws://127.0.0.1:{port}/v1/ws", worker, log_path, [serving, processors])


def _check_broker(settings: Settings) -> None:
    try:
        with celery_app.connection_for_write() as conn:
            conn.ensure_connection(max_retries=2)
    except Exception as exc:  # kombu raises its transport's errors
        raise DemoFailed(
            f"cannot reach Redis for Celery: {exc} (is `macaron up` running, "
            f"or MACARON_REDIS_URL set?)"
        ) from exc


def _await_start(uv: uvicorn.Server, serving: _Background) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while not uv.started:
        serving.check()
        if time.monotonic() > deadline:
            raise DemoFailed(f"the chat server did not start in {SERVER_START_S:.0f} s")
        time.sleep(0.05)


def _stop_server(uv: uvicorn.Server, serving: _Background) -> None:
    uv.should_exit = True
    serving.thread.join(timeout=30)


def _stop_processors(stop: threading.Event, processors: _Background) -> None:
    stop.set()
    processors.thread.join(timeout=30)


def _start_worker(settings: Settings, log: IO[bytes]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "macaron", "worker"],
        env=worker_environment(settings),
        stdout=log,
        stderr=subprocess.STDOUT,
    )


def _stop_worker(worker: subprocess.Popen[bytes]) -> None:
    """Celery's warm shutdown finishes the task at hand; a minute later it is killed."""
    worker.terminate()
    try:
        worker.wait(timeout=60)
    except subprocess.TimeoutExpired:
        worker.kill()
        worker.wait()


# --- the generations --------------------------------------------------------------------------


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
    contract = load_contract(settings.contract_path or CONTRACT_V1)
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
        keep(GenerationRecord(0, *demo.measure()))
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
        release_id, scores = self.measure()
        rates = {name: s.pass_rate for name, s in report.by_specialist().items()}
        return GenerationRecord(n, release_id, scores, len(report.turns), rates, runs)

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
            outcomes = {run_id: _outcome(self.stage, run_id) for run_id in runs}
            pending = [run_id for run_id, outcome in outcomes.items() if outcome is None]
            if not pending:
                self.seen.update(runs)
                return [outcome for outcome in outcomes.values() if outcome is not None]
            if time.monotonic() > deadline:
                raise DemoFailed(
                    f"run {pending[0]} was not decided in {timeout_s:.0f} s "
                    f"(worker log: {self.stage.worker_log})"
                )
            self.step(f"generation {n}: run {pending[0]} {_progress(self.stage, pending[0])}")
            time.sleep(POLL_S)

    def measure(self) -> tuple[str, dict[str, float]]:
        """The contract's score per suite on the active release, once the server serves it: as
        its evaluation recorded it, or else by running the contract on the serving engine."""
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
        with server.pool.connection() as conn:
            outcomes = recorded_outcomes(conn, serving.release_id, self.contract)
        if outcomes is None:
            adapters = {name: ref.name for name, ref in serving.adapters.items()}
            try:
                outcomes = asyncio.run(run_contract(server.chat.engine, adapters, self.contract))
            except ValueError as exc:  # the release lacks a specialist the contract names
                raise DemoFailed(f"release {serving.release_id}: {exc}") from exc
        return serving.release_id, {s: sum(o) / len(o) for s, o in outcomes.items() if o}

    def _run_ids(self) -> list[UUID]:
        with self.stage.server.pool.connection() as conn:
            rows = conn.execute("SELECT run_id FROM training_runs ORDER BY created_at").fetchall()
        return [row["run_id"] for row in rows]

    def _new_runs(self) -> list[UUID]:
        return [run_id for run_id in self._run_ids() if run_id not in self.seen]


def _outcome(stage: Stage, run_id: UUID) -> RunRecord | None:
    """What became of the run, or ``None`` while it is still being trained or decided."""
    with stage.server.pool.connection() as conn:
        row = conn.execute(
            "SELECT r.specialist, r.status, r.error, r.metrics, e.scores, e.passed, "
            "p.kind AS promotion, p.reason AS promotion_reason FROM training_runs r "
            "LEFT JOIN evaluations e ON e.run_id = r.run_id "
            "LEFT JOIN LATERAL (SELECT kind, reason FROM promotions WHERE run_id = r.run_id "
            "ORDER BY created_at DESC LIMIT 1) p ON true WHERE r.run_id = %s",
            (run_id,),
        ).fetchone()
    assert row is not None  # the run was listed from this table
    scores: dict[str, Any] = row["scores"] or {}
    seconds = row["metrics"].get("seconds")

    def decided(outcome: str, reasons: list[str]) -> RunRecord:
        return RunRecord(
            str(run_id),
            row["specialist"],
            outcome,
            bool(row["passed"]),
            None if seconds is None else float(seconds),
            scores.get("candidate", {}),
            scores.get("parent", {}),
            reasons,
        )

    failure = _task_failure(str(run_id))
    if row["status"] == "failed" or (row["status"] != "succeeded" and failure is not None):
        return decided("training failed", [row["error"] or failure or "unknown"])
    if row["status"] != "succeeded":
        return None
    if row["passed"] is None:
        failure = _task_failure(f"{run_id}.evaluate")
        return None if failure is None else decided("evaluation failed", [failure])
    if not row["passed"]:
        return decided("rejected", list(scores.get("reasons", [])))
    if row["promotion"] == "promoted":
        return decided("promoted", [])
    if row["promotion"] == "rejected":
        return decided("promotion refused", [row["promotion_reason"]])
    failure = _task_failure(f"{run_id}.promote")
    return None if failure is None else decided("promotion failed", [failure])


def _task_failure(task_id: str) -> str | None:
    """The error of a worker task that failed (its id is derived from the run id), if any."""
    result = celery_app.AsyncResult(task_id)
    return repr(result.result) if result.state == "FAILURE" else None


def _progress(stage: Stage, run_id: UUID) -> str:
    result = celery_app.AsyncResult(str(run_id))
    info = result.info
    if result.state == "PROGRESS" and isinstance(info, dict):
        return f"training: step {info.get('step')} of {info.get('steps')}"
    with stage.server.pool.connection() as conn:
        row = conn.execute(
            "SELECT status FROM training_runs WHERE run_id = %s", (run_id,)
        ).fetchone()
    status = "unknown" if row is None else str(row["status"])
    return {"succeeded": "trained: evaluating and deciding"}.get(status, status)


# --- output ------------------------------------------------------------------------------------


def write_outputs(report: DemoReport, out_dir: Path) -> tuple[Path, Path]:
    """``demo.json`` (every record) and ``demo.png`` (contract score per suite per generation)."""
    data, chart = out_dir / "demo.json", out_dir / "demo.png"
    data.write_text(json.dumps(report.as_json(), indent=2) + "\n", encoding="utf-8")
    plot_scores(report, chart)
    return data, chart


def plot_scores(report: DemoReport, path: Path) -> None:
    """One line per contract suite; the x axis names the runs each generation promoted."""
    figure = Figure(figsize=(8, 4.8), dpi=120, layout="constrained")
    axes = figure.add_subplot()
    generations = [g.generation for g in report.generations]
    suites = sorted({suite for g in report.generations for suite in g.scores})
    for suite in suites:
        scores = [g.scores.get(suite, math.nan) for g in report.generations]
        axes.plot(generations, scores, marker="o", label=suite)
    labels = []
    for g in report.generations:
        promoted = [run.specialist for run in g.runs if run.outcome == "promoted"]
        labels.append(f"{g.generation}" + (f"\n+{', '.join(promoted)}" if promoted else ""))
    axes.set_xticks(generations, labels)
    axes.set_ylim(-0.03, 1.03)
    axes.set_xlabel("generation (and the specialists it promoted)")
    axes.set_ylabel("contract score (share of tasks passed)")
    axes.set_title(f"Contract score of the active release per suite ({report.contract_version})")
    axes.grid(alpha=0.3)
    if suites:
        axes.legend(loc="best")
    figure.savefig(path, format="png")


def _scores_text(scores: dict[str, float]) -> str:
    return " · ".join(f"{suite} {score:.2f}" for suite, score in sorted(scores.items())) or "-"


def generation_table(record: GenerationRecord) -> Table:
    """One generation: its runs and the contract score of the release it leaves active."""
    caption = f"active release {record.release_id}; contract: {_scores_text(record.scores)}"
    if record.turns:
        caption += (
            f"\n{record.turns} simulated turns, oracle pass rate: "
            f"{_scores_text(record.simulated_pass_rate)}"
        )
    table = Table(title=f"generation {record.generation}", caption=caption)
    for column in ("run", "specialist", "training s", "outcome", "candidate", "parent"):
        table.add_column(column)
    for run in record.runs:
        seconds = "-" if run.training_seconds is None else f"{run.training_seconds:.0f}"
        outcome = run.outcome if not run.reasons else f"{run.outcome}: {'; '.join(run.reasons)}"
        table.add_row(
            run.run_id,
            run.specialist,
            seconds,
            outcome,
            _scores_text(run.candidate),
            _scores_text(run.parent),
        )
    return table


def demo_table(report: DemoReport) -> Table:
    """Every generation's contract score per suite, and what its runs became."""
    suites = sorted({suite for g in report.generations for suite in g.scores})
    table = Table(title=f"learning loop under contract {report.contract_version}")
    for column in ("generation", "release", "runs", *suites):
        table.add_column(column, justify="right" if column in suites else "left")
    for g in report.generations:
        runs = ", ".join(f"{run.specialist} {run.outcome}" for run in g.runs) or "-"
        scores = (f"{g.scores[s]:.2f}" if s in g.scores else "-" for s in suites)
        table.add_row(str(g.generation), g.release_id, runs, *scores)
    return table
