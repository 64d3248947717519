"""A demo's generations: measure the active release, then for each generation play simulated
users until a run is queued (or, in self mode, roll out each specialist's prompts until a run
of its own is queued or its budget is spent), wait until every new run is decided, and measure
again."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from core.contract import Contract
from core.errors import ConfigError
from core.ids import derived_id
from core.settings import Settings
from core.tasks import Task
from infra.postgres.keys import create_key
from infra.postgres.lookups import run_ids_oldest_first, run_specialists, run_times
from infra.postgres.registry import active_release
from learners.evaluation.contract_runner import (
    DEFAULT_CONTRACT,
    OUTSIDE,
    load_contract,
    load_training_bank,
)
from learners.evaluation.evaluate import release_outcomes
from learners.queue import app as celery_app
from learners.queue import enqueue_rollouts
from learners.recipes.config import CPU_CONFIG, DEFAULT_CONFIG, RLOO_CONFIG, load_config
from learners.rollouts.curriculum import Curriculum
from learners.rollouts.job import RolloutJob, RolloutSummary
from learners.rollouts.writing import FAMILIES, family_examples
from learners.tasks import DEFAULT_BANK
from macaron.demo.options import DemoOptions, Mode, Traffic, check_options
from macaron.demo.outcomes import run_outcome, run_progress
from macaron.demo.output import write_outputs
from macaron.demo.records import (
    DemoFailed,
    DemoReport,
    GenerationRecord,
    RunRecord,
    phase_seconds,
    rollout_stats,
)
from macaron.demo.stage import SERVER_START_S, Stage, Step, running_loop
from macaron.simulator import (
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
TRIGGER_LAG_S = 30.0
"""How long the processors may take, after the last simulated turn, to queue a run."""
POLL_S = 1.0
SETTLE_S = 2.0
"""How long a round's end waits for the processors to queue a run for the traffic it played
(they take well under a second) before another round starts: the turn that completes the
trigger's count is often a round's last."""
ROLLOUT_CHUNK = 8
"""Prompts rolled out per round of the self mode (a job per specialist among them)."""


def demo_settings(settings: Settings, mode: Mode = "oracle") -> Settings:
    """Short answers, no rate limit for the simulated users and the CPU recipe (with policy
    gradient on the rollout groups in self mode), unless the settings chose. Self mode trains
    on the model's own evidence only: a training config that takes edits is a ``ConfigError``
    there (on a stack that ever ran oracle traffic it would train on the oracle's answers)."""
    chosen = settings.model_fields_set
    update: dict[str, Any] = {}
    if "training_config" not in chosen:
        update["training_config"] = RLOO_CONFIG if mode == "self" else CPU_CONFIG
    if "max_new_tokens" not in chosen:
        update["max_new_tokens"] = DEMO_MAX_NEW_TOKENS
    if "turns_per_minute" not in chosen:
        update["turns_per_minute"] = DEMO_TURNS_PER_MINUTE
    settings = settings.model_copy(update=update)
    config = settings.training_config or DEFAULT_CONFIG
    if mode == "self" and not load_config(config).own_evidence_only:
        raise ConfigError(
            f"self mode trains on its own evidence only, but training config {config} takes "
            "edits: give it sources: [rollout, feedback]"
        )
    return settings


def run_demo(
    settings: Settings,
    options: DemoOptions,
    step: Step = lambda _: None,
    on_generation: Callable[[GenerationRecord], None] | None = None,
    router: Router | None = None,
) -> DemoReport:
    """Measure the active release, then run the options' generations of the loop; writes
    ``demo.json`` and ``demo.png`` into its ``out_dir`` after each generation. The traffic of a
    generation is simulated users whose oracle corrects wrong answers with the reference
    (``oracle``) or rollout jobs judged by the verifiers (``self``; a prompt whose groups are
    flat sampled again up to the budget), groups with no passing sample resampled as ``hints``
    says (``tools``: a tool sweep; ``checker``: the checker's
    hint, an ablation), sampled by the worker or the chat server's rollout lane, as
    ``rollouts`` says."""
    o = options
    check_options(o)
    settings = demo_settings(settings, o.mode)
    contract = load_contract(settings.contract_path or DEFAULT_CONTRACT)
    unscored = sorted(set(o.specialists) - contract.suites.keys())
    if unscored:
        raise ConfigError(
            f"contract {contract.version} has no suite for {', '.join(unscored)}: "
            "their training runs could not be evaluated"
        )
    bank = load_training_bank(settings.task_bank_path or DEFAULT_BANK, contract)
    tasks = bank_tasks(bank.tasks, o.specialists)
    plays = task_stream(tasks, o.seed)
    curricula = {  # self mode: each specialist's own play order (and budget: ``roll``)
        s: Curriculum([t for t in tasks if t.specialist == s], o.seed)
        for s in (o.specialists if o.mode == "self" else ())
    }
    o.out_dir.mkdir(parents=True, exist_ok=True)
    report = DemoReport(contract.version, [], "single" if contract.development is None else "test")

    def keep(record: GenerationRecord) -> None:
        report.generations.append(record)
        write_outputs(report, o.out_dir)
        if on_generation is not None:
            on_generation(record)

    with running_loop(settings, o.out_dir, step, router=router, rollouts=o.rollouts) as stage:
        budget = o.samples if o.budget is None else o.budget
        writes = frozenset(s for f, s in FAMILIES.items() if family_examples(f, bank.tasks))
        traffic = Traffic(o.mode, o.samples, budget, o.written, writes, o.seed, o.hints)
        demo = _Demo(stage, contract, (plays, curricula), step, settings.train_threshold, traffic)
        demo.outside = load_contract(OUTSIDE) if o.outside else None
        step("generation 0: measuring the contract on the active release")
        keep(demo.measure())
        for n in range(1, o.generations + 1):
            keep(demo.generation(n, o.turns_per_generation, o.concurrency, o.run_timeout_s))
    return report


class _Demo:
    """One demo's running state: the runs already accounted for and the play order."""

    def __init__(
        self,
        stage: Stage,
        contract: Contract,
        plays: tuple[Iterator[Task], dict[str, Curriculum]],
        step: Step,
        threshold: int,
        traffic: Traffic,
    ) -> None:
        self.stage = stage
        self.contract = contract
        self.plays, self.curricula = plays
        """The simulated users' play order (oracle), and each specialist's rollouts' (self)."""
        self.step = step
        self.threshold = threshold
        self.traffic = traffic
        with stage.server.pool.connection() as conn:
            _, self.key = create_key(conn, SIMULATOR_TENANT, {"chat"})
        self.outside: Contract | None = None
        """The outside measure, run on each generation's release beside the contract."""
        self.seen = set(self._run_ids())
        """Runs of earlier generations (or from before the demo), never waited for again."""
        self.origin = sorted(stage.server.log.end_positions().items())
        """Where the log ended when the demo began: rollout job ids derive from it and the
        seed, so a demo on a fresh stack samples the same again, and a second demo on the
        same stack gets jobs of its own."""

    def generation(
        self, n: int, turns: int, concurrency: int, run_timeout_s: float
    ) -> GenerationRecord:
        started = datetime.now(UTC)
        update: dict[str, Any] = {"generation": n, "mode": self.traffic.mode}
        if self.traffic.mode == "self":
            update["hints"] = self.traffic.hints
            update["rollouts"] = self.roll(n, turns, run_timeout_s)
        else:
            report = self.simulate(n, turns, concurrency)
            update["turns"] = len(report.turns)
            update["simulated_pass_rate"] = {
                name: s.pass_rate for name, s in report.by_specialist().items()
            }
        runs = self.settle(n, run_timeout_s)
        update["runs"] = runs
        measuring = datetime.now(UTC)
        self.step(f"generation {n}: measuring the contract on the active release")
        measured = self.measure()
        with self.stage.server.pool.connection() as conn:
            times = run_times(conn, [UUID(r.run_id) for r in runs])
        update["phase_seconds"] = phase_seconds(
            started, runs, {str(k): v for k, v in times.items()}, measuring, datetime.now(UTC)
        )
        return replace(measured, **update)

    def simulate(self, n: int, turns: int, concurrency: int) -> SimulationReport:
        """Play until the trigger has queued a run, at most ``turns`` turns; then give the
        processors time to catch up. A queued run is looked for after every turn, and at a
        round's end once the processors have had ``SETTLE_S`` to queue one: the run trains at
        once, and simulated users beside it would only slow both."""
        played: list[PlayedTurn] = []
        started = time.monotonic()
        while len(played) < turns and not self._queued_within(SETTLE_S if played else 0.0):
            plan = [next(self.plays) for _ in range(min(2 * concurrency, turns - len(played)))]
            chunk = asyncio.run(
                run_simulation(
                    self.stage.url, self.key, plan, concurrency=concurrency, until=self._new_runs
                )
            )
            played += chunk.turns
            self.step(f"generation {n}: {len(played)} simulated turns")
            self.stage.check()
        self.await_trigger(f"{len(played)} simulated turns")
        return SimulationReport(played, time.monotonic() - started)

    def roll(self, n: int, prompts: int, timeout_s: float) -> dict[str, dict[str, float]]:
        """Roll out up to ``prompts`` prompts of each specialist, each from its own play order,
        ``ROLLOUT_CHUNK`` at a time in a job of its own, the specialists in turn. A specialist
        stops once the trigger has queued a run of its own (that run trains it now); the
        others go on, since another's run takes nothing from their budgets. What the rollouts
        gave, per specialist."""
        left = dict.fromkeys(self.curricula, prompts)
        summaries: list[RolloutSummary] = []
        specialists: list[str] = []
        while open_ := sorted(s for s, count in left.items() if count):
            for specialist in open_:
                if self._queued(specialist, SETTLE_S if specialist in specialists else 0.0):
                    left[specialist] = 0
                    continue
                curriculum = self.curricula[specialist]
                chunk = [next(curriculum) for _ in range(min(ROLLOUT_CHUNK, left[specialist]))]
                job = RolloutJob(
                    job_id=derived_id(
                        "demo-rollouts",
                        self.origin,
                        self.traffic.seed,
                        n,
                        specialist,
                        prompts - left[specialist],
                    ),
                    specialist=specialist,
                    environments=list(dict.fromkeys(t.id for t in chunk)),
                    # a chunk across two rounds of the play order may hold a task twice
                    samples=self.traffic.samples,
                    budget=self.traffic.budget,
                    written=self.traffic.written if specialist in self.traffic.writes else 0,
                    seed=self.traffic.seed,
                    hints=self.traffic.hints,
                )
                enqueue_rollouts(job)
                summary = self._await_job(job, n, timeout_s)
                curriculum.record(summary.by_task)
                summaries.append(summary)
                specialists.append(specialist)
                left[specialist] -= len(chunk)
            rolled = rollout_stats(specialists, summaries)
            self.step(
                f"generation {n}: prompts rolled out: "
                + ", ".join(f"{s} {rolled[s]['groups']:.0f}" for s in sorted(rolled))
            )
        self.await_trigger(f"rollouts of {len(summaries)} jobs")
        return rollout_stats(specialists, summaries)

    def _await_job(self, job: RolloutJob, n: int, timeout_s: float) -> RolloutSummary:
        result = celery_app.AsyncResult(str(job.job_id))
        deadline = time.monotonic() + timeout_s
        while not result.ready():
            self.stage.check()
            if time.monotonic() > deadline:
                raise DemoFailed(f"rollout job {job.job_id} did not finish in {timeout_s:.0f} s")
            self.step(
                f"generation {n}: rolling out {len(job.environments)} {job.specialist} prompts"
            )
            time.sleep(POLL_S)
        if result.failed():
            raise DemoFailed(f"rollout job {job.job_id} failed: {result.result!r}")
        return RolloutSummary.model_validate(result.result)

    def await_trigger(self, traffic: str) -> None:
        """Give the processors time to queue a run after the traffic; ``DemoFailed`` if none."""
        deadline = time.monotonic() + TRIGGER_LAG_S
        while not self._new_runs():
            self.stage.check()
            if time.monotonic() > deadline:
                raise DemoFailed(
                    f"{traffic} queued no training run (the trigger needs {self.threshold} new "
                    "experience records of one specialist): raise --turns-per-generation or "
                    "lower MACARON_TRAIN_THRESHOLD"
                )
            time.sleep(POLL_S)

    def settle(self, n: int, timeout_s: float) -> list[RunRecord]:
        """Wait until every new run is decided; runs queued meanwhile (the harness proposal
        an adapter run's decision queues) are waited for too. Their records."""
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
        outside = None
        if self.outside is not None:
            self.step("measuring the outside measure (BFCL) on the active release")
            measured = release_outcomes(
                server.pool, server.chat.engine, serving, server.chat.harness, self.outside
            )
            outside = measured.call_rates(self.outside).get("no_call")
        return GenerationRecord(
            0,
            serving.release_id,
            serving.harness_version,
            outcomes.scores(),
            outcomes.format_scores(),
            outcomes.call_rates(self.contract),
            mode=self.traffic.mode,
            hints=self.traffic.hints,
            outside=outside,
        )

    def _run_ids(self) -> list[UUID]:
        with self.stage.server.pool.connection() as conn:
            return run_ids_oldest_first(conn)

    def _queued(self, specialist: str, wait_s: float) -> bool:
        """Whether a new run of ``specialist`` is queued, given the processors up to ``wait_s``
        to queue one."""
        deadline = time.monotonic() + wait_s
        while True:
            with self.stage.server.pool.connection() as conn:
                if specialist in run_specialists(conn, self._new_runs()):
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S / 4)

    def _queued_within(self, wait_s: float) -> bool:
        """Whether a new run is queued, given the processors up to ``wait_s`` to queue one."""
        deadline = time.monotonic() + wait_s
        while not self._new_runs():
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S / 4)
        return True

    def _new_runs(self) -> list[UUID]:
        return [run_id for run_id in self._run_ids() if run_id not in self.seen]
